"""Redis is not trusted blindly: kvmesh logs in with a password from a file as an ACL user limited to
the commands it sends, over TLS when asked; a forged epoch silences no engine for longer than a
heartbeat TTL; and with --engines-from-index a processor dials only the engines an allow-list
vouches for, and sends its token only to one that proved it holds that token.

Real redis-server processes (requirepass, the ACL user of redis_acl_rule, a TLS port with a CA
made here by the openssl tool), a real worker and engine publishing through the restricted user,
a real processor, and fake engines: real grpc.aio servers on 127.0.0.1 that record every call.
"""

from __future__ import annotations

import asyncio
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError

from services import SamplingParams
from services.common.clients import GenerateRequest
from services.common.engine_output import EngineCoreRequest
from services.common.hashing import hash_token_blocks
from services.common.kv_events import BlockStored
from services.common.rpc.kvmesh.v1 import engine_pb2, engine_pb2_grpc
from services.common.rpc.security import TOKEN_METADATA_KEY, RpcSecurity
from services.engine.client import GrpcEngineClient
from services.prefix_index import EngineLoad, PrefixIndexReplica, RedisPrefixIndex
from services.prefix_index.redis_index import RedisAccess, redis_acl_rule
from services.processor.client import GrpcProcessorClient
from services.processor.index_engines import AllowList
from tests.redis_server import RedisServer
from tests.services.procs import REPO_ROOT, ServiceProcess, free_port, processor_command, running_stack, start_service

pytestmark = pytest.mark.anyio

NAMESPACE = "kvmesh:pi"
USER = "kvmesh"
PASSWORD = "redis-password-of-this-test"
ADMIN_PASSWORD = "redis-admin-password-of-this-test"
TOKEN = "the-internal-token-of-this-test"
HEARTBEAT_TTL = 1.5  # seconds: the engine's; a forged live key outlives it by nothing
KV_BYTES = 64 * 2**20


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certs(d: Path) -> Path:
    """A CA, and one certificate for 127.0.0.1 used by redis-server and by kvmesh as its client."""
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
            "-subj", "/CN=kvmesh redis test CA", cwd=d)
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=127.0.0.1",
            cwd=d)
    openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out", "tls.crt",
            "-days", "1", "-extfile", "ext.cnf", cwd=d)
    return d


class SecuredRedis(RedisServer):
    """redis-server with a password on its default user (the admin: the test's forger), the
    kvmesh ACL user, and a TLS port: on free loopback ports, no persistence, killed by its pid."""

    def __init__(self) -> None:
        tls_port = free_port()
        acl = redis_acl_rule(NAMESPACE, USER, PASSWORD).split()
        super().__init__(config=["--requirepass", ADMIN_PASSWORD, f"--{acl[0]}", *acl[1:], "--tls-port", str(tls_port)])
        self.tls_port = tls_port
        self.certs = make_certs(self.dir)
        self.config += ["--tls-cert-file", str(self.certs / "tls.crt"), "--tls-key-file", str(self.certs / "tls.key"),
                        "--tls-ca-cert-file", str(self.certs / "ca.crt")]
        (self.dir / "password").write_text(PASSWORD + "\n")  # as a mounted Secret may end
        try:
            self.start()
        except RuntimeError:
            if "TLS" in self.log() and "support" in self.log():
                pytest.skip(f"this redis-server has no TLS: {self.log()[-300:]}")
            raise

    @property
    def tls_url(self) -> str:
        return f"rediss://127.0.0.1:{self.tls_port}/0"

    def access(self) -> RedisAccess:
        return RedisAccess(self.url, USER, PASSWORD)

    def fields(self) -> dict[str, object]:
        """The prefix-index fields of a service that reaches this Redis as the ACL user."""
        return {"prefix_index": self.url, "prefix_index_username": USER,
                "prefix_index_password_file": self.dir / "password"}

    def admin(self) -> aioredis.Redis:
        return aioredis.Redis(port=self.port, password=ADMIN_PASSWORD)


@pytest.fixture
def redis_server() -> Iterator[SecuredRedis]:
    server = SecuredRedis()
    try:
        yield server
    finally:
        server.close()


def hashes(n: int, seed: int) -> list[bytes]:
    return hash_token_blocks(list(range(seed, seed + 16 * n)), 16, "m")


# ----------------------------------------------------------------------------- password, ACL, TLS


