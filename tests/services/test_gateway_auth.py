"""API keys over a real uvicorn on loopback, spoken to in raw HTTP/1.1 so that the request target
reaches the server exactly as written (an HTTP client would normalise `//`, `..` and `%2F`).

Every route of the app, as `app.routes` lists it, without the key: 401 in OpenAI's shape unless its
path is public; with the key: never 401. Then path and header tricks around each protected route:
401 or 404, never a 200."""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import uvicorn
from starlette.routing import Route

from services.gateway.app import create_app
from services.gateway.auth import ANONYMOUS, PUBLIC_PATHS, APIKeyMiddleware, Tenant, api_keys_from, tenant_of
from services.processor.async_processor import AsyncProcessor
from services.processor.processor import Processor
from services.processor.tokenizer import load_tokenizer
from tests.services.procs import free_port, gateway_command, running_service
from tests.unit.test_gateway import MAX_MODEL_LEN, MODEL, ScriptedEngine

KEYS = ["sk-first-key", "sk-second-key"]
AUTH = {"Authorization": f"Bearer {KEYS[0]}"}


class Reply(NamedTuple):
    status: int
    headers: dict[str, str]
    body: bytes


def raw_request(port: int, method: str, target: str, headers: dict[str, str] | None = None,
                body: bytes = b"") -> Reply:
    """One HTTP/1.1 request with `target` sent byte for byte."""
    headers = {"Host": f"127.0.0.1:{port}", **(headers or {}), "Connection": "close"}
    if body or method == "POST":
        headers |= {"Content-Type": "application/json", "Content-Length": str(len(body))}
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"{method} {target} HTTP/1.1\r\n{head}\r\n".encode("latin-1") + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    head_bytes, _, content = rest.partition(b"\r\n\r\n")
    pairs = [line.decode("latin-1").split(": ", 1) for line in head_bytes.split(b"\r\n") if line]
    reply_headers = {name.lower(): value for name, value in pairs}
    return Reply(int(status_line.split()[1]), reply_headers, content)


