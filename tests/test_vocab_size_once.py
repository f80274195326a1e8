"""The vocabulary's size is read from the tokenizer once per arm, not per request: `len()` of
a fast tokenizer asks the Rust side, which releases the GIL, so every call waited for the
device thread's next release (0.8 s of the event loop's time in a 64-request Gemma 3 burst).
The checks it serves (stop_token_ids, logit_bias, token-id prompts) still refuse an id outside
the vocabulary."""

from __future__ import annotations

from contextlib import ExitStack

import httpx

from backends.sim import SimBackend
from gateway.arms.local import LocalArm
from tests.conftest import SIM_MODEL, start_server


class CountingLen:
    """A tokenizer whose `len()` is counted (every other attribute is the wrapped one's)."""

    def __init__(self, tokenizer: object) -> None:
        self._tokenizer = tokenizer
        self.calls = 0

    def __len__(self) -> int:
        self.calls += 1
        return len(self._tokenizer)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> object:
        return getattr(self._tokenizer, name)


def test_many_requests_read_the_vocabulary_size_once() -> None:
    backend = SimBackend(num_blocks=64, max_model_len=256)
    counting = CountingLen(backend.tokenizer)
    backend.tokenizer = counting  # type: ignore[assignment]
    arm = LocalArm.from_backend(backend)
    with ExitStack() as stack:
        server = start_server(stack, arm)
        body = {"model": SIM_MODEL, "prompt": [97, 98], "max_tokens": 2}
        for _ in range(4):
            reply = httpx.post(
                f"{server.v1}/completions",
                json={**body, "stop_token_ids": [99], "logit_bias": {"100": 1.0}},
                timeout=30,
            )
            assert reply.status_code == 200, reply.text
        assert counting.calls == 1
        vocab = len(counting)
        for field, value in (
            ("stop_token_ids", [vocab]),
            ("logit_bias", {str(vocab): 1.0}),
            ("prompt", [97, vocab]),
        ):
            reply = httpx.post(f"{server.v1}/completions", json={**body, field: value}, timeout=30)
            assert reply.status_code == 400, (field, reply.text)
            assert "outside the vocabulary" in reply.json()["error"]["message"]
