"""Load one rank's shard of a Hugging Face checkpoint, and nothing more, from safetensors.

The rank's model is the HF class built from its local config (sizes.py), so every module
already has its shard's shape; its parameters are then read with `safe_open(...).get_slice`
(only the rows or columns this rank owns leave the file), cut by the model family's rules
(models/, `tp_rules` and `tp_replicated`; the Llama family's):

- column-parallel (rows of the weight): the Q projection by query heads, K and V by KV heads
  (replicated when there are more ranks than KV heads), gate and up by intermediate rows, the
  embedding and the LM head by vocabulary rows;
- row-parallel (columns of the weight): the output projection by query heads, down by
  intermediate columns; their biases (if any) are kept whole and added on rank 0 only
  (layers.py);
- replicated: every norm (input/post-attention, final, Qwen3's per-head Q/K norms).

The generic path's loader (generic_shard.py) cuts by the model's own `base_model_tp_plan`
(tp_plan.py) through the same `read_shard`, `empty_model` and `finish_shard`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from backends.torch.models import ArchitectureFamily, architecture_of, family_of
from backends.torch.parallel.sizes import ModelDims, ShardPlan

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_PER_HEAD = ("q_heads", "kv_heads")


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Which safetensors file holds each tensor of the checkpoint in `model_dir`."""
    index = model_dir / _INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    with safe_open(str(model_dir / _SINGLE), "pt") as f:
        return {name: model_dir / _SINGLE for name in f.keys()}  # noqa: SIM118 - not a dict


#: a rank's part of a checkpoint tensor: (name, whole shape) -> (dim, index range), None: whole
Cut = Callable[[str, list[int]], "tuple[int, range] | None"]


def shard_range(name: str, plan: ShardPlan, family: ArchitectureFamily) -> tuple[int, range] | None:
    """(dim, index range) of `name` this rank holds, None for a replicated tensor (by the
    family's rules, models/)."""
    for pattern, dim, part in family.tp_rules:
        if pattern.search(name):
            heads: range = getattr(plan, part)
            if part not in _PER_HEAD:
                return dim, heads
            hd = plan.dims.head_dim
            return dim, range(heads.start * hd, heads.stop * hd)
    if family.tp_replicated.search(name):
        return None
    raise ValueError(f"no tensor-parallel rule for the parameter {name!r}")


def read_shard(
    files: dict[str, Path],
    names: list[str],
    cut: Cut,
    dtype: torch.dtype,
    device: str,
) -> dict[str, torch.Tensor]:
    """This rank's slice (`cut`) of each tensor in `names`, read from `files` (by name)."""
    out: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    for path, file_names in by_file.items():
        with safe_open(str(path), "pt", device=device) as f:
            for name in file_names:
                view = f.get_slice(name)
                part = cut(name, list(view.get_shape()))
                if part is None:
                    tensor = view[:]
                elif part[0] == 0:
                    tensor = view[part[1].start : part[1].stop]
                else:
                    tensor = view[:, part[1].start : part[1].stop]
                out[name] = tensor.to(dtype).contiguous()
    return out


def empty_model(local_config: Any, dtype: torch.dtype) -> Any:
    """The HF causal LM of `local_config`: parameters on the meta device, buffers real."""
    with init_empty_weights():  # NOTE: parameters on the meta device, buffers (rotary) real
        return AutoModelForCausalLM.from_config(local_config, dtype=dtype)


def tied_head(config: Any, files: dict[str, Path]) -> bool:
    """Whether the LM head is the embedding (tied, and not stored apart)."""
    return bool(getattr(config, "tie_word_embeddings", False)) and "lm_head.weight" not in files


def load_shard(
    model_dir: str | Path, plan: ShardPlan, dtype: torch.dtype, device: str = "cpu"
) -> PreTrainedModel:
    """The HF causal LM of rank `plan.rank`: local sizes, its own slices of the weights."""
    model_dir = Path(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    if ModelDims.of(config) != plan.dims:
        raise ValueError(f"{model_dir} does not have the dimensions the shard plan was made for")
    model = empty_model(plan.local_config(config), dtype)
    files = weight_files(model_dir)
    tied = tied_head(config, files)
    names = [n for n in model.state_dict() if not (tied and n == "lm_head.weight")]
    missing = [n for n in names if n not in files]
    if missing:
        raise ValueError(f"{model_dir} lacks the tensors {missing[:4]}")
    family = family_of(architecture_of(config))
    tensors = read_shard(files, names, lambda n, _: shard_range(n, plan, family), dtype, device)
    model.load_state_dict(tensors, strict=False, assign=True)
    return finish_shard(model, model_dir, tied, device)


def finish_shard(model: Any, model_dir: Path, tied: bool, device: str) -> PreTrainedModel:
    """`model` with its LM head tied (`tied`), on `device`, its generation config read, in
    eval mode (ValueError where a parameter was left unset)."""
    if tied:  # the same vocabulary rows serve the embedding and the LM head
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    model.to(device)  # the rotary buffers
    if (model_dir / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if still_meta:
        raise ValueError(f"shard loading left parameters unset: {still_meta[:4]}")
    return model.eval()  # type: ignore[no-any-return]
