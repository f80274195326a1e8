"""Tensor parallelism on the generic path (CPU, gloo): TP = 2 greedy equals HF `generate`.

Each model runs its own transformers code on two ranks, cut by its config's
`base_model_tp_plan` (backends/torch/parallel/tp_plan.py): Gemma 3 (dense: sliding layers,
per-head q/k norms, `(1 + w)` norms, a tied embedding) and Qwen3-MoE (a dense MLP layer split
like Gemma's, then a sparse layer whose router and experts every rank holds whole), each LM
head split by vocabulary rows as its CausalLM's `_tp_plan` says. The
workload is the generic oracle's (tests/test_generic_oracle.py): orca with a 16-token budget and
chunked prefill, a KV cache for one 80-token context (so sequences are preempted), and a
second turn served partly from the prefix cache; every step's block accounting is checked and
every block is free at the end. One group of two ranks serves the module.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import PreTrainedModel

from backends.torch.generic.model import _weight_bytes
from backends.torch.parallel import layers
from backends.torch.parallel.backend import TensorParallelBackend
from backends.torch.parallel.generic_shard import split_embedding, split_head
from backends.torch.parallel.group import TensorParallelGroup, acquire_group, release_group
from backends.torch.parallel.tp_plan import GenericPlan, choose_split, embedding_splits
from backends.torch.testing.tiny_generic import tiny_generic_model
from backends.torch.testing.tiny_models import BLOCK_SIZE, tiny_tokenizer
from tests.test_generic_oracle import (
    assert_orca_with_chunks_preemption_and_a_hit_exact,
    hf_two_phases,
)

#: one dense and one mixture-of-experts model whose plans split them
ARCHS = ["gemma3", "qwen3_moe"]


def saved_model(arch: str, folder: Path) -> PreTrainedModel:
    """The tiny `arch` (EOS ignored), saved with the tiny tokenizer as an HF directory."""
    model = tiny_generic_model(arch)
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def group() -> Iterator[TensorParallelGroup]:
    group = acquire_group(2, "cpu")
    yield group
    release_group(group)


@pytest.fixture(scope="module", params=ARCHS)
def saved(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[PreTrainedModel, Path]:
    path = tmp_path_factory.mktemp(request.param)
    return saved_model(request.param, path), path


@pytest.fixture(scope="module")
def expected(saved: tuple[PreTrainedModel, Path]) -> tuple[list[list[int]], list[list[int]]]:
    return hf_two_phases(saved[0])


@pytest.fixture(scope="module")
def tp_backend(
    group: TensorParallelGroup, saved: tuple[PreTrainedModel, Path]
) -> Iterator[TensorParallelBackend]:
    # NOTE: `auto` takes the generic path for both classes; max_num_seqs 1 sizes the KV cache
    # for one 80-token context
    backend = TensorParallelBackend.load(
        str(saved[1]), tensor_parallel_size=2, device="cpu", dtype="float32",
        block_size=BLOCK_SIZE, max_model_len=80, max_num_seqs=1,
    )  # fmt: skip
    yield backend
    backend.close()


def test_tp2_orca_with_chunks_preemption_and_a_prefix_hit_equals_hf_generate(
    tp_backend: TensorParallelBackend, expected: tuple[list[list[int]], list[list[int]]]
) -> None:
    assert_orca_with_chunks_preemption_and_a_hit_exact(tp_backend, expected)


def test_each_rank_caches_its_own_kv_heads_and_computes_its_half_of_the_vocabulary(
    tp_backend: TensorParallelBackend,
) -> None:
    ranks = tp_backend.describe()
    assert {r["num_blocks"] for r in ranks} == {tp_backend.kv_cache_spec.num_blocks}
    # 4 query heads over 2 KV heads: each rank probes (and caches) its half; the CausalLM's
    # `_tp_plan` gathers the LM head after a colwise split, so each rank computes 160 of the
    # 320 vocabulary rows and rank 0 samples from the whole logits; the instance's plan splits
    # the embedding (`embedding_rowwise`), so each rank holds the same 160 rows of it
    assert [(r["num_heads"], r["num_kv_heads"], r["first_kv_head"]) for r in ranks] == [
        (2, 1, 0),
        (2, 1, 1),
    ]
    assert [r["vocab_rows"] for r in ranks] == [160, 160]
    assert [r["embedding_rows"] for r in ranks] == [160, 160]


@pytest.mark.parametrize(
    ("arch", "size", "reason"),
    [
        ("phi3", 2, r"Phi3ForCausalLM .* base_model_tp_plan splits no weight"),
        ("olmoe", 2, r"OlmoeForCausalLM .* base_model_tp_plan splits no weight"),
        ("gemma3", 4, r"Gemma3ForCausalLM cannot run tensor_parallel_size 4 .* the 2 KV heads"),
    ],
)
def test_a_plan_that_cannot_split_the_model_is_refused_before_any_process(
    tmp_path: Path, arch: str, size: int, reason: str
) -> None:
    saved_model(arch, tmp_path)
    before = multiprocessing.active_children()
    with pytest.raises(ValueError, match=reason):
        TensorParallelBackend.load(str(tmp_path), tensor_parallel_size=size, device="cpu")
    assert multiprocessing.active_children() == before, "a refused model started processes"


def test_the_local_config_divides_what_the_plan_splits() -> None:
    """(heads, intermediate size): Mixtral's experts read `intermediate_size` and are whole."""
    assert choose_split(tiny_generic_model("qwen3_moe").config, 2)[1] == (True, True)
    assert choose_split(tiny_generic_model("mixtral").config, 2)[1] == (True, False)


