"""Prometheus metrics every service shares.

    registry = new_registry("engine")              one per process: process_*, python_*, kvmesh_build_info
    grpc_metrics = GrpcMetrics(registry, "engine")  kvmesh_grpc_* from interceptors on servers and channels
    (ServiceMetrics.create("engine") makes both)
    endpoint = MetricsEndpoint.start(registry, host, port)     /metrics of a gRPC service

and, for `kvmesh serve`'s gateway, `merge_scrapes()`: several processes' pages as one valid page.

A registry per process rather than prometheus-client's global one: tests build several cores in one
process, and the global registry refuses a second metric of the same name.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import inspect
import logging
import socket
import threading
import time
import urllib.request
from urllib.parse import urlsplit
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import NamedTuple
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import grpc
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    GCCollector,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

COMPONENT = "component"
INSTANCE = "instance"  # which of several processes of one component, in a merged page (merge_scrapes)
# Request-scale durations: 0.5 ms (a loopback unary call) to 10 min (a long generation stream).
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0, 120.0, 300.0, 600.0)
# Step-scale durations: 100 us (an empty step) to 30 s (a long prefill on a CPU).
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
                0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# vLLM keeps its own label set on its metrics; every other series from a process that lacks
# `component` gets it when pages are merged.
VLLM_PREFIX = "vllm:"


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


def version() -> str:
    try:
        return importlib.metadata.version("kvmesh")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def new_registry(component: str) -> CollectorRegistry:
    """A process's registry: the process, platform and GC collectors prometheus-client puts in its
    global registry, plus kvmesh_build_info{component, version} = 1."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    Gauge("kvmesh_build_info", "1 per kvmesh process, labelled with its component and version",
          [COMPONENT, "version"], registry=registry).labels(component, version()).set(1)
    return registry


# ----------------------------------------------------------------------------- gRPC


class GrpcMethod(NamedTuple):
    service: str
    method: str

    @classmethod
    def parse(cls, full_method: str) -> GrpcMethod:
        """"/kvmesh.v1.Engine/Generate" -> ("kvmesh.v1.Engine", "Generate")."""
        service, _, method = full_method.lstrip("/").rpartition("/")
        return cls(service or "unknown", method)


class GrpcMetrics:
    """kvmesh_grpc_{server,client}_{handled_total,handling_seconds} of one process. A call is
    counted once it has finished, with its final status code; streams are timed whole."""

    def __init__(self, registry: CollectorRegistry, component: str) -> None:
        self.component = component
        labels = [COMPONENT, "grpc_service", "grpc_method"]
        self.server_handled = Counter("kvmesh_grpc_server_handled", "gRPC calls this server finished",
                                      [*labels, "grpc_code"], registry=registry)
        self.server_seconds = Histogram("kvmesh_grpc_server_handling_seconds",
                                        "gRPC call duration on the server (streams: the whole stream)",
                                        labels, buckets=LATENCY_BUCKETS, registry=registry)
        self.client_handled = Counter("kvmesh_grpc_client_handled", "gRPC calls this client finished",
                                      [*labels, "grpc_code"], registry=registry)
        self.client_seconds = Histogram("kvmesh_grpc_client_handling_seconds",
                                        "gRPC call duration at the client (streams: the whole stream)",
                                        labels, buckets=LATENCY_BUCKETS, registry=registry)

    def observe_server(self, method: GrpcMethod, code: grpc.StatusCode, seconds: float) -> None:
        self.server_handled.labels(self.component, *method, code.name).inc()
        self.server_seconds.labels(self.component, *method).observe(seconds)

    def observe_client(self, method: GrpcMethod, code: grpc.StatusCode, seconds: float) -> None:
        self.client_handled.labels(self.component, *method, code.name).inc()
        self.client_seconds.labels(self.component, *method).observe(seconds)

    def server_interceptor(self) -> grpc.aio.ServerInterceptor:
        return _ServerInterceptor(self)

    def aio_client_interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        """For grpc.aio.insecure_channel(..., interceptors=...)."""
        return [_AioUnaryUnary(self), _AioUnaryStream(self)]

    def intercept_channel(self, channel: grpc.Channel) -> grpc.Channel:
        """A blocking channel whose unary calls are counted and timed."""
        return grpc.intercept_channel(channel, _SyncUnaryUnary(self))


