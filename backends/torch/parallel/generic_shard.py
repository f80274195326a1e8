"""Load one rank's shard of a checkpoint for the generic path, cut by its TP plan (tp_plan.py).

The rank's model is the HF class built from the plan's local config. The weights of the modules
the plan splits (colwise, rowwise) are read by slice, as the native path reads its shards
(shard.py `read_shard`): only the rank's rows or columns leave the file. Every other tensor is
whole on every rank, so it is read whole, through transformers' own conversion of the
checkpoint's names and layouts (an MoE checkpoint stores each expert apart; transformers 5's
module holds them stacked), as `from_pretrained` converts them. A rowwise module's bias is kept
on rank 0 only (zeros elsewhere), so the all-reduce of the partial products holds it once.
Where the plan splits the LM head (tp_plan.py), the rank's head is a new `nn.Linear` over its
vocabulary rows: a view of the embedding's rows where the two are tied, else a copy of its rows
(the whole head freed). Where it splits the embedding too, the embedding keeps a copy of those
rows alone (the whole table freed), and a tied head is that copy.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import convert_and_load_state_dict_in_model
from transformers.modeling_utils import LoadStateDictConfig

from backends.torch.parallel.shard import (
    empty_model,
    finish_shard,
    read_shard,
    tied_head,
    weight_files,
)
from backends.torch.parallel.tp_plan import GenericPlan


def load_generic_shard(
    model_dir: str | Path, plan: GenericPlan, dtype: torch.dtype, device: str = "cpu"
) -> PreTrainedModel:
    """The HF causal LM of rank `plan.rank` on the generic path (see the module)."""
    model_dir = Path(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    model = empty_model(plan.local_config(config), dtype)
    files = weight_files(model_dir)
    planned = [name for name in model.state_dict() if plan.planned(name)]
    renamed = [name for name in planned if name not in files]
    if renamed:
        raise ValueError(
            f"{model_dir} stores {renamed[:4]} under other names (transformers converts them "
            "at load), so a rank cannot read its slice of them"
        )
    tensors = read_shard(files, planned, plan.cut, dtype, device)
    if plan.rank != 0:
        for name in filter(plan.rowwise_bias, tensors):
            tensors[name].zero_()
    model.load_state_dict(tensors, strict=False, assign=True)
    _load_whole(model, files, set(planned), dtype)
    model = finish_shard(model, model_dir, tied_head(config, files), device)
    if plan.split_vocab:
        split_head(model, plan.vocab)
    if plan.split_embedding:
        split_embedding(model, plan.vocab)
    return model


def split_embedding(model: Any, rows: range) -> None:
    """`model`'s embedding cut to a copy of its vocabulary `rows`; a head tied to it (split to
    the same rows first: a view of them) made that copy (see the module)."""
    embedding: nn.Embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.untyped_storage().data_ptr() == (
        embedding.weight.untyped_storage().data_ptr()
    )
    with torch.no_grad():
        local = embedding.weight[rows.start : rows.stop].clone()
    embedding.weight = nn.Parameter(local, requires_grad=False)
    embedding.num_embeddings = len(rows)
    embedding.padding_idx = None  # NOTE: the lookup ignores it; it may lie outside the rows
    if tied:
        head.weight = embedding.weight


def split_head(model: Any, rows: range) -> None:
    """`model`'s LM head cut to its vocabulary `rows` (see the module)."""
    head: nn.Linear = model.get_output_embeddings()
    tied = head.weight is model.get_input_embeddings().weight
    with torch.device("meta"):  # its weights are the rows below: none allocated first
        part = nn.Linear(head.in_features, len(rows), bias=head.bias is not None)
    with torch.no_grad():
        weight = head.weight[rows.start : rows.stop]
        part.weight = nn.Parameter(weight if tied else weight.clone(), requires_grad=False)
        if head.bias is not None:
            part.bias = nn.Parameter(head.bias[rows.start : rows.stop].clone(), requires_grad=False)
    model.set_output_embeddings(part)


def _load_whole(model: Any, files: dict[str, Path], skip: set[str], dtype: torch.dtype) -> None:
    """Every checkpoint tensor but `skip`, whole, into `model` through transformers' own
    conversions (ValueError where one does not fit)."""
    with contextlib.ExitStack() as stack:
        opened = {p: stack.enter_context(safe_open(str(p), "pt")) for p in set(files.values())}
        state = {n: opened[p].get_slice(n) for n, p in files.items() if n not in skip}
        # NOTE: typed as the base class; its items are the renamings and converters it takes
        mapping: Any = get_model_conversion_mapping(model)
        load_config = LoadStateDictConfig(dtype=dtype, weight_mapping=mapping)
        info, _ = convert_and_load_state_dict_in_model(
            model=model, state_dict=state, load_config=load_config
        )
    problems = [*info.mismatched_keys, *info.error_msgs, *info.conversion_errors]
    if problems:
        raise ValueError(f"the whole tensors do not fit the rank's model: {problems[:4]}")
