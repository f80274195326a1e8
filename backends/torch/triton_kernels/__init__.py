"""Carousel's Triton kernels: the paged K/V store and the unified paged attention.

Imported only through `backends.torch.kernels.triton()`, never at module level elsewhere:
importing this package imports triton. Triton decides when a kernel is decorated whether it
compiles for the GPU or runs in its interpreter (`TRITON_INTERPRET=1`, numpy on the CPU),
so on a CPU these kernels run only if that variable was set before this package was first
imported; `interpreted()` says which way they were built.
"""

from __future__ import annotations

from backends.torch.triton_kernels.kv_store import store_kv
from backends.torch.triton_kernels.unified_attention import paged_attention, paged_attention_kernel

__all__ = ["interpreted", "paged_attention", "store_kv"]


def interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter (they then take CPU tensors)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(paged_attention_kernel, InterpretedFunction)
