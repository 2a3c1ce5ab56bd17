"""Where a kernel runs: compiled for a CUDA device, or on the CPU under Triton's interpreter.

`@triton.jit` decides between the two when the kernel's module is imported, from the environment
variable TRITON_INTERPRET: set it to 1 *before* importing `kvmesh_kernels.paged_attention` or
`kvmesh_kernels.reshape_and_cache` (tests/kernels/conftest.py does) and every launch runs in numpy on the
host, on CPU or CUDA tensors alike. That is also why `kvmesh_kernels/__init__.py` imports those modules
lazily: `import kvmesh_kernels` must not fix the choice.

One known gap of the interpreter (Triton 3.9): `tl.dot` on bfloat16 operands multiplies their raw
uint16 storage and returns garbage; loads, stores and casts of bfloat16 are right. The launchers
therefore ask the kernels to upcast bfloat16 dot operands to float32 when interpreted
(`dot_in_fp32`); compiled kernels use the tensor cores' bfloat16 dot as usual.
"""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction


def is_interpreted(kernel: object) -> bool:
    """Whether this `@triton.jit` kernel was built for the interpreter."""
    return isinstance(kernel, InterpretedFunction)


def dot_in_fp32(kernel: object, dtype: torch.dtype) -> bool:
    return is_interpreted(kernel) and dtype == torch.bfloat16


def check_device(kernel: object, *tensors: torch.Tensor) -> None:
    """All tensors on one device, and one this kernel can run on."""
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise ValueError(f"tensors on different devices: {device} and {t.device}")
    if device.type != "cuda" and not is_interpreted(kernel):
        raise RuntimeError(
            f"Triton kernels run on CUDA devices, not on {device}; on the CPU set TRITON_INTERPRET=1 before "
            "the kernels are imported (slow: for tests), or use the torch attention backend"
        )
