"""Acceptance of disaggregated prefill/decode on real processes, KV blocks over gloo.

One `kvmesh serve --prefill-engines 1 --decode-engines 1 --speculative-config ...` for the module
(engine-prefill-0 and engine-decode-0, each with its worker; the decode engine drafts n-gram tokens). The tests that only talk to it come first and leave both
engines idle with no block used; the one that kills the prefill engine's worker runs last.

The colocated truth is the in-process LLM (one engine, no transfer) on the same prompts, greedy.
Requests go to the decode engine directly (Engine.Generate with the prefill engine named, as the
processor's decider names it) so that token ids are compared exactly; the decider itself is tested
through the gateway.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import aclosing

import pytest
import torch

from services import LLM, SamplingParams
from services.common.clients import EngineStats
from services.common.engine_output import EngineCoreRequest, PrefillTask
from services.engine.client import GrpcEngineClient
from services.worker.kv_transfer import KVTransferEndpoint
from tests.services.procs import Serve, client_for, gone, running_serve
from tests.services.test_router_processes import metric

THRESHOLD = 128  # prompts longer than this (uncached) are prefilled on the prefill engine
LEASE = 3.0  # seconds the prefill engine holds blocks nobody released
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
KV_CACHE = "192MiB"  # ~4,300 tokens per engine: a few 1,500-token prompts at once
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def prompts(n: int, low: int, high: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(rng.randint(low, high))] for _ in range(n)]


def wait_for(condition: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:g}s: {what}"
        time.sleep(0.05)


class PD:
    """The running P/D stack and what the tests ask of its engines."""

    def __init__(self, serve: Serve) -> None:
        self.serve = serve
        self.prefill, self.decode = "engine-prefill-0", "engine-decode-0"

    def address(self, name: str) -> str:
        return self.serve.services[name]["address"]

    def page(self, name: str) -> str:
        return urllib.request.urlopen(self.serve.services[name]["metrics"], timeout=5).read().decode()

    def _call(self, name: str, method: str, *args):
        async def call():
            client = GrpcEngineClient(self.address(name), timeout=10, security=self.serve.security)
            try:
                return await getattr(client, method)(*args)
            finally:
                await client.close()
        return asyncio.run(call())

    def stats(self, name: str) -> EngineStats:
        return self._call(name, "stats")

    def generate(self, batch: list[list[int]], remote: bool = True,
                 params: SamplingParams = GREEDY) -> list[list[int]]:
        """Token ids from the decode engine, all prompts at once; with `remote`, each names the
        prefill engine (as the processor's decider does for a long prompt)."""
        async def run() -> list[list[int]]:
            client = GrpcEngineClient(self.address(self.decode), timeout=10, security=self.serve.security)

            async def one(i: int, prompt: list[int]) -> list[int]:
                request = EngineCoreRequest(f"pd-{time.monotonic_ns()}-{i}", prompt, params,
                                            prefill_engine_address=self.address(self.prefill) if remote else None)
                tokens: list[int] = []
                async with aclosing(client.generate(request)) as stream:
                    async for output in stream:
                        tokens += output.new_token_ids
                return tokens
            try:
                return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(batch))))
            finally:
                await client.close()
        return asyncio.run(run())

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Both engines: nothing running or waiting, no block used (leases and transfers included)."""
        for name in (self.prefill, self.decode):
            wait_for(lambda: (s := self.stats(name)).num_running == s.num_waiting == s.num_used_blocks == 0,
                     timeout, f"{name} idle: {self.stats(name)}")


@pytest.fixture(scope="module")
def pd(served_model: str) -> Iterator[PD]:
    args = ["--prefill-engines", "1", "--decode-engines", "1", "--prefill-threshold", str(THRESHOLD),
            "--kv-lease", str(LEASE), "--kv-transfer-timeout", "3", "--kv-cache-memory", KV_CACHE,
            "--max-model-len", "2048", "--speculative-config", json.dumps(SPEC)]
    with running_serve(served_model, extra_args=args) as serve:
        yield PD(serve)


@pytest.fixture(scope="module")
def colocated(served_model: str) -> Iterator[LLM]:
    llm = LLM(model=served_model, dtype="float32", kv_cache_memory=192 * 2**20, max_model_len=2048)
    yield llm
    del llm


def truth(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY)]


def counters(pd: PD) -> dict[str, float]:
    decode, prefill, processor = pd.page(pd.decode), pd.page(pd.prefill), pd.page("processor")
    return {
        "received": metric(decode, "kvmesh_kv_transfers_total", direction="received"),
        "sent": metric(prefill, "kvmesh_kv_transfers_total", direction="sent"),
        "bytes": metric(decode, "kvmesh_kv_transfer_bytes_total", direction="received"),
        "recomputes": metric(decode, "kvmesh_kv_transfer_recomputes_total"),
        "failures": metric(decode, "kvmesh_kv_transfer_failures_total"),
        "expired": metric(prefill, "kvmesh_kv_leases_expired_total"),
        # The processor counts requests that came through it, each once (the engines do not).
        "finished": metric(processor, "vllm:request_success_total"),
        "e2es": metric(decode, "vllm:e2e_request_latency_seconds_count"),
        "ttfts": metric(decode, "vllm:time_to_first_token_seconds_count"),
    }


def check_remote_prefill_matches_colocated(pd: PD, colocated: LLM, batch: list[list[int]], wave: int) -> None:
    """`wave` prompts at a time: as many as both engines' KV caches hold at once (a decode engine
    without free blocks for a transfer computes the prompt itself: kvmesh_kv_transfer_local_prefills)."""
    before = counters(pd)
    tokens = [t for i in range(0, len(batch), wave) for t in pd.generate(batch[i:i + wave])]
    assert tokens == truth(colocated, batch)
    after = counters(pd)
    # Every prompt's blocks went P -> D (none was cached on D: fresh random prompts), none recomputed.
    assert after["received"] - before["received"] == len(batch)
    assert after["sent"] - before["sent"] == len(batch)
    assert after["recomputes"] == before["recomputes"] and after["failures"] == before["failures"]
    # D's own (vLLM's) metrics count them, once each: P's first token is their first token.
    assert after["e2es"] - before["e2es"] == after["ttfts"] - before["ttfts"] == len(batch)
    block_size = 16
    bytes_per_token = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M: layers, K and V, KV heads, head size, float32
    assert after["bytes"] - before["bytes"] == sum(len(p) // block_size * block_size for p in batch) * bytes_per_token
    # D released every lease: none expired, and no block stays used on either side.
    pd.wait_idle()
    assert counters(pd)["expired"] == before["expired"]


def test_long_prompts_prefilled_remotely_decode_the_colocated_tokens(pd: PD, colocated: LLM):
    check_remote_prefill_matches_colocated(pd, colocated, prompts(4, 200, 800, seed=1), wave=4)


def test_a_decode_engine_drafts_on_a_prompt_whose_kv_came_from_the_prefill_engine(pd: PD, colocated: LLM):
    """The decode engine speculates from the first token P sampled: its drafts are verified against
    the transferred KV, and the tokens are those of the colocated engine without speculation."""
    text = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great lamp, and "
            "wrote the weather in a leather book that had belonged to his grandfather. In winter the storms "
            "came from the north, the waves broke white over the rocks below the tower, and the ships kept "
            "well away from the reef that the lamp warned them of. In summer the keeper painted the rails, "
            "mended the nets of the fishermen in the village, and read the old letters by the window. When "
            "the supply boat came each month, he carried the oil, the flour and the newspapers up the path.")
    prompt = colocated.get_tokenizer().encode(f"Copy the text exactly.\nText: {text}\nCopy: {text[:40]}")
    assert len(prompt) > THRESHOLD
    params = SamplingParams(temperature=0, max_tokens=32)
    accepted = lambda: metric(pd.page(pd.decode), "vllm:spec_decode_num_accepted_tokens_total")  # noqa: E731
    before, accepted_before = counters(pd), accepted()
    [expected] = colocated.generate([prompt], params)
    assert pd.generate([prompt], params=params) == [expected.outputs[0].token_ids]
    after = counters(pd)
    assert after["received"] - before["received"] == 1 and after["recomputes"] == before["recomputes"]
    assert accepted() - accepted_before >= 10  # the copy is drafted and accepted
    pd.wait_idle()


@pytest.mark.slow
def test_tensor_parallel_pairs_send_each_rank_its_own_shard(served_model: str, colocated: LLM):
    """--tensor-parallel-size 2 on both sides: rank r of P sends its KV heads to rank r of D (a pair
    group per rank pair); the blocks of both ranks add up to the whole cache's bytes."""
    args = ["--prefill-engines", "1", "--decode-engines", "1", "--prefill-threshold", str(THRESHOLD),
            "--tensor-parallel-size", "2", "--kv-cache-memory", "96MiB", "--max-model-len", "2048",
            # Eight processes on CI's two busy cores: a transfer must not time out into a recompute.
            "--kv-transfer-timeout", "30", "--remote-prefill-timeout", "120"]
    batch = prompts(2, 150, 400, seed=11)
    with running_serve(served_model, extra_args=args) as serve:
        tp = PD(serve)
        assert "worker-prefill-0-r1" in serve.services and "worker-decode-0-r1" in serve.services
        before = counters(tp)
        assert tp.generate(batch) == truth(colocated, batch)
        after = counters(tp)
        assert after["received"] - before["received"] == len(batch), (before, after)
        assert after["recomputes"] == before["recomputes"], (before, after)
        assert after["bytes"] - before["bytes"] == sum(len(p) // 16 * 16 for p in batch) * 30 * 2 * 3 * 64 * 4
        tp.wait_idle()


def test_a_cached_prefix_on_the_decode_engine_is_not_transferred_again(pd: PD, colocated: LLM):
    [prompt] = prompts(1, 400, 400, seed=3)
    assert pd.generate([prompt[:320]], remote=False) == truth(colocated, [prompt[:320]])  # D caches 20 blocks
    before = counters(pd)
    assert pd.generate([prompt]) == truth(colocated, [prompt])
    after = counters(pd)
    assert after["received"] - before["received"] == 1
    assert after["bytes"] - before["bytes"] == (400 // 16 - 320 // 16) * 16 * 30 * 2 * 3 * 64 * 4  # 5 blocks
    pd.wait_idle()


def test_short_prompts_never_go_to_the_prefill_engine(pd: PD):
    client, model = client_for(pd.serve)
    decisions = lambda outcome: metric(pd.page("processor"), "kvmesh_pd_decisions_total", outcome=outcome)  # noqa: E731
    before = {o: decisions(o) for o in ("short", "cached", "remote")}
    sent, finished = counters(pd)["sent"], counters(pd)["finished"]
    for prompt in prompts(5, 10, THRESHOLD, seed=4):
        client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    assert decisions("short") - before["short"] == 5
    assert decisions("remote") == before["remote"] and counters(pd)["sent"] == sent
    assert counters(pd)["finished"] == finished + 5
    # A long one does go there, once: then the decode engine holds it (the transferred blocks are in
    # its prefix cache) and computes it itself. Every outcome, end to end through the gateway.
    [long] = prompts(1, 300, 300, seed=5)
    first = client.completions.create(model=model, prompt=long, max_tokens=4, temperature=0)
    assert decisions("remote") - before["remote"] == 1
    assert counters(pd)["sent"] == sent + 1
    # Prefilled on P and decoded on D, it is one request: vllm:request_success counts it once.
    assert counters(pd)["finished"] == finished + 6
    again = client.completions.create(model=model, prompt=long, max_tokens=4, temperature=0)
    assert decisions("cached") - before["cached"] == 1
    assert counters(pd)["sent"] == sent + 1
    assert counters(pd)["finished"] == finished + 7
    assert again.choices[0].text == first.choices[0].text
    pd.wait_idle()


def test_a_constrained_long_prompt_is_prefilled_where_its_grammar_is(pd: PD):
    """A structured-output request's first token must be masked by its grammar, which lives on the
    decode engine: the decider never sends it to the prefill engine, however long its prompt."""
    client, model = client_for(pd.serve)
    decisions = lambda outcome: metric(pd.page("processor"), "kvmesh_pd_decisions_total", outcome=outcome)  # noqa: E731
    before, sent = decisions("constrained"), counters(pd)["sent"]
    [long] = prompts(1, 300, 300, seed=6)
    answer = client.completions.create(model=model, prompt=long, max_tokens=8, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert answer.choices[0].text in ("alpha", "beta")
    assert decisions("constrained") - before == 1 and counters(pd)["sent"] == sent
    pd.wait_idle()


def test_a_decode_side_that_vanishes_after_the_transfer_leaves_the_lease_to_expire(pd: PD):
    """The test process is the decode side: a real KV-transfer endpoint receives P's blocks over
    gloo, then goes away without ReleaseTransfer. P holds the blocks until the lease expires. It
    holds the engine token, as a real decode worker does: the stores' keys are signed with it."""
    info = pd._call(pd.prefill, "info")
    secret = (pd.serve.token_file.parent / "engine-token").read_text().strip()
    receiver = KVTransferEndpoint("127.0.0.1:0", torch.device("cpu"), timeout=5.0, secret=secret)
    kv_caches = [torch.zeros(2, 32, 16, 3, 64) for _ in range(30)]  # this side's cache: 32 blocks
    [prompt] = prompts(1, 300, 300, seed=6)
    num_blocks = len(prompt) // 16
    task = PrefillTask(EngineCoreRequest(f"vanish-{time.monotonic_ns()}", prompt, GREEDY), (receiver.endpoint_id,),
                       0, list(range(num_blocks)), tag=7)
    expired = counters(pd)["expired"]

    async def prefill() -> int:
        client = GrpcEngineClient(pd.address(pd.prefill), timeout=10, security=pd.serve.credential("engine"))
        try:
            async with aclosing(client.prefill(task, timeout=30)) as stream:
                first = await anext(stream)
                received = await asyncio.to_thread(receiver.receive, info.kv_transfer_endpoints[0], task.tag,
                                                   kv_caches, task.block_ids)
                sent = await anext(stream)
                assert sent.sent and sent.bytes_sent == received
                return first.first_token_id
        finally:
            await client.close()

    assert asyncio.run(prefill()) is not None
    assert all(kv[:, :num_blocks].abs().sum() > 0 for kv in kv_caches)  # real KV arrived in every layer
    receiver.close()
    assert pd.stats(pd.prefill).num_used_blocks >= num_blocks  # held under the lease, nobody released it
    pd.wait_idle(timeout=LEASE + 5)
    assert counters(pd)["expired"] == expired + 1


def test_killing_the_prefill_worker_mid_prefill_makes_the_decode_engine_recompute(pd: PD, colocated: LLM):
    """Last: it kills the prefill engine's worker (kvmesh serve restarts that pair)."""
    [prompt] = prompts(1, 1500, 1500, seed=7)
    before = counters(pd)
    worker_pid = pd.serve.services["worker-prefill-0"]["pid"]
    result: list[list[int]] = []
    thread = threading.Thread(target=lambda: result.extend(pd.generate([prompt])))
    thread.start()
    # Kill as soon as P has the prompt in its scheduler (its prefill takes ~1-2 s on 2 cores).
    wait_for(lambda: pd.stats(pd.prefill).num_running > 0 or not thread.is_alive(), 30, "the prefill engine runs it")
    assert thread.is_alive(), "the request finished before the prefill engine was killed"
    os.kill(worker_pid, signal.SIGKILL)
    thread.join(60)
    assert not thread.is_alive()
    assert result == truth(colocated, [prompt])  # the same tokens, computed on D
    assert gone(worker_pid)
    decode = pd.page(pd.decode)  # P's engine is gone or restarting: D's counters only
    assert metric(decode, "kvmesh_kv_transfer_recomputes_total") == before["recomputes"] + 1
    assert metric(decode, "kvmesh_kv_transfers_total", direction="received") == before["received"]
    # No block stays used on D; P's pair is restarted by kvmesh serve with an empty cache.
    wait_for(lambda: pd.stats(pd.decode).num_used_blocks == 0, 10, "decode engine idle")
