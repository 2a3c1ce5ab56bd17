"""The batched LoRA kernels (kvmesh_kernels/lora.py) against the per-segment torch references: the native
CPU kernels in every build this CPU runs (the `isa` fixture) and the Triton kernels (under
TRITON_INTERPRET on the CPU, small shapes; compiled on a GPU), over decode-like batches (many one-row
segments), prefill-like ones (a few long segments, an empty one among them), an empty batch, a batch
without adapters, ranks padded with zeros and a merged layer's slices at their column offsets.

Tolerances. Float32: the kernels and the reference sum the same float32 products in another order, so
they agree to a few ulps of the sums (1e-5 with outputs of order 1). Shrink takes bfloat16 inputs
but widens them exactly and returns float32 sums: the same tolerance. Expand rounds out + delta once
to bfloat16 in both, so after the float32 difference above the results are equal or, rarely, one
bfloat16 ulp apart (rtol 2^-7 covers one ulp anywhere in a binade). On a GPU the bfloat16 / float16
dots take the tensor cores (shrink: exact products, float32 sums; expand: y rounded to TF32, 2^-11
relative), within one bfloat16 ulp; float16 outputs have 3 more mantissa bits, so there 2^-9.
"""

from __future__ import annotations

import zlib
from typing import NamedTuple

import pytest
import torch

from kvmesh_kernels import cpu_lora, lora, native
from kvmesh_kernels.reference import lora_expand_ref, lora_shrink_ref
from services.common.config import default_cache_dir

NUM_SLOTS = 4
# name -> (segment lengths, their slots)
CASES = {
    "decode": ([1] * 14, [0, 1, -1, 2, 3, 0, 0, -1, 1, 2, 3, 3, -1, 1]),
    "prefill": ([17, 0, 64, 15, 1], [2, 0, 0, -1, 3]),
    "mixed": ([1, 33, 1, 1, 16, 1], [3, 1, -1, 0, 2, 1]),
    "empty": ([], []),
    "no_adapter": ([1, 5, 1, 9], [-1, -1, -1, -1]),
}
# (in, rank, n): odd sizes (vector and tile tails everywhere), and SmolLM2's k_proj at rank 16
NATIVE_DIMS = [(77, 13, 50), (576, 16, 192)]
TRITON_DIMS = (77, 13, 50)
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-5, 2**-7), torch.float16: (1e-4, 2**-9)}  # atol, rtol


class LoraBatch(NamedTuple):
    x: torch.Tensor  # [T, in]
    a_stack: torch.Tensor  # [S, R, in]
    b_stack: torch.Tensor  # [S, n, R]
    seg_indptr: torch.Tensor  # [N + 1] int32
    seg_slots: torch.Tensor  # [N] int32


def make_batch(case: str, dims: tuple[int, int, int], dtype: torch.dtype, gen: torch.Generator) -> LoraBatch:
    """Fresh random inputs scaled so that y and the delta are of order 1."""
    lens, slots = CASES[case]
    in_dim, rank, n = dims
    device = gen.device
    bounds = [0]
    for length in lens:
        bounds.append(bounds[-1] + length)
    x = torch.randn(bounds[-1], in_dim, generator=gen, device=device).to(dtype)
    a_stack = (torch.randn(NUM_SLOTS, rank, in_dim, generator=gen, device=device) / in_dim**0.5).to(dtype)
    b_stack = (torch.randn(NUM_SLOTS, n, rank, generator=gen, device=device) / rank**0.5).to(dtype)
    return LoraBatch(x, a_stack, b_stack, torch.tensor(bounds, dtype=torch.int32, device=device),
                     torch.tensor(slots, dtype=torch.int32, device=device))


@pytest.fixture
def cpu_gen(request: pytest.FixtureRequest) -> torch.Generator:
    """The native kernels' inputs: fresh in every case, the same on every run."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="module", autouse=True)
def _built():
    assert cpu_lora.available(default_cache_dir()), "the native LoRA kernels did not build (is gcc installed?)"


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)
    if dtype != torch.float32 and not got.is_cuda and got.numel() >= 1000:
        # Rounded to nearest from nearly equal float32 sums: an ulp apart only now and then (truncation
        # would differ in about half of them).
        assert (got != want).float().mean() < 0.02


def expand_both(batch: LoraBatch, y: torch.Tensor, offset: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A random out with room on both sides of the delta's columns, and its copy for the reference."""
    n = batch.b_stack.shape[1]
    out = torch.randn(batch.x.shape[0], offset + n + 3, generator=gen, device=gen.device).to(batch.x.dtype)
    return out, out.clone()