def _final_code(context: grpc.aio.ServicerContext, error: BaseException | None) -> grpc.StatusCode:
    """The status a handler ended with: the one it set or aborted with, else from how it ended."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    if code:  # grpc.aio keeps the code set by abort() as its integer value
        return _STATUS_BY_VALUE.get(code, grpc.StatusCode.UNKNOWN)
    if error is None:
        return grpc.StatusCode.OK
    return grpc.StatusCode.CANCELLED if isinstance(error, asyncio.CancelledError) else grpc.StatusCode.UNKNOWN


_STATUS_BY_VALUE = {status.value[0]: status for status in grpc.StatusCode}


class _ServerInterceptor(grpc.aio.ServerInterceptor):
    """Wraps each handler in one of its own kind (grpc.aio tells coroutines, async generators and
    plain functions apart: a plain one would be run as a blocking handler on a thread)."""

    def __init__(self, metrics: GrpcMetrics) -> None:
        self.metrics = metrics

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = GrpcMethod.parse(handler_call_details.method)
        observe = self.metrics.observe_server

        def wrap(behavior: Callable) -> Callable:
            if inspect.isasyncgenfunction(behavior):
                async def streaming(request_or_iterator, context):
                    start, error = time.perf_counter(), None
                    try:
                        async for response in behavior(request_or_iterator, context):
                            yield response
                    except BaseException as exc:
                        error = exc
                        raise
                    finally:
                        observe(method, _final_code(context, error), time.perf_counter() - start)
                return streaming
            if inspect.iscoroutinefunction(behavior):
                async def unary(request_or_iterator, context):
                    start, error = time.perf_counter(), None
                    try:
                        return await behavior(request_or_iterator, context)
                    except BaseException as exc:
                        error = exc
                        raise
                    finally:
                        observe(method, _final_code(context, error), time.perf_counter() - start)
                return unary
            return behavior  # a blocking handler: none of ours, left as it is

        kinds = {"unary_unary": grpc.unary_unary_rpc_method_handler,
                 "unary_stream": grpc.unary_stream_rpc_method_handler,
                 "stream_unary": grpc.stream_unary_rpc_method_handler,
                 "stream_stream": grpc.stream_stream_rpc_method_handler}
        for kind, make in kinds.items():
            behavior = getattr(handler, kind)
            if behavior is not None:
                return make(wrap(behavior), request_deserializer=handler.request_deserializer,
                            response_serializer=handler.response_serializer)
        return handler


class _AioClientInterceptor:
    def __init__(self, metrics: GrpcMetrics) -> None:
        self.metrics = metrics
        self._pending: set[asyncio.Task[None]] = set()  # strong references until recorded

    def _watch(self, call: grpc.aio.Call, method: GrpcMethod, start: float) -> None:
        # A done callback cannot await the call's code; a task does, once the call has ended.
        def done(_: object) -> None:
            task = asyncio.ensure_future(self._record(call, method, start))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)
        call.add_done_callback(done)

    async def _record(self, call: grpc.aio.Call, method: GrpcMethod, start: float) -> None:
        seconds = time.perf_counter() - start
        self.metrics.observe_client(method, await call.code(), seconds)


class _AioUnaryUnary(_AioClientInterceptor, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        start = time.perf_counter()
        call = await continuation(client_call_details, request)
        self._watch(call, GrpcMethod.parse(_method_name(client_call_details)), start)
        return call


class _AioUnaryStream(_AioClientInterceptor, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        start = time.perf_counter()
        call = await continuation(client_call_details, request)
        self._watch(call, GrpcMethod.parse(_method_name(client_call_details)), start)
        return call


class _SyncUnaryUnary(grpc.UnaryUnaryClientInterceptor):
    def __init__(self, metrics: GrpcMetrics) -> None:
        self.metrics = metrics

    def intercept_unary_unary(self, continuation, client_call_details, request):
        start = time.perf_counter()
        outcome = continuation(client_call_details, request)  # blocking: the call has ended
        self.metrics.observe_client(GrpcMethod.parse(_method_name(client_call_details)), outcome.code(),
                                    time.perf_counter() - start)
        return outcome


def _method_name(client_call_details: grpc.ClientCallDetails) -> str:
    method = client_call_details.method
    return method.decode() if isinstance(method, bytes) else method


@dataclass(frozen=True)
class ServiceMetrics:
    """A gRPC service process's registry and its kvmesh_grpc_* metrics."""

    registry: CollectorRegistry
    grpc: GrpcMetrics

    @classmethod
    def create(cls, component: str) -> ServiceMetrics:
        registry = new_registry(component)
        return cls(registry, GrpcMetrics(registry, component))