@pytest.mark.parametrize(
    ("plan", "reason"),
    [
        ({}, "its config has no base_model_tp_plan"),
        (
            {"layers.*.mlp.experts.gate_up_proj": "packed_colwise"},
            r"entry layers\.\*\.mlp\.experts\.gate_up_proj: packed_colwise is not one",
        ),
    ],
)
def test_a_plan_the_generic_path_cannot_run_is_refused_by_name(
    plan: dict[str, str], reason: str
) -> None:
    config = tiny_generic_model("qwen3_moe").config
    config.base_model_tp_plan = {**config.base_model_tp_plan, **plan} if plan else {}
    with pytest.raises(ValueError, match=rf"^Qwen3MoeForCausalLM cannot run .*{reason}"):
        choose_split(config, 2)


@pytest.mark.parametrize(("arch", "tied"), [("gemma3", True), ("qwen3_moe", False)])
def test_a_split_head_holds_its_vocabulary_rows_a_tied_one_as_a_view(arch: str, tied: bool) -> None:
    """Rank 1 of 2's head: the second 160 of the 320 rows; tied to the embedding, a view of
    its rows (no memory added), untied a copy of them alone; and both plans split it."""
    model = tiny_generic_model(arch)
    assert GenericPlan.of(model.config, 1, 2).vocab == range(160, 320)
    embedding = model.get_input_embeddings().weight
    whole = model.get_output_embeddings().weight.detach().clone()
    assert (model.get_output_embeddings().weight is embedding) == tied
    split_head(model, range(160, 320))
    head = model.get_output_embeddings()
    assert head.out_features == 160 and torch.equal(head.weight, whole[160:])
    shares = head.weight.untyped_storage().data_ptr() == embedding.untyped_storage().data_ptr()
    assert shares == tied


@pytest.mark.parametrize(("arch", "tied"), [("gemma3", True), ("qwen3_moe", False)])
def test_a_split_vocabularys_rank_reports_each_resident_byte_once(arch: str, tied: bool) -> None:
    """Rank 1's weight bytes (the served report, /metrics): a tied head's rows are the
    embedding's, so splitting it adds none; an untied head keeps its 160 rows of 320; the
    split embedding keeps its 160 rows, and a tied head is those rows."""
    model = tiny_generic_model(arch)
    embedding = model.get_input_embeddings()
    head_bytes = model.get_output_embeddings().weight.nbytes
    table_bytes = embedding.weight.nbytes
    dtype = str(model.dtype).removeprefix("torch.")
    whole = _weight_bytes(model, 0)[dtype]
    split_head(model, range(160, 320))
    expected = whole if tied else whole - head_bytes // 2
    assert _weight_bytes(model, 0) == {dtype: expected}
    split_embedding(model, range(160, 320))
    assert _weight_bytes(model, 0) == {dtype: expected - table_bytes // 2}
    assert embedding.weight.shape[0] == embedding.num_embeddings == 160
    assert (model.get_output_embeddings().weight is embedding.weight) == tied


def test_each_half_of_a_split_embedding_looks_up_its_own_ids_and_the_halves_sum_to_the_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`EmbeddingRows` on the two halves of a tiny Gemma 3's scaled embedding, in one process
    (the all-reduce replaced by the test's sum): each half gives its ids' rows and zeros for
    the others, by position or keyword; an id outside the vocabulary raises before any
    collective."""
    monkeypatch.setattr(layers.dist, "all_reduce", lambda tensor: None)
    ids = torch.tensor([[0, 159, 160, 319, 7, 300]])
    expected = tiny_generic_model("gemma3").get_input_embeddings()(ids)
    parts = []
    for rows in (range(0, 160), range(160, 320)):
        model = tiny_generic_model("gemma3")
        split_embedding(model, rows)
        embedding = model.get_input_embeddings()
        layers.EmbeddingRows(embedding, rows.start, 320)
        part = embedding(ids)
        assert torch.equal(embedding(input_ids=ids), part)  # Gemma's keyword
        inside = (ids >= rows.start) & (ids < rows.stop)
        assert torch.equal(part[inside], expected[inside])
        assert not part[~inside].any()
        parts.append(part)
        with pytest.raises(IndexError, match="token id 320 is outside the vocabulary"):
            embedding(torch.tensor([[1, 320]]))
    assert torch.equal(parts[0] + parts[1], expected)


@pytest.mark.parametrize(
    ("change", "splits"),
    [
        ("none", True),
        ("max_norm", False),
        ("own_forward", False),
        ("not_in_plan", False),
    ],
)
def test_an_embedding_splits_only_where_each_id_is_looked_up_alone(
    change: str, splits: bool
) -> None:
    model = tiny_generic_model("qwen3_moe")  # untied: the head need not split with it
    embedding = model.get_input_embeddings()
    if change == "max_norm":
        embedding.max_norm = 1.0
    elif change == "own_forward":
        embedding.__class__ = type("Mixing", (nn.Embedding,), {"forward": lambda self, x: x})
    elif change == "not_in_plan":
        model._tp_plan = {k: v for k, v in model._tp_plan.items() if "embed" not in k}
    assert embedding_splits(model, 2, head_splits=False) == splits
    assert not embedding_splits(model, 3, head_splits=False)  # 3 does not divide 320


def test_a_tied_embedding_splits_only_with_its_head() -> None:
    model = tiny_generic_model("gemma3")
    assert embedding_splits(model, 2, head_splits=True)
    assert not embedding_splits(model, 2, head_splits=False)