async def test_the_acl_user_is_all_kvmesh_needs(redis_server: SecuredRedis):
    """Every index call and the replica's stream reads go through the restricted user (each script
    loaded from scratch: EVALSHA, then SCRIPT LOAD); a command or key outside it is refused."""
    index = RedisPrefixIndex.connect(redis_server.access(), 1.0, NAMESPACE, heartbeat_ttl_s=30)
    replica = PrefixIndexReplica.connect(redis_server.access(), 1.0, NAMESPACE, heartbeat_ttl_s=30)
    try:
        await index.check_access(redis_server.url)
        chain = hashes(3, 0)
        assert await index.apply("10.0.0.1:50052", 7, [BlockStored(chain, None, [], 16)]) is False
        assert await index.heartbeat("10.0.0.1:50052", 7, EngineLoad(1, 0, 30, 0.5)) is True
        assert await index.longest_prefix(chain) == {"10.0.0.1:50052": 3}
        assert (await index.engines())["10.0.0.1:50052"].epoch == 7
        _, engines = await index.snapshot()
        epoch, held = engines["10.0.0.1:50052"]
        assert (epoch, set(held)) == (7, set(chain))
        replica.start()
        await asyncio.wait_for(replica.sync(), 10)
        assert await replica.longest_prefix(chain) == {"10.0.0.1:50052": 3}
        await index.apply("10.0.0.1:50052", 8, [BlockStored(chain[:1], None, [], 16)])  # a restart
        await asyncio.wait_for(replica.sync(), 10)
        assert await replica.longest_prefix(chain) == {"10.0.0.1:50052": 1}
        assert await index.sweep() == []
        await index.clear("10.0.0.1:50052")
        assert await index.engines() == {}
        client = redis_server.access().client(1.0)
        try:
            with pytest.raises(NoPermissionError):
                await client.set("outside-the-namespace", 1)
            with pytest.raises(NoPermissionError):
                await client.flushall()
        finally:
            await client.aclose()
    finally:
        await replica.close()
        await index.close()


