"""The gateway's metrics: kvmesh_http_* from an ASGI middleware, and the /metrics page.

Under `kvmesh serve` the page also carries the local services' pages (`aggregate_urls`), merged
into one exposition (services.common.metrics.merge_scrapes), so that one scrape of the API port
shows everything, as vLLM's does. A gateway in a pod has no aggregate URLs: each pod is scraped on
its own and nothing is counted twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common.metrics import COMPONENT, LATENCY_BUCKETS, Scrape, fetch_page, merge_scrapes, new_registry

logger = logging.getLogger(__name__)

COMPONENT_NAME = "gateway"
# Label values that cannot grow with what clients send: every path no route matches is one route,
# every method outside HTTP's own is one method.
UNMATCHED_ROUTE = "unmatched"
OTHER_METHOD = "other"
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"})
CLIENT_CLOSED_REQUEST = 499
SCRAPE_TIMEOUT = 2.0  # seconds for each local service's page


class GatewayMetrics:
    """`registry` defaults to one of its own (one app per process in a pod; several in tests)."""

    def __init__(self, aggregate_urls: Sequence[str] = (), registry: CollectorRegistry | None = None) -> None:
        self.registry = registry = registry if registry is not None else new_registry(COMPONENT_NAME)
        self.aggregate_urls = tuple(aggregate_urls)
        self.requests = Counter("kvmesh_http_requests", "HTTP requests the gateway finished",
                                [COMPONENT, "route", "method", "code"], registry=registry)
        self.request_seconds = Histogram("kvmesh_http_request_duration_seconds",
                                         "HTTP request start to the last byte sent (streams included)",
                                         [COMPONENT, "route", "method"], buckets=LATENCY_BUCKETS, registry=registry)
        self.stream_seconds = Histogram("kvmesh_http_stream_duration_seconds", "SSE streams, first to last byte",
                                        [COMPONENT, "route"], buckets=LATENCY_BUCKETS, registry=registry)
        self.streams_active = Gauge("kvmesh_http_streams_active", "SSE streams open now", [COMPONENT, "route"],
                                    registry=registry)

    async def page(self) -> bytes:
        """This process's metrics, merged with the local services' when aggregating. A service that
        does not answer is left out (and logged); the page still comes."""
        own = generate_latest(self.registry)
        if not self.aggregate_urls:
            return own
        pages = await asyncio.gather(*(asyncio.to_thread(fetch_page, url, SCRAPE_TIMEOUT)
                                       for url in self.aggregate_urls), return_exceptions=True)
        scrapes = [Scrape(COMPONENT_NAME, own.decode())]
        for url, page in zip(self.aggregate_urls, pages):
            if isinstance(page, BaseException):
                logger.warning("metrics of %s left out: %s", url, page)
            else:
                scrapes.append(Scrape(url, page))
        return merge_scrapes(scrapes)


class HttpMetricsMiddleware:
    """Counts and times every HTTP request by route template (matched here, so that a request
    refused before routing, e.g. by the API-key check, still gets its route) and method; a path or
    method of a client's invention is counted under one label value (UNMATCHED_ROUTE, OTHER_METHOD),
    so that no client can grow the series without bound."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    def _route_of(self, scope: Scope) -> str:
        for route in self.routes:
            match, _ = route.matches(scope)
            if match != Match.NONE:  # PARTIAL: the path matched, the method did not (a 405)
                return getattr(route, "path", UNMATCHED_ROUTE)
        return UNMATCHED_ROUTE

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method = scope["method"] if scope["method"] in METHODS else OTHER_METHOD
        metrics, route = self.metrics, self._route_of(scope)
        start = time.perf_counter()
        status: int | None = None
        stream_start: float | None = None

        async def send_and_watch(message: Message) -> None:
            nonlocal status, stream_start
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = dict(message.get("headers", ()))
                if headers.get(b"content-type", b"").startswith(b"text/event-stream"):
                    stream_start = time.perf_counter()
                    metrics.streams_active.labels(COMPONENT_NAME, route).inc()
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        except asyncio.CancelledError:
            status = status or CLIENT_CLOSED_REQUEST
            raise
        except Exception:
            status = status or 500
            raise
        finally:
            end = time.perf_counter()
            if stream_start is not None:
                metrics.streams_active.labels(COMPONENT_NAME, route).dec()
                metrics.stream_seconds.labels(COMPONENT_NAME, route).observe(end - stream_start)
            metrics.requests.labels(COMPONENT_NAME, route, method, str(status or 500)).inc()
            metrics.request_seconds.labels(COMPONENT_NAME, route, method).observe(end - start)
