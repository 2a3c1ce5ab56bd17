"""The `kvmesh` command.

    kvmesh serve [--model smollm2] [--host 127.0.0.1] [--port 8000] ...   all services on this machine
    kvmesh worker|engine|processor|gateway --...                           one service (a pod's entry point)

`kvmesh serve` starts worker, engine, processor and gateway as separate processes, the internal ones
on Unix sockets in a private directory (see serve()): the processor and every worker at once, the
engines when the workers are healthy, the gateway when all the rest are. It prints where the API is,
then supervises them. With several --model it starts a pool per model ("worker-m<k>", "engine-m<k>",
...) behind the one processor and gateway. With --num-engines N it starts N engine+worker pairs
("worker-0", "engine-0", ...; "worker" and "engine" when N is 1), each on sockets of its own, behind
the one processor and gateway. With --tensor-parallel-size R each engine drives a group of R worker
processes ("worker-r0".."worker-r<R-1>", or "worker-<i>-r0".. with several engines), ranks 0..R-1 of
one torch.distributed group whose rendezvous is a free loopback port of the group's own (TCP:
torch's store speaks nothing else; see Layout); a group's workers start together (they wait for each
other), then its engine. An engine exits non-zero when one of its workers fails (gone, stuck, a
failed step); when the engine or any of its workers exits, all of them are restarted, on the same
sockets (the processor reconnects to the same address), the other groups untouched, after a back-off
(--restart-backoff, doubled per restart within --restart-window, at most --restart-backoff-max; each
pair counts its own); after --max-restarts of one pair within the window that pair stays down and
the other pairs serve on. A processor or gateway that exits is restarted alone, at the same address,
on a budget of its own. Several of them recover at once, none waiting for another's model to load.
Serving ends (exit 1) when the processor, the gateway or the last engine taking requests gives up.
On Ctrl-C or SIGTERM, or on giving up, it stops them all, the gateway first so that requests in
flight can finish (--grace), then the rest (--internal-grace); SIGKILL after a grace. The children
get SIGTERM should this process die without stopping them (Linux's parent-death signal, which each
child sets on itself first thing: a `preexec_fn` would make subprocess fork() instead of vfork(),
and a fork() of this process, whose gRPC health checks leave gRPC's threads behind, can deadlock in
gRPC's fork handlers).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import os
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from enum import Enum
from pathlib import Path
from typing import NamedTuple

from services.common.config import (
    DisaggregationConfig,
    CacheConfig,
    FleetConfig,
    EngineServiceConfig,
    GATEWAY_SERVE_FIELDS,
    GatewayConfig,
    GRAMMAR_COMPILE_FIELDS,
    GrammarLimits,
    Limits,
    GATEWAY_LORA_FIELDS,
    LoRAConfig,
    PROCESSOR_MODEL_FIELDS,
    ModelConfig,
    ParallelConfig,
    PrefixIndexConfig,
    ProcessorServiceConfig,
    RoutingConfig,
    SchedulerConfig,
    SecurityConfig,
    ServeConfig,
    ServingConfig,
    WorkerConfig,
)
from services.common.architectures import check_folder_architecture
from services.common.flags import add_flags, build, to_argv
from services.common.lora import base_config_of, check_adapter
from services.common.processes import (
    KILL_AFTER,
    LOOPBACK,
    SERVICE_NAMES,
    SUPERVISOR_PID_ENV,
    Child,
    ChildSpec,
    ReadyLine,
    Supervisor,
    format_ready_line,
    free_ports,
    grpc_serving,
    http_ok,
    kill_group,
)
from services.common.rpc.security import ROLES
from services.common.token_files import write_role_tokens
from services.common.unix_socket import check_path_length, unix_address
from services.worker.step_channel import step_channel_path

SERVICES = {name: f"services.{name}.server" for name in SERVICE_NAMES}
USAGE = """usage: kvmesh <command> [flags]

commands:
  serve       run worker, engine, processor and gateway on this machine (kvmesh serve --help)
  worker      run the worker service (kvmesh worker --help)
  engine      run the engine service
  processor   run the processor service
  gateway     run the OpenAI-compatible HTTP gateway
