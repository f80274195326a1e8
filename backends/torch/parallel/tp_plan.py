"""Tensor parallelism of the generic path, cut by the model's own `base_model_tp_plan`.

A transformers config names, per module of its base model, how tensor parallelism splits it
(`layers.*.<attention>.<query projection>: colwise`, ...;
transformers/distributed/tensor_parallel.py says what each style does). The generic path
runs each style's inference forward:

- `colwise`: the weight's (and bias's) output rows in N equal parts; the rank's output is its
  part of the features (its heads, its intermediate rows), which the next module takes as is;
- `rowwise`: the weight's input columns in N equal parts; the rank's partial product is summed
  by an all-reduce after the module (a forward hook, layers.py `all_reduce_output`), its bias
  (whole) kept on rank 0 only, so the sum holds it once;
- whole on every rank: `replicate`, `replicated_with_grad_allreduce` (a norm over the rank's
  own heads: no collective in the forward), and the gathered styles `colwise_gather_output`,
  `colwise_rep`, `rowwise_split_input`, `rowwise_rep`, whose split-then-gather (or
  split-then-reduce) forward computes the whole product: computed whole, it is the same one;
- whole on every rank too: every module the plan does not name (the norms, MoE routers and
  experts; transformers 5 names experts only in `base_model_ep_plan`, for expert parallelism),
  and the LM head and the embedding where they do not split (below).

The LM head is the CausalLM class's own plan (`_tp_plan`, `lm_head: colwise_gather_output`):
where it names it so, the head is a plain `nn.Linear` and N divides the vocabulary, each rank
computes its `V / N` vocabulary rows of the logits (a view of the embedding's rows where they
are tied, so no memory is added) and rank 0 gathers them (layers.py `gather_vocab`), as the
native path's `GatheredLMHead` does. For a model like Gemma 3 270M, whose tied 262,144-row head
is 168M of its 268M parameters, that head is most of a decode step's work; computed whole on
every rank, tensor parallelism would split only the rest.

The embedding is the model's plan too (the instance's `_tp_plan`, `<embedding>:
embedding_rowwise`, which transformers adds for a base model with an `embed_tokens` and a
plan): where it names it so, the embedding is an `nn.Embedding` looking each id
up alone (its own forward, or Gemma's scaled one), N divides its rows and a tied head splits
with it, each rank holds the same `V / N` rows as its head, looks up the ids inside them (zeros
for the others) and one all-reduce sums the parts (layers.py `EmbeddingRows`), as the native
path's `VocabParallelEmbedding` does. A tied model's rank then holds `V / N` rows in all, for
its embedding and its head alike: for Gemma 3 270M at N = 2, 84M parameters of the 168M.

Any other style (packed, sequence-parallel or MoE-expert styles) is refused by name,
as is a plan that splits nothing (every rank would run the whole model). The rank's model is
the HF class built from a local config: the attention heads and KV heads, the MLP's
intermediate size, or both, divided by N, whichever makes every planned weight exactly its part
of the checkpoint's and every other weight whole (built on the meta device, before any process
starts). So the generic probe (generic/probe.py) reads the rank's own heads and its KV cache
holds only those.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

from backends.torch.generic.swaps import same_code
from backends.torch.parallel.sizes import ModelDims

#: the weight dimension each split style cuts (colwise: output rows, rowwise: input columns)
SPLIT_DIM = {"colwise": 0, "rowwise": 1}
#: styles whose forward is the whole module's on every rank (see the module docstring)
WHOLE_STYLES = frozenset({
    "replicate", "replicated_with_grad_allreduce", "colwise_gather_output", "colwise_rep",
    "rowwise_split_input", "rowwise_rep",
})  # fmt: skip
#: the CausalLM `_tp_plan` styles of a head whose vocabulary rows split, gathered after
GATHERED_HEAD_STYLES = frozenset({"colwise_gather_output", "colwise_rep"})
#: the `_tp_plan` style of an embedding whose vocabulary rows split, summed after
EMBEDDING_STYLE = "embedding_rowwise"
#: which sizes the local config divides, most split first: (heads, intermediate size)
_CHOICES = ((True, True), (True, False), (False, True))


@dataclass(frozen=True)
class PlanEntry:
    """One `base_model_tp_plan` entry, its key matched against the full model's names."""

    key: str
    style: str
    pattern: re.Pattern[str]

    @classmethod
    def of(cls, key: str, style: str, prefix: str) -> PlanEntry:
        body = re.escape(key).replace(r"\*", r"\d+")
        return cls(key, style, re.compile(rf"(?:{re.escape(prefix)}\.)?{body}"))

    def matches(self, param_name: str) -> bool:
        """Whether the entry names `param_name` or the module that holds it."""
        module = param_name.rpartition(".")[0]
        return bool(self.pattern.fullmatch(param_name) or self.pattern.fullmatch(module))


