"""A loopback stand-in for the one corner of the Kubernetes API that discovery reads: list and watch of
`discovery.k8s.io/v1` EndpointSlices in a namespace, by label selector.

No Kubernetes API server can be installed on these machines (no container runtime, no etcd, no
kind/k3s), so the discovery tests talk to this server instead. It speaks the API's wire format, so
the real `kubernetes` client runs unchanged against it: its URL building, urllib3 HTTP, chunked
watch streams and JSON parsing into models. What the real server does and this one copies:

- a list answers `{"kind": "EndpointSliceList", "metadata": {"resourceVersion": ...}, "items": [...]}`;
- `watch=true&resourceVersion=RV` answers 200 with chunked newline-delimited events
  `{"type": "ADDED"|"MODIFIED"|"DELETED", "object": <slice>}` newer than RV, then holds the stream
  open and pushes events as they happen;
- a watch from a resourceVersion older than the retained history gets one `ERROR` event carrying a
  410 `Status` ("too old resource version"), then the stream ends;
- resource versions are one global counter, as etcd's revision.

The test drives it: `apply` (create or replace a slice), `delete`, `drop_watches` (cut every open
watch mid-stream, as an API server restart or a load balancer would), `fail` (answer the next
requests 500), and reads `requests` to see what the client asked for. A change made with
`compacted=True` leaves no event: watches from before it get 410 Gone.

    with FakeKubeApi() as api:
        api.apply(endpoint_slice("engines-abc", "engines", [endpoint("10.0.0.1", hostname="e-0")]))
        configuration = kubernetes.client.Configuration(host=api.url)
"""

from __future__ import annotations

import json
import re
import socket
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self
from urllib.parse import parse_qs, urlsplit

SLICES_PATH = re.compile(r"^/apis/discovery\.k8s\.io/v1/namespaces/([^/]+)/endpointslices$")
SERVICE_LABEL = "kubernetes.io/service-name"
POLL = 0.05  # seconds between a held watch's checks for new events or a drop


def endpoint(ip: str, ready: bool | None = True, hostname: str | None = None, pod: str | None = None) -> dict:
    """One `endpoints[]` entry of an EndpointSlice; `ready=None` leaves the condition out (unknown)."""
    entry: dict[str, Any] = {"addresses": [ip], "conditions": {} if ready is None else {"ready": ready}}
    if hostname is not None:
        entry["hostname"] = hostname
    if pod is not None:
        entry["targetRef"] = {"kind": "Pod", "name": pod, "namespace": "test"}
    return entry


def endpoint_slice(name: str, service: str, endpoints: list[dict], ports: dict[str, int] | None = None,
                   address_type: str = "IPv4") -> dict:
    """`ports` by name; default {"grpc": 50052}."""
    return {
        "kind": "EndpointSlice",
        "apiVersion": "discovery.k8s.io/v1",
        "metadata": {"name": name, "namespace": "test", "labels": {SERVICE_LABEL: service}},
        "addressType": address_type,
        "endpoints": endpoints,
        "ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in (ports or {"grpc": 50052}).items()],
    }


@dataclass(frozen=True)
class Request:
    namespace: str
    watch: bool
    label_selector: str
    resource_version: str | None


def _selected(obj: dict, selector: str) -> bool:
    """Equality-based label selectors (`a=b,c=d`): all that discovery sends."""
    labels = obj["metadata"].get("labels", {})
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


