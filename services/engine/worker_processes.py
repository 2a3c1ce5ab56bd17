"""A tensor-parallel group of worker processes on this machine, for the offline `LLM` with
tensor_parallel_size above 1 (as vLLM's multiproc executor): N `kvmesh worker` processes, ranks
0..N-1, on free loopback ports, rendezvousing on one more, driven by a GroupWorkerClient.

    WorkerProcesses.start(model, cache, worker, parallel)   spawn, wait until every rank serves
    .client                                                 the GroupWorkerClient over them
    .close()                                                close the client, SIGTERM, then SIGKILL

The children follow this process (Linux's parent-death signal, set by `kvmesh worker` itself:
services/common/processes.py), so a crash here leaves no worker behind; close() stops them in an
orderly way.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

from services.common.config import (GATEWAY_LORA_FIELDS, CacheConfig, LoRAConfig, ModelConfig, ParallelConfig,
                                    ServingConfig, WorkerConfig)
from services.common.flags import to_argv
from services.common.processes import LOOPBACK, ChildSpec, Supervisor, free_ports, grpc_serving
from services.common.rpc.security import ENGINE, RpcSecurity
from services.common.token_files import write_token_file
from services.engine.executor import GroupWorkerClient
from services.worker.client import GrpcWorkerClient

STOP_GRACE = 5.0  # seconds the workers get to exit after SIGTERM, before SIGKILL


class WorkerProcesses:
    def __init__(self, supervisor: Supervisor, client: GroupWorkerClient,
                 private: tempfile.TemporaryDirectory) -> None:
        self.supervisor = supervisor  # `kvmesh serve`'s: it spawns, waits for and stops the same way
        self.client = client
        self._private = private  # holds the internal token file while the workers live

    @property
    def pids(self) -> list[int]:
        return [child.proc.pid for child in self.supervisor.children]

    @classmethod
    def start(cls, model: ModelConfig, cache: CacheConfig, worker: WorkerConfig, parallel: ParallelConfig,
              timeout: float = 600.0, lora: LoRAConfig = LoRAConfig()) -> WorkerProcesses:
        """Spawn the group and wait (at most `timeout` s) until each rank serves; RuntimeError,
        with every process stopped, if one exits or the wait runs out."""
        size = parallel.tensor_parallel_size
        *ports, store_port = free_ports(size + 1)
        private = tempfile.TemporaryDirectory(prefix="kvmesh-llm-")
        security = write_token_file(Path(private.name))
        addresses = [f"{LOOPBACK}:{port}" for port in ports]
        group = replace(parallel, distributed_address=f"{LOOPBACK}:{store_port}")
        supervisor = Supervisor(internal_grace=STOP_GRACE)
        ranks = [ChildSpec(f"worker-r{rank}",
                           [*to_argv(model), *to_argv(cache), *to_argv(worker), *to_argv(ServingConfig(LOOPBACK, port)),
                            *to_argv(replace(group, rank=rank)), *to_argv(security), *to_argv(lora, exclude=GATEWAY_LORA_FIELDS)],
                           address, lambda address=address: grpc_serving(address))
                 for rank, (port, address) in enumerate(zip(ports, addresses))]
        try:
            if not supervisor.start(ranks, timeout):  # it said why on stderr
                raise RuntimeError(f"the {size} worker processes of the tensor-parallel group did not start")
        except BaseException:
            supervisor.stop()
            private.cleanup()
            raise
        rpc_security = RpcSecurity.load(security, ENGINE)
        client = GroupWorkerClient([GrpcWorkerClient(address, timeout=timeout, security=rpc_security)
                                    for address in addresses])
        return cls(supervisor, client, private)

    def close(self) -> None:
        """Idempotent: the client closed, the workers stopped (SIGTERM, SIGKILL after a grace), reaped."""
        self.client.close()
        self.supervisor.stop()
        self._private.cleanup()
