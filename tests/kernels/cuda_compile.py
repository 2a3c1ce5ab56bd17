"""Compile every kernel for a CUDA target (sm_90, the H200's) without a GPU: Triton's compiler and
ptxas run on any machine. The interpreter runs kernel bodies as Python and accepts things the
compiler rejects (loop-carried variables changing type, scalar/tensor mix-ups, int64/int32
pointer arithmetic), so this catches what the CPU tests cannot.

    python -m tests.kernels.cuda_compile        # must run WITHOUT TRITON_INTERPRET set
"""

from __future__ import annotations

import inspect
import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
FLOAT_ARGS = {"scale", "soft_cap"}
I64_ARGS = {"stride_c_kv"}  # [2, num_blocks, ...]: the V half can start past 2**31 elements


def signature(kernel, pointers: dict[str, str], constexprs: dict[str, object]) -> tuple[dict, dict]:
    """Triton's signature for `kernel`: pointers typed as given, floats, ints (what the launcher
    passes), and the constexprs; also returns constexprs keyed by argument position."""
    names = list(inspect.signature(kernel.fn).parameters)
    sig, const = {}, {}
    for i, name in enumerate(names):
        if name in constexprs:
            sig[name] = "constexpr"
            const[(i,)] = constexprs[name]
        elif name.endswith("_ptr"):
            sig[name] = pointers[name]
        elif name in FLOAT_ARGS:
            sig[name] = "fp32"
        else:
            sig[name] = "i64" if name in I64_ARGS else "i32"
    return sig, const


def compile_kernel(kernel, pointers: dict[str, str], constexprs: dict[str, object]) -> None:
    sig, const = signature(kernel, pointers, constexprs)
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=const), target=TARGET)
    assert "cubin" in compiled.asm, f"{kernel.fn.__name__}: no cubin"
    print(f"{kernel.fn.__name__} {constexprs}: {compiled.metadata.shared} bytes shared memory")


def main() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("run without TRITON_INTERPRET: the kernels must be compiled, not interpreted")
    from kvmesh_kernels.paged_attention import TILE_N, _paged_attention_kernel, _split_kv_reduce_kernel
    from kvmesh_kernels.lora_triton import _lora_expand_kernel, _lora_shrink_kernel
    from kvmesh_kernels.reshape_and_cache import _reshape_and_cache_kernel

    # (dtype, num_splits, group, head_size, block_size, window, soft cap): each path and feature once.
    for dtype, splits, group, head_size, block_size, window, cap in (
        ("bf16", 1, 4, 128, 16, False, False),  # Llama-3-8B prefill or mixed batch
        ("fp16", 8, 4, 128, 16, False, False),  # Llama-3-8B small-batch decode
        ("fp32", 1, 3, 64, 32, True, True),  # SmolLM2-like heads, window and soft cap
        ("bf16", 3, 8, 64, 16, True, False),
    ):
        block_m = 64 if splits == 1 else 16
        pointers = {"out_ptr": f"*{dtype}", "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32",
                    "q_ptr": f"*{dtype}", "kv_cache_ptr": f"*{dtype}", "query_start_loc_ptr": "*i32",
                    "seq_lens_ptr": "*i32", "block_table_ptr": "*i32"}
        compile_kernel(_paged_attention_kernel, pointers, dict(
            GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_m // group, HEAD_SIZE=head_size, HEAD_PAD=head_size,
            BLOCK_SIZE=block_size, TILE_N=TILE_N, NUM_SPLITS=splits, USE_WINDOW=window, USE_SOFT_CAP=cap,
            DOT_FP32=False, DOT_PRECISION="ieee" if dtype == "fp32" else "tf32",
            num_reqs=1,  # what Triton may specialise a batch of one request to
        ))
    compile_kernel(_split_kv_reduce_kernel,
                   {"out_ptr": "*bf16", "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32",
                    "query_start_loc_ptr": "*i32"},
                   dict(HEAD_SIZE=128, HEAD_PAD=128, NUM_SPLITS=8, SPLITS_PAD=8))
    compile_kernel(_reshape_and_cache_kernel,
                   {"key_ptr": "*bf16", "value_ptr": "*bf16", "kv_cache_ptr": "*bf16", "slot_mapping_ptr": "*i64"},
                   dict(NUM_KV_HEADS=8, HEAD_SIZE=128, BLOCK_SIZE=16, BLOCK_T=4, HEADS_PAD=8, HEAD_PAD=128))
    # LoRA: a decode batch (16-row programs) in bfloat16 and a prefill (64-row programs) in float32.
    for dtype, block_m in (("bf16", 16), ("fp32", 64)):
        lora_pointers = {"y_ptr": "*fp32", "x_ptr": f"*{dtype}", "a_ptr": f"*{dtype}", "out_ptr": f"*{dtype}",
                         "b_ptr": f"*{dtype}", "seg_indptr_ptr": "*i32", "seg_slots_ptr": "*i32"}
        precision = "ieee" if dtype == "fp32" else "tf32"
        compile_kernel(_lora_shrink_kernel, lora_pointers, dict(
            BLOCK_M=block_m, BLOCK_N=16, BLOCK_K=128, DOT_FP32=False, DOT_PRECISION=precision))
        compile_kernel(_lora_expand_kernel, lora_pointers, dict(
            BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=16, DOT_PRECISION=precision, ROUND_BF16=False))

if __name__ == "__main__":
    main()
