"""What the gateway's public answers no longer give away, seen by a client of `kvmesh serve`:

- under --root-path with --api-key, /health is still public (a kubelet's probe carries no key), so
  pods become Ready; every other path still needs the key;
- /v1/models names the model as served, not where its files lie (`root`);
- a 503 (from /health or a completion, with the processor unreachable) says the model is not
  available and nothing about the addresses or gRPC details behind the gateway;
- a body's `request_id` with a newline (which would forge log lines) is a 400 naming the field.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.services.procs import REPO_ROOT, Serve, free_port, gateway_command, gateway_over

pytestmark = pytest.mark.slow

ROOT_PATH = "/kvmesh"
API_KEY = "sk-leaks"
AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def serve(serve: Serve) -> Iterator[Serve]:
    with gateway_over(serve, ["--root-path", ROOT_PATH, "--api-key", API_KEY]) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def lonely_gateway() -> Iterator[int]:
    """A gateway whose processor address nobody listens on: its port."""
    port, dead = free_port(), free_port()
    proc = subprocess.Popen(gateway_command(processor_address=f"127.0.0.1:{dead}", served_model_name="smollm2",
                                            api_key=API_KEY, root_path=ROOT_PATH, timeout=1, port=port),
                            cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while call(port, "GET", "/version")[0] != 200:
            assert proc.poll() is None and time.monotonic() < deadline, "the gateway did not start"
            time.sleep(0.2)
        yield port
    finally:
        proc.kill()
        proc.wait(10)


def call(port: int, method: str, path: str, body: dict | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request(method, path, None if body is None else json.dumps(body), headers or {})
        response = connection.getresponse()
        return response.status, response.read()
    except OSError:
        return 0, b""
    finally:
        connection.close()


def assert_names_nothing_inside(body: bytes) -> None:
    message = json.loads(body)["error"]["message"]
    for inside in ("127.0.0.1", "ipv4", "ipv6", "grpc", "statuscode", "unavailable", "details", "connect"):
        assert inside not in message.lower(), message


def test_health_is_public_under_a_root_path_with_an_api_key(serve: Serve):
    # The proxy strips the prefix: the gateway gets /health, as a kubelet's probe of the pod sends it.
    assert call(serve.port, "GET", "/health") == (200, b"")
    for path in ("/v1/models", f"{ROOT_PATH}/health", "/health/", "//health"):
        assert call(serve.port, "GET", path)[0] == 401, path


def test_models_do_not_name_the_model_files(serve: Serve, model_path: Path):
    status, body = call(serve.port, "GET", "/v1/models", headers=AUTH)
    assert status == 200, body
    (card,) = json.loads(body)["data"]
    assert card["root"] == card["id"] == "smollm2"
    assert str(model_path) not in body.decode() and str(model_path.name) not in body.decode()


def test_a_request_id_with_a_newline_is_refused_naming_it(serve: Serve):
    for request_id in ("a\nfake log line", "a\rb", "\x1b[31mred"):
        status, body = call(serve.port, "POST", "/v1/completions", {"model": "smollm2", "prompt": "Hi",
                                                                    "max_tokens": 1, "request_id": request_id},
                            AUTH)
        assert status == 400, body
        error = json.loads(body)["error"]
        assert error["param"] == "request_id" and "printable" in error["message"]
    status, body = call(serve.port, "POST", "/v1/completions", {"model": "smollm2", "prompt": "Hi", "max_tokens": 1,
                                                                "request_id": "plain-id"}, AUTH)
    assert status == 200, body


def test_a_503_names_nothing_behind_the_gateway(lonely_gateway: int):
    status, body = call(lonely_gateway, "GET", "/health")
    assert status == 503, body
    assert json.loads(body)["error"]["code"] == "service_unavailable"
    assert_names_nothing_inside(body)
    status, body = call(lonely_gateway, "POST", "/v1/completions",
                        {"model": "smollm2", "prompt": "Hi", "max_tokens": 1}, AUTH)
    assert status in (503, 504), body
    assert_names_nothing_inside(body)
