"""Flags come from the config dataclasses: each knob is one field, its flag, environment variable,
bounds and default; `kvmesh serve` hands its children exactly the configs it parsed."""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import pytest

from services import cli
from services.common.config import (
    CacheConfig,
    EngineArgs,
    EngineServiceConfig,
    GatewayConfig,
    Limits,
    ModelConfig,
    ParallelConfig,
    PrefixIndexConfig,
    ProcessorServiceConfig,
    RoutingConfig,
    SchedulerConfig,
    ServingConfig,
    WorkerConfig,
)
from services.common.flags import add_flags, build, configs_of, to_argv
from services.engine import server as engine_server
from services.gateway import server as gateway_server
from services.processor import server as processor_server
from services.worker import server as worker_server

CONFIGS = [ModelConfig, CacheConfig, SchedulerConfig, WorkerConfig, ServingConfig, EngineServiceConfig,
           ProcessorServiceConfig, GatewayConfig, Limits, PrefixIndexConfig, RoutingConfig]
SOCKETS = Path("/run/user/1000/kvmesh-serve-test")  # where `kvmesh serve` would keep its sockets


def sock(name: str) -> str:
    """The gRPC address serve gives child `name`."""
    return f"unix:{SOCKETS}/{name}.sock"


def parser_for(config_class: type, env_prefix: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_flags(parser, config_class, env_prefix)
    return parser


def parse(config_class: type, argv: list[str], env_prefix: str | None = None):
    parser = parser_for(config_class, env_prefix)
    return build(parser, config_class, parser.parse_args(argv))


@pytest.mark.parametrize("config_class", CONFIGS, ids=lambda c: c.__name__)
def test_every_field_has_help_and_the_defaults_round_trip(config_class):
    assert all(f.metadata.get("help") for f in fields(config_class))
    default = config_class()
    assert parse(config_class, []) == default
    assert parse(config_class, to_argv(default)) == default


def test_non_default_values_round_trip_through_flags():
    configs = [
        ModelConfig(model="/models/x", served_model_name="x", dtype="bfloat16", max_model_len=512, seed=3),
        CacheConfig(block_size=32, kv_cache_memory=2**28, memory_fraction=0.5),
        SchedulerConfig(max_num_seqs=4, max_num_waiting=0, policy="priority", enable_prefix_caching=False),
        GatewayConfig(access_log=False, api_key=("a", "b"), aggregate_metrics=("http://127.0.0.1:1/metrics",),
                      return_tokens_as_token_ids=True),
        Limits(max_n=2, max_tokens=7),
        ProcessorServiceConfig(engine_address=("127.0.0.1:1", "127.0.0.1:2"), engine_timeout=3.0),
        PrefixIndexConfig(prefix_index="redis://127.0.0.1:6379/2", prefix_index_namespace="t", heartbeat_ttl=2.0),
        RoutingConfig(routing="session", routing_imbalance=0, max_migrations=0),
    ]
    for config in configs:
        assert parse(type(config), to_argv(config)) == config


def test_environment_gives_defaults_and_flags_win(monkeypatch):
    monkeypatch.setenv("KVMESH_TEST_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("KVMESH_TEST_ENABLE_PREFIX_CACHING", "false")
    assert parse(SchedulerConfig, [], "KVMESH_TEST") == SchedulerConfig(max_num_seqs=7, enable_prefix_caching=False)
    assert parse(SchedulerConfig, ["--max-num-seqs", "9"], "KVMESH_TEST").max_num_seqs == 9
    monkeypatch.setenv("KVMESH_TEST_API_KEY", "k1, k2")
    assert parse(GatewayConfig, [], "KVMESH_TEST").api_key == ("k1", "k2")
    assert parse(GatewayConfig, ["--api-key", "k3"], "KVMESH_TEST").api_key == ("k3",)


@pytest.mark.parametrize("argv, message", [
    (["--max-num-seqs", "0"], "max_num_seqs must be at least 1"),
    (["--scheduling-policy", "lifo"], "invalid choice"),
    (["--max-num-seqs", "x"], "invalid"),
])
def test_bad_values_are_usage_errors_naming_the_flag(argv, message, capsys):
    parser = argparse.ArgumentParser(prog="kvmesh engine")
    add_flags(parser, SchedulerConfig, None)
    with pytest.raises(SystemExit) as exit_info:
        build(parser, SchedulerConfig, parser.parse_args(argv))
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_a_bad_environment_value_is_a_usage_error():
    result = subprocess.run([sys.executable, "-m", "services.cli", "engine", "--help"], capture_output=True,
                            text=True, env={"KVMESH_ENGINE_ENABLE_PREFIX_CACHING": "maybe", "PATH": ""})
    assert result.returncode == 2 and "$KVMESH_ENGINE_ENABLE_PREFIX_CACHING: not a boolean" in result.stderr


def test_vllms_dtype_names_read_as_ours(monkeypatch):
    # vLLM's scripts and charts pass --dtype half (and float); the config names each dtype one way.
    assert parse(ModelConfig, ["--dtype", "half"]).dtype == "float16"
    assert parse(ModelConfig, ["--dtype", "float"]).dtype == "float32"
    assert ModelConfig(dtype="half") == ModelConfig(dtype="float16")  # LLM(dtype="half")
    monkeypatch.setenv("KVMESH_TEST_DTYPE", "half")
    assert parse(ModelConfig, [], "KVMESH_TEST").dtype == "float16"
    with pytest.raises(ValueError, match="dtype must be one of"):
        ModelConfig(dtype="fp16")


def test_sizes_read_as_memory_sizes():
    assert parse(CacheConfig, ["--kv-cache-memory", "1.5GiB"]).kv_cache_memory == 3 * 2**29
    assert parse(CacheConfig, ["--kv-cache-memory", "128M"]).kv_cache_memory == 2**27


def test_a_parser_names_the_configs_it_has_flags_of_with_their_fields():
    """What the tests' command builder (tests/services/procs.py) reads to spell a service's flags."""
    parser = argparse.ArgumentParser()
    add_flags(parser, ModelConfig, None, only=["model", "dtype"])
    add_flags(parser, CacheConfig, None, exclude=["kv_cache_memory"])
    assert configs_of(parser) == [(ModelConfig, ("model", "dtype")),
                                  (CacheConfig, tuple(f.name for f in fields(CacheConfig) if f.name != "kv_cache_memory"))]
    assert configs_of(argparse.ArgumentParser()) == []


def test_serve_hands_each_child_exactly_its_configs():
    """What each service parses from the argv `kvmesh serve` gives it is what serve was asked for."""
    parser = cli.build_serve_parser()
    argv = ["--model", "/m", "--kv-cache-memory", "64MiB", "--max-num-seqs", "3", "--no-enable-prefix-caching",
            "--scheduling-policy", "priority", "--attention-backend", "torch", "--max-n", "2", "--api-key", "k",
            "--api-key-file", "/run/keys", "--port", "8123", "--block-size", "32", "--return-tokens-as-token-ids"]
    args = parser.parse_args(argv)
    spec = cli.serve_spec(parser, args)
    layout = cli.Layout(cli.groups_of(1), SOCKETS, {"worker": 4, "engine": 5, "processor": 6})
    argvs = cli.service_argvs(spec, layout)
    model = replace(spec.model, served_model_name="/m")

    worker_parser = worker_server.build_parser()
    worker_args = worker_parser.parse_args(argvs["worker"])
    assert build(worker_parser, ModelConfig, worker_args) == model
    assert build(worker_parser, CacheConfig, worker_args) == CacheConfig(block_size=32, kv_cache_memory=64 * 2**20)
    assert build(worker_parser, WorkerConfig, worker_args) == WorkerConfig("torch", max_num_seqs=3)
    assert build(worker_parser, ServingConfig, worker_args).unix_socket == SOCKETS / "worker.sock"

    engine = engine_server.parse_args(argvs["engine"])
    assert engine.scheduler == SchedulerConfig(max_num_seqs=3, policy="priority", enable_prefix_caching=False)
    assert (engine.service.worker_address, engine.service.advertise_address) == ((sock("worker"),), sock("engine"))
    assert engine.parallel == ParallelConfig()
    assert (engine.model.served_model_name, engine.serving.unix_socket, engine.serving.metrics_port) == \
        ("/m", SOCKETS / "engine.sock", 5)

    processor = processor_server.parse_args(argvs["processor"])
    assert processor.service.engine_address == (sock("engine"),)
    assert (processor.model.model, processor.model.name) == ("/m", "/m")

    gateway_parser = gateway_server.build_parser()
    gateway_args = gateway_parser.parse_args(argvs["gateway"])
    gateway = build(gateway_parser, GatewayConfig, gateway_args)
    assert (gateway.processor_address, gateway.api_key) == (sock("processor"), ("k",))
    assert gateway.api_key_file == Path("/run/keys")  # read by the gateway, never by serve
    assert gateway.return_tokens_as_token_ids
    assert gateway.aggregate_metrics == tuple(f"http://127.0.0.1:{p}/metrics" for p in (4, 5, 6))
    assert build(gateway_parser, Limits, gateway_args) == Limits(max_n=2)
    assert build(gateway_parser, ServingConfig, gateway_args).port == 8123


def test_serve_with_two_engines_hands_each_pair_its_own_sockets():
    """--num-engines 2: two worker+engine pairs on sockets of their own, every engine named to the
    processor, the prefix index to engines and processor, the routing to the processor, and every
    internal service's /metrics to the gateway."""
    parser = cli.build_serve_parser()
    args = parser.parse_args(["--num-engines", "2", "--prefix-index", "redis://127.0.0.1:7/1", "--heartbeat-ttl", "3",
                              "--routing", "least-load", "--max-migrations", "1"])
    spec = cli.serve_spec(parser, args)
    assert spec.serve.num_engines == 2
    names = ["worker-0", "engine-0", "worker-1", "engine-1", "processor"]
    layout = cli.Layout(cli.groups_of(2), SOCKETS, dict(zip(names, range(11, 16))))
    assert layout.internal == tuple(names)
    argvs = cli.service_argvs(spec, layout)
    assert list(argvs) == [*names, "gateway"]
    index = PrefixIndexConfig(prefix_index="redis://127.0.0.1:7/1", heartbeat_ttl=3.0)

    for i in range(2):
        worker_parser = worker_server.build_parser()
        worker_serving = build(worker_parser, ServingConfig, worker_parser.parse_args(argvs[f"worker-{i}"]))
        assert worker_serving.unix_socket == SOCKETS / f"worker-{i}.sock"
        engine_parser = engine_server.build_parser()
        engine_args = engine_parser.parse_args(argvs[f"engine-{i}"])
        service = build(engine_parser, EngineServiceConfig, engine_args)
        assert (service.worker_address, service.advertise_address) == ((sock(f"worker-{i}"),), sock(f"engine-{i}"))
        assert build(engine_parser, PrefixIndexConfig, engine_args) == index
        assert build(engine_parser, ServingConfig, engine_args).metrics_port == 12 + 2 * i

    processor_parser = processor_server.build_parser()
    processor_args = processor_parser.parse_args(argvs["processor"])
    assert build(processor_parser, ProcessorServiceConfig, processor_args).engine_address == (sock("engine-0"),
                                                                                            sock("engine-1"))
    assert build(processor_parser, PrefixIndexConfig, processor_args) == index
    assert build(processor_parser, RoutingConfig, processor_args) == RoutingConfig("least-load", max_migrations=1)

    gateway_parser = gateway_server.build_parser()
    gateway = build(gateway_parser, GatewayConfig, gateway_parser.parse_args(argvs["gateway"]))
    assert gateway.aggregate_metrics == tuple(f"http://127.0.0.1:{p}/metrics" for p in range(11, 16))


def test_serve_with_tensor_parallel_groups_hands_each_rank_its_place():
    """--tensor-parallel-size 2 --num-engines 2: each engine drives its two workers (rank order),
    each group rendezvouses on a port of its own, and a worker alone gets no parallel flags."""
    parser = cli.build_serve_parser()
    args = parser.parse_args(["--num-engines", "2", "--tensor-parallel-size", "2", "--distributed-timeout", "4"])
    spec = cli.serve_spec(parser, args)
    groups = cli.groups_of(2, 2)
    assert groups == (cli.Group(("worker-0-r0", "worker-0-r1"), "engine-0"),
                      cli.Group(("worker-1-r0", "worker-1-r1"), "engine-1"))
    assert groups[0].stages == (("worker-0-r0", "worker-0-r1"), ("engine-0",))
    names = ["worker-0-r0", "worker-0-r1", "engine-0", "worker-1-r0", "worker-1-r1", "engine-1", "processor"]
    layout = cli.Layout(groups, SOCKETS, dict(zip(names, range(11, 18))), {"engine-0": 21, "engine-1": 22})
    assert layout.internal == tuple(names)
    argvs = cli.service_argvs(spec, layout)

    for i, group in enumerate(groups):
        engine = engine_server.parse_args(argvs[group.engine])
        assert engine.parallel.tensor_parallel_size == 2
        assert engine.service.worker_address == tuple(sock(w) for w in group.workers)
        for rank, worker in enumerate(group.workers):
            parallel_parser = argparse.ArgumentParser()  # ParallelConfig's flags alone, out of the worker's argv
            add_flags(parallel_parser, ParallelConfig, None)
            parallel = build(parallel_parser, ParallelConfig, parallel_parser.parse_known_args(argvs[worker])[0])
            assert parallel == ParallelConfig(2, rank, f"127.0.0.1:{21 + i}", 4.0)
            worker_dests = {a.dest for a in worker_server.build_parser()._actions}
            if "rank" in worker_dests:
                worker_parser = worker_server.build_parser()
                assert build(worker_parser, ParallelConfig, worker_parser.parse_args(argvs[worker])) == parallel

    one = cli.service_argvs(cli.serve_spec(parser, parser.parse_args([])),
                            cli.Layout(cli.groups_of(1), SOCKETS, {"worker": 4, "engine": 5, "processor": 6}))
    assert not any(flag.startswith(("--rank", "--tensor-parallel-size", "--distributed")) for flag in one["worker"])
    assert cli.Layout.allocate(SOCKETS, 2, 2).distributed_ports.keys() == {"engine-0", "engine-1"}
    assert cli.Layout.allocate(SOCKETS, 2, 1).distributed_ports == {}


def test_parallel_config_is_checked():
    with pytest.raises(ValueError, match="rank 2 is outside a tensor-parallel group of 2"):
        ParallelConfig(tensor_parallel_size=2, rank=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1"):
        ParallelConfig(tensor_parallel_size=0)


@pytest.mark.parametrize("value, message", [("0", "num_engines must be at least 1"),
                                            ("65", "num_engines must be at most 64")])
def test_num_engines_is_bounded(value, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--num-engines", value])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_new_field_reaches_serve_and_its_service():
    """Every knob of the model, cache, scheduler and worker is a flag of `kvmesh serve` (less the
    worker's batch cap, which serve derives) and of the service that takes it."""
    serve_dests = {a.dest for a in cli.build_serve_parser()._actions}
    for config_class in (ModelConfig, CacheConfig, SchedulerConfig, WorkerConfig, Limits, PrefixIndexConfig,
                         RoutingConfig):
        missing = {f.name for f in fields(config_class)} - serve_dests
        assert missing <= ({"max_num_seqs"} if config_class is WorkerConfig else set()), (config_class, missing)
    worker_dests = {a.dest for a in worker_server.build_parser()._actions}
    engine_dests = {a.dest for a in engine_server.build_parser()._actions}
    processor_dests = {a.dest for a in processor_server.build_parser()._actions}
    for config_class, dests in ((ModelConfig, worker_dests), (CacheConfig, worker_dests),
                                (WorkerConfig, worker_dests), (SchedulerConfig, engine_dests),
                                (PrefixIndexConfig, engine_dests), (PrefixIndexConfig, processor_dests),
                                (RoutingConfig, processor_dests)):
        assert {f.name for f in fields(config_class)} <= dests, config_class
    assert "block_size" not in engine_dests  # the engine takes its worker's (WorkerInfo)


def test_engine_args_take_the_flags_names():
    args = EngineArgs.from_kwargs(model="m", max_num_seqs=8, scheduling_policy="priority", kv_cache_memory=100)
    assert args.scheduler.max_num_seqs == args.worker.max_num_seqs == 8
    assert (args.scheduler.policy, args.cache.kv_cache_memory, args.model.model) == ("priority", 100, "m")
    with pytest.raises(TypeError, match="unknown engine argument"):
        EngineArgs.from_kwargs(max_num_seq=8)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        EngineArgs.from_kwargs(block_size=12)
