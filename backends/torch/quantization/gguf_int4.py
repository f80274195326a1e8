"""A GGUF file's own 4-bit blocks as torch's int4 layout: `w = (q - 8) * scale + zero`.

torch's weight-only int4 kernels (`_weight_int4pack_mm_for_cpu`, and `_weight_int4pack_mm` on
CUDA) compute each weight of a group of 32 along K and one output channel as
`(q - 8) * scale + zero`, q in [0, 15]. llama.cpp's 4-bit blocks are exactly of that form:

- Q4_0 (`w = d (q - 8)`): scale = d, zero = 0;
- Q4_1 (`w = d q + m`): scale = d, zero = m + 8 d;
- Q4_K (super-blocks of 256: eight sub-blocks of 32 with 6-bit sub-scales `sc` and mins `mn`,
  `w = d sc q - dmin mn`): scale = d sc, zero = 8 d sc - dmin mn.

So the file's 4 bits are served as they are, nothing requantised. Other block types (Q8_0,
Q6_K, ...) do not fit and stay with the dequantised (bf16) model. The blocks are read once
with the `gguf` package (llama.cpp's own reader) and cached beside the converted model
(`INT4_FILE`), so later starts read one safetensors file.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from backends.torch.models import ArchitectureFamily, family_of_gguf

GROUP_SIZE = 32  # weights per (scale, zero) along K: a Q4_0/Q4_1 block, a Q4_K sub-block
INT4_FILE = "gguf_int4.safetensors"  # beside the converted model's own files


@dataclass(frozen=True)
class Int4Blocks:
    """An (N, K) weight as 4-bit codes with a scale and zero per group of 32 along K."""

    qweight: torch.Tensor  # (N, K) uint8 in [0, 15]
    scale: torch.Tensor  # (N, K / 32) fp32
    zero: torch.Tensor  # (N, K / 32) fp32

    def dequantize(self) -> torch.Tensor:
        """The (N, K) fp32 weight these blocks stand for."""
        n, k = self.qweight.shape
        q = self.qweight.float().view(n, k // GROUP_SIZE, GROUP_SIZE)  # (N, G, 32)
        w = (q - 8) * self.scale[..., None] + self.zero[..., None]
        return w.view(n, k)

    def rows(self, index: torch.Tensor) -> Int4Blocks:
        """These blocks with their output channels (rows) reordered by `index`."""
        return Int4Blocks(self.qweight[index], self.scale[index], self.zero[index])

    @staticmethod
    def cat(parts: list[Int4Blocks]) -> Int4Blocks:
        """The blocks of the weight made of `parts`' rows one after another (fused QKV)."""
        return Int4Blocks(
            torch.cat([p.qweight for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.zero for p in parts]),
        )


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 fields (nb, 2) bytes -> (nb,) fp32."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[:, 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(nb, 16) bytes -> (nb, 32) codes: llama.cpp stores element j in byte j's low nibble
    and element j + 16 in its high one."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(blocks[:, :2])
    return _nibbles(blocks[:, 2:]), d, np.zeros_like(d)


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    return _nibbles(blocks[:, 4:]), d, m + 8 * d


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    from gguf.quants import Q4_K

    nb = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2])[:, None], _f16(blocks[:, 2:4])[:, None]
    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))  # (nb, 8) each
    qs = blocks[:, 16:].reshape(nb, 4, 1, 32)  # 4 chunks of 64: low nibbles, then high ones
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(nb * 8, GROUP_SIZE)
    scale = d * sc.astype(np.float32)
    zero = 8 * scale - dmin * mn.astype(np.float32)
    return q, scale.reshape(-1), zero.reshape(-1)


#: ggml type name -> (bytes per block, its (codes, scale, zero) per group of 32)
_DECODERS: dict[str, tuple[int, Any]] = {
    "Q4_0": (18, _q4_0),
    "Q4_1": (20, _q4_1),
    "Q4_K": (144, _q4_k),
}
INT4_TYPES = frozenset(_DECODERS)