# --- native ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dims", NATIVE_DIMS, ids=str)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "bf16-weights"])
@pytest.mark.parametrize("b_layout", ["row-major", "transposed"])
def test_native_kernels_equal_the_reference(case, dims, dtype, b_layout, isa, cpu_gen):
    if dtype == "bf16-weights":  # float32 activations over bfloat16 slots, as `--dtype auto` keeps them
        dtype = torch.float32
        batch = make_batch(case, dims, dtype, cpu_gen)
        batch = batch._replace(a_stack=batch.a_stack.bfloat16(), b_stack=batch.b_stack.bfloat16())
    else:
        batch = make_batch(case, dims, dtype, cpu_gen)
    if b_layout == "transposed":  # the worker's layout on the CPU: each slot's B as R rows of n
        batch = batch._replace(b_stack=batch.b_stack.transpose(1, 2).contiguous().transpose(1, 2))
        assert cpu_lora.transposed(batch.b_stack)
    lib = cpu_lora.variant(isa, default_cache_dir())
    want_y = lora_shrink_ref(batch.x, batch.a_stack, batch.seg_indptr, batch.seg_slots)
    y = torch.full_like(want_y, float("nan"))  # every row must be written, slot -1 rows with zeros
    assert cpu_lora.lora_shrink(y, batch.x, batch.a_stack, batch.seg_indptr, batch.seg_slots, lib=lib)
    assert_close(y, want_y, torch.float32)
    assert torch.equal(y[want_y.abs().sum(1) == 0], want_y[want_y.abs().sum(1) == 0])  # exact zeros

    offset = 5
    out, want = expand_both(batch, want_y, offset, cpu_gen)
    n = batch.b_stack.shape[1]
    assert cpu_lora.lora_expand(out[:, offset:offset + n], want_y, batch.b_stack, batch.seg_indptr,
                                batch.seg_slots, lib=lib)
    lora_expand_ref(want, want_y, batch.b_stack, batch.seg_indptr, batch.seg_slots, offset)
    assert_close(out, want, dtype)
    touched = torch.zeros_like(out, dtype=torch.bool)
    for i, slot in enumerate(batch.seg_slots.tolist()):
        if slot >= 0:
            touched[batch.seg_indptr[i]:batch.seg_indptr[i + 1], offset:offset + n] = True
    assert torch.equal(out[~touched], want[~touched])  # other columns, and slot -1 rows, untouched


def test_the_served_build_is_what_auto_takes_on_the_cpu(cpu_gen):
    batch = make_batch("mixed", NATIVE_DIMS[1], torch.bfloat16, cpu_gen)
    y = lora.lora_shrink(batch.x, batch.a_stack, batch.seg_indptr, batch.seg_slots)
    want_y = torch.empty_like(y)
    assert cpu_lora.lora_shrink(want_y, batch.x, batch.a_stack, batch.seg_indptr, batch.seg_slots,
                                lib=cpu_lora.variant("native", default_cache_dir()))
    assert torch.equal(y, want_y)
    assert_close(y, lora.lora_shrink(*batch[:2], *batch[3:], backend="torch"), torch.float32)


# --- Triton ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_kernels_equal_the_reference(case, dtype, gen):
    batch = make_batch(case, TRITON_DIMS, dtype, gen)
    y = lora.lora_shrink(batch.x, batch.a_stack, batch.seg_indptr, batch.seg_slots, backend="triton")
    want_y = lora_shrink_ref(batch.x, batch.a_stack, batch.seg_indptr, batch.seg_slots)
    assert_close(y, want_y, torch.float32 if dtype == torch.float32 or not y.is_cuda else torch.bfloat16)
    out, want = expand_both(batch, want_y, 7, gen)
    lora.lora_expand_(out, want_y, batch.b_stack, batch.seg_indptr, batch.seg_slots, 7, backend="triton")
    lora_expand_ref(want, want_y, batch.b_stack, batch.seg_indptr, batch.seg_slots, 7)
    assert_close(out, want, dtype)


# --- both ------------------------------------------------------------------------------------------

BACKENDS = ["native", "triton"]


def backend_gen(backend: str, cpu_gen: torch.Generator, gen: torch.Generator) -> torch.Generator:
    return cpu_gen if backend == "native" else gen


@pytest.mark.parametrize("backend", BACKENDS)
def test_zeros_beyond_an_adapters_rank_change_nothing(backend, cpu_gen, gen):
    """Slots are padded to the max rank: an adapter of rank 5 in a rank-16 stack gives its rank-5 result."""
    batch = make_batch("mixed", (77, 5, 50), torch.float32, backend_gen(backend, cpu_gen, gen))
    padded_a = torch.nn.functional.pad(batch.a_stack, (0, 0, 0, 11))  # [S, 16, in]
    padded_b = torch.nn.functional.pad(batch.b_stack, (0, 11))  # [S, n, 16]
    args = (batch.seg_indptr, batch.seg_slots)
    y = lora.lora_shrink(batch.x, batch.a_stack, *args, backend=backend)
    padded_y = lora.lora_shrink(batch.x, padded_a, *args, backend=backend)
    assert torch.equal(padded_y[:, :5], y) and not padded_y[:, 5:].any()
    out = torch.randn(batch.x.shape[0], 50, generator=gen, device=gen.device).to(batch.x.device)
    padded_out = out.clone()
    lora.lora_expand_(out, y, batch.b_stack, *args, 0, backend=backend)
    lora.lora_expand_(padded_out, padded_y, padded_b, *args, 0, backend=backend)
    assert torch.equal(padded_out, out)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_merged_layer_expands_each_slice_at_its_offset(backend, cpu_gen, gen):
    """qkv: one shrink over the slices' A stacks concatenated along R, each slice expanded from its
    columns of y (a strided view) into its columns of the merged output."""
    g, dtype = backend_gen(backend, cpu_gen, gen), torch.bfloat16
    slices = [make_batch("mixed", (77, 8, n), dtype, g) for n in (48, 16, 16)]
    x, indptr, slots = slices[0].x, slices[0].seg_indptr, slices[0].seg_slots
    merged_a = torch.cat([s.a_stack for s in slices], dim=1)  # [S, 24, in]
    y = lora.lora_shrink(x, merged_a, indptr, slots, backend=backend)
    out = torch.randn(x.shape[0], 80, generator=g, device=g.device).to(dtype)
    want = out.clone()
    offset = 0
    for i, s in enumerate(slices):
        lora.lora_expand_(out, y[:, 8 * i:8 * (i + 1)], s.b_stack, indptr, slots, offset, backend=backend)
        want_y = lora_shrink_ref(x, s.a_stack, indptr, slots)
        lora_expand_ref(want, want_y, s.b_stack, indptr, slots, offset)
        offset += s.b_stack.shape[1]
    assert_close(out, want, dtype)


