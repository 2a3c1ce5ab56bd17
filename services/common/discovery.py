"""Discovery through the Kubernetes API: the ready endpoints of a Service, followed as they change.

    watcher = EndpointWatcher("kvmesh-engine", kube_configuration(), namespace="prod")
    watcher.subscribe(engines.update)     # called on the event loop with the whole ready set
    watcher.start()
    ...
    await watcher.close()

Off Kubernetes, services are given each other's addresses (--engine-address, --worker-address); in
Kubernetes, processors find engines, and engines their workers, this way.

The watcher lists the Service's EndpointSlices (`discovery.k8s.io/v1`, label
`kubernetes.io/service-name=<service>`), then watches them from the list's resourceVersion:

    list ──rv──▶ watch ──ADDED/MODIFIED/DELETED──▶ slices by name ──▶ ready set changed? ──▶ subscribers
      ▲            │ stream ends or breaks: watch again from the last rv seen
      └────────────┘ 410 Gone (that history was compacted): list again

Every round that ends sooner than STEADY_WATCH seconds (errors included) backs off exponentially, so a
failing API server is not hammered. The `kubernetes` client is synchronous (urllib3) and a watch is a
blocking read held open for minutes, so the loop runs in a daemon thread of its own; it hands each new
ready set to the event loop with `call_soon_threadsafe`, and subscribers only ever run on the loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import urllib3

# The client is imported where it is used: the import costs every process start-up time, and most
# processes off Kubernetes never watch anything.
if TYPE_CHECKING:
    from kubernetes.client import Configuration, DiscoveryV1Api, V1EndpointSlice
    from kubernetes.watch import Watch

logger = logging.getLogger(__name__)

SERVICE_LABEL = "kubernetes.io/service-name"
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
WATCH_SECONDS = 300  # the API server ends each watch after this long; we then resume it
REQUEST_TIMEOUT = (10.0, 30.0)  # (connect, read) seconds of a list
STEADY_WATCH = 1.0  # seconds: a list+watch round shorter than this counts as a failure (back off)
CLOSE_TIMEOUT = 5.0  # seconds close() waits for the thread
# What a list or watch raises when the API server or the network fails, besides the client's
# ApiException; the thread logs and retries.
TRANSIENT_ERRORS = (urllib3.exceptions.HTTPError, OSError, ValueError)

T = TypeVar("T")


@dataclass(frozen=True, slots=True, order=True)
class Endpoint:
    """One ready endpoint: where to dial it, and which pod it is."""

    address: str  # host:port of the named port, as grpc dials it ([v6]:port for IPv6)
    hostname: str | None = None  # the pod's hostname behind a headless Service (StatefulSet: name-N)
    pod: str | None = None  # targetRef.name


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with jitter: delay(n) after the n-th failure in a row, in seconds."""

    initial: float = 0.5
    maximum: float = 30.0

    def __post_init__(self) -> None:
        if not 0 < self.initial <= self.maximum:
            raise ValueError(f"need 0 < initial <= maximum, got {self.initial} and {self.maximum}")

    def delay(self, failures: int) -> float:
        # Jitter in [1/2, 1] of the delay: replicas that lost the API server together do not return together.
        return min(self.maximum, self.initial * 2 ** (failures - 1)) * random.uniform(0.5, 1.0)


def default_namespace() -> str:
    """This pod's namespace (from its service account), else $KVMESH_NAMESPACE, else "default"."""
    if SERVICE_ACCOUNT_NAMESPACE.is_file():
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    return os.environ.get("KVMESH_NAMESPACE") or "default"


def kube_configuration() -> Configuration:
    """How to reach the API server: the pod's service account inside Kubernetes, else the kubeconfig
    ($KUBECONFIG or ~/.kube/config), which is how a service outside the cluster (or a test) points
    discovery at an API server."""
    from kubernetes import config as kube_config
    from kubernetes.client import Configuration

    configuration = Configuration()
    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            kube_config.load_incluster_config(client_configuration=configuration)
        else:
            # $KUBECONFIG read now: the client reads it once, at import.
            kube_config.load_kube_config(os.environ.get("KUBECONFIG"), client_configuration=configuration)
    except kube_config.ConfigException as exc:
        raise ValueError(f"cannot reach the Kubernetes API: not in a pod, and no usable kubeconfig ({exc})") from exc
    return configuration


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def ready_endpoints(endpoint_slice: V1EndpointSlice, port_name: str) -> frozenset[Endpoint]:
    """The slice's ready endpoints on its port named `port_name` (none if it has no such port).

    An absent `ready` condition means unknown, which EndpointSlice consumers are told to treat as
    ready. Every address of one endpoint is the same pod; the API says the first one will do.
    """
    port = next((p.port for p in endpoint_slice.ports or () if p.name == port_name and p.port), None)
    if port is None:
        logger.warning("EndpointSlice %s has no port named %r", endpoint_slice.metadata.name, port_name)
        return frozenset()
    return frozenset(
        Endpoint(_host_port(e.addresses[0], port), e.hostname, e.target_ref.name if e.target_ref else None)
        for e in endpoint_slice.endpoints or ()
        if e.addresses and not (e.conditions is not None and e.conditions.ready is False)
    )