def int4_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> Int4Blocks:
    """The (N, K) weight `shape` stored as ggml `type_name` blocks `raw` (uint8, row-major)."""
    block_bytes, decode = _DECODERS[type_name]
    n, k = shape
    q, scale, zero = decode(np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, block_bytes))
    return Int4Blocks(
        torch.from_numpy(np.ascontiguousarray(q, dtype=np.uint8)).view(n, k),
        torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32)).view(n, k // GROUP_SIZE),
        torch.from_numpy(np.ascontiguousarray(zero, dtype=np.float32)).view(n, k // GROUP_SIZE),
    )


def hf_name(gguf_name: str, family: ArchitectureFamily) -> str | None:
    """The HF module a GGUF weight becomes (`blk.3.attn_q.weight` -> the family's name for
    layer 3's Q projection), or None for a tensor with no linear of ours."""
    parts = gguf_name.removesuffix(".weight").split(".")
    if len(parts) == 3 and parts[0] == "blk":
        return family.gguf_hf_name(int(parts[1]), parts[2])
    return family.gguf_top_names.get(parts[0]) if len(parts) == 1 else None


def unpermute_rows(num_rows: int, num_heads: int) -> torch.Tensor:
    """The row order undoing llama.cpp's rotary permutation of Llama's Q/K weights.

    convert_hf_to_gguf.py interleaves each head's two rotary halves; transformers undoes it
    when it loads the GGUF (`_reverse_permute_weights`). The permutation moves whole output
    rows, so it moves the int4 codes, scales and zeros of a row alike.
    """
    dim = num_rows // num_heads // 2
    return torch.arange(num_rows).view(num_heads, dim, 2).transpose(1, 2).reshape(num_rows)


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def read_int4(gguf_path: Path) -> dict[str, Int4Blocks]:
    """Every Q4_0 / Q4_1 / Q4_K weight of the file, by HF module name, in HF's row order."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    arch = _field(reader, "general.architecture")
    family = family_of_gguf(str(arch))
    if family is None:
        return {}
    permuted = family.gguf_rotary_permuted.get(str(arch), ())
    heads = _field(reader, f"{arch}.attention.head_count")
    kv_heads = _field(reader, f"{arch}.attention.head_count_kv") or heads
    out: dict[str, Int4Blocks] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name, family)
        if name is None or tensor.tensor_type.name not in INT4_TYPES:
            continue
        k, n = (int(d) for d in tensor.shape)  # ggml lists the fastest dimension first
        blocks = int4_blocks(np.asarray(tensor.data), tensor.tensor_type.name, (n, k))
        kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
        if kind in permuted and heads:
            num_heads = heads if kind == permuted[0] else kv_heads  # Q's rows, then K's
            blocks = blocks.rows(unpermute_rows(n, int(num_heads)))
        out[name] = blocks
    return out


def save_int4(blocks: dict[str, Int4Blocks], path: Path) -> None:
    """Write `blocks` to `path` atomically (two codes per byte on disk)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name, b in blocks.items():
        tensors[f"{name}.qweight"] = b.qweight[:, ::2] | (b.qweight[:, 1::2] << 4)  # (N, K/2)
        tensors[f"{name}.scale"] = b.scale.contiguous()
        tensors[f"{name}.zero"] = b.zero.contiguous()
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    os.close(handle)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_int4(path: Path) -> dict[str, Int4Blocks]:
    """What `save_int4` wrote."""
    from safetensors.torch import load_file

    tensors = load_file(path)
    names = {key.rsplit(".", 1)[0] for key in tensors}
    out = {}
    for name in sorted(names):
        packed = tensors[f"{name}.qweight"]  # (N, K/2)
        q = torch.stack([packed & 0x0F, packed >> 4], dim=-1).view(packed.shape[0], -1)
        out[name] = Int4Blocks(q, tensors[f"{name}.scale"], tensors[f"{name}.zero"])
    return out
