"""API keys: `Authorization: Bearer <key>` on every request, except a short list of public paths.

A pure ASGI middleware in front of routing, denying by default: a request reaches the app only with
a valid key or when its raw path (as the client sent it, before any decoding or normalising) is
exactly one of PUBLIC_PATHS. `//v1/models`, `/v1/%6dodels`, `/health/` or `/v1/../health` are not
public, so they need the key like any other path, whatever the router would make of them; the Host
header plays no part.

A valid key names its request's tenant (`scope["state"]["tenant"]`): an id that is a hash of the key,
never the key, with which engines take turns between clients; and whether the key may set a
request's `priority` (only the keys of --priority-api-key-file may). Without keys there is one
anonymous tenant, which may set it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from services.gateway.errors import APIError

# Probes, scrapers and routers polling the load carry no key (vLLM asks one only under /v1).
PUBLIC_PATHS = frozenset({b"/health", b"/ping", b"/load", b"/metrics", b"/version"})
API_KEY_ENV = "KVMESH_API_KEY"  # one key, or several separated by commas
TENANT_ID_BYTES = 8  # of the key's sha256: 16 hex digits, distinct for any set of keys a gateway holds


@dataclass(frozen=True)
class Tenant:
    """Who a request comes from, as far as the engines and `priority` are concerned."""

    id: str | None  # a hash of the API key; None without keys
    may_set_priority: bool


ANONYMOUS = Tenant(None, may_set_priority=True)


def tenant_of(scope: Scope) -> Tenant:
    """The tenant APIKeyMiddleware found for this request (ANONYMOUS without keys)."""
    return scope.get("state", {}).get("tenant", ANONYMOUS)


def api_keys_from_file(path: Path | None) -> list[str]:
    """The keys in `path`, one a line (blank lines and lines starting with # skipped); [] for None."""
    if path is None:
        return []
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def api_keys_from(flags: Iterable[str] | None, environ: dict[str, str] | None = None,
                  path: Path | None = None) -> list[str]:
    """The keys given with --api-key (else those in KVMESH_API_KEY), then those in `path`
    (--api-key-file); [] means no authentication. A key file without a key is a ValueError: a
    Secret mounted empty must not turn authentication off."""
    keys = list(flags or [])
    if not keys:
        keys = (os.environ if environ is None else environ).get(API_KEY_ENV, "").split(",")
    keys = [k.strip() for k in keys if k.strip()]
    if path is not None:
        from_file = api_keys_from_file(path)
        if not from_file:
            raise ValueError(f"{path} holds no key (one a line): refusing to serve without one")
        keys += from_file
    return keys


class APIKeyMiddleware:
    """`priority_keys` are keys too, which may also set `priority`."""

    def __init__(self, app: ASGIApp, api_keys: Iterable[str], priority_keys: Iterable[str] = ()) -> None:
        self.app = app
        # Compared as digests: equal lengths, so hmac.compare_digest leaks nothing about a key's length.
        self._digests = [_digest(key.encode()) for key in api_keys]
        self._priority_digests = [_digest(key.encode()) for key in priority_keys]
        if not self._digests:
            raise ValueError("APIKeyMiddleware needs at least one key (--priority-api-key-file needs --api-key)")
        self._tenants = {d: Tenant(d[:TENANT_ID_BYTES].hex(), d in self._priority_digests)
                         for d in [*self._digests, *self._priority_digests]}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        tenant = self._tenant(scope)
        if tenant is not None:
            if tenant is not ANONYMOUS:
                scope.setdefault("state", {})["tenant"] = tenant
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
        else:
            error = APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                             "invalid_request_error", code="invalid_api_key",
                             headers={"WWW-Authenticate": "Bearer"})
            await error.response()(scope, receive, send)

    def _tenant(self, scope: Scope) -> Tenant | None:
        """The tenant of the request's key; ANONYMOUS on a public path; None when it may not pass."""
        raw_path: bytes = (scope.get("raw_path") or scope["path"].encode()).partition(b"?")[0]
        # Under --root-path the server puts the prefix in front of the path the proxy forwarded.
        root = scope.get("root_path", "").encode()
        if root and raw_path.startswith(root + b"/"):
            raw_path = raw_path[len(root):]
        if raw_path in PUBLIC_PATHS:
            return ANONYMOUS
        scheme, _, key = Headers(scope=scope).get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            return None
        digest = _digest(key.strip().encode("latin-1"))
        # Every key is compared, so the time taken does not tell which one (if any) matched.
        matches = [d for d in self._tenants if hmac.compare_digest(digest, d)]
        return self._tenants[matches[0]] if matches else None


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()