"""
PARTNER_EXIT_WAIT = 3.0  # seconds the survivors of a group get to exit on their own (the engine, after its worker)
PR_SET_PDEATHSIG = 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        parser = build_serve_parser()
        args = parser.parse_args(rest)
        return serve(serve_spec(parser, args))
    if command in SERVICES:
        _follow_supervisor()
        # Imported on demand: a gateway pod must not need torch, which the worker imports.
        return importlib.import_module(SERVICES[command]).main(rest)
    print(f"kvmesh: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2


# ----------------------------------------------------------------------------- kvmesh serve


# What `kvmesh serve` takes of each config: the model and the engine's knobs whole; of the worker's,
# the attention backend (its batch cap is the engine's --max-num-seqs); the gateway's limits and keys;
# how the engine watches its worker; the prefix index (engines and processor) and routing (processor).
SERVE_FLAGS: list[tuple[type, dict[str, object]]] = [
    (ModelConfig, {"exclude": ["model", "served_model_name"]}),  # FleetConfig's, once per model
    (CacheConfig, {}),
    (SchedulerConfig, {}),
    (WorkerConfig, {"exclude": ["max_num_seqs"]}),
    (Limits, {}),
    (GatewayConfig, {"only": GATEWAY_SERVE_FIELDS}),
    (EngineServiceConfig, {"only": ["worker_liveness_interval", "worker_liveness_timeout", "exit_grace"]}),
    (ServeConfig, {}),
    (PrefixIndexConfig, {}),
    (RoutingConfig, {}),
    (ParallelConfig, {"only": ["tensor_parallel_size", "distributed_timeout"]}),
    (DisaggregationConfig, {"only": ["kv_transfer_timeout", "kv_lease", "remote_prefill_timeout", "prefill_threshold"]}),
    (GrammarLimits, {}),
    (FleetConfig, {}),
    (LoRAConfig, {}),
]


def build_serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh serve",
                                     description="Serve a model behind an OpenAI-compatible API on this machine.")
    for config_class, selection in SERVE_FLAGS:
        add_flags(parser, config_class, None, **selection)
    return parser


def _follow_supervisor() -> None:
    """In a child of `kvmesh serve`: SIGTERM when the supervisor dies. Set here, after exec (see
    the module docstring); a supervisor already gone by now means exit at once."""
    supervisor = os.environ.pop(SUPERVISOR_PID_ENV, None)
    if supervisor is None:
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(supervisor):
        sys.exit("kvmesh: the kvmesh serve that started this service is gone")


class ServeSpec(NamedTuple):
    """`kvmesh serve`'s configs, in SERVE_FLAGS' order."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    worker: WorkerConfig
    limits: Limits
    gateway: GatewayConfig
    engine: EngineServiceConfig
    serve: ServeConfig
    prefix_index: PrefixIndexConfig
    routing: RoutingConfig
    parallel: ParallelConfig
    disaggregation: DisaggregationConfig = DisaggregationConfig()
    grammar_limits: GrammarLimits = GrammarLimits()
    fleet: FleetConfig = FleetConfig()
    lora: LoRAConfig = LoRAConfig()

    @property
    def models(self) -> tuple[ModelConfig, ...]:
        """Each served model's config (`model` is the first's), in --model's order."""
        return self.fleet.model_configs(self.model)


