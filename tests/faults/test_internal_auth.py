"""The internal gRPC ports trust no one without the internal token.

Real worker, engine and processor processes on loopback, started with a token file as a pod gets
it from a Secret: every RPC of every kvmesh service and reflection refuse a caller without the
token (or with a wrong one) with UNAUTHENTICATED, health stays open; `kvmesh serve`'s children are
authenticated by default; a worker serves only the engine that owns it and lets a new engine take
it over once the old one has gone silent; mutual TLS refuses a client without a certificate; the
engine fails a poisoned request alone with INVALID_ARGUMENT and serves the next one.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services import SamplingParams
from services.common.config import SecurityConfig
from services.common.engine_output import EngineCoreRequest
from services.common.errors import EngineDeadError, InternalError
from services.common.processes import start_serve
from services.common.rpc import convert
from services.common.rpc.client import health_status
from services.common.rpc.kvmesh.v1 import engine_pb2, engine_pb2_grpc, processor_pb2, worker_pb2, worker_pb2_grpc
from services.common.rpc.security import RpcSecurity
from services.common.rpc.server import GRPC_OPTIONS
from services.common.scheduler_output import SchedulerOutput
from services.common.sampling_params import MAX_TOKEN_IDS
from services.common.validation import MAX_STOP_TOKEN_IDS
from services.engine.client import GrpcEngineClient
from services.processor.client import GrpcProcessorClient
from services.worker.client import SESSION_METADATA_KEY, GrpcWorkerClient
from services.worker.step_channel import HANDSHAKE_TIMEOUT, StepChannel
from tests.services.procs import PYTHON, REPO_ROOT, ServiceProcess, free_port, grpc_health_status
from tests.services.procs import engine_command, running_stack, worker_command

TOKEN = "the-internal-token-of-this-test"
KV_BYTES = 64 * 2**20
OWNER_LEASE = 2.0  # seconds; the TLS worker's, short so that a take-over is quick to show
SERVING = health_pb2.HealthCheckResponse.SERVING
SERVICES = {"worker": worker_pb2.DESCRIPTOR.services_by_name["Worker"],
            "engine": engine_pb2.DESCRIPTOR.services_by_name["Engine"],
            "processor": processor_pb2.DESCRIPTOR.services_by_name["Processor"]}
# Open by design: an engine found in the prefix index proves it holds the processor token before
# the processor sends it that token. It answers a challenge only, and an empty one is refused.
OPEN_METHODS = {"ProveIdentity"}


@dataclass
class Stack:
    worker: ServiceProcess
    engine: ServiceProcess
    processor: ServiceProcess
    security: RpcSecurity


@pytest.fixture(scope="module")
def token_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="kvmesh-auth-") as directory:
        path = Path(directory)
        (path / "token").write_text(TOKEN + "\n")  # a trailing newline, as `kubectl create secret` may leave
        yield path


@pytest.fixture(scope="module")
def stack(served_model: str, token_dir: Path) -> Iterator[Stack]:
    token = {"internal_token_file": token_dir / "token"}
    with running_stack(worker=dict(model=served_model, dtype="float32", kv_cache_memory=KV_BYTES, **token),
                       engine=token, processor=dict(model=served_model, **token)) as (worker, engine, processor, _):
        yield Stack(worker, engine, processor, RpcSecurity(TOKEN))


def call_raw(channel: grpc.Channel, service, method, metadata) -> grpc.StatusCode:
    """Call `method` with an empty message (raw bytes: no stub needed); the status it ends with."""
    path = f"/{service.full_name}/{method.name}"
    try:
        if method.server_streaming:
            for _ in channel.unary_stream(path)(b"", timeout=10, metadata=metadata):
                pass
        else:
            channel.unary_unary(path)(b"", timeout=10, metadata=metadata)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def reflect(channel: grpc.Channel, metadata) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                        timeout=10, metadata=metadata)
    return {s.name for reply in replies for s in reply.list_services_response.service}


# ----------------------------------------------------------------------------- the token


@pytest.mark.parametrize("metadata", [None, (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)],
                         ids=["no token", "wrong token", "token without Bearer"])
def test_every_internal_rpc_refuses_a_caller_without_the_token(stack: Stack, metadata):
    for name, service in SERVICES.items():
        address = getattr(stack, name).address
        with grpc.insecure_channel(address) as channel:
            codes = {m.name: call_raw(channel, service, m, metadata) for m in service.methods}
            assert codes == {m.name: grpc.StatusCode.INVALID_ARGUMENT if m.name in OPEN_METHODS
                             else grpc.StatusCode.UNAUTHENTICATED for m in service.methods}, name
            with pytest.raises(grpc.RpcError) as refused:
                reflect(channel, metadata)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Health stays open: kubelet's probes and `kvmesh serve` send no token.
        assert grpc_health_status(address, service=service.full_name) == SERVING


def test_the_token_opens_every_service(stack: Stack):
    with grpc.insecure_channel(stack.engine.address) as channel:
        assert "kvmesh.v1.Engine" in reflect(channel, stack.security.call_metadata)

    async def calls() -> None:
        processor = GrpcProcessorClient(stack.processor.address, timeout=30, security=stack.security)
        engine = GrpcEngineClient(stack.engine.address, timeout=10, security=stack.security)
        try:
            assert (await processor.model_info()).max_model_len > 0
            assert await processor.detokenize([28, 29]) != ""
            assert (await engine.stats()).num_total_blocks > 0
        finally:
            await processor.close()
            await engine.close()
    asyncio.run(calls())
    worker = GrpcWorkerClient(stack.worker.address, timeout=10, security=stack.security)
    try:
        assert worker.get_info().vocab_size > 0
    finally:
        worker.close()


def test_an_empty_token_file_is_refused_at_start(tmp_path: Path):
    (tmp_path / "token").write_text("\n")
    result = subprocess.run(engine_command(worker_address=f"127.0.0.1:{free_port()}", port=free_port(),
                                           internal_token_file=tmp_path / "token"),
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "is empty" in result.stderr


# ----------------------------------------------------------------------------- the engine's own checks


def good_request(request_id: str, **params) -> engine_pb2.EngineRequest:
    sampling = SamplingParams(**{"temperature": 0, "max_tokens": 4, **params})
    return convert.engine_request_to_proto(EngineCoreRequest(request_id, [504, 3458, 282, 4649, 314], sampling,
                                                             eos_token_ids=(2,)))


def poisoned(name: str, change: Callable[[engine_pb2.EngineRequest], None]) -> tuple[str, engine_pb2.EngineRequest]:
    request = good_request(f"poisoned-{name}")
    change(request)
    return name, request


def set_params(**values) -> Callable[[engine_pb2.EngineRequest], None]:
    def change(request: engine_pb2.EngineRequest) -> None:
        for field, value in values.items():
            setattr(request.sampling_params, field, value)
    return change


POISONED = [
    *(poisoned(f"{field}={value}", set_params(**{field: value})) for field, value in (
        ("temperature", math.nan), ("temperature", math.inf), ("temperature", -1.0),
        ("top_p", 0.0), ("top_p", 1.5), ("top_p", math.nan),
        ("top_k", -2), ("min_p", math.nan), ("min_p", 2.0),
        ("presence_penalty", math.nan), ("presence_penalty", 3.0), ("frequency_penalty", -math.inf),
        ("repetition_penalty", math.nan), ("repetition_penalty", 0.0), ("repetition_penalty", math.inf),
        ("max_tokens", 0), ("max_tokens", -5), ("logprobs", 10**6), ("logprobs", -1), ("prompt_logprobs", 10**6),
        ("n", 2), ("n", 2**31 - 1), ("n", 0))),
    poisoned("min_tokens>max_tokens", set_params(min_tokens=5, max_tokens=2)),
    poisoned("logit_bias out of vocabulary", lambda r: r.sampling_params.logit_bias.update({10**9: 5.0})),
    poisoned("logit_bias negative id", lambda r: r.sampling_params.logit_bias.update({-1: 5.0})),
    poisoned("logit_bias NaN", lambda r: r.sampling_params.logit_bias.update({28: math.nan})),
    poisoned("logit_bias 1e30", lambda r: r.sampling_params.logit_bias.update({28: 1e30})),
    poisoned("stop_token_ids out of vocabulary", lambda r: r.sampling_params.stop_token_ids.append(10**9)),
    poisoned("too many stop_token_ids",
             lambda r: r.sampling_params.stop_token_ids.extend(range(MAX_STOP_TOKEN_IDS + 1))),
    poisoned("too many stop strings", lambda r: r.sampling_params.stop.extend(["x"] * 5000)),
    poisoned("allowed_token_ids out of vocabulary", lambda r: r.sampling_params.allowed_token_ids.extend([28, 10**9])),
    poisoned("allowed_token_ids longer than any vocabulary",
             lambda r: r.sampling_params.allowed_token_ids.extend([28] * (MAX_TOKEN_IDS + 1))),
    poisoned("logprob_token_ids negative", lambda r: r.sampling_params.logprob_token_ids.append(-3)),
    poisoned("too many logprob_token_ids", lambda r: r.sampling_params.logprob_token_ids.extend([28] * 129)),
    poisoned("logprobs not the number of logprob_token_ids",
             lambda r: (r.sampling_params.logprob_token_ids.extend([28, 29]), set_params(logprobs=1)(r))),
    poisoned("empty stop string", lambda r: r.sampling_params.stop.append("")),
    # With min_tokens the worker masks every eos id in the logits: an id outside them failed the step.
    poisoned("eos out of vocabulary", lambda r: (r.eos_token_ids.append(10**9), set_params(min_tokens=2)(r))),
    poisoned("eos negative", lambda r: (r.eos_token_ids.append(-7), set_params(min_tokens=2)(r))),
    poisoned("empty request id", lambda r: setattr(r, "request_id", "")),
    poisoned("huge request id", lambda r: setattr(r, "request_id", "r" * 100_000)),
    poisoned("no sampling params", lambda r: r.ClearField("sampling_params")),
    poisoned("empty prompt", lambda r: r.ClearField("prompt_token_ids")),
    poisoned("prompt out of vocabulary", lambda r: r.prompt_token_ids.append(10**9)),
    poisoned("prompt negative id", lambda r: r.prompt_token_ids.append(-1)),
    poisoned("prompt as long as the context", lambda r: r.prompt_token_ids.extend([28] * 10**5)),
    poisoned("priority under fcfs", lambda r: setattr(r, "priority", -5)),
]


def test_poisoned_requests_fail_alone_and_the_engine_serves_on(stack: Stack):
    with grpc.insecure_channel(stack.engine.address, options=GRPC_OPTIONS) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        metadata = stack.security.call_metadata
        # A request in flight whose id a duplicate then reuses.
        running = stub.Generate(good_request("in-flight", max_tokens=500, ignore_eos=True), metadata=metadata,
                                timeout=120)
        first = next(running)
        duplicate = good_request(first.request_id)
        codes = {}
        for name, request in [*POISONED, ("duplicate id", duplicate)]:
            try:
                list(stub.Generate(request, metadata=metadata, timeout=30))
                codes[name] = grpc.StatusCode.OK
            except grpc.RpcError as error:
                codes[name] = error.code()
        assert codes == {name: grpc.StatusCode.INVALID_ARGUMENT for name in codes}
        running.cancel()
        # The engine serves the next request, and says it is healthy.
        outputs = list(stub.Generate(good_request("after", temperature=0.8, top_p=0.9, top_k=5, min_tokens=2,
                                                  logit_bias={28: 100.0}, repetition_penalty=1.2),
                                     metadata=metadata, timeout=60))
        assert outputs[-1].finish_reason == "length"
        assert sum(len(o.new_token_ids) for o in outputs) == 4
        assert grpc_health_status(stack.engine.address) == SERVING


# ----------------------------------------------------------------------------- the worker's owner


def empty_step() -> SchedulerOutput:
    return SchedulerOutput([], [], {}, 0)


def test_worker_steps_only_for_the_engine_that_owns_it(stack: Stack):
    """The stack's engine owns its worker and steps it all the time: neither a second InitializeCache
    nor a step from another session gets through, and the engine serves on."""
    with grpc.insecure_channel(stack.worker.address, options=GRPC_OPTIONS) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        intruder = (*stack.security.call_metadata, (SESSION_METADATA_KEY, "intruder"))

        async def stream_while(probe: Callable[[], None]) -> None:
            engine = GrpcEngineClient(stack.engine.address, timeout=10, security=stack.security)
            request = EngineCoreRequest("owner-busy", [504, 3458, 282], SamplingParams(temperature=0, max_tokens=40,
                                                                                       ignore_eos=True))
            try:
                count = 0
                async for output in engine.generate(request):
                    count += len(output.new_token_ids)
                    if count == 2:
                        await asyncio.to_thread(probe)
                assert count == 40
            finally:
                await engine.close()

        def probe() -> None:
            with pytest.raises(grpc.RpcError) as refused:
                stub.InitializeCache(worker_pb2.InitializeCacheRequest(max_num_reqs=4), metadata=intruder, timeout=10)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            # The step channel opens for the owner's session only, the token notwithstanding.
            with pytest.raises(EngineDeadError, match="another engine"):
                StepChannel.connect("127.0.0.1", step_port(stack), stack.security, "intruder", timeout=10)
        asyncio.run(stream_while(probe))
    assert grpc_health_status(stack.engine.address) == SERVING


def step_port(stack: Stack) -> int:
    with grpc.insecure_channel(stack.worker.address, options=GRPC_OPTIONS) as channel:
        info = worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetWorkerInfoRequest(), timeout=10,
                                                          metadata=stack.security.call_metadata)
    assert info.step_port > 0
    return info.step_port


def test_the_step_channel_refuses_a_caller_without_the_token(stack: Stack):
    port = step_port(stack)
    for security in (RpcSecurity(), RpcSecurity(token="not-the-token")):
        with pytest.raises(InternalError, match="UNAUTHENTICATED"):
            StepChannel.connect("127.0.0.1", port, security, "any-session", timeout=10)
    # Whatever is not a hello (here an HTTP request) is closed without an answer.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: worker\r\n\r\n")
        assert closed_by_peer(sock)
    # A client that connects and says nothing is closed after the handshake's deadline, and holds up
    # no other: the stack's engine steps on meanwhile.
    with socket.create_connection(("127.0.0.1", port), timeout=30) as silent:
        asyncio.run(generate_tokens(stack, 8))
        start = time.monotonic()
        assert closed_by_peer(silent)
        assert time.monotonic() - start < HANDSHAKE_TIMEOUT + 5
    assert grpc_health_status(stack.engine.address) == SERVING


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the peer closed the connection (with nothing sent first), waiting up to its timeout."""
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:  # closed with our bytes unread
        return True