class EndpointWatcher:
    """The ready endpoints of one Service, kept current by list + watch in a thread.

    `start()` inside the running event loop; subscribers are called on that loop with the whole
    ready set each time it changes (the first time once the initial list is in, even if empty).
    """

    def __init__(self, service: str, configuration: Configuration, namespace: str | None = None,
                 port_name: str = "grpc", backoff: Backoff = Backoff()) -> None:
        if not service:
            raise ValueError("a Service name is required")
        self.service = service
        self.namespace = namespace or default_namespace()
        self.port_name = port_name
        self._configuration = configuration
        self._backoff = backoff
        self._selector = f"{SERVICE_LABEL}={service}"
        self._subscribers: list[Callable[[frozenset[Endpoint]], None]] = []
        # Owned by the event loop: the last ready set delivered (None until the first list is in).
        self._endpoints: frozenset[Endpoint] | None = None
        self._changed = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        # Owned by the thread: each slice's ready endpoints, the last set handed to the loop, and the
        # resourceVersion to resume from (None: list first).
        self._slices: dict[str, frozenset[Endpoint]] = {}
        self._resource_version: str | None = None
        self._published: frozenset[Endpoint] | None = None
        self._watch: Watch | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watch-{service}", daemon=True)

    @property
    def endpoints(self) -> frozenset[Endpoint]:
        """The ready set as last delivered to the loop (empty before the first list)."""
        return self._endpoints or frozenset()

    def subscribe(self, callback: Callable[[frozenset[Endpoint]], None]) -> None:
        self._subscribers.append(callback)
        if self._endpoints is not None:
            callback(self._endpoints)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    async def wait_for(self, find: Callable[[frozenset[Endpoint]], T | None]) -> T:
        """The first non-None `find(ready set)`, waiting for changes until there is one."""
        while True:
            if self._endpoints is not None and (found := find(self._endpoints)) is not None:
                return found
            await self._changed.wait()  # _deliver sets it, then replaces it for the next change

    async def close(self) -> None:
        """Stop the thread: cut the open watch (its blocking read) and wait for it to notice."""
        self._stopping.set()
        deadline = time.monotonic() + CLOSE_TIMEOUT
        while self._thread.is_alive():
            watch = self._watch
            if watch is not None:
                watch.stop()  # repeated: a stop that lands while a new watch is connecting is lost
            if time.monotonic() > deadline:
                logger.warning("the watch of %s did not stop in %.0fs; leaving its daemon thread", self.service,
                               CLOSE_TIMEOUT)
                return
            await asyncio.sleep(0.02)

    # ------------------------------------------------------------------------- on the loop

    def _deliver(self, endpoints: frozenset[Endpoint]) -> None:
        if self._stopping.is_set():
            return
        self._endpoints = endpoints
        for callback in self._subscribers:
            callback(endpoints)
        self._changed.set()
        self._changed = asyncio.Event()

    # ------------------------------------------------------------------------- on the thread

    def _run(self) -> None:
        from kubernetes.client import ApiClient, DiscoveryV1Api
        from kubernetes.client.exceptions import ApiException

        api = DiscoveryV1Api(ApiClient(self._configuration))
        failures = 0
        try:
            while not self._stopping.is_set():
                started = time.monotonic()
                try:
                    if self._resource_version is None:
                        self._list(api)
                    self._watch_from(api)
                except ApiException as exc:
                    if exc.status == HTTPStatus.GONE:
                        logger.info("watch of %s expired (410 Gone); listing again", self.service)
                        self._resource_version = None
                    elif not self._stopping.is_set():
                        logger.warning("watch of %s: API error %s %s", self.service, exc.status, exc.reason)
                except TRANSIENT_ERRORS as exc:
                    if not self._stopping.is_set():
                        logger.warning("watch of %s failed (%s: %s); resuming from %s", self.service,
                                       type(exc).__name__, exc, self._resource_version)
                failures = 0 if time.monotonic() - started >= STEADY_WATCH else failures + 1
                if failures:
                    self._stopping.wait(self._backoff.delay(failures))
        finally:
            api.api_client.close()
            logger.info("stopped watching %s", self.service)

    def _list(self, api: DiscoveryV1Api) -> None:
        """Replaces every slice with the listed ones; the watch resumes from the list's resourceVersion."""
        reply = api.list_namespaced_endpoint_slice(self.namespace, label_selector=self._selector,
                                                   _request_timeout=REQUEST_TIMEOUT)
        self._slices = {s.metadata.name: ready_endpoints(s, self.port_name) for s in reply.items}
        self._publish()
        self._resource_version = reply.metadata.resource_version

    def _watch_from(self, api: DiscoveryV1Api) -> None:
        """Applies events until the stream ends, keeping the last resourceVersion seen (bookmarks
        included) to resume from. A broken stream raises; 410 Gone raises ApiException(410)."""
        from kubernetes.watch import Watch

        watch = Watch()
        self._watch = watch
        if self._stopping.is_set():  # close() may have run before self._watch was set
            return
        # timeout_seconds also turns off the client's own hidden resume-and-retry: one call, one watch.
        events = watch.stream(api.list_namespaced_endpoint_slice, self.namespace, label_selector=self._selector,
                              resource_version=self._resource_version, allow_watch_bookmarks=True,
                              timeout_seconds=WATCH_SECONDS, _request_timeout=(REQUEST_TIMEOUT[0], WATCH_SECONDS + 30))
        for event in events:
            kind, obj = event["type"], event["object"]
            if kind in ("ADDED", "MODIFIED"):
                self._slices[obj.metadata.name] = ready_endpoints(obj, self.port_name)
            elif kind == "DELETED":
                self._slices.pop(obj.metadata.name, None)
            self._publish()  # a BOOKMARK only moved the resourceVersion: nothing changes
            self._resource_version = watch.resource_version

    def _publish(self) -> None:
        endpoints = frozenset().union(*self._slices.values())
        if endpoints == self._published:
            return
        self._published = endpoints
        logger.info("service %s: %d ready endpoint(s): %s", self.service, len(endpoints),
                    ", ".join(sorted(e.address for e in endpoints)) or "none")
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._deliver, endpoints)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self._stopping.set()
