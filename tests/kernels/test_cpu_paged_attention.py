"""The native CPU paged decode-attention kernel (the `cpu` backend's decode path) against the
plain-torch reference: odd context lengths, GQA ratios, head and block sizes, sliding window,
soft-cap, float32, bfloat16 and float16, NaN-poisoned cache outside the contexts and a NaN-poisoned
output; in every build this CPU can run (the `isa` fixture: native, AVX2 + FMA, scalar;
AVX-512 emulated where the CPU lacks it)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvmesh_kernels import cpu_paged_attention, native
from kvmesh_kernels.reference import paged_attention_ref
from services.common.config import default_cache_dir
from tests.kernels.avx512_emulation import EMULATED
from tests.kernels.paged_inputs import TOLERANCES, Shape, make_case, poisoned_like

SEQ_LENS = [1, 15, 16, 17, 100, 257]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True, scope="module")
def _built() -> None:
    cpu_paged_attention.build(default_cache_dir())  # the worker does this at start-up


def test_each_build_runs_the_path_it_was_compiled_for(isa):
    lanes = cpu_paged_attention.vector_width(cpu_paged_attention.variant(isa, default_cache_dir()))
    want = {"avx2": 8, "scalar": 1, EMULATED: 16}.get(isa) or (16 if native.cpu_has("avx512f") else
                                                 8 if native.cpu_has("avx2", "fma") else 1)
    assert lanes == want
    # A variant is loaded beside the served build, never in its place.
    assert cpu_paged_attention.vector_width() == cpu_paged_attention.vector_width(
        cpu_paged_attention.variant("native", default_cache_dir()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("head_size,block_size", [(64, 16), (128, 32), (64, 32), (80, 8), (40, 16)])
def test_decode_matches_reference(dtype, num_heads, num_kv_heads, head_size, block_size, isa, gen):
    case = make_case(Shape(num_heads, num_kv_heads, head_size, block_size, dtype), [1] * len(SEQ_LENS),
                     SEQ_LENS, torch.device("cpu"), gen)
    scale = head_size**-0.5
    out = poisoned_like(case.q)
    cpu_paged_attention.paged_decode_attention(out, case.q, case.kv_cache[0], case.kv_cache[1],
                                               case.batch.block_table, case.batch.seq_lens, scale,
                                               lib=cpu_paged_attention.variant(isa, default_cache_dir()))
    ref = paged_attention_ref(case.q, case.kv_cache, case.batch.query_start_loc, case.batch.seq_lens,
                              case.batch.block_table, scale)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("window,soft_cap", [(8, None), (None, 30.0), (20, 5.0)])
def test_sliding_window_and_soft_cap(window, soft_cap, isa, gen):
    case = make_case(Shape(6, 2, 64, 16, torch.float32), [1] * len(SEQ_LENS), SEQ_LENS, torch.device("cpu"), gen)
    out = poisoned_like(case.q)
    cpu_paged_attention.paged_decode_attention(out, case.q, case.kv_cache[0], case.kv_cache[1],
                                               case.batch.block_table, case.batch.seq_lens, 0.125,
                                               sliding_window=window, soft_cap=soft_cap,
                                               lib=cpu_paged_attention.variant(isa, default_cache_dir()))
    ref = paged_attention_ref(case.q, case.kv_cache, case.batch.query_start_loc, case.batch.seq_lens,
                              case.batch.block_table, 0.125, window, soft_cap)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


# Prefill chunks over cached context, whole prompts and decodes in one step (odd lengths).
Q_LENS, CONTEXTS = [5, 1, 17, 1, 16, 33], [20, 15, 17, 257, 16, 100]


def prefill_rows(q_lens: list[int], seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token a row: (its request, its causal context length), written out the long way."""
    seq_of_row, row_lens = [], []
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        for j in range(q_len):
            seq_of_row.append(i)
            row_lens.append(seq_len - q_len + j + 1)
    return torch.tensor(seq_of_row, dtype=torch.int32), torch.tensor(row_lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,soft_cap", [(None, None), (8, None), (20, 5.0)])
def test_prefill_rows_match_reference(dtype, window, soft_cap, isa, gen):
    case = make_case(Shape(6, 2, 64, 16, dtype), Q_LENS, CONTEXTS, torch.device("cpu"), gen)
    seq_of_row, row_lens = prefill_rows(Q_LENS, CONTEXTS)
    out = poisoned_like(case.q)
    cpu_paged_attention.paged_decode_attention(out, case.q, case.kv_cache[0], case.kv_cache[1],
                                               case.batch.block_table, row_lens, 0.125, window, soft_cap,
                                               lib=cpu_paged_attention.variant(isa, default_cache_dir()),
                                               seq_of_row=seq_of_row)
    ref = paged_attention_ref(case.q, case.kv_cache, case.batch.query_start_loc, case.batch.seq_lens,
                              case.batch.block_table, 0.125, window, soft_cap)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decodes_sharing_a_prefix_match_reference_and_each_row_alone(dtype, isa, gen):
    # Requests 0-4 hold the same first five blocks (a prompt prefix from the prefix cache); the
    # kernel reads them once for the rows of a tile. Request 5 shares nothing; a prefill chunk
    # (request 6's last three tokens) sits between the decodes.
    contexts, q_lens = [100, 117, 81, 257, 96, 90, 70], [1, 1, 1, 1, 1, 1, 3]
    case = make_case(Shape(6, 2, 64, 16, dtype), q_lens, contexts, torch.device("cpu"), gen)
    table = case.batch.block_table.clone()
    table[1:5, :5] = table[0, :5]
    order = [0, 1, 6, 6, 6, 2, 3, 4, 5]  # request of each row
    seq_of_row, row_lens = torch.tensor(order, dtype=torch.int32), torch.tensor(
        [100, 117, 68, 69, 70, 81, 257, 96, 90], dtype=torch.int32)
    q_rows = torch.cat([case.q[:2], case.q[6:], case.q[2:6]])  # the rows in `order`
    lib = cpu_paged_attention.variant(isa, default_cache_dir())
    out = poisoned_like(q_rows)
    cpu_paged_attention.paged_decode_attention(out, q_rows, case.kv_cache[0], case.kv_cache[1], table, row_lens,
                                               0.125, lib=lib, seq_of_row=seq_of_row)
    ref = paged_attention_ref(case.q, case.kv_cache, case.batch.query_start_loc, case.batch.seq_lens, table, 0.125)
    ref_rows = torch.cat([ref[:2], ref[6:], ref[2:6]])
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref_rows.float(), atol=atol, rtol=rtol)
    for row, request in enumerate(order):  # a row's sums do not depend on the rows beside it
        alone = poisoned_like(q_rows[row : row + 1])
        cpu_paged_attention.paged_decode_attention(alone, q_rows[row : row + 1], case.kv_cache[0], case.kv_cache[1],
                                                   table[request : request + 1].contiguous(),
                                                   row_lens[row : row + 1], 0.125, lib=lib)
        assert torch.equal(alone, out[row : row + 1])