# ----------------------------------------------------------------------------- /metrics of a gRPC service


class MetricsEndpoint:
    """A small HTTP server (a daemon thread) serving one registry on /metrics.

    Always Prometheus' text format, whatever the scraper asks for: prometheus-client's OpenMetrics
    output (which Prometheus asks for first) writes `vllm:x` as `vllm_x`, and vLLM's names are the
    point of exporting them."""

    def __init__(self, server: WSGIServer) -> None:
        self._server = server

    @property
    def port(self) -> int:
        return self._server.server_port

    @classmethod
    def start(cls, registry: CollectorRegistry, host: str, port: int) -> MetricsEndpoint | None:
        """None for port 0 (metrics off), and when the port is taken: a service keeps serving
        without /metrics rather than failing (Prometheus then shows the target down), with an error
        in its log."""
        if port == 0:
            return None

        def app(environ: dict, start_response: Callable) -> list[bytes]:
            if environ.get("PATH_INFO") not in ("/metrics", "/"):
                start_response("404 Not Found", [("Content-Type", "text/plain")])
                return [b"not found: try /metrics\n"]
            body = generate_latest(registry)
            start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST), ("Content-Length", str(len(body)))])
            return [body]

        server_class = _ThreadingServerV6 if ":" in host else _ThreadingServer
        try:
            server = make_server(host, port, app, server_class, handler_class=_QuietHandler)
        except OSError as exc:
            logger.error("cannot serve /metrics on %s:%d (%s); this process has no /metrics", host, port, exc)
            return None
        threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
        logger.info("metrics on http://%s:%d/metrics", host, port)
        return cls(server)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper never holds the process up at exit


class _ThreadingServerV6(_ThreadingServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass  # one line per scrape would drown the service's log


# ----------------------------------------------------------------------------- merging pages


class Scrape(NamedTuple):
    source: str  # where it came from, for messages
    text: str


def component_of(families: Iterable[Metric]) -> str | None:
    """The `component` label of a page's kvmesh_build_info."""
    for family in families:
        if family.name == "kvmesh_build_info":
            for sample in family.samples:
                if COMPONENT in sample.labels:
                    return sample.labels[COMPONENT]
    return None


def merge_scrapes(scrapes: Sequence[Scrape]) -> bytes:
    """One valid exposition from several processes' pages: a family appears once (families merge by
    name; the first page's help and type win, a later page's family of another type is dropped with
    a warning), and series from different processes stay distinct: every sample without a
    `component` label gets its page's component (from its kvmesh_build_info), except vLLM's,
    which keep vLLM's labels. Pages of one component from several sources (the engines and workers
    of `kvmesh serve --num-engines 2`) carry the same labels: each of their samples, vLLM's too, also
    gets an `instance` label, its source's host:port. A series two pages both carry is kept once,
    from the first."""
    merged: dict[str, Metric] = {}
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    pages = [(scrape, list(text_string_to_metric_families(scrape.text))) for scrape in scrapes]
    sources: dict[str, set[str]] = {}
    for scrape, families in pages:
        sources.setdefault(component_of(families) or scrape.source, set()).add(scrape.source)
    for scrape, families in pages:
        component = component_of(families) or scrape.source
        instance = (urlsplit(scrape.source).netloc or scrape.source) if len(sources[component]) > 1 else None
        for family in families:
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            elif target.type != family.type:
                logger.warning("metric %s is a %s in %s but a %s before; dropped from %s", family.name,
                               family.type, scrape.source, target.type, scrape.source)
                continue
            for sample in family.samples:
                labels = dict(sample.labels)
                if COMPONENT not in labels and not family.name.startswith(VLLM_PREFIX):
                    labels[COMPONENT] = component
                if instance is not None:
                    labels[INSTANCE] = instance
                key = (sample.name, tuple(sorted(labels.items())))
                if key in seen:
                    logger.warning("series %s%s comes from more than one page; kept once", sample.name, labels)
                    continue
                seen.add(key)
                target.samples.append(sample._replace(labels=labels))
    return generate_latest(_Families(list(merged.values())))


class _Families:
    """Already collected families, in the shape generate_latest() reads (a collector)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def fetch_page(url: str, timeout: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()
