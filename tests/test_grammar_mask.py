"""Grammar bitmasks on logits: forbidden tokens get -inf, only in constrained rows."""

from __future__ import annotations

import math

import pytest
import torch
import xgrammar as xgr
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.torch.sample.grammar_mask import allocate_bitmask, apply_grammar_bitmask

BATCH, VOCAB = 6, 100  # 100 ids: 4 words, the last one partly beyond the vocab


def random_bitmask(rows: int, words: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=generator)


def allowed_ids(bitmask_row: torch.Tensor, vocab: int) -> set[int]:
    """Token ids whose bit is set in one packed row (read bit by bit, the slow obvious way)."""
    words = bitmask_row.tolist()
    return {j for j in range(vocab) if (words[j // 32] >> (j % 32)) & 1}


def test_forbidden_tokens_get_minus_inf_and_allowed_ones_keep_their_logit() -> None:
    logits = torch.randn(BATCH, VOCAB)
    original = logits.clone()
    bitmask = random_bitmask(BATCH, 4, seed=1)
    apply_grammar_bitmask(logits, list(range(BATCH)), bitmask)
    for row in range(BATCH):
        allowed = allowed_ids(bitmask[row], VOCAB)
        for token in range(VOCAB):
            if token in allowed:
                assert logits[row, token] == original[row, token]
            else:
                assert logits[row, token] == -math.inf


def test_only_the_constrained_rows_change_and_bitmask_row_i_is_for_rows_i() -> None:
    logits = torch.randn(BATCH, VOCAB)
    original = logits.clone()
    rows = [4, 1]
    bitmask = random_bitmask(2, 4, seed=2)
    apply_grammar_bitmask(logits, rows, bitmask)
    for i, row in enumerate(rows):
        finite = {t for t in range(VOCAB) if math.isfinite(logits[row, t])}
        assert finite == allowed_ids(bitmask[i], VOCAB)
    for row in set(range(BATCH)) - set(rows):
        assert torch.equal(logits[row], original[row])


def test_columns_beyond_the_bitmask_vocab_are_masked_in_constrained_rows_only() -> None:
    """A model's logits wider than its tokenizer: padded ids can never be sampled."""
    logits = torch.randn(3, 130)  # 130 columns, bitmask covers 4 words = 128 ids
    original = logits.clone()
    apply_grammar_bitmask(logits, [0, 2], allocate_bitmask(2, 128))  # all 128 allowed
    assert torch.isfinite(logits[0, :128]).all() and torch.isfinite(logits[2, :128]).all()
    assert (logits[[0, 2], 128:] == -math.inf).all()
    assert torch.equal(logits[1], original[1])


def test_vocab_size_masks_the_spare_bits_of_the_last_word() -> None:
    logits = torch.randn(1, 100)
    apply_grammar_bitmask(logits, [0], allocate_bitmask(1, 100), vocab_size=90)
    assert torch.isfinite(logits[0, :90]).all()
    assert (logits[0, 90:] == -math.inf).all()


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(st.integers(0, BATCH - 1), unique=True, min_size=1, max_size=BATCH),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_matches_xgrammars_own_kernel(rows: list[int], seed: int, dtype: torch.dtype) -> None:
    """Both paths (numpy for float32, torch otherwise) against xgrammar's reference."""
    torch.manual_seed(seed)
    logits = torch.randn(BATCH, VOCAB).to(dtype)
    bitmask = random_bitmask(len(rows), 4, seed)
    expected = logits.clone()
    full = allocate_bitmask(BATCH, VOCAB)
    full[rows] = bitmask
    xgr.apply_token_bitmask_inplace(expected, full, vocab_size=VOCAB, indices=rows)
    apply_grammar_bitmask(logits, rows, bitmask)
    assert torch.equal(logits, expected)


def test_a_non_contiguous_float32_batch_takes_the_torch_path_and_still_masks() -> None:
    logits = torch.randn(VOCAB, BATCH).t()  # (BATCH, VOCAB), not contiguous
    bitmask = random_bitmask(1, 4, seed=3)
    apply_grammar_bitmask(logits, [2], bitmask)
    finite = {t for t in range(VOCAB) if math.isfinite(logits[2, t])}
    assert finite == allowed_ids(bitmask[0], VOCAB)


def test_no_rows_is_a_no_op_and_a_wrong_bitmask_is_refused() -> None:
    logits = torch.randn(2, VOCAB)
    original = logits.clone()
    apply_grammar_bitmask(logits, [], allocate_bitmask(0, VOCAB))
    assert torch.equal(logits, original)
    with pytest.raises(ValueError, match="int32"):
        apply_grammar_bitmask(logits, [0, 1], allocate_bitmask(1, VOCAB))
    with pytest.raises(ValueError, match="int32"):
        apply_grammar_bitmask(logits, [0], torch.zeros(1, 4, dtype=torch.int64))
