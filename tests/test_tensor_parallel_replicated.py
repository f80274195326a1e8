"""More ranks than KV heads: at TP = 4 the tiny models' 2 KV heads are each replicated on two
ranks (one query head per rank), and greedy outputs still equal HF `generate`."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.torch.parallel.backend import TensorParallelBackend
from backends.torch.testing.tiny_models import BLOCK_SIZE, tiny_model, tiny_tokenizer
from tests.test_oracle import MAX_TOKENS, hf_greedy, prompts
from tests.test_tensor_parallel import run_with_abort

pytestmark = pytest.mark.slow


def test_tp4_replicates_kv_heads_and_equals_hf_generate(tmp_path: Path) -> None:
    model = tiny_model("qwen3")
    model.generation_config.eos_token_id = None
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    expected = [hf_greedy(model, p, m) for p, m in zip(prompts(), MAX_TOKENS, strict=True)]
    backend = TensorParallelBackend.load(
        str(tmp_path), tensor_parallel_size=4, device="cpu", dtype="float32",
        block_size=BLOCK_SIZE, max_model_len=128, max_num_seqs=64,
    )  # fmt: skip
    try:
        ranks = backend.describe()
        assert [(r["num_heads"], r["first_kv_head"]) for r in ranks] == [
            (1, 0), (1, 0), (1, 1), (1, 1)
        ]  # fmt: skip
        outputs, _, _ = run_with_abort(backend, "orca")
        assert outputs == expected
    finally:
        backend.close()
