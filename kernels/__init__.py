"""Triton kernels: block-sparse flash attention (all patterns), diffuser diffusion, decode attention.

CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set before this package is imported.
Tile configurations live in `kernels.tuning` (IMGGEN_AUTOTUNE=1 times them on CUDA); every one of
them is compiled for sm_90 without a GPU by `python -m imggen.kernels.aot_check --json`.
"""
from .decode import decode_attention, decode_attention_reference
from .sparse_ops import sparse_attention

__all__ = ["sparse_attention", "decode_attention", "decode_attention_reference"]