# Prompt chunks long enough for the prefill tiles (a run of at least 8 rows of one request, its
# (row, head) pairs across the vector lanes: 1 to 4 vectors of them), beside decodes, over contexts
# that end inside the 32-position chunks and cross blocks.
LONG_Q_LENS, LONG_CONTEXTS = [70, 1, 130, 9, 20], [70, 40, 301, 150, 45]


@pytest.mark.parametrize("dtype,num_heads,num_kv_heads,head_size,block_size,window", [
    (torch.float32, 4, 4, 64, 16, None), (torch.float32, 6, 2, 80, 8, 24), (torch.float32, 8, 2, 128, 32, None),
    (torch.bfloat16, 6, 2, 64, 16, None), (torch.bfloat16, 8, 2, 80, 8, 24), (torch.bfloat16, 4, 4, 128, 32, 24),
    (torch.float16, 8, 2, 64, 16, 24), (torch.float16, 4, 4, 80, 8, None), (torch.float16, 6, 2, 128, 32, None),
])
def test_long_prefill_chunks_match_reference(dtype, num_heads, num_kv_heads, head_size, block_size, window, isa,
                                             gen):
    case = make_case(Shape(num_heads, num_kv_heads, head_size, block_size, dtype), LONG_Q_LENS, LONG_CONTEXTS,
                     torch.device("cpu"), gen)
    seq_of_row, row_lens = prefill_rows(LONG_Q_LENS, LONG_CONTEXTS)
    out = poisoned_like(case.q)
    scale = head_size**-0.5
    cpu_paged_attention.paged_decode_attention(out, case.q, case.kv_cache[0], case.kv_cache[1],
                                               case.batch.block_table, row_lens, scale, window,
                                               lib=cpu_paged_attention.variant(isa, default_cache_dir()),
                                               seq_of_row=seq_of_row)
    ref = paged_attention_ref(case.q, case.kv_cache, case.batch.query_start_loc, case.batch.seq_lens,
                              case.batch.block_table, scale, window)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_size,block_size,window,dtype", [
    (4, 1, 256, 16, None, torch.float32), (9, 3, 64, 16, None, torch.float32), (8, 2, 128, 32, 24, torch.float32),
    (4, 4, 80, 8, None, torch.float32), (8, 4, 96, 16, 24, torch.float32), (9, 3, 64, 16, None, torch.bfloat16),
    (4, 1, 256, 16, 24, torch.bfloat16),
])
def test_bfloat16_prefill_products_round_only_their_operands(num_heads, num_kv_heads, head_size, block_size, window,
                                                             dtype, isa, gen):
    """`prefill_bf16` (`--dtype auto` or `bfloat16`): a build with AVX512_BF16 multiplies the prompt
    runs' q.k and p.v in bfloat16, which lands within a few bfloat16 roundings of the reference over
    q, K and V rounded to bfloat16, while a decode in the same call keeps its float32 arithmetic bit
    for bit; every other build ignores the flag."""
    case = make_case(Shape(num_heads, num_kv_heads, head_size, block_size, dtype), LONG_Q_LENS,
                     LONG_CONTEXTS, torch.device("cpu"), gen)
    seq_of_row, row_lens = prefill_rows(LONG_Q_LENS, LONG_CONTEXTS)
    lib = cpu_paged_attention.variant(isa, default_cache_dir())
    built = cpu_paged_attention.prefill_bf16_built(lib)
    assert built == {"avx2": False, "scalar": False, EMULATED: True}.get(isa, native.cpu_has("avx512_bf16"))
    scale = head_size**-0.5
    out = {}
    for bf16 in (False, True):
        out[bf16] = poisoned_like(case.q)
        cpu_paged_attention.paged_decode_attention(out[bf16], case.q, case.kv_cache[0], case.kv_cache[1],
                                                   case.batch.block_table, row_lens, scale, window, lib=lib,
                                                   seq_of_row=seq_of_row, prefill_bf16=bf16)
    if not built:
        assert torch.equal(out[True], out[False])
        return
    rounded = paged_attention_ref((case.q.float() * scale).bfloat16().float() / scale,
                                  case.kv_cache.bfloat16().float(), case.batch.query_start_loc, case.batch.seq_lens,
                                  case.batch.block_table, scale, window)
    # p in bfloat16: ~2 of its ulps at 1.0, and a bfloat16 output's own rounding
    atol = 1e-2 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[True].float(), rounded, atol=atol, rtol=1e-2)
    decode = LONG_Q_LENS[0]  # request 1's one new token
    assert torch.equal(out[True][decode], out[False][decode])
    assert (out[True] - out[False]).abs().max() > 1e-4