def plan_entries(config: PretrainedConfig, prefix: str = "model") -> tuple[PlanEntry, ...]:
    """The config's `base_model_tp_plan` (empty where it has none), keys under `prefix`."""
    plan = getattr(config, "base_model_tp_plan", None) or {}
    return tuple(PlanEntry.of(key, str(style), prefix) for key, style in plan.items())


def style_of(entries: tuple[PlanEntry, ...], param_name: str) -> str | None:
    """The style of the first entry naming `param_name` (None: whole, unnamed)."""
    return next((e.style for e in entries if e.matches(param_name)), None)


def split_dim(entries: tuple[PlanEntry, ...], param_name: str, ndim: int) -> int | None:
    """The dimension of `param_name` (of `ndim` dims) the plan cuts, None: whole."""
    dim = SPLIT_DIM.get(style_of(entries, param_name) or "")
    return dim if dim is not None and dim < ndim else None  # a rowwise bias stays whole


@dataclass(frozen=True)
class GenericPlan:
    """What rank `rank` of `world_size` holds of a model on the generic path (module doc)."""

    entries: tuple[PlanEntry, ...]
    dims: ModelDims  # the whole model's
    rank: int
    world_size: int
    split_heads: bool
    split_mlp: bool
    split_vocab: bool = False  # the LM head's vocabulary rows (the module doc)
    split_embedding: bool = False  # the embedding's vocabulary rows (the module doc)

    @classmethod
    def of(cls, config: PretrainedConfig, rank: int, world_size: int) -> GenericPlan:
        """Rank `rank`'s plan (ValueError, one line naming the class, where none runs)."""
        full = _meta_model(config)
        entries, (heads, mlp) = _choose_split(full, config, world_size)
        vocab = head_splits(full, world_size)
        embedding = embedding_splits(full, world_size, vocab)
        return cls(entries, dims_of(config), rank, world_size, heads, mlp, vocab, embedding)

    def _part(self, total: int, split: bool) -> range:
        if not split:
            return range(total)
        size = total // self.world_size
        return range(self.rank * size, (self.rank + 1) * size)

    @property
    def q_heads(self) -> range:
        return self._part(self.dims.num_heads, self.split_heads)

    @property
    def kv_heads(self) -> range:
        return self._part(self.dims.num_kv_heads, self.split_heads)

    @property
    def vocab(self) -> range:
        """The vocabulary rows this rank's split LM head computes and its split embedding
        holds (the whole vocabulary where neither splits; a head or embedding that does not
        split holds every row whatever this says)."""
        return self._part(self.dims.vocab_size, self.split_vocab or self.split_embedding)

    def local_config(self, config: PretrainedConfig) -> PretrainedConfig:
        return local_config(config, self.dims, self.split_heads, self.split_mlp, self.world_size)

    def planned(self, name: str) -> bool:
        """Whether `name` is a weight or bias of a module the plan splits (read by slice)."""
        return style_of(self.entries, name) in SPLIT_DIM

    def cut(self, name: str, shape: list[int]) -> tuple[int, range] | None:
        """(dim, index range) of checkpoint tensor `name` (whole `shape`) this rank holds."""
        dim = split_dim(self.entries, name, len(shape))
        if dim is None:
            return None
        size = shape[dim] // self.world_size
        return dim, range(self.rank * size, (self.rank + 1) * size)

    def rowwise_bias(self, name: str) -> bool:
        return name.endswith(".bias") and style_of(self.entries, name) == "rowwise"

    def rowwise_modules(self, model: nn.Module) -> list[nn.Module]:
        """The modules whose partial outputs the ranks sum (an all-reduce after each)."""
        return [
            module
            for path, module in model.named_modules()
            if style_of(self.entries, path + ".weight") == "rowwise"
        ]


