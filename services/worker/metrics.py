"""The worker's metrics: kvmesh_worker_step_seconds (one step as its step channel serves it:
read, decoded, executed, its answer encoded; by outcome), kvmesh_worker_execute_seconds (one execute_model: inputs,
forward, sampling) and kvmesh_worker_forward_seconds (the model's forward pass alone).

The forward pass is timed by hooks on the model, so the model runner carries no timing code. On a
GPU the hooks record CUDA events instead of reading a clock (the launch returns long before the
kernels finish, and a sync there would stall the step); the events are read once the step has
ended, when the step's own sync on its sampled tokens has completed them.
"""

from __future__ import annotations

import time

import torch
from prometheus_client import Histogram
from torch import nn

from services.common.metrics import COMPONENT, STEP_BUCKETS, ServiceMetrics


class WorkerMetrics:
    def __init__(self, service: ServiceMetrics, model_name: str) -> None:
        self.service = service
        labels, values = [COMPONENT, "model_name"], (service.grpc.component, model_name)
        self.execute_seconds = Histogram("kvmesh_worker_execute_seconds",
                                         "One execute_model: inputs, forward pass and sampling",
                                         labels, buckets=STEP_BUCKETS, registry=service.registry).labels(*values)
        steps = Histogram("kvmesh_worker_step_seconds",
                          "One step as the step channel serves it: read, decoded, executed, its answer encoded",
                          [*labels, "outcome"], buckets=STEP_BUCKETS, registry=service.registry)
        self._step_outcomes = {True: steps.labels(*values, "ok"), False: steps.labels(*values, "error")}
        self.forward_seconds = Histogram("kvmesh_worker_forward_seconds", "The model's forward pass alone",
                                         labels, buckets=STEP_BUCKETS, registry=service.registry).labels(*values)
        self._start: float | torch.cuda.Event | None = None
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # GPU forwards not yet read

    def watch_forward(self, model: nn.Module, device: torch.device) -> None:
        """Time every forward pass of `model` (on the thread that runs the steps)."""
        on_gpu = device.type == "cuda"

        def before(module: nn.Module, args: object) -> None:
            if on_gpu:
                self._start = torch.cuda.Event(enable_timing=True)
                self._start.record()
            else:
                self._start = time.perf_counter()

        def after(module: nn.Module, args: object, output: object) -> None:
            if on_gpu:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._pending.append((self._start, end))
            else:
                self.forward_seconds.observe(time.perf_counter() - self._start)

        model.register_forward_pre_hook(before)
        model.register_forward_hook(after)

    def observe_step_handling(self, seconds: float, ok: bool) -> None:
        self._step_outcomes[ok].observe(seconds)

    def observe_step(self, seconds: float) -> None:
        """After an execute_model of `seconds`, on the same thread; reads the GPU forwards' events."""
        self.execute_seconds.observe(seconds)
        pending, self._pending = self._pending, []
        for start, end in pending:
            end.synchronize()  # already complete: the step ended with a sync on its sampled tokens
            self.forward_seconds.observe(start.elapsed_time(end) / 1000.0)