def assert_401(reply: Reply, what: str) -> None:
    assert reply.status == 401, (what, reply)
    assert reply.headers["www-authenticate"] == "Bearer"
    if what.startswith("HEAD "):
        return  # no body
    error = json.loads(reply.body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_api_key", what


@pytest.fixture(scope="module")
def app(model_path: Path):
    tokenizer = load_tokenizer(model_path)
    processor = Processor.for_tokenizer(tokenizer, model_path, MAX_MODEL_LEN)
    return create_app(AsyncProcessor(processor, ScriptedEngine(tokenizer, tokenizer.eos_token_id)), MODEL,
                      api_keys=KEYS)


@pytest.fixture(scope="module")
def port(app) -> Iterator[int]:
    """The app under a real uvicorn (h11) in a thread of this process."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join(10)


def routes(app) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves, its own (/openapi.json) included."""
    found = [(method, route.path) for route in app.routes if isinstance(route, Route)
             for method in sorted(route.methods or ())]
    assert {("POST", "/v1/completions"), ("GET", "/health"), ("GET", "/openapi.json")} <= set(found)
    assert all("{" not in path for _, path in found), "a path parameter: give the table a value for it"
    return found


def test_every_route_needs_the_key_unless_public(app, port):
    for method, path in routes(app):
        body = b"{}" if method == "POST" else b""
        without = raw_request(port, method, path, body=body)
        with_key = raw_request(port, method, path, AUTH, body=body)
        if path.encode() in PUBLIC_PATHS:
            assert without.status == with_key.status != 401, (method, path, without, with_key)
        else:
            assert_401(without, f"{method} {path}")
            assert with_key.status not in (401, 500), (method, path, with_key)
    assert raw_request(port, "GET", "/v1/models", AUTH).status == 200
    assert raw_request(port, "GET", "/v1/models", {"Authorization": f"Bearer {KEYS[1]}"}).status == 200
    assert raw_request(port, "GET", "/health").status == 200


@pytest.mark.parametrize("authorization", [
    None, "", "Bearer", "Bearer ", f"Basic {KEYS[0]}", f"{KEYS[0]}", "Bearer sk-first-ke", f"Bearer {KEYS[0]}x",
    f"Bearer {KEYS[0]} {KEYS[1]}", f"Token {KEYS[0]}",
])
def test_wrong_or_missing_keys_are_401(port, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    assert_401(raw_request(port, "GET", "/v1/models", headers), repr(authorization))


def tricks(path: str) -> list[str]:
    """Request targets that spell `path` differently, or hide it behind a public path."""
    rest = path[1:]
    return [
        "/" + path, path + "/", path.replace("/", "//"), path.upper(), path + "%20", path + ";",
        path[:-1] + f"%{ord(path[-1]):02X}",  # an encoded letter
        "/" + rest.replace("/", "%2F"), "/" + rest.replace("/", "%2f"),  # encoded slashes
        "/./" + rest, "/x/../" + rest, "/health/../" + rest, "/health/%2E%2E/" + rest, "/health%2F..%2F" + rest,
        "/health;/" + rest, "/health/" + rest, "/metrics/../" + rest, "/version%2F..%2F" + rest,
        f"http://127.0.0.1{path}", f"http://127.0.0.1/health/..{path}",  # absolute-form targets
    ]


def test_path_tricks_never_reach_a_handler_without_the_key(app, port):
    protected = sorted({path for _, path in routes(app) if path.encode() not in PUBLIC_PATHS})
    for method, path in sorted({(m, p) for m, p in routes(app) if p in protected}):
        for target in tricks(path):
            reply = raw_request(port, method, target, body=b"{}" if method == "POST" else b"")
            assert reply.status in (401, 404), (method, target, reply)


@pytest.mark.parametrize("headers", [
    {"Host": "evil.example"}, {"Host": "localhost"}, {"Host": "127.0.0.1:1"}, {"Host": ""},
    {"X-Original-URL": "/health"}, {"X-Rewrite-URL": "/health"}, {"X-Forwarded-Prefix": "/health"},
    {"X-Forwarded-Host": "127.0.0.1", "X-Forwarded-For": "127.0.0.1", "X-Real-IP": "127.0.0.1"},
])
def test_odd_host_and_proxy_headers_change_nothing(port, headers):
    assert_401(raw_request(port, "GET", "/v1/models", headers), repr(headers))
    assert raw_request(port, "GET", "/v1/models", {**headers, **AUTH}).status == 200


def test_a_refused_body_is_never_read(port):
    """401 comes before the body-size check and before any body is parsed."""
    reply = raw_request(port, "POST", "/v1/completions", body=b"{not json")
    assert_401(reply, "bad body without key")
    assert raw_request(port, "POST", "/v1/completions", AUTH, body=b"{not json").status == 400


def test_keys_come_from_flags_else_the_environment():
    env = {"KVMESH_API_KEY": " a, b ,,"}
    assert api_keys_from(None, env) == ["a", "b"]
    assert api_keys_from(["c"], env) == ["c"]
    assert api_keys_from(None, {}) == [] and api_keys_from([], {"KVMESH_API_KEY": ""}) == []
    with pytest.raises(ValueError):
        APIKeyMiddleware(app=None, api_keys=[])


def test_a_key_file_is_read_at_start_and_an_empty_one_is_refused(tmp_path: Path):
    """--api-key-file (a mounted Secret): a real gateway asks for its keys; a file without a key
    stops it at start instead of serving with no authentication."""
    keys = tmp_path / "api-keys"
    keys.write_text("# mounted from a Secret\nsk-from-file\n\n")
    assert api_keys_from(["c"], {}, keys) == ["c", "sk-from-file"]
    port = free_port()
    with running_service(gateway_command(processor_address=f"127.0.0.1:{free_port()}", port=port, api_key_file=keys),
                         port, health="http", http_path="/version"):
        assert_401(raw_request(port, "GET", "/v1/models"), "no key")
        assert_401(raw_request(port, "GET", "/v1/models", {"Authorization": "Bearer sk-other"}), "wrong key")
        # Past authentication: the processor is down, so anything but a 401.
        assert raw_request(port, "GET", "/v1/models", {"Authorization": "Bearer sk-from-file"}).status != 401
    empty = tmp_path / "empty"
    empty.write_text("\n# no key here\n")
    with pytest.raises(ValueError, match="holds no key"):
        api_keys_from(None, {}, empty)
    result = subprocess.run(gateway_command(api_key_file=empty), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--api-key-file" in result.stderr and "holds no key" in result.stderr


def test_a_key_names_its_tenant_by_a_hash_and_only_priority_keys_may_set_priority():
    seen: list[Tenant] = []

    async def app(scope, receive, send) -> None:
        seen.append(tenant_of(scope))

    middleware = APIKeyMiddleware(app, KEYS, priority_keys=["sk-operator"])

    async def call(key: str | None, path: bytes = b"/v1/completions") -> None:
        headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
        await middleware({"type": "http", "path": path.decode(), "raw_path": path, "headers": headers}, None, None)

    for key in (*KEYS, "sk-operator", KEYS[0]):
        asyncio.run(call(key))
    asyncio.run(call(None, b"/health"))
    first, second, operator, again, public = seen
    assert first == again and len({first.id, second.id, operator.id}) == 3
    assert first.id == hashlib.sha256(KEYS[0].encode()).hexdigest()[:16]  # a hash, never the key
    assert (first.may_set_priority, second.may_set_priority, operator.may_set_priority) == (False, False, True)
    assert public is ANONYMOUS