def serve_spec(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ServeSpec:
    """`kvmesh serve`'s configs from its parsed flags; `model` is the first --model's."""
    spec = ServeSpec(*(build(parser, c, args) for c, _ in SERVE_FLAGS))
    if len(spec.fleet.model) > 1 and spec.serve.prefill_engines:
        parser.error("--prefill-engines serves one model: give one --model")
    return spec._replace(model=spec.models[0])


class RestartBudget:
    """When to restart a dead engine+worker pair (each pair has its own): after backoff * 2^(restarts within the window),
    at most backoff_max; never again (None) once max_restarts happened within the window. Restarts
    older than the window are forgotten, so a pair that stayed up that long starts over at backoff."""

    def __init__(self, backoff: float, backoff_max: float, max_restarts: int, window: float) -> None:
        self.backoff, self.backoff_max = backoff, backoff_max
        self.max_restarts, self.window = max_restarts, window
        self.restarts: list[float] = []  # monotonic times, oldest first

    def next_delay(self, now: float) -> float | None:
        self.restarts = [t for t in self.restarts if now - t < self.window]
        if len(self.restarts) >= self.max_restarts:
            return None
        delay = min(self.backoff * 2 ** len(self.restarts), self.backoff_max)
        self.restarts.append(now)
        return delay


def serve(spec: ServeSpec) -> int:
    supervisor = Supervisor(spec.serve.grace, spec.serve.internal_grace)
    previous = {sig: signal.signal(sig, supervisor.request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    # The children's role tokens, new each run, and their gRPC sockets: in a directory only this
    # user may enter (mkdtemp's 0700), that lives as long as they may restart. A token is never in
    # an argv, which `ps` shows to everyone. A loopback port would be free for any local user to
    # bind while its service restarts, and its callers would then hand that user their token.
    with tempfile.TemporaryDirectory(prefix="kvmesh-serve-", dir=runtime_dir()) as private:
        try:
            return _serve(spec, supervisor, Path(private))
        finally:
            supervisor.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def runtime_dir() -> str | None:
    """$XDG_RUNTIME_DIR when it is this user's own directory (private and cleared at logout), else
    None: the temp dir."""
    path = os.environ.get("XDG_RUNTIME_DIR")
    if not path:
        return None
    try:
        status = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(status.st_mode) or status.st_uid != os.getuid() or not os.access(path, os.W_OK | os.X_OK):
        return None
    return path


# The role tokens each kind of child holds: its own, to call with, and its callers', to check them.
# The gateway, the one facing the internet, holds its own only.
CHILD_ROLE_TOKENS = {"gateway": ("gateway",), "processor": ("gateway", "processor"),
                     "engine": ("processor", "engine"), "worker": ("engine",)}


def child_security(security: SecurityConfig, kind: str) -> SecurityConfig:
    """`security` with only the role tokens a child of `kind` holds (a shared token stays)."""
    return replace(security, **{f"{role}_token_file": None for role in ROLES if role not in CHILD_ROLE_TOKENS[kind]})


class Group(NamedTuple):
    """An engine and its workers (ranks 0..N-1, in rank order): restarted together (an engine's
    worker state dies with it, and a tensor-parallel group with any of its ranks)."""

    workers: tuple[str, ...]
    engine: str
    role: str = "both"  # disaggregated prefill/decode: prefill or decode
    model: int = 0  # which --model it serves (its index)

    @property
    def names(self) -> tuple[str, ...]:
        return (*self.workers, self.engine)

    @property
    def stages(self) -> tuple[tuple[str, ...], ...]:
        """The order they start in: the workers together (they wait for each other), then the engine."""
        return self.workers, (self.engine,)

    def describe(self) -> str:
        if self == SOLE_GROUP:
            return "the worker and the engine"
        return f"{', '.join(self.workers)} and {self.engine}"


SOLE_GROUP = Group(("worker",), "engine")  # the names with one engine of one worker, as before


def groups_of(num_engines: int, tensor_parallel_size: int = 1) -> tuple[Group, ...]:
    """The children's names: "worker"/"engine" for one engine, "worker-<i>"/"engine-<i>" for more;
    an engine's ranks "<worker>-r<rank>" when it has several ("worker-r0", "worker-1-r0")."""
    def group(worker: str, engine: str) -> Group:
        if tensor_parallel_size == 1:
            return Group((worker,), engine)
        return Group(tuple(f"{worker}-r{rank}" for rank in range(tensor_parallel_size)), engine)

    if num_engines == 1:
        return (group("worker", "engine"),)
    return tuple(group(f"worker-{i}", f"engine-{i}") for i in range(num_engines))


def disaggregated_groups(prefill_engines: int, decode_engines: int, tensor_parallel_size: int = 1) -> tuple[Group, ...]:
    """Prefill groups "worker-prefill-<i>"/"engine-prefill-<i>", then decode groups likewise."""
    return tuple(
        Group(tuple(f"worker-{role}-{i}" + (f"-r{r}" if tensor_parallel_size > 1 else "")
                    for r in range(tensor_parallel_size)), f"engine-{role}-{i}", role)
        for role, count in (("prefill", prefill_engines), ("decode", decode_engines)) for i in range(count))


def groups_for(serve: ServeConfig, tensor_parallel_size: int = 1, num_models: int = 1) -> tuple[Group, ...]:
    if serve.prefill_engines:
        return disaggregated_groups(serve.prefill_engines, serve.decode_engines, tensor_parallel_size)
    if num_models == 1:
        return groups_of(serve.num_engines, tensor_parallel_size)
    return model_groups(num_models, serve.num_engines, tensor_parallel_size)


def model_groups(num_models: int, num_engines: int, tensor_parallel_size: int = 1) -> tuple[Group, ...]:
    """--num-engines groups per model, model k's named as groups_of names them with "-m<k>" after
    "worker" and "engine" ("worker-m1", "engine-m1-0", "worker-m1-r0")."""
    def named(name: str, k: int) -> str:
        kind, _, rest = name.partition("-")
        return f"{kind}-m{k}" + (f"-{rest}" if rest else "")

    return tuple(Group(tuple(named(w, k) for w in group.workers), named(group.engine, k), group.role, k)
                 for k in range(num_models) for group in groups_of(num_engines, tensor_parallel_size))


class Layout(NamedTuple):
    """Where `kvmesh serve` puts each service: gRPC on a Unix socket in `socket_dir` (private),
    /metrics on loopback ports (no token travels there), and each tensor-parallel group's rendezvous
    on a loopback port: torch's TCPStore speaks TCP only, and its keys are signed with the internal
    token (parallel_group.namespaced), so whoever binds a freed port learns no secret."""

    groups: tuple[Group, ...]
    socket_dir: Path
    metrics_ports: dict[str, int]  # by child name: every worker and engine, and the processor
    distributed_ports: dict[str, int] = {}  # by engine name, for groups of several workers (read only)

    @classmethod
    def allocate(cls, socket_dir: Path, num_engines: int = 1, tensor_parallel_size: int = 1,
                 groups: tuple[Group, ...] | None = None) -> Layout:
        """Free ports for what stays TCP; ValueError when `socket_dir` is too deep for a socket's name."""
        groups = groups if groups is not None else groups_of(num_engines, tensor_parallel_size)
        names = internal_names(groups)
        parallel = [g.engine for g in groups] if tensor_parallel_size > 1 else []
        ports = free_ports(len(names) + len(parallel))
        layout = cls(groups, socket_dir, dict(zip(names, ports)), dict(zip(parallel, ports[len(names):])))
        for name in names:  # a worker's step channel has the longest path
            check_path_length(step_channel_path(layout.socket(name)))
        return layout

    @property
    def internal(self) -> tuple[str, ...]:
        return internal_names(self.groups)

    def socket(self, name: str) -> Path:
        return self.socket_dir / f"{name}.sock"

    def address(self, name: str) -> str:
        return unix_address(self.socket(name))

    def metrics_url(self, name: str) -> str:
        return f"http://{LOOPBACK}:{self.metrics_ports[name]}/metrics"


def internal_names(groups: Sequence[Group]) -> tuple[str, ...]:
    """The internal services in the order they start: each engine's workers before it, then the processor."""
    return (*(name for group in groups for name in group.names), "processor")


def service_argvs(spec: ServeSpec, layout: Layout, security: SecurityConfig = SecurityConfig()) -> dict[str, list[str]]:
    """Each child's flags, every field of its configs spelled out (services/common/flags.py);
    of `security` (the token files), each child gets the role tokens its kind holds."""
    # One name per model for every service's metrics, and each group's model.
    models = [replace(m, served_model_name=m.name) for m in spec.models]
    fleet = replace(spec.fleet, served_model_name=tuple(m.name for m in models))

    def serving(name: str) -> list[str]:
        return to_argv(ServingConfig(LOOPBACK, 0, spec.serve.internal_grace,
                                     metrics_port=layout.metrics_ports[name], unix_socket=layout.socket(name)))

    argvs: dict[str, list[str]] = {}
    for group in layout.groups:
        model = models[group.model]
        # Each model's engines and workers get its LoRA adapters only (their folders).
        lora = replace(spec.lora, lora_modules=spec.lora.modules_of(model.name, fleet.names))
        for rank, worker in enumerate(group.workers):
            argvs[worker] = [*to_argv(model), *to_argv(spec.cache), *to_argv(lora, exclude=GATEWAY_LORA_FIELDS),
                             *to_argv(replace(spec.worker, max_num_seqs=spec.scheduler.max_num_seqs)),
                             *serving(worker), *parallel_argv(spec.parallel, layout, group, rank),
                             *transfer_argv(spec.disaggregation, group, ["kv_transfer_address", "kv_transfer_timeout"])]
        # The engine's own address is its id in the prefix index.
        engine = replace(spec.engine, worker_address=tuple(layout.address(w) for w in group.workers),
                         advertise_address=layout.address(group.engine))
        argvs[group.engine] = [*to_argv(engine), *to_argv(spec.prefix_index), *to_argv(spec.scheduler),
                               *to_argv(spec.parallel, only=["tensor_parallel_size"]),
                               *to_argv(model, only=["served_model_name"]), *serving(group.engine),
                               *transfer_argv(spec.disaggregation, group, ["engine_role", "kv_lease",
                                                                           "kv_transfer_timeout",
                                                                           "remote_prefill_timeout"]),
                               *to_argv(spec.grammar_limits), *to_argv(lora, exclude=["max_cpu_loras", *GATEWAY_LORA_FIELDS])]
    # Disaggregated: the processor routes to the decode engines and names the prefill ones to them.
    engines = tuple(layout.address(g.engine) for g in layout.groups if g.role != "prefill")
    prefill = DisaggregationConfig(prefill_engine_address=tuple(
        layout.address(g.engine) for g in layout.groups if g.role == "prefill"),
        prefill_threshold=spec.disaggregation.prefill_threshold)
    argvs["processor"] = [*to_argv(ProcessorServiceConfig(engine_address=engines)), *to_argv(spec.routing),
                          *to_argv(spec.prefix_index), *to_argv(fleet),
                          *to_argv(spec.models[0], only=PROCESSOR_MODEL_FIELDS),
                          *serving("processor"), *to_argv(spec.grammar_limits, exclude=GRAMMAR_COMPILE_FIELDS),
                          *to_argv(spec.lora, only=["enable_lora", "lora_modules"]),
                          *(to_argv(prefill, only=["prefill_engine_address", "prefill_threshold"])
                            if prefill.prefill_engine_address else [])]
    gateway = replace(spec.gateway, processor_address=layout.address("processor"),
                      aggregate_metrics=tuple(layout.metrics_url(name) for name in layout.internal))
    argvs["gateway"] = [*to_argv(gateway), *to_argv(fleet, only=["served_model_name"]), *to_argv(spec.limits),
                        *to_argv(spec.lora, only=["enable_lora", "lora_modules", "allow_runtime_lora_updating"]),
                        *to_argv(spec.grammar_limits, exclude=GRAMMAR_COMPILE_FIELDS),
                        *to_argv(ServingConfig(spec.serve.host, spec.serve.port, spec.serve.grace),
                                 only=["host", "port", "grace"])]
    kinds = {"processor": "processor", "gateway": "gateway",
             **{name: "worker" for group in layout.groups for name in group.workers},
             **{group.engine: "engine" for group in layout.groups}}
    return {name: [*argv, *to_argv(child_security(security, kinds[name]))] for name, argv in argvs.items()}


def transfer_argv(config: DisaggregationConfig, group: Group, only: list[str]) -> list[str]:
    """A disaggregated group's flags: its engine's role, its workers' KV-transfer endpoints on
    loopback (any free port); none for a colocated group."""
    if group.role == "both":
        return []
    return to_argv(replace(config, engine_role=group.role, kv_transfer_address=f"{LOOPBACK}:0"), only=only)


def parallel_argv(parallel: ParallelConfig, layout: Layout, group: Group, rank: int) -> list[str]:
    """A worker's place in its group: none for a group of one (a worker alone needs no flags), else
    its rank, the size and the group's rendezvous on loopback."""
    if len(group.workers) == 1:
        return []
    address = f"{LOOPBACK}:{layout.distributed_ports[group.engine]}"
    return to_argv(replace(parallel, tensor_parallel_size=len(group.workers), rank=rank, distributed_address=address))


def _serve(spec: ServeSpec, supervisor: Supervisor, private: Path) -> int:
    tp = spec.parallel.tensor_parallel_size
    try:  # a model no worker could load: one line now, not a worker's traceback after its imports
        for model in spec.models:
            check_folder_architecture(model.model)
        check_lora_modules(spec)
    except ValueError as exc:
        print(f"kvmesh: {exc}", file=sys.stderr)
        return 2
    try:
        layout = Layout.allocate(private, tensor_parallel_size=tp, groups=groups_for(spec.serve, tp, len(spec.models)))
    except ValueError as exc:  # a socket path too long for its directory
        print(f"kvmesh: {exc}", file=sys.stderr)
        return 2
    argvs = service_argvs(spec, layout, write_role_tokens(private))
    host, port = spec.serve.host, spec.serve.port
    api = f"http://{_url_host(host)}:{port}"
    metrics = {name: layout.metrics_url(name) for name in layout.internal} | {"gateway": f"{api}/metrics"}

    def grpc_ready(address: str) -> Callable[[], bool]:
        return lambda: grpc_serving(address)

    def internal(names: Sequence[str]) -> list[ChildSpec]:
        return [ChildSpec(name, argvs[name], layout.address(name), grpc_ready(layout.address(name))) for name in names]

    # The processor needs no engine to start (it turns SERVING once one is), so its imports overlap
    # with the workers' loading. The gateway opens the API last: a client sees it only when all serve.
    processor = supervisor.launch(internal(["processor"]))
    # Every group's workers load together, then every engine starts (each waits for its own workers).
    stages = [internal([w for group in layout.groups for w in group.workers]),
              internal([group.engine for group in layout.groups])]
    gateway = [ChildSpec("gateway", argvs["gateway"], f"{host}:{port}", lambda: http_ok(f"{api}/health"))]
    timeout = spec.serve.startup_timeout
    if not (all(supervisor.start(stage, timeout) for stage in stages) and supervisor.wait_ready(processor, timeout)
            and supervisor.start(gateway, timeout)):
        return 0 if supervisor.stop_requested else 1
    print(f"kvmesh: serving {', '.join(spec.fleet.names)} at {api}/v1 (Ctrl-C to stop)", flush=True)
    if spec.serve.print_addresses:
        services = {c.name: {"address": c.address, "pid": c.proc.pid, "metrics": metrics[c.name]}
                    for c in supervisor.children}
        print(format_ready_line(ReadyLine(f"{api}/v1", services)), flush=True)
    return supervise(supervisor, spec.serve, layout.groups)


def check_lora_modules(spec: ServeSpec) -> None:
    """ValueError naming what is wrong with an adapter of --lora-modules: its base model, its folder,
    its rank, its target modules, or (for a base model given as a folder) its shapes."""
    names = spec.fleet.names
    spec.lora.parents(names)
    for model in spec.models:
        base_config = base_config_of(model.model)
        for module in spec.lora.modules_of(model.name, names):
            check_adapter(module.path, spec.lora.max_lora_rank, base_config)


class Single(NamedTuple):
    """A service restarted alone (the processor, the gateway): it holds no state a pair depends on."""

    name: str

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name,)

    @property
    def stages(self) -> tuple[tuple[str, ...], ...]:
        return ((self.name,),)

    def describe(self) -> str:
        return f"the {self.name}"


Unit = Group | Single  # what supervision restarts as one


class Outcome(Enum):
    SERVING = "serving"
    GAVE_UP = "gave up"


class Recovery:
    """One unit's way back after one of its children exited, a step at a time, so that several
    units recover at once and none waits for another's model to load:

        draining (its survivors exit on their own, PARTNER_EXIT_WAIT) -> stopping (SIGTERM, then
        SIGKILL after KILL_AFTER) -> back-off (its budget's delay, or give up) -> starting (stage by
        stage, each until ready or --startup-timeout) -> serving
                  a stage that exits or times out: draining again, with one more restart counted
    """

    def __init__(self, supervisor: Supervisor, unit: Unit, budget: RestartBudget, startup_timeout: float,
                 why: str) -> None:
        self.supervisor, self.unit, self.budget = supervisor, unit, budget
        self.startup_timeout = startup_timeout
        self.why = why  # what went wrong last, for the log
        self.phase = "draining"
        self.deadline = time.monotonic() + PARTNER_EXIT_WAIT
        self.stage = 0  # the stage starting, while "starting"
        self.ready: set[str] = set()  # its children found ready so far

    def members(self, names: Sequence[str] | None = None) -> list[Child]:
        names = self.unit.names if names is None else names
        return [c for c in self.supervisor.children if c.name in names]

    def step(self, now: float) -> Outcome | None:
        """Moves on as far as `now` allows; the outcome once there is one."""
        if self.phase == "draining" and (now >= self.deadline or all(c.proc.poll() is not None
                                                                     for c in self.members())):
            for child in self.members():
                if child.proc.poll() is None:
                    child.proc.send_signal(signal.SIGTERM)
            self.phase, self.deadline = "stopping", now + KILL_AFTER
        if self.phase == "stopping" and (now >= self.deadline or all(c.proc.poll() is not None
                                                                     for c in self.members())):
            for child in self.members():
                kill_group(child.proc)
            delay = self.budget.next_delay(now)
            if delay is None:
                return Outcome.GAVE_UP
            print(f"kvmesh: {self.why}; restarting {self.unit.describe()} in {delay:g}s", file=sys.stderr, flush=True)
            self.phase, self.deadline, self.stage = "backoff", now + delay, 0
        if self.phase == "backoff" and now >= self.deadline:
            self._start_stage(now)
        if self.phase == "starting":
            return self._follow_start(now)
        return None

    def _start_stage(self, now: float) -> None:
        for name in self.unit.stages[self.stage]:
            self.supervisor.respawn(name)
        self.phase, self.deadline, self.ready = "starting", now + self.startup_timeout, set()

    def _follow_start(self, now: float) -> Outcome | None:
        for child in self.members(self.unit.stages[self.stage]):
            if child.proc.poll() is not None:
                return self._failed(now, f"the {child.name} exited with code {child.proc.returncode} while starting")
            if child.name not in self.ready and child.ready():
                self.ready.add(child.name)
        if len(self.ready) < len(self.unit.stages[self.stage]):
            if now > self.deadline:
                return self._failed(now, f"{self.unit.describe()} were not healthy after {self.startup_timeout:.0f}s")
            return None
        self.stage += 1
        if self.stage == len(self.unit.stages):
            return Outcome.SERVING
        self._start_stage(now)
        return None

    def _failed(self, now: float, why: str) -> None:
        print(f"kvmesh: {why}", file=sys.stderr, flush=True)
        self.why = f"{self.unit.describe()} did not come back"
        self.phase, self.deadline = "draining", now  # its survivors are stopped at the next step
        return None


def supervise(supervisor: Supervisor, config: ServeConfig, groups: Sequence[Group] = (SOLE_GROUP,)) -> int:
    """Until a stop is requested (0): restart whatever exited, each unit on its own budget and several
    at once (Recovery): an engine with all its workers, the processor, the gateway. A unit whose
    budget is spent stays down; that ends serving (1) when it is the processor, the gateway or the
    last engine that takes requests (a decode or colocated one), else the other engines serve on."""
    units: list[Unit] = [*groups, *(Single(c.name) for c in supervisor.children
                                    if not any(c.name in g.names for g in groups))]
    budgets = {unit: RestartBudget(config.restart_backoff, config.restart_backoff_max, config.max_restarts,
                                   config.restart_window) for unit in units}
    recoveries: dict[Unit, Recovery] = {}
    lost: set[Unit] = set()
    while not supervisor.stop_requested:
        for unit in units:
            if unit in recoveries or unit in lost:
                continue
            died = next((c for c in supervisor.children if c.name in unit.names and c.proc.poll() is not None), None)
            if died is not None:
                why = f"the {died.name} exited with code {died.proc.returncode}"
                recoveries[unit] = Recovery(supervisor, unit, budgets[unit], config.startup_timeout, why)
        for unit, recovery in list(recoveries.items()):
            outcome = recovery.step(time.monotonic())
            if outcome is None:
                continue
            del recoveries[unit]
            if outcome is Outcome.SERVING:
                verb = "is" if len(unit.names) == 1 else "are"
                print(f"kvmesh: {unit.describe()} {verb} serving again", file=sys.stderr, flush=True)
                continue
            lost.add(unit)
            serving = [g for g in groups if g.role != "prefill" and g not in lost]
            last = isinstance(unit, Single) or not serving
            print(f"kvmesh: {recovery.why}; {unit.describe()} restarted {config.max_restarts} times in "
                  f"{config.restart_window:.0f}s: giving up on {unit.describe()}"
                  + ("; stopping the others" if last else f", serving with {len(serving)} other engine(s)"),
                  file=sys.stderr, flush=True)
            if last:
                return 1
        supervisor.sleep(0.2)
    return 0


def _url_host(host: str) -> str:
    """Where this machine reaches a server listening on `host`."""
    if host in ("", "0.0.0.0"):
        return LOOPBACK
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


if __name__ == "__main__":
    sys.exit(main())