def bad_calls(x, a, b, indptr, slots):
    """(error message fragment, call) for each bad argument."""
    out, y = torch.zeros(x.shape[0], 60, dtype=x.dtype), torch.zeros(x.shape[0], a.shape[1])

    def expand(**kw):
        args = {"out": out, "y": y, "b_stack": b, "seg_indptr": indptr, "seg_slots": slots, "out_offset": 0}
        return lambda backend: lora.lora_expand_(**{**args, **kw}, backend=backend)

    def shrink(**kw):
        args = {"x": x, "a_stack": a, "seg_indptr": indptr, "seg_slots": slots}
        return lambda backend: lora.lora_shrink(**{**args, **kw}, backend=backend)

    ind = indptr.tolist()
    return [
        ("x must be", shrink(x=x[0])),
        ("a_stack must be", shrink(a_stack=a[:, :, 1:])),
        ("a_stack must be of x's dtype", shrink(a_stack=a.double())),
        ("seg_slots must be a contiguous", shrink(seg_slots=slots.long())),
        ("seg_indptr must be a contiguous", shrink(seg_indptr=indptr[:-1])),
        ("seg_indptr must be a contiguous", shrink(seg_indptr=indptr.long())),
        ("from 0 to the", shrink(seg_indptr=torch.tensor([1, *ind[1:]], dtype=torch.int32))),
        ("from 0 to the", shrink(seg_indptr=torch.tensor([*ind[:-1], ind[-1] + 1], dtype=torch.int32))),
        ("must not decrease", shrink(seg_indptr=torch.tensor([0, 9, 2, *ind[3:]], dtype=torch.int32))),
        ("must not decrease", expand(seg_indptr=torch.tensor([0, 9, 2, *ind[3:]], dtype=torch.int32))),
        ("below the 4 slots, got 4", shrink(seg_slots=torch.tensor([0, 4, 1, 2, 0, 1], dtype=torch.int32))),
        ("below the 4 slots, got -2", expand(seg_slots=torch.tensor([0, -2, 1, 2, 0, 1], dtype=torch.int32))),
        ("out_offset 11 \\+ n 50", expand(out_offset=11)),
        ("out_offset -1", expand(out_offset=-1)),
        ("b_stack must be", expand(b_stack=b[:, :, 1:])),
        ("b_stack must be of out's dtype", expand(b_stack=b.double())),
        ("y has 52 rows and out 53", expand(y=y[1:], out=out)),
        ("y must be float32 or", expand(y=y.double())),
        ("out must be", expand(out=out.t())),
        ("backend must be one of", lambda backend: lora.lora_shrink(x, a, indptr, slots, backend="cuda")),
    ]


@pytest.mark.parametrize("backend", ["native", "triton", "torch"])
def test_bad_arguments_raise_value_errors_naming_them(backend, cpu_gen):
    batch = make_batch("mixed", (77, 13, 50), torch.float32, cpu_gen)
    for match, call in bad_calls(batch.x, batch.a_stack, batch.b_stack, batch.seg_indptr, batch.seg_slots):
        with pytest.raises(ValueError, match=match):
            call(backend)
    with pytest.raises(ValueError, match="x must be one of"):
        lora.lora_shrink(batch.x.double(), batch.a_stack.double(), batch.seg_indptr, batch.seg_slots,
                         backend="native")


def test_the_avx512_build_compiles_and_loads_on_any_x86_host():
    # Its kernels run where the CPU has AVX-512 (there the native build is this path and the tests above
    # run it); elsewhere the source must still compile.
    if not native.cpu_has("avx2"):
        pytest.skip("not an x86-64 host with AVX2: -march=x86-64-v4 is x86's")
    lib = cpu_lora._declare(native.load(cpu_lora._NAME, (*cpu_lora._BASE_FLAGS, "-march=x86-64-v4"),
                                        default_cache_dir()))
    assert cpu_lora.isa(lib) == 512
