"""The two opaque ops of the compiled forward: a (prepacked) linear and one layer's attention.

torch.compile traces the dense per-token part of the forward (norms, rotary, MLP activations,
residuals) into fused C++ kernels, but two things must stay as they are:

- `carousel::linear(x, weight, bias)`: the matmul through our `Linear` for that weight
  (layers/linear.py: oneDNN-prepacked where that pays, `F.linear` elsewhere). A prepacked weight is
  an opaque oneDNN tensor that the compiler cannot trace, and Inductor would otherwise emit a
  plain `mm` that re-packs bf16 weights on every call.
- `carousel::attention(q, k, v, layer)`: the attention backend's `write_kv` + `attend`, with
  the step's metadata taken from the forward context (`forward_context`), so the compiled
  graph never depends on how a batch splits into prefills and decodes.

NOTE: `carousel::attention` writes the KV cache, which the graph never reads otherwise; it
is declared without mutated arguments, like vLLM's `unified_attention`. It is never dropped
(its output is used) and runs in program order.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from backends.torch.layers.linear import Linear

_linears: weakref.WeakValueDictionary[int, Linear] = weakref.WeakValueDictionary()


def register_linear(linear: Linear) -> None:
    """Route `carousel::linear` calls on `linear.weight` through `linear`."""
    _linears[linear.weight.data_ptr()] = linear


def _linear_for(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    linear = _linears.get(weight.data_ptr())
    if linear is None or linear.weight.shape != weight.shape or linear.weight.dtype != weight.dtype:
        return Linear(weight, bias)  # not registered: plain F.linear
    return linear


@torch.library.custom_op("carousel::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ weight.T + bias` through the registered `Linear` of `weight`."""
    return _linear_for(weight, bias)(x)


@linear.register_fake
def _linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


class _Context(threading.local):
    backend: Any = None
    meta: Any = None


_context = _Context()


@contextlib.contextmanager
def forward_context(backend: Any, meta: Any) -> Iterator[None]:
    """Make `backend` and this step's `meta` what `carousel::attention` uses, for one forward."""
    previous = (_context.backend, _context.meta)
    _context.backend, _context.meta = backend, meta
    try:
        yield
    finally:
        _context.backend, _context.meta = previous


@torch.library.custom_op("carousel::attention", mutates_args=())
def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor
) -> torch.Tensor:
    """Layer `layer`'s attention by the current forward context's backend (N, nh, hd).

    NOTE: `layer` is a 0-d tensor, not an int, so one compiled graph serves every layer
    (an int argument would be specialised on).
    """
    backend, meta = _context.backend, _context.meta
    if backend is None:
        raise RuntimeError("carousel::attention called outside forward_context")
    index = int(layer)
    backend.write_kv(index, k, v, meta)
    out: torch.Tensor = backend.attend(index, q, k, v, meta)
    return out


@attention.register_fake
def _attention_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor
) -> torch.Tensor:
    return q.new_empty(q.shape)
