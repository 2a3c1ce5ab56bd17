"""API keys: `Authorization: Bearer <key>` on every request, except a short list of public paths.

A pure ASGI middleware in front of routing, denying by default: a request reaches the app only with
a valid key or when its raw path (as the client sent it, before any decoding or normalising) is
exactly one of PUBLIC_PATHS. `//v1/models`, `/v1/%6dodels`, `/health/` or `/v1/../health` are not
public, so they need the key like any other path, whatever the router would make of them; the Host
header plays no part.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from services.gateway.errors import APIError

# Probes, scrapers and routers polling the load carry no key (vLLM asks one only under /v1).
PUBLIC_PATHS = frozenset({b"/health", b"/ping", b"/load", b"/metrics", b"/version"})
API_KEY_ENV = "KVMESH_API_KEY"  # one key, or several separated by commas


def api_keys_from(flags: Iterable[str] | None, environ: dict[str, str] | None = None) -> list[str]:
    """The keys given with --api-key, else those in KVMESH_API_KEY; [] means no authentication."""
    keys = list(flags or [])
    if not keys:
        keys = (os.environ if environ is None else environ).get(API_KEY_ENV, "").split(",")
    keys = [k.strip() for k in keys if k.strip()]
    return keys


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_keys: Iterable[str]) -> None:
        self.app = app
        # Compared as digests: equal lengths, so hmac.compare_digest leaks nothing about a key's length.
        self._digests = [_digest(key.encode()) for key in api_keys]
        if not self._digests:
            raise ValueError("APIKeyMiddleware needs at least one key")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" or self._allowed(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
        else:
            error = APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                             "invalid_request_error", code="invalid_api_key",
                             headers={"WWW-Authenticate": "Bearer"})
            await error.response()(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
        if raw_path.partition(b"?")[0] in PUBLIC_PATHS:
            return True
        scheme, _, key = Headers(scope=scope).get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            return False
        digest = _digest(key.strip().encode("latin-1"))
        # Every key is compared, so the time taken does not tell which one (if any) matched.
        matches = [hmac.compare_digest(digest, d) for d in self._digests]
        return any(matches)


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()
