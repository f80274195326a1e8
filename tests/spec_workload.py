"""Prompts that make prompt lookup draft, and a tiny model accept some of the drafts.

Random tiny models do not copy their prompts, so two kinds of prompt: a random span repeated
(drafts on every step; the model accepts where its output falls into the span or a loop of its
own), and a seed followed by the model's own greedy continuation and the seed again (it says
the continuation again where its window or its attention makes the context alike: every
draft taken on the sliding-window models). The tests measure that drafts were accepted.
"""

from __future__ import annotations

import random

from transformers import PreTrainedModel

from backends.torch.testing.tiny_models import VOCAB
from schedulers.spec_decode.config import SpeculativeConfig
from tests.test_oracle import hf_greedy

#: k = 3 drafts after any earlier match of the last 1 to 3 tokens
SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
#: (span length, repeats) of the repeated-span prompts; seed lengths of the echo prompts
SPANS = ((3, 8), (5, 5), (2, 10))
ECHO_SEEDS = (5, 7)
MAX_TOKENS = [40, 24, 30, 28, 20, 12]
DELAYS_S = [0.0, 0.0, 0.01, 0.02, 0.03, 0.05]


def spec_prompts(model: PreTrainedModel, seed: int = 7) -> list[list[int]]:
    """Six prompts of 20-31 tokens: three repeated spans, two echoes, and the first prompt
    plus one token (a prefix-cache hit once the first has run)."""
    rng = random.Random(seed)
    prompts = []
    for length, repeats in SPANS:
        prompts.append([rng.randrange(VOCAB) for _ in range(length)] * repeats)
    for length in ECHO_SEEDS:
        start = [rng.randrange(VOCAB) for _ in range(length)]
        prompts.append(start + hf_greedy(model, start, 16) + start)
    prompts.append([*prompts[0], rng.randrange(VOCAB)])
    return prompts