class FakeKubeApi:
    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._revision = 1
        self._objects: dict[tuple[str, str], dict] = {}  # (namespace, name) -> slice
        self._events: list[tuple[int, str, str, dict]] = []  # (revision, namespace, type, object)
        self._oldest = 1  # watches from a revision below this get 410
        self._drops = 0  # bumped by drop_watches(); a held watch that sees a change cuts its connection
        self._failures = 0  # the next this many requests get 500
        self.requests: list[Request] = []
        self.open_watches = 0
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                api._serve(self)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-kube-api", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.drop_watches()
        self._server.shutdown()
        self._server.server_close()

    # ------------------------------------------------------------------------- driven by the test

    def apply(self, obj: dict, namespace: str = "test", compacted: bool = False) -> int:
        """Create or replace a slice (ADDED or MODIFIED); returns its new resourceVersion.
        `compacted`: the event is compacted away at once, so no watch ever sees it (as for a client
        that was away too long); watches from before it get 410 and must list to learn of it."""
        key = (namespace, obj["metadata"]["name"])
        with self._lock:
            kind = "MODIFIED" if key in self._objects else "ADDED"
            return self._record(namespace, kind, obj, key, compacted)

    def delete(self, name: str, namespace: str = "test", compacted: bool = False) -> int:
        with self._lock:
            obj = self._objects.pop((namespace, name))
            return self._record(namespace, "DELETED", obj, None, compacted)

    def drop_watches(self) -> None:
        """Cut every open watch without ending its chunked body (the client sees a broken stream)."""
        with self._lock:
            self._drops += 1
            self._lock.notify_all()

    def fail(self, count: int) -> None:
        """Answer the next `count` requests with 500 InternalError (an API server in trouble)."""
        with self._lock:
            self._failures = count

    def watch_requests(self) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if r.watch]

    def list_requests(self) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if not r.watch]

    # ------------------------------------------------------------------------- the API

    def _record(self, namespace: str, kind: str, obj: dict, key: tuple[str, str] | None, compacted: bool) -> int:
        self._revision += 1
        obj = json.loads(json.dumps(obj))  # the stored copy; the caller may reuse its dict
        obj["metadata"]["resourceVersion"] = str(self._revision)
        if key is not None:
            self._objects[key] = obj
        if compacted:  # all history up to and including this change is gone
            self._events.clear()
            self._oldest = self._revision
        else:
            self._events.append((self._revision, namespace, kind, obj))
        self._lock.notify_all()
        return self._revision

    def _serve(self, handler: BaseHTTPRequestHandler) -> None:
        url = urlsplit(handler.path)
        match = SLICES_PATH.match(url.path)
        if match is None:
            self._reply(handler, 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                       "reason": "NotFound", "code": 404, "message": f"no route {url.path}"})
            return
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        request = Request(match.group(1), query.get("watch") == "true", query.get("labelSelector", ""),
                          query.get("resourceVersion"))
        with self._lock:
            self.requests.append(request)
            failing = self._failures > 0
            self._failures -= failing
            drops = self._drops  # a drop_watches() from now on cuts this watch
        if failing:
            self._reply(handler, 500, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                       "reason": "InternalError", "code": 500, "message": "etcd is sulking"})
        elif request.watch:
            self._watch(handler, request, drops)
        else:
            self._list(handler, request)

    def _list(self, handler: BaseHTTPRequestHandler, request: Request) -> None:
        with self._lock:
            items = [o for (ns, _), o in sorted(self._objects.items())
                     if ns == request.namespace and _selected(o, request.label_selector)]
            body = {"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                    "metadata": {"resourceVersion": str(self._revision)}, "items": items}
        self._reply(handler, 200, body)

    def _watch(self, handler: BaseHTTPRequestHandler, request: Request, drops: int) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        since = int(request.resource_version or self._revision)
        with self._lock:
            self.open_watches += 1
        try:
            while True:
                with self._lock:
                    oldest = self._oldest
                    if since < oldest:
                        break
                    events = [(rv, kind, obj) for rv, ns, kind, obj in self._events
                              if rv > since and ns == request.namespace and _selected(obj, request.label_selector)]
                    if self._drops != drops:
                        # Abrupt: no terminating chunk, so the client reads a broken body.
                        handler.connection.shutdown(socket.SHUT_RDWR)
                        return
                    if not events:
                        self._lock.wait(POLL)
                        continue
                for rv, kind, obj in events:
                    self._chunk(handler, {"type": kind, "object": obj})
                    since = rv
            gone = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "reason": "Expired",
                    "code": 410, "message": f"too old resource version: {since} ({oldest})"}
            self._chunk(handler, {"type": "ERROR", "object": gone})
            self._end(handler)
        except (BrokenPipeError, ConnectionResetError):
            return  # the client went away
        finally:
            with self._lock:
                self.open_watches -= 1

    @staticmethod
    def _chunk(handler: BaseHTTPRequestHandler, event: dict) -> None:
        data = (json.dumps(event) + "\n").encode()
        handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        handler.wfile.flush()

    @staticmethod
    def _end(handler: BaseHTTPRequestHandler) -> None:
        handler.wfile.write(b"0\r\n\r\n")
        handler.wfile.flush()

    @staticmethod
    def _reply(handler: BaseHTTPRequestHandler, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        handler.send_response(code)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)