@pytest.mark.parametrize("window", [None, 500])
def test_a_long_contexts_bfloat16_copy_is_made_on_every_thread(window, isa, gen):
    """The last 64 rows of a 3,000-token prompt in bfloat16: their tiles share one copy of 3,000
    positions of 3 kv heads, made on all threads in slices (a short prompt's on one)."""
    case = make_case(Shape(9, 3, 64, 16, torch.float32), [64], [3000], torch.device("cpu"), gen)
    seq_of_row, row_lens = prefill_rows([64], [3000])
    lib = cpu_paged_attention.variant(isa, default_cache_dir())
    out = poisoned_like(case.q)
    cpu_paged_attention.paged_decode_attention(out, case.q, case.kv_cache[0], case.kv_cache[1], case.batch.block_table,
                                               row_lens, 0.125, window, lib=lib, seq_of_row=seq_of_row,
                                               prefill_bf16=True)
    rounded = paged_attention_ref((case.q * 0.125).bfloat16().float() / 0.125, case.kv_cache.bfloat16().float(),
                                  case.batch.query_start_loc, case.batch.seq_lens, case.batch.block_table, 0.125,
                                  window)
    exact = paged_attention_ref(case.q, case.kv_cache, case.batch.query_start_loc, case.batch.seq_lens,
                                case.batch.block_table, 0.125, window)
    want = rounded if cpu_paged_attention.prefill_bf16_built(lib) else exact
    torch.testing.assert_close(out, want, atol=1e-2 if want is rounded else 2e-5, rtol=1e-2 if want is rounded else 2e-5)


