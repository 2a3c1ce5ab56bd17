"""The fused CPU ops against the torch code they replace: RoPE and the KV write bit-exact in every
dtype (float32 outputs must stay token-identical to transformers), bfloat16 and float16 RMSNorm within
one rounding step of their type and float32 RMSNorm within a few ulps (only their sums' order
differs); in every build this CPU can run (the `isa` fixture: native, AVX2 + FMA, scalar;
AVX-512 emulated where the CPU lacks it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvmesh_kernels import cpu_fused_ops, native
from services.common.config import default_cache_dir
from services.worker.layers.activation import GeluTanhAndMul
from services.worker.layers.rmsnorm import RMSNorm
from services.worker.layers.rotary_embedding import apply_rotary, split_and_rotate_qkv

N, H, HKV, D = 37, 6, 2, 64
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# One unit in the last place of a half type's significand, relative (bfloat16: 8 bits, float16: 11).
HALF_ULP = {torch.bfloat16: 2**-7, torch.float16: 2**-10}


@pytest.fixture(autouse=True)
def _need_compiler():
    assert cpu_fused_ops.available(default_cache_dir()), "the fused CPU ops did not build (is gcc installed?)"


def cos_sin(dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    positions = torch.randint(0, 4096, (N,), generator=gen)
    freqs = torch.outer(positions.float(), 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D))
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_equals_the_torch_rotation_bit_for_bit(dtype, isa):
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(N, (H + 2 * HKV) * D, generator=gen).to(dtype)
    cs = cos_sin(dtype, gen)
    cos, sin = cs.unsqueeze(1).chunk(2, dim=-1)
    want_q = apply_rotary(qkv[:, : H * D].reshape(N, H, D), cos, sin)
    want_k = apply_rotary(qkv[:, H * D : (H + HKV) * D].reshape(N, HKV, D), cos, sin)
    want_v = qkv[:, (H + HKV) * D :].clone()
    cpu_fused_ops.rope_inplace(qkv, cs, H + HKV, D, lib=cpu_fused_ops.variant(isa, default_cache_dir()))
    q, k, v = qkv.split([H * D, HKV * D, HKV * D], dim=-1)
    assert torch.equal(q.view(N, H, D), want_q) and torch.equal(k.view(N, HKV, D), want_k)
    assert torch.equal(v, want_v)


def test_float16_rope_rounds_as_torch_into_subnormals_and_overflow(isa):
    # Magnitudes from 2^-26 to 2^15: products below float16's smallest normal (2^-14) round into its
    # subnormals, sums past 65504 round to infinity; every value bit for bit torch's (the scalar
    # build's conversions are the portable C ones).
    gen = torch.Generator().manual_seed(8)
    scale = 2.0 ** torch.randint(-26, 15, (N, (H + 2 * HKV) * D), generator=gen)
    qkv = (torch.randn(N, (H + 2 * HKV) * D, generator=gen).clamp(-1.99, 1.99) * scale).half()
    cs = cos_sin(torch.float16, gen)
    qkv[0, [0, D // 2]] = torch.tensor([60000.0, -60000.0], dtype=torch.float16)
    cs[0, [0, D // 2]] = 0.7071  # token 0's first pair: 60000 (cos + sin) overflows
    cos, sin = cs.unsqueeze(1).chunk(2, dim=-1)
    want_q = apply_rotary(qkv[:, : H * D].reshape(N, H, D), cos, sin)
    assert want_q.isinf().any() and (want_q.abs() < 2**-14).logical_and(want_q != 0).any()
    cpu_fused_ops.rope_inplace(qkv, cs, H + HKV, D, lib=cpu_fused_ops.variant(isa, default_cache_dir()))
    assert torch.equal(qkv[:, : H * D].reshape(N, H, D).view(torch.int16), want_q.view(torch.int16))


def test_the_layer_rotates_q_and_k_with_the_served_build():
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(N, (H + 2 * HKV) * D, generator=gen)
    cs = cos_sin(torch.float32, gen)
    cos, sin = cs.unsqueeze(1).chunk(2, dim=-1)
    want_q = apply_rotary(qkv[:, : H * D].reshape(N, H, D), cos, sin)
    q, _, _ = split_and_rotate_qkv(qkv, cs, H, HKV, D)
    assert torch.equal(q, want_q)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_write_equals_index_copy_and_skips_padding(dtype, isa):
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(N, (H + 2 * HKV) * D, generator=gen).to(dtype)
    k = qkv[:, H * D : (H + HKV) * D].view(N, HKV, D)  # strided rows, as the model passes them
    v = qkv[:, (H + HKV) * D :].view(N, HKV, D)
    slots = torch.randperm(8 * 16, generator=gen)[:N]
    slots[[3, 10]] = -1
    k_cache, v_cache = torch.full((2, 8, 16, HKV, D), 7.0, dtype=dtype).unbind(0)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    valid = slots >= 0
    want_k.view(-1, HKV, D).index_copy_(0, slots[valid], k[valid])
    want_v.view(-1, HKV, D).index_copy_(0, slots[valid], v[valid])
    cpu_fused_ops.kv_write(k_cache, v_cache, k, v, slots, lib=cpu_fused_ops.variant(isa, default_cache_dir()))
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize("dtype", list(HALF_ULP))
def test_half_rms_norm_matches_the_reference_rounding(dtype, isa):
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(N, 576, generator=gen) * 3).to(dtype)
    weight = (torch.randn(576, generator=gen) * 0.1 + 1).to(dtype)
    want = weight * F.rms_norm(x.float(), (576,), None, 1e-5).to(dtype)
    got = cpu_fused_ops.rms_norm(x, weight, 1e-5, lib=cpu_fused_ops.variant(isa, default_cache_dir()))
    torch.testing.assert_close(got, want, atol=0, rtol=HALF_ULP[dtype])  # one ulp at most
    assert (got != want).float().mean() < 0.01


def test_f32_rms_norm_matches_transformers_within_summation_order(isa):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(N, 576, generator=gen) * 3
    weight = torch.randn(576, generator=gen) * 0.1 + 1
    want = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))  # LlamaRMSNorm
    got = cpu_fused_ops.rms_norm(x, weight, 1e-5, lib=cpu_fused_ops.variant(isa, default_cache_dir()))
    torch.testing.assert_close(got, want, atol=0, rtol=4e-7)  # a few float32 ulps


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_is_the_residual_add_then_the_norm(dtype, isa):
    gen = torch.Generator().manual_seed(5)
    x, residual = (torch.randn(2, N, 576, generator=gen) * 3).to(dtype)
    weight = (torch.randn(576, generator=gen) * 0.1 + 1).to(dtype)
    lib = cpu_fused_ops.variant(isa, default_cache_dir())
    out, new_residual = cpu_fused_ops.add_rms_norm(x, residual, weight, 1e-5, lib=lib)
    assert torch.equal(new_residual, x + residual)  # the add rounds as torch's
    assert torch.equal(out, cpu_fused_ops.rms_norm(x + residual, weight, 1e-5, lib=lib))
    # The layer's torch path (off the CPU, or without a compiler) gives the same within the sum's order.
    norm = RMSNorm(576, 1e-5, dtype)
    norm.weight.data.copy_(weight)
    want_out, want_residual = norm._norm(x + residual), x + residual
    torch.testing.assert_close(out, want_out, atol=0, rtol=HALF_ULP.get(dtype, 4e-7))
    assert torch.equal(new_residual, want_residual)


def test_silu_and_mul_is_torchs_within_16_ulps_over_the_whole_range(isa):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(N, 2 * 1536, generator=gen) * 6
    x[0, :8] = torch.tensor([-200.0, -88.0, -87.0, -1e-4, 0.0, 1e-4, 88.0, 200.0])  # e^-g under/overflows
    got = cpu_fused_ops.silu_and_mul(x, lib=cpu_fused_ops.variant(isa, default_cache_dir()))
    gate, up = x.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(got, want, atol=1e-37, rtol=16 * torch.finfo(torch.float32).eps)


def test_gelu_tanh_and_mul_is_the_exact_function_within_32_ulps_and_close_to_torchs(isa):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(N, 2 * 1152, generator=gen) * 6
    x[0, :8] = torch.tensor([-200.0, -88.0, -10.0, -1e-4, 0.0, 1e-4, 88.0, 200.0])  # e^-z under/overflows
    got = cpu_fused_ops.gelu_tanh_and_mul(x, lib=cpu_fused_ops.variant(isa, default_cache_dir()))
    gate, up = x.double().chunk(2, dim=-1)
    exact = 0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3))) * up
    # Far below zero the output is tiny and e^-z's argument large: its absolute error stays under 1e-9.
    torch.testing.assert_close(got.double(), exact, atol=1e-9, rtol=32 * torch.finfo(torch.float32).eps)
    # torch's 1 + tanh cancels for negative gates: it is the one further from the exact value.
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(got, F.gelu(gate, approximate="tanh") * up, atol=3e-5, rtol=1e-5)
    assert torch.equal(GeluTanhAndMul()(x), cpu_fused_ops.gelu_tanh_and_mul(x))  # the layer calls the served build


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="int64"):
        k = torch.zeros(4, HKV, D)
        cpu_fused_ops.kv_write(torch.zeros(2, 16, HKV, D), torch.zeros(2, 16, HKV, D), k, k,
                               torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="of one dtype"):
        cpu_fused_ops.rms_norm(torch.zeros(2, 8), torch.zeros(8).bfloat16(), 1e-5)


def test_loading_the_native_kernels_leaves_subnormals_alone():
    """-ffast-math would link crtfastmath.o, which sets flush-to-zero for the whole process on load
    and silently changes every torch op's results near zero (and trips Hypothesis)."""
    from kvmesh_kernels import cpu_paged_attention

    cpu_paged_attention.build(default_cache_dir())
    assert cpu_fused_ops.available(default_cache_dir())
    tiny = torch.tensor([1e-39], dtype=torch.float32)  # a float32 subnormal
    assert (tiny / 10).item() != 0.0 and (tiny * 1).item() != 0.0


def test_a_served_kernel_is_not_rebuilt_with_other_flags():
    """Variants come from `load`; `build` serves one set of flags per kernel and says so."""
    assert cpu_fused_ops.available(default_cache_dir())
    with pytest.raises(ValueError, match="other flags"):
        native.build("fused_ops", ("-O1",), default_cache_dir())
