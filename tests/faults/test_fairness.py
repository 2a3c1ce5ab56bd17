"""One request may not monopolise the engine: under `kvmesh serve` with room for few sequences at
once, a request of the most sequences a request may ask for (--max-sequences-per-request: prompts x
n) is running when a small chat arrives; the waiting queue takes turns between the two requests,
so the chat is answered long before the big request ends (without turns, it would wait for every
sequence queued before it).

Nor may one client: the waiting queue takes turns between API keys, so one key's burst does not
hold back another key's request; a client address holds at most --max-connections-per-client
connections (behind a --trusted-proxy, the address X-Forwarded-For names; elsewhere that header
changes nothing); request bodies held at once stay within --max-buffered-body-bytes (over it: a
503 at once, never the gateway's memory); and only the keys of --priority-api-key-file may set
`priority` (others: a 403 naming it)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator

import openai
import pytest

from tests.services.procs import Serve, gateway_over, serving

pytestmark = pytest.mark.slow

MAX_NUM_SEQS = 4
MAX_SEQUENCES = 32  # per request: 4 prompts x n = 8
BIG_TOKENS = 24


@pytest.fixture(scope="module")
def roomy(served_model: str) -> Iterator[Serve]:
    """Room for a few sequences at once: a stack of its own."""
    yield from serving(served_model, ["--max-num-seqs", str(MAX_NUM_SEQS),
                                    "--max-sequences-per-request", str(MAX_SEQUENCES)])


def test_a_small_chat_is_served_while_a_request_of_many_sequences_runs(roomy: Serve):
    serve = roomy
    client = openai.OpenAI(base_url=serve.api, api_key="unused", timeout=600, max_retries=0)
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match="max-sequences-per-request"):
        client.completions.create(model=model, prompt=["a"] * 4, n=MAX_SEQUENCES // 4 + 1, max_tokens=1)

    big: dict[str, float] = {}

    def run_big() -> None:
        response = client.completions.create(model=model, prompt=["Once upon a time", "The sea", "In 1900", "Dear"],
                                             n=MAX_SEQUENCES // 4, max_tokens=BIG_TOKENS, temperature=1.0,
                                             extra_body={"ignore_eos": True})
        big["choices"] = len(response.choices)

    thread = threading.Thread(target=run_big)
    thread.start()
    deadline = time.monotonic() + 120
    while serve.engine_stats().num_running < MAX_NUM_SEQS:  # the big one fills the engine
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.05)
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                           temperature=0, extra_body={"ignore_eos": True})
    left = serve.engine_stats().num_waiting  # the big request's sequences not yet started
    thread.join(600)
    assert big["choices"] == MAX_SEQUENCES and reply.usage.completion_tokens == 8
    # Fair turns: the chat went in when the first running sequences finished, ahead of the 28 queued
    # (without turns it would have waited for every one of them to start: none left). Counted in
    # sequences, not seconds, so a loaded machine cannot blur it.
    queued = MAX_SEQUENCES - MAX_NUM_SEQS
    assert left >= queued // 2, f"{left} of the {queued} queued sequences were still waiting when the chat ended"
    serve.wait_until_engine_idle()


# ----------------------------------------------------------------------------- per client

KEYS = ("tenant-a-key", "tenant-b-key")
PRIORITY_KEY = "operator-key"  # in the --priority-api-key-file
PER_CLIENT = 8
BODY_BUDGET = 2**20
PROXY = "127.0.0.5"  # a trusted proxy's address (any 127/8 address reaches 127.0.0.1)
BURST = 5
BURST_TOKENS = 64  # each request runs long enough for the late one to arrive while the first runs


@pytest.fixture(scope="module")
def guarded(serve: Serve, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    """The shared stack (one sequence at a time under the priority policy: the queue's order decides
    who goes next) behind a gateway with two tenants' keys and one that may set priority, and small
    connection and body caps."""
    key_file = tmp_path_factory.mktemp("keys") / "priority-keys"
    key_file.write_text(f"# keys that may set priority\n{PRIORITY_KEY}\n")
    with gateway_over(serve, ["--api-key", KEYS[0], "--api-key", KEYS[1], "--priority-api-key-file", str(key_file),
                              "--max-connections-per-client", str(PER_CLIENT), "--trusted-proxy", PROXY,
                              "--max-buffered-body-bytes", str(BODY_BUDGET)]) as gateway:
        yield gateway


def connection(serve: Serve, source: str) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", serve.port, timeout=10, source_address=(source, 0))


def get_health(conn: http.client.HTTPConnection, forwarded_for: str | None = None) -> tuple[int, bytes]:
    """GET /health on `conn`, kept alive: its status and body."""
    conn.request("GET", "/health", headers={"X-Forwarded-For": forwarded_for} if forwarded_for else {})
    response = conn.getresponse()
    return response.status, response.read()


def assert_refused(status: int, body: bytes, expected: int, flag: str, bound: int) -> None:
    assert status == expected, (status, body)
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert flag in error["message"] and str(bound) in error["message"], error


def test_connections_are_capped_per_client_address(guarded: Serve):
    held = [connection(guarded, "127.0.0.3") for _ in range(PER_CLIENT)]
    try:
        assert [get_health(c)[0] for c in held] == [200] * PER_CLIENT
        # One more from that address is refused, whatever X-Forwarded-For it claims; another address is not.
        assert_refused(*get_health(connection(guarded, "127.0.0.3"), "10.9.9.9"), 429,
                       "--max-connections-per-client", PER_CLIENT)
        assert get_health(connection(guarded, "127.0.0.4"))[0] == 200
    finally:
        for conn in held:
            conn.close()
    deadline = time.monotonic() + 5
    while (status := get_health(connection(guarded, "127.0.0.3"))[0]) != 200:  # the gateway saw them close
        assert time.monotonic() < deadline, status
        time.sleep(0.1)


def test_behind_a_trusted_proxy_the_forwarded_client_is_capped(guarded: Serve):
    held = [connection(guarded, PROXY) for _ in range(PER_CLIENT)]
    try:
        assert [get_health(c, "10.1.1.1")[0] for c in held] == [200] * PER_CLIENT
        assert_refused(*get_health(connection(guarded, PROXY), "10.1.1.1"), 429, "--max-connections-per-client",
                       PER_CLIENT)
        assert get_health(connection(guarded, PROXY), "10.1.1.2")[0] == 200  # another client of the same proxy
    finally:
        for conn in held:
            conn.close()


def partial_body(serve: Serve, source: str, num_bytes: int) -> socket.socket:
    """A completion request whose body stops `num_bytes` in, 10 bytes short of its length."""
    sock = socket.create_connection(("127.0.0.1", serve.port), timeout=10, source_address=(source, 0))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEYS[0].encode()
                 + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (num_bytes + 10)
                 + b" " * num_bytes)
    return sock


def answer_of(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def test_request_bodies_held_at_once_stay_within_the_budget(guarded: Serve):
    first = partial_body(guarded, "127.0.0.6", BODY_BUDGET - 2**16)
    try:
        time.sleep(1.0)  # the gateway holds it all
        start = time.monotonic()
        second = partial_body(guarded, "127.0.0.7", 2**17)
        head, _, body = answer_of(second).partition(b"\r\n\r\n")
        assert time.monotonic() - start < 5
        assert_refused(int(head.split()[1]), body, 503, "--max-buffered-body-bytes", BODY_BUDGET)
    finally:
        first.close()
    with openai.OpenAI(base_url=guarded.api, api_key=KEYS[0], timeout=120, max_retries=0) as client:
        model = client.models.list().data[0].id
        deadline = time.monotonic() + 10
        while True:  # the first body's bytes are given back once the gateway sees it go
            with pytest.raises(openai.APIStatusError) as answer:  # a prompt too long for the context: a 400
                client.completions.create(model=model, prompt="x" * 200_000, max_tokens=1)
            if answer.value.status_code == 400:
                break
            assert answer.value.status_code == 503 and time.monotonic() < deadline, answer.value
            time.sleep(0.2)


def test_a_tenant_with_a_burst_waits_its_turn(guarded: Serve):
    """One sequence at a time: key A queues a burst, then key B asks once; B goes after A's next one,
    not after A's whole burst."""
    finished: list[str] = []

    def complete(key: str, name: str) -> None:
        # Each client is closed, so its kept-alive connection does not count against the cap.
        with openai.OpenAI(base_url=guarded.api, api_key=key, timeout=300, max_retries=0) as client:
            client.completions.create(model=model, prompt=f"Story {name}:", max_tokens=BURST_TOKENS,
                                      temperature=0, extra_body={"ignore_eos": True})
        finished.append(name)

    with openai.OpenAI(base_url=guarded.api, api_key=KEYS[0], max_retries=0) as client:
        model = client.models.list().data[0].id
    burst = [threading.Thread(target=complete, args=(KEYS[0], f"a{i}")) for i in range(BURST)]
    for thread in burst:
        thread.start()
    deadline = time.monotonic() + 60
    while (stats := guarded.engine_stats()).num_waiting < BURST - 1:
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    late = threading.Thread(target=complete, args=(KEYS[1], "b"))
    late.start()
    for thread in (*burst, late):
        thread.join(300)
    assert len(finished) == BURST + 1
    # Running a0; waiting a1..a4; b arrives: a1 (A's turn), then b (B's), then A's others.
    assert finished.index("b") <= 2, finished


def test_only_keys_allowed_to_may_set_priority(guarded: Serve):
    def complete(key: str, priority: int) -> None:
        with openai.OpenAI(base_url=guarded.api, api_key=key, timeout=120, max_retries=0) as client:
            client.completions.create(model=client.models.list().data[0].id, prompt="Hi", max_tokens=1,
                                      extra_body={"priority": priority})

    with pytest.raises(openai.PermissionDeniedError) as refused:
        complete(KEYS[0], -5)
    error = refused.value.body
    assert error["param"] == "priority" and "--priority-api-key-file" in error["message"], error
    complete(KEYS[0], 0)
    complete(PRIORITY_KEY, -5)