@pytest.mark.parametrize("prefill_bf16", [False, True])
@pytest.mark.parametrize("window", [None, 24])
def test_a_prefill_row_does_not_depend_on_the_rows_beside_it(window, prefill_bf16, isa, gen):
    """A 100-token prompt attended in one call, and from its sixth token on in another: the tiles of
    rows start elsewhere, and every row in a full tile of both comes out bit for bit the same (the
    prefix cache and chunked prefill cut prompts anywhere). In bfloat16 also its last 21 rows alone:
    one tile, whose copy of K and V starts elsewhere than the whole prompt's."""
    case = make_case(Shape(6, 2, 64, 16, torch.float32), [100], [100], torch.device("cpu"), gen)
    seq_of_row, row_lens = prefill_rows([100], [100])
    lib = cpu_paged_attention.variant(isa, default_cache_dir())
    whole, tail, last = poisoned_like(case.q), poisoned_like(case.q[5:]), poisoned_like(case.q[79:])
    for out, rows in ((whole, slice(0, 100)), (tail, slice(5, 100)), (last, slice(79, 100))):
        cpu_paged_attention.paged_decode_attention(out, case.q[rows], case.kv_cache[0], case.kv_cache[1],
                                                   case.batch.block_table, row_lens[rows].contiguous(), 0.125,
                                                   window, lib=lib, seq_of_row=seq_of_row[rows].contiguous(),
                                                   prefill_bf16=prefill_bf16)
    # Group 3: tiles of 10 rows (21 in bfloat16), from row 0 in the one call and from row 5 in the other.
    assert torch.equal(whole[5:95], tail[:90])
    torch.testing.assert_close(whole[95:], tail[90:], atol=2e-5, rtol=2e-5)
    if prefill_bf16 and cpu_paged_attention.prefill_bf16_built(lib):
        assert torch.equal(whole[79:], last)
    else:  # float32: 21 rows are tiles of 10, 10 and 1, the last one the per-row path's
        torch.testing.assert_close(whole[79:], last, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [None, 8])
def test_the_cpu_backend_attends_a_mixed_step_in_one_call(window, gen):
    """The `cpu` backend's plan on the engine's own metadata: the same cache and output as the
    torch backend (SDPA per prefill chunk), every token through the native kernel."""
    from services.worker.attention import get_attention_backend
    from services.worker.attention.torch_backend import NativeAttentionPlan, TorchAttentionBackend
    from tests.model.test_model import make_metadata

    case = make_case(Shape(6, 2, 64, 16, torch.float32), Q_LENS, CONTEXTS, torch.device("cpu"), gen)
    blocks = [[b for b in row if b >= 0] for row in case.batch.block_table.tolist()]
    meta = make_metadata(Q_LENS, CONTEXTS, [row[: -(-s // 16)] for row, s in zip(blocks, CONTEXTS)])
    layer = SimpleNamespace(num_heads=6, num_kv_heads=2, head_size=64, scale=0.125, sliding_window=window,
                            logits_soft_cap=None)
    k, v = torch.randn((2, sum(Q_LENS), 2, 64), generator=gen)
    cache = case.kv_cache.nan_to_num(0.0)  # the torch backend's SDPA reads whole blocks
    want_cache = cache.clone()
    want = TorchAttentionBackend().forward(layer, case.q, k, v, want_cache, TorchAttentionBackend().plan(meta))
    backend = get_attention_backend("cpu", torch.device("cpu"))
    plan = backend.plan(meta)
    assert isinstance(plan, NativeAttentionPlan)
    out = backend.forward(layer, case.q, k, v, cache, plan)
    assert torch.equal(cache, want_cache)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


def test_launcher_rejects_bad_arguments():
    q = torch.randn(2, 4, 64)
    cache = torch.zeros(2, 4, 16, 2, 64)
    table = torch.zeros(2, 1, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    with pytest.raises(TypeError):
        cpu_paged_attention.paged_decode_attention(q.clone(), q, cache[0].half(), cache[1].half(), table, lens, 1.0)
    with pytest.raises(TypeError):
        cpu_paged_attention.paged_decode_attention(q.clone(), q, cache[0], cache[1], table.long(), lens, 1.0)
    with pytest.raises(ValueError):
        cpu_paged_attention.paged_decode_attention(q.clone(), q.transpose(1, 2).contiguous().transpose(1, 2),
                                                   cache[0], cache[1], table, lens, 1.0)
