"""The paged-attention kernels against the plain-torch reference (kvmesh_kernels/reference.py).

On the CPU they run under Triton's interpreter (conftest.py), so the shapes are small: few heads,
contexts up to 257 tokens. Every case draws fresh random inputs, poisons the output with NaN (every
element must be written) and keeps NaN in every cache slot outside the contexts (none may be read).
Tolerances per dtype: paged_inputs.TOLERANCES.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kvmesh_kernels.paged_attention import AttentionParams, PagedBatch, choose_num_splits, paged_attention
from kvmesh_kernels.reference import paged_attention_ref
from tests.kernels.conftest import kernels_device
from tests.kernels.paged_inputs import TOLERANCES, PagedCase, Shape, make_case, poisoned_like

LENGTHS = [1, 15, 16, 17, 100, 257] + ([1025, 4097] if kernels_device().type == "cuda" else [])
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]


def run_and_check(case: PagedCase, params: AttentionParams, num_splits: int | None = None) -> None:
    out = poisoned_like(case.q)
    paged_attention(case.q, case.kv_cache, out, case.batch, params, num_splits=num_splits)
    assert not out.isnan().any(), "the kernel left output elements unwritten"
    expected = paged_attention_ref(case.q, case.kv_cache, case.batch.query_start_loc, case.batch.seq_lens,
                                   case.batch.block_table, params.scale, params.sliding_window,
                                   params.logits_soft_cap)
    atol, rtol = TOLERANCES[case.q.dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("length", LENGTHS)
def test_mixed_batch_of_prefills_and_decodes(length: int, dtype: torch.dtype, device, gen) -> None:
    # One batch, one launch: a whole prompt of `length`, a decode over `length` tokens of context,
    # and a 7-token prefill chunk on top of `length` cached tokens.
    shape = Shape(num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=dtype)
    case = make_case(shape, q_lens=[length, 1, 7], seq_lens=[length, length, length + 7], device=device, gen=gen)
    run_and_check(case, AttentionParams(scale=64**-0.5), num_splits=1)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (6, 2), (8, 1)], ids=["gqa1", "gqa3", "gqa8"])
def test_gqa_head_and_block_sizes(num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
                                  device, gen) -> None:
    shape = Shape(num_heads, num_kv_heads, head_size, block_size, torch.float16)
    case = make_case(shape, q_lens=[16, 1, 1, 5], seq_lens=[16, 100, 17, 22], device=device, gen=gen)
    run_and_check(case, AttentionParams(scale=head_size**-0.5), num_splits=1)


@pytest.mark.parametrize("window,dtype", [(1, torch.float32), (16, torch.bfloat16), (40, torch.float16)],
                         ids=["w1-fp32", "w16-bf16", "w40-fp16"])
def test_sliding_window(window: int, dtype: torch.dtype, device, gen) -> None:
    shape = Shape(num_heads=6, num_kv_heads=2, head_size=64, block_size=16, dtype=dtype)
    case = make_case(shape, q_lens=[100, 1, 17, 1], seq_lens=[100, 257, 60, 15], device=device, gen=gen)
    run_and_check(case, AttentionParams(scale=0.125, sliding_window=window), num_splits=1)


def test_logits_soft_cap_with_window(device, gen) -> None:
    shape = Shape(num_heads=4, num_kv_heads=1, head_size=64, block_size=32, dtype=torch.float32)
    case = make_case(shape, q_lens=[33, 1], seq_lens=[40, 100], device=device, gen=gen)
    # A scale large enough that the cap bends the scores: |q.k| * scale is often above 5.
    run_and_check(case, AttentionParams(scale=0.5, sliding_window=50, logits_soft_cap=5.0), num_splits=1)


@pytest.mark.parametrize("num_splits,num_heads,num_kv_heads,dtype,window", [
    (2, 2, 2, torch.float32, None),
    (3, 6, 2, torch.bfloat16, None),
    (8, 8, 1, torch.float16, None),
    (4, 6, 2, torch.float32, 40),
], ids=["s2-gqa1-fp32", "s3-gqa3-bf16", "s8-gqa8-fp16", "s4-gqa3-fp32-window"])
def test_split_kv_decode(num_splits: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype,
                         window: int | None, device, gen) -> None:
    # Decodes of every length, plus a request without a token this step; short contexts leave some
    # splits empty, and a window empties the splits before it.
    shape = Shape(num_heads, num_kv_heads, 64, 16, dtype)
    lengths = LENGTHS
    case = make_case(shape, q_lens=[1] * len(lengths) + [0], seq_lens=lengths + [30], device=device, gen=gen)
    run_and_check(case, AttentionParams(scale=0.125, sliding_window=window), num_splits=num_splits)


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_split_kv_on_a_mixed_batch(device, gen) -> None:
    # Chosen for decodes only, but right for any batch: rows of a prefill chunk whose positions come
    # before a split's share get an empty share there.
    shape = Shape(num_heads=6, num_kv_heads=2, head_size=64, block_size=16, dtype=torch.float32)
    case = make_case(shape, q_lens=[100, 1, 17], seq_lens=[100, 257, 60], device=device, gen=gen)
    run_and_check(case, AttentionParams(scale=0.125, sliding_window=70), num_splits=3)


def test_split_kv_with_soft_cap_matches_one_pass(device, gen) -> None:
    shape = Shape(num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=torch.float32)
    case = make_case(shape, q_lens=[1, 1], seq_lens=[257, 100], device=device, gen=gen)
    params = AttentionParams(scale=0.3, logits_soft_cap=4.0)
    unified, split = poisoned_like(case.q), poisoned_like(case.q)
    paged_attention(case.q, case.kv_cache, unified, case.batch, params, num_splits=1)
    paged_attention(case.q, case.kv_cache, split, case.batch, params, num_splits=4)
    torch.testing.assert_close(split, unified, atol=1e-5, rtol=1e-5)
    run_and_check(case, params, num_splits=4)


def test_requests_without_tokens_and_an_empty_batch(device, gen) -> None:
    shape = Shape(num_heads=2, num_kv_heads=1, head_size=64, block_size=16, dtype=torch.float32)
    case = make_case(shape, q_lens=[0, 3, 0, 1], seq_lens=[20, 3, 5, 40], device=device, gen=gen)
    run_and_check(case, AttentionParams(scale=0.125))
    empty = case.q[:0]
    batch = PagedBatch(case.batch.query_start_loc[:1], case.batch.seq_lens[:0], case.batch.block_table[:0], 0, 0)
    paged_attention(empty, case.kv_cache, torch.empty_like(empty), batch, AttentionParams(scale=0.125))


def test_noncontiguous_q_and_out(device, gen) -> None:
    # q as the model hands it over: a view into the fused q|k|v projection output.
    shape = Shape(num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=torch.float32)
    case = make_case(shape, q_lens=[17, 1], seq_lens=[17, 50], device=device, gen=gen)
    fused = torch.randn((case.q.shape[0], (4 + 2 * 2) * 64), generator=gen, device=device)
    q = fused[:, : 4 * 64].view(-1, 4, 64)
    q.copy_(case.q)
    wide_out = poisoned_like(fused)
    out = wide_out[:, : 4 * 64].view(-1, 4, 64)
    params = AttentionParams(scale=0.125)
    paged_attention(q, case.kv_cache, out, case.batch, params)
    expected = paged_attention_ref(case.q, case.kv_cache, case.batch.query_start_loc, case.batch.seq_lens,
                                   case.batch.block_table, 0.125)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    assert wide_out[:, 4 * 64 :].isnan().all(), "wrote outside out's view"


def test_choose_num_splits() -> None:
    # An H200 has 132 SMs; Llama-3-8B 8 KV heads.
    assert choose_num_splits(num_reqs=1, num_kv_heads=8, max_query_len=1, max_seq_len=8192, num_sms=132) == 32
    assert choose_num_splits(num_reqs=1, num_kv_heads=8, max_query_len=1, max_seq_len=1024, num_sms=132) == 4
    assert choose_num_splits(num_reqs=4, num_kv_heads=8, max_query_len=1, max_seq_len=4096, num_sms=132) == 8
    # Enough programs already, a prefill in the batch, or contexts too short: the unified kernel.
    assert choose_num_splits(num_reqs=32, num_kv_heads=8, max_query_len=1, max_seq_len=8192, num_sms=132) == 1
    assert choose_num_splits(num_reqs=1, num_kv_heads=8, max_query_len=2, max_seq_len=8192, num_sms=132) == 1
    assert choose_num_splits(num_reqs=1, num_kv_heads=8, max_query_len=1, max_seq_len=300, num_sms=132) == 1
    assert choose_num_splits(num_reqs=1, num_kv_heads=1, max_query_len=1, max_seq_len=10**6, num_sms=132) == 64


def test_launcher_rejects_bad_inputs(device, gen) -> None:
    shape = Shape(num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=torch.float16)
    case = make_case(shape, q_lens=[3, 1], seq_lens=[3, 20], device=device, gen=gen)
    q, cache, batch = case
    params = AttentionParams(scale=0.125)

    def rejects(match: str, **changes) -> None:
        args = dict(q=q, kv_cache=cache, out=torch.empty_like(q), batch=batch, params=params)
        args.update(changes)
        with pytest.raises(ValueError, match=match):
            paged_attention(**args)

    rejects("share one dtype", kv_cache=cache.float())
    rejects("share one dtype", q=q.double(), out=torch.empty_like(q.double()), kv_cache=cache.double())
    rejects("out must have", out=torch.empty_like(q[1:]))
    rejects("contiguous in head_size", q=q.transpose(1, 2).contiguous().transpose(1, 2))
    rejects("not a multiple", q=q[:, :3], out=torch.empty_like(q[:, :3]))
    rejects("kv_cache must be", kv_cache=cache[0])
    rejects("seq_lens must be", batch=batch._replace(seq_lens=batch.seq_lens.long()))
    rejects("block_table must be", batch=batch._replace(block_table=batch.block_table[:1]))
    rejects("exceeds the block table", batch=batch._replace(max_seq_len=10**4))
    rejects("sliding_window", params=AttentionParams(scale=0.1, sliding_window=0))
    rejects("scale must be positive", params=AttentionParams(scale=0.0))
    rejects("num_splits must be at least 1", num_splits=0)


@triton.jit
def _dot_kernel(a_ptr, b_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    a = tl.load(a_ptr + offs[:, None] * N + offs[None, :])
    b = tl.load(b_ptr + offs[:, None] * N + offs[None, :])
    tl.store(out_ptr + offs[:, None] * N + offs[None, :], tl.dot(a, b))


@pytest.mark.skipif(kernels_device().type == "cuda", reason="a fact about Triton's interpreter")
def test_interpreter_still_needs_the_bfloat16_dot_workaround() -> None:
    # kvmesh_kernels/interpreter.py: the interpreter's tl.dot multiplies bfloat16's raw uint16 storage, so
    # the launchers upcast bfloat16 dot operands under it. When a Triton upgrade fixes the dot, this
    # fails: drop `dot_in_fp32` and this test.
    a, b = torch.randn(2, 16, 16).to(torch.bfloat16)
    out = torch.empty(16, 16)
    _dot_kernel[(1,)](a, b, out, N=16)
    assert not torch.allclose(out, a.float() @ b.float(), atol=1e-2), "the interpreter's bfloat16 dot works now"