async def generate_tokens(stack: Stack, count: int) -> None:
    engine = GrpcEngineClient(stack.engine.address, timeout=10, security=stack.security)
    request = EngineCoreRequest(f"after-probe-{time.monotonic_ns()}", [504, 3458, 282],
                                SamplingParams(temperature=0, max_tokens=count, ignore_eos=True))
    try:
        tokens = [t async for output in engine.generate(request) for t in output.new_token_ids]
        assert len(tokens) == count
    finally:
        await engine.close()


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """A CA, and one certificate for every internal service (server and client) with the name
    kvmesh-internal, made with the openssl command-line tool."""
    d = tmp_path_factory.mktemp("certs")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
            "-subj", "/CN=kvmesh test CA", cwd=d)
    (d / "ext.cnf").write_text("subjectAltName=DNS:kvmesh-internal\nextendedKeyUsage=serverAuth,clientAuth\n")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "tls.key", "-out", "tls.csr",
            "-subj", "/CN=kvmesh-internal", cwd=d)
    openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "tls.crt", "-days", "1", "-extfile", "ext.cnf", cwd=d)
    return d


@pytest.fixture(scope="module")
def tls_worker(served_model: str, token_dir: Path, certs: Path) -> Iterator[tuple[ServiceProcess, RpcSecurity]]:
    """A worker with mutual TLS and the token; its engine lease is OWNER_LEASE seconds."""
    config = SecurityConfig(internal_token_file=token_dir / "token", tls_cert_file=certs / "tls.crt",
                            tls_key_file=certs / "tls.key", tls_ca_file=certs / "ca.crt",
                            tls_server_name="kvmesh-internal")
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="kvmesh-tls-worker-", suffix=".log", delete=False)
    proc = subprocess.Popen(worker_command(model=served_model, dtype="float32", port=port, kv_cache_memory=KV_BYTES,
                                           owner_lease=OWNER_LEASE, internal_token_file=config.internal_token_file,
                                           tls_cert_file=config.tls_cert_file, tls_key_file=config.tls_key_file,
                                           tls_ca_file=config.tls_ca_file),
                            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    worker = ServiceProcess(proc, port, Path(log.name))
    security = RpcSecurity.load(config)
    try:
        client = GrpcWorkerClient(worker.address, timeout=180, security=security)  # waits for it to come up
        client.get_info()
        client.close()
        yield worker, security
    finally:
        worker.kill()
        worker.log_path.unlink(missing_ok=True)


def test_mutual_tls_refuses_a_client_without_a_certificate(tls_worker, certs: Path):
    worker, security = tls_worker
    override = [("grpc.ssl_target_name_override", "kvmesh-internal")]
    ca = (certs / "ca.crt").read_bytes()
    no_cert = grpc.secure_channel(worker.address, grpc.ssl_channel_credentials(root_certificates=ca), options=override)
    plain = grpc.insecure_channel(worker.address)
    for channel in (no_cert, plain):
        with channel:
            with pytest.raises(grpc.RpcError) as refused:
                health_status(channel, timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # no handshake, no call
    # With the certificate: health without a token; the rest needs the token too.
    with security.channel(worker.address, GRPC_OPTIONS) as channel:
        assert health_status(channel, timeout=5) == SERVING
        with pytest.raises(grpc.RpcError) as refused:
            worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetWorkerInfoRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        info = worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetWorkerInfoRequest(), timeout=5,
                                                          metadata=security.call_metadata)
    client = GrpcWorkerClient(worker.address, timeout=10, security=security)
    try:
        assert client.get_info().vocab_size > 0
    finally:
        client.close()
    # The step channel asks for the same: in plain text, even with the token, no hello gets through.
    with pytest.raises(ConnectionError):
        StepChannel.connect("127.0.0.1", info.step_port, RpcSecurity(token=security.token), "any-session", timeout=10)
    # The chart's exec probe (kubelet's own gRPC probe cannot speak TLS).
    tls_flags = [f"--tls-{name}-file={certs / file}" for name, file in
                 (("cert", "tls.crt"), ("key", "tls.key"), ("ca", "ca.crt"))]
    probe = [PYTHON, "-m", "services.common.rpc.health_probe", f"--port={worker.port}"]
    assert subprocess.run([*probe, *tls_flags, "--tls-server-name=kvmesh-internal"], cwd=REPO_ROOT,
                          timeout=60).returncode == 0
    assert subprocess.run(probe, cwd=REPO_ROOT, timeout=60, capture_output=True).returncode == 1


def test_a_new_engine_takes_the_worker_over_once_the_old_one_is_silent(tls_worker):
    worker, security = tls_worker
    old, new = (GrpcWorkerClient(worker.address, timeout=t, security=security) for t in (0.5, 20))
    try:
        assert old.initialize_cache(4) > 0
        old.execute_model(empty_step())  # the owner steps; its lease runs
        with pytest.raises(EngineDeadError, match="another engine"):  # refused while the lease runs
            replace_attempt = GrpcWorkerClient(worker.address, timeout=0.5, security=security)
            try:
                replace_attempt.initialize_cache(4)
            finally:
                replace_attempt.close()
        with pytest.raises(EngineDeadError, match="another engine"):
            new.execute_model(empty_step())
        start = time.monotonic()
        assert new.initialize_cache(4) > 0  # retries until the old session has been silent OWNER_LEASE s
        assert time.monotonic() - start < OWNER_LEASE + 5
        new.execute_model(empty_step())
        with pytest.raises(EngineDeadError, match="another engine"):  # the old session is out for good
            old.execute_model(empty_step())
    finally:
        old.close()
        new.close()


# ----------------------------------------------------------------------------- kvmesh serve


def test_kvmesh_serve_authenticates_its_children(served_model: str, monkeypatch: pytest.MonkeyPatch):
    port = free_port()
    monkeypatch.delenv("KVMESH_INTERNAL_TOKEN", raising=False)  # serve hands out tokens of its own
    started = start_serve(["--model", served_model, "--dtype", "float32", "--port", str(port),
                           "--kv-cache-memory", "64MiB"], cwd=REPO_ROOT)
    proc, services = started.proc, started.ready.services
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, max_tokens=5, temperature=0,
                                               messages=[{"role": "user", "content": "Say hi"}])
        assert reply.choices[0].message.content
        for name in ("worker", "engine", "processor"):
            address = services[name]["address"]
            with grpc.insecure_channel(address) as channel:
                service = SERVICES[name]
                assert call_raw(channel, service, service.methods_by_name["GetInfo" if name != "processor"
                                                                          else "GetModelInfo"], None) \
                    == grpc.StatusCode.UNAUTHENTICATED
        # Each child holds the role tokens it calls with and is called with, no other; each token is
        # in a file of this user's only, never on a command line. The gateway holds its own only.
        held = {"gateway": ["gateway"], "processor": ["gateway", "processor"], "engine": ["processor", "engine"],
                "worker": ["engine"]}
        for name, roles in held.items():
            argv = Path(f"/proc/{services[name]['pid']}/cmdline").read_bytes().split(b"\0")
            flags = [arg.decode() for arg in argv if arg.endswith(b"-token-file")]
            assert flags == [f"--{role}-token-file" for role in roles], name
            for flag in flags:
                token_file = Path(argv[argv.index(flag.encode()) + 1].decode())
                token = token_file.read_text().strip()
                assert len(token) >= 32 and token.encode() not in b" ".join(argv)
                assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
                assert stat.S_IMODE(token_file.parent.stat().st_mode) == 0o700
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert not token_file.parent.exists()  # removed with the run
    finally:
        for pid in [proc.pid, *(s["pid"] for s in services.values())]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
        for log in (started.stdout, started.stderr):
            log.unlink(missing_ok=True)
