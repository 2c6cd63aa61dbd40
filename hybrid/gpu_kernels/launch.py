"""What the kernels share: block sizes, and the fp32 switch for Triton's interpreter.

On CUDA tensors the kernels are compiled by Triton. With TRITON_INTERPRET=1 set before Triton is first
imported (tests/conftest.py does so on machines without CUDA) the same source runs in Triton's interpreter on
CPU tensors: that is how CI checks the kernels against the torch reference. The interpreter (Triton 3.6)
computes bf16 arithmetic and bf16 dot products wrongly (NaN and garbage seen on the dev box), so kernels take
an `F32` flag: operands are widened to fp32 before any arithmetic and dot products run in IEEE fp32. On CUDA
it is set only for fp32 models (tensor-core dots on bf16 operands otherwise).
"""

from __future__ import annotations

import torch


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def wide_math(t: torch.Tensor) -> bool:
    """True where a kernel must widen operands to fp32 before dots: the interpreter, or fp32 data."""
    return not t.is_cuda or t.dtype == torch.float32