def head_splits(model: nn.Module, world_size: int) -> bool:
    """Whether `model`'s LM head splits by vocabulary rows over `world_size` ranks: its class's
    `_tp_plan` gathers it after a colwise split, it is a plain `nn.Linear` of the config's
    vocabulary (a model with another head keeps it whole) and `world_size` divides its rows."""
    plan = getattr(model, "_tp_plan", None) or {}
    head = model.get_output_embeddings()  # type: ignore[operator]
    vocab = int(getattr(model.config, "vocab_size", 0) or 0)
    return (
        plan.get("lm_head") in GATHERED_HEAD_STYLES
        and head is getattr(model, "lm_head", None)
        and type(head) is nn.Linear
        and head.out_features == vocab
        and head.out_features % world_size == 0
    )


def embedding_splits(model: nn.Module, world_size: int, head_splits: bool) -> bool:
    """Whether `model`'s embedding splits by vocabulary rows over `world_size` ranks: the
    instance's `_tp_plan` names it `embedding_rowwise`, it is an `nn.Embedding` whose forward
    looks each id up alone (nn.Embedding's own, or Gemma's scaled one: a row times a constant),
    without `max_norm` (which rewrites the rows it reads), of the config's vocabulary that
    `world_size` divides; and a head tied to it splits too (`head_splits`), else the head
    would need the rows the rank gave up."""
    embedding = model.get_input_embeddings()  # type: ignore[operator]
    path = next((p for p, m in model.named_modules() if m is embedding), None)
    plan = getattr(model, "_tp_plan", None) or {}
    head = model.get_output_embeddings()  # type: ignore[operator]
    tied = head is not None and head.weight is getattr(embedding, "weight", None)
    vocab = int(getattr(model.config, "vocab_size", 0) or 0)
    return (
        path is not None
        and plan.get(path) == EMBEDDING_STYLE
        and isinstance(embedding, nn.Embedding)
        and looks_up_alone(type(embedding))
        and embedding.max_norm is None
        and embedding.num_embeddings == vocab
        and vocab % world_size == 0
        and (head_splits or not tied)
    )


def looks_up_alone(cls: type[nn.Embedding]) -> bool:
    """Whether an embedding class's forward is nn.Embedding's or Gemma's scaled one (the
    looked-up rows times a constant: each output row depends on its id's row alone)."""
    return cls.forward is nn.Embedding.forward or same_code(
        cls, "forward", Gemma3TextScaledWordEmbedding.forward
    )


def dims_of(config: PretrainedConfig) -> ModelDims:
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelDims(
        num_heads=heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(head_dim),
        intermediate_size=int(getattr(config, "intermediate_size", 0) or 0),
        vocab_size=int(config.vocab_size),
    )


def local_config(
    config: PretrainedConfig, dims: ModelDims, heads: bool, mlp: bool, n: int
) -> PretrainedConfig:
    """A copy of `config` with the heads and KV heads (`heads`) and the intermediate size
    (`mlp`) divided by `n`; head_dim pinned (Llama-like classes derive it from the heads)."""
    local = copy.deepcopy(config)
    if heads:
        local.head_dim = dims.head_dim
        local.num_attention_heads = dims.num_heads // n
        local.num_key_value_heads = dims.num_kv_heads // n
    if mlp:
        local.intermediate_size = dims.intermediate_size // n
    return local


def choose_split(
    config: PretrainedConfig, world_size: int
) -> tuple[tuple[PlanEntry, ...], tuple[bool, bool]]:
    """The plan's entries and the local config's split (heads, intermediate size) under which
    `world_size` ranks hold exactly the plan's parts; ValueError, one line naming the class and
    the reason, where none does."""
    return _choose_split(_meta_model(config), config, world_size)