async def test_a_wrong_password_fails_the_start_with_a_clear_message(redis_server: SecuredRedis, tmp_path: Path):
    """Checked at start, before any engine or tokenizer: a wrong password names the refusal and
    never the password; a missing password file names the file."""
    wrong = "not-the-password-of-this-test"
    (tmp_path / "wrong").write_text(wrong)
    base = dict(engine_address=f"127.0.0.1:{free_port()}", port=free_port(), metrics_port=0,
                prefix_index=redis_server.url, prefix_index_username=USER)
    refused = subprocess.run(processor_command(**base, prefix_index_password_file=tmp_path / "wrong"), cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0
    assert "refused kvmesh's credentials" in refused.stderr, refused.stderr[-2000:]
    assert "invalid username-password pair" in refused.stderr  # Redis's own WRONGPASS reason
    assert wrong not in refused.stderr + refused.stdout
    missing = subprocess.run(processor_command(**base, prefix_index_password_file=tmp_path / "absent"), cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0
    assert f"cannot read --prefix-index-password-file {tmp_path / 'absent'}" in missing.stderr, missing.stderr[-2000:]


async def test_the_index_over_tls(redis_server: SecuredRedis):
    """rediss:// with the CA, a client certificate and the ACL user; a server certificate from
    another CA is refused at start, as a wrong password is."""
    certs = redis_server.certs
    access = RedisAccess(redis_server.tls_url, USER, PASSWORD, certs / "ca.crt", certs / "tls.crt", certs / "tls.key")
    index = RedisPrefixIndex.connect(access, 2.0, NAMESPACE, heartbeat_ttl_s=30)
    try:
        await index.check_access(access.redacted_url)
        chain = hashes(2, 100)
        await index.apply("e", 1, [BlockStored(chain, None, [], 16)])
        assert await index.longest_prefix(chain) == {"e": 2}
    finally:
        await index.close()
    other_ca = make_certs(Path(tempfile.mkdtemp(prefix="kvmesh-other-ca-", dir=redis_server.dir)))
    untrusted = RedisAccess(redis_server.tls_url, USER, PASSWORD, other_ca / "ca.crt", certs / "tls.crt",
                            certs / "tls.key")
    index = RedisPrefixIndex.connect(untrusted, 2.0, NAMESPACE)
    try:
        with pytest.raises(PermissionError, match="TLS"):
            await index.check_access(untrusted.redacted_url)
    finally:
        await index.close()


# ----------------------------------------------------------------------------- forged epochs, forged engines


@dataclass
class Stack:
    redis: SecuredRedis
    worker: ServiceProcess
    engine: ServiceProcess
    token_file: Path
    security: RpcSecurity


@pytest.fixture(scope="module")
def stack(served_model: str) -> Iterator[Stack]:
    """A worker and an engine with the token, the engine publishing through the ACL user."""
    with ExitStack() as exits:
        workdir = Path(exits.enter_context(tempfile.TemporaryDirectory(prefix="kvmesh-redis-trust-stack-")))
        redis = SecuredRedis()
        exits.callback(redis.close)
        token = workdir / "token"
        token.write_text(TOKEN + "\n")
        worker, engine, _, _ = exits.enter_context(running_stack(
            worker=dict(model=served_model, dtype="float32", metrics_port=0, kv_cache_memory=KV_BYTES,
                        internal_token_file=token),
            engine=dict(metrics_port=0, heartbeat_ttl=HEARTBEAT_TTL, internal_token_file=token, **redis.fields())))
        yield Stack(redis, worker, engine, token, RpcSecurity(TOKEN))


async def until(predicate, timeout: float, what: str) -> None:
    """Polls the async `predicate` until it holds; fails naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        await asyncio.sleep(0.1)


async def cache_prompt(stack: Stack, prompt: list[int]) -> list[bytes]:
    """Runs `prompt` on the engine; its full blocks' hashes, as the router computes them."""
    engine = GrpcEngineClient(stack.engine.address, timeout=30, security=stack.security)
    try:
        info = await engine.info()
        request = EngineCoreRequest(f"r-{uuid.uuid4().hex}", prompt, SamplingParams(temperature=0, max_tokens=1),
                                    eos_token_ids=(2,))
        async for _ in engine.generate(request):
            pass
    finally:
        await engine.close()
    return hash_token_blocks(prompt, info.block_size, info.model_id)


async def test_a_forged_epoch_silences_no_engine(stack: Stack):
    """Forged epochs (too long to be one, garbage, and a live-looking one with a heartbeat TTL):
    the engine takes its id back within a heartbeat TTL and publishes on, and a processor's replica
    (through the ACL user) keeps finding its prompts, garbage never crashing a reader."""
    engine_id = stack.engine.address
    admin = stack.redis.admin()
    replica = PrefixIndexReplica.connect(stack.redis.access(), 1.0, NAMESPACE, HEARTBEAT_TTL)
    epoch_key, live_key = f"{NAMESPACE}:e:{engine_id}:epoch", f"{NAMESPACE}:e:{engine_id}:live"
    try:
        replica.start()
        await until(lambda: admin.exists(live_key), 30, "the engine heartbeats into the index")
        own = await admin.get(epoch_key)
        forgeries = {
            "too long": [("SET", epoch_key, "9" * 30)],
            "garbage": [("SET", epoch_key, "garbage"), ("HSET", live_key, "epoch", "garbage")],
            "live-looking": [("SET", epoch_key, "9" * 19), ("HSET", live_key, "epoch", "9" * 19),
                             ("PEXPIRE", live_key, round(HEARTBEAT_TTL * 1000))],
        }
        for seed, (name, commands) in enumerate(forgeries.items()):
            for command in commands:
                await admin.execute_command(*command)
            await replica.engines()  # a garbage epoch crashes no reader

            async def taken_back() -> bool:
                return await admin.get(epoch_key) == own and await admin.hget(live_key, "epoch") == own
            await until(taken_back, 3 * HEARTBEAT_TTL + 5, f"the engine takes its id back from a {name} epoch")
            chain = await cache_prompt(stack, [500 + seed + i % 7 for i in range(40)])

            async def routed() -> bool:
                try:
                    return (await replica.longest_prefix(chain)).get(engine_id, 0) == len(chain)
                except ConnectionError:  # reloading after the forged entries
                    return False
            await until(routed, 15, f"a new prompt is found on the engine after a {name} epoch")
    finally:
        await replica.close()
        await admin.aclose()


class Recorder(grpc.aio.ServerInterceptor):
    """Records the method and the metadata of every call a fake engine gets."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, str]]] = []

    async def intercept_service(self, continuation, handler_call_details):
        self.calls.append((handler_call_details.method, dict(handler_call_details.invocation_metadata or ())))
        return await continuation(handler_call_details)


class Impostor(engine_pb2_grpc.EngineServicer):
    """Claims the identity it is asked for, without the token to prove it; everything else UNIMPLEMENTED."""

    def __init__(self, address: str) -> None:
        self.address = address

    async def ProveIdentity(self, request, context):
        return engine_pb2.IdentityProof(engine_id=self.address, proof=b"\0" * 32)


@dataclass
class FakeEngine:
    server: grpc.aio.Server
    address: str
    recorder: Recorder


async def fake_engine() -> FakeEngine:
    recorder = Recorder()
    server = grpc.aio.server(interceptors=[recorder])
    port = server.add_insecure_port("127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    engine_pb2_grpc.add_EngineServicer_to_server(Impostor(address), server)
    await server.start()
    return FakeEngine(server, address, recorder)


@pytest.fixture
async def fakes() -> AsyncIterator[tuple[FakeEngine, FakeEngine]]:
    outside, allowed = await fake_engine(), await fake_engine()
    try:
        yield outside, allowed
    finally:
        await asyncio.gather(outside.server.stop(0), allowed.server.stop(0))


async def test_the_processor_dials_only_vouched_engines(stack: Stack, served_model: str,
                                                        fakes: tuple[FakeEngine, FakeEngine]):
    """Forged index entries: one outside --engine-allowed-address is never dialled; one inside it is
    asked to prove its identity without the token, fails, and gets no other call and never the
    token. The real engine proves itself and serves every request."""
    outside, allowed = fakes
    forger = RedisPrefixIndex.connect(stack.redis.access(), 1.0, NAMESPACE, heartbeat_ttl_s=120)
    port = free_port()
    processor = None
    try:
        for fake in fakes:
            await forger.heartbeat(fake.address, 1, EngineLoad(0, 0, 1000, 0.0))  # idle: a router's favourite
        processor = await asyncio.to_thread(start_service, processor_command(
            model=served_model, port=port, metrics_port=0, engines_from_index=True,
            engine_allowed_address=[stack.engine.address, allowed.address], routing="least-load",
            internal_token_file=stack.token_file, **stack.redis.fields()), port)
        client = GrpcProcessorClient(processor.address, timeout=30, stream_timeout=120, security=stack.security)
        try:
            for i in range(6):
                request = GenerateRequest(f"vouched-{i}", SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                                          prompt_token_ids=[504, 3458, 282 + i])
                deltas = [delta async for delta in client.generate(request)]
                assert sum(len(c.token_ids) for d in deltas for c in d.choices) == 2
                await asyncio.sleep(0.5)  # across the processor's polls of the index
        finally:
            await client.close()
        assert outside.recorder.calls == [], "an engine no allow-list vouches for was dialled"
        methods = {method for method, _ in allowed.recorder.calls}
        assert methods == {"/kvmesh.v1.Engine/ProveIdentity"}, allowed.recorder.calls
        assert not any(TOKEN_METADATA_KEY in metadata for _, metadata in allowed.recorder.calls)
    finally:
        if processor is not None:
            processor.kill()
            processor.log_path.unlink(missing_ok=True)
        for fake in fakes:
            await forger.clear(fake.address)
        await forger.close()


def test_the_allow_list_and_the_proof() -> None:
    """host:port entries match exactly, IPs and networks on any port, host names never by network;
    a proof holds for the token and the id it was made for only."""
    allow = AllowList(["10.0.0.0/16", "127.0.0.1:50052", "fd00::1"])
    assert [allow.allows(a) for a in ("10.0.3.4:1", "10.1.0.1:50052", "127.0.0.1:50052", "127.0.0.1:50053",
                                      "[fd00::1]:9", "engine.local:50052")] == [True, False, True, False, True, False]
    engine, processor = RpcSecurity(TOKEN), RpcSecurity(TOKEN)
    nonce = b"n" * 32
    proof = engine.prove(nonce, "", "127.0.0.1:50052")
    assert processor.verifies(nonce, "127.0.0.1:50052", proof)
    assert not processor.verifies(nonce, "127.0.0.1:6666", proof)  # relayed for another address
    assert not RpcSecurity("another-token").verifies(nonce, "127.0.0.1:50052", proof)
    assert not RpcSecurity().verifies(nonce, "127.0.0.1:50052", proof)
    with pytest.raises(ValueError, match="nonce"):
        engine.prove(b"short", "", "127.0.0.1:50052")
    with pytest.raises(LookupError):
        RpcSecurity().prove(nonce, "", "127.0.0.1:50052")  # an engine without tokens proves nothing