def _choose_split(
    full: nn.Module, config: PretrainedConfig, world_size: int
) -> tuple[tuple[PlanEntry, ...], tuple[bool, bool]]:
    """`choose_split` over `full`, the whole model `config` builds on the meta device."""
    name = type(full).__name__
    entries = plan_entries(config, str(getattr(full, "base_model_prefix", "model")))
    reason = _why_plan_cannot_run(full, entries)
    if reason is None:
        dims = dims_of(config)
        mismatches, undivided = [], []
        for heads, mlp in _CHOICES:
            split = (config, dims, heads, mlp)
            too_few = _undivided(dims, world_size, heads, mlp)
            if too_few is None:
                local = _meta_model(local_config(*split, world_size))
                mismatch = _mismatch(full, local, entries, world_size)
                if mismatch is None:
                    return entries, (heads, mlp)
                mismatches.append(mismatch)
            elif _fits(full, entries, *split):
                undivided.append(too_few)
        reason = (undivided or mismatches or [f"{world_size} does not divide its sizes"])[0]
    raise ValueError(
        f"{name} cannot run tensor_parallel_size {world_size} on the generic (transformers) "
        f"path: {reason}"
    )


def _meta_model(config: PretrainedConfig) -> nn.Module:
    with torch.device("meta"):
        model: nn.Module = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    return model


def _why_plan_cannot_run(model: nn.Module, entries: tuple[PlanEntry, ...]) -> str | None:
    """Why the plan cannot be honoured on `model` (no plan, a style not run here, nothing
    split), or None."""
    if not entries:
        return "its config has no base_model_tp_plan to cut the weights by"
    modules = dict(model.named_modules())
    params = [name for name, _ in model.named_parameters()]
    split = False
    for entry in entries:
        named = [p for p in params if entry.matches(p)]
        if not named and not any(entry.pattern.fullmatch(m) for m in modules):
            continue  # transformers too leaves an entry that names nothing unused
        if entry.style in SPLIT_DIM:
            owners = {modules[p.rpartition(".")[0]] for p in named}
            if not owners or not all(isinstance(m, nn.Linear) for m in owners):
                return f"its plan entry {entry.key}: {entry.style} names no nn.Linear"
            split = True
        elif entry.style != EMBEDDING_STYLE and entry.style not in WHOLE_STYLES:
            return (
                f"its plan entry {entry.key}: {entry.style} is not one the generic path runs "
                "(colwise, rowwise, embedding_rowwise, or whole on every rank)"
            )
    if not split:
        return (
            "its base_model_tp_plan splits no weight (every entry gathers its output), so "
            "every rank would hold and run the whole model"
        )
    return None


def _undivided(dims: ModelDims, n: int, heads: bool, mlp: bool) -> str | None:
    """Which of the sizes a split divides do not divide by `n` (None: all do)."""
    sizes = []
    if heads:
        sizes += [(dims.num_heads, "attention heads"), (dims.num_kv_heads, "KV heads")]
    if mlp:
        sizes.append((dims.intermediate_size, "intermediate size"))
    bad = [f"the {value} {what}" for value, what in sizes if value % n]
    return f"{n} does not divide {' and '.join(bad)}" if bad else None


def _fits(
    full: nn.Module,
    entries: tuple[PlanEntry, ...],
    config: PretrainedConfig,
    dims: ModelDims,
    heads: bool,
    mlp: bool,
) -> bool:
    """Whether splitting (`heads`, `mlp`) matches the plan at all: at the greatest size that
    divides what it splits (False where that is 1)."""
    sizes = [dims.num_heads, dims.num_kv_heads] if heads else []
    n = math.gcd(*sizes, *([dims.intermediate_size] if mlp else []))
    local = _meta_model(local_config(config, dims, heads, mlp, n)) if n > 1 else None
    return local is not None and _mismatch(full, local, entries, n) is None


def _mismatch(
    full: nn.Module, local: nn.Module, entries: tuple[PlanEntry, ...], n: int
) -> str | None:
    """Where a rank's model (of `n`) differs from the plan's parts of the whole one (None:
    nowhere)."""
    local_shapes = {name: list(p.shape) for name, p in local.named_parameters()}
    for name, param in full.named_parameters():
        want = list(param.shape)
        dim = split_dim(entries, name, param.ndim)
        if dim is not None:
            if want[dim] % n:
                return f"{name}'s {want[dim]} {('rows', 'columns')[dim]} do not split in {n}"
            want[dim] //= n
        got = local_shapes.get(name)
        if got != want:
            return f"its plan does not match the local sizes: {name} would be {got}, not {want}"
    return None
