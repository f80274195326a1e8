"""Output processing: the engine's token-level outputs -> text deltas, with stop strings.

It runs on the consumer's side (the asyncio loop of the gateway, `LLM`'s loop), not on the
engine thread, so detokenization and stop-string search never sit on the step loop's
critical path (as vLLM v1's output processor runs in the front-end process). A stop string
ends its choice here at once; the engine hears of it through `Engine.stop_choice` and frees
the sequence's KV blocks at its next iteration (tokens it computed meanwhile are dropped).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from schedulers.detokenizer import IncrementalDetokenizer
from schedulers.outputs import RequestOutput
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import FinishReason


@dataclasses.dataclass
class _Choice:
    detokenizer: IncrementalDetokenizer
    num_output_tokens: int = 0
    finished: bool = False


class OutputProcessor:
    """Text for every choice of one request (one prompt, `params.n` choices)."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams):
        self._choices = [
            _Choice(IncrementalDetokenizer(tokenizer, prompt_token_ids, params.stop))
            for _ in range(params.n)
        ]
        self._open = params.n

    @property
    def finished(self) -> bool:
        return self._open == 0

    def is_finished(self, index: int) -> bool:
        return self._choices[index].finished

    def process(self, output: RequestOutput) -> tuple[RequestOutput | None, bool]:
        """(the output with its text, whether a stop string just ended the choice).

        The output is None for what arrives after its choice ended (the engine had run on
        past a stop string). NOTE: a stop string ends the choice with `stop` even when the
        engine's output carried another finish reason, as the cut text is what the client gets.
        """
        choice = self._choices[output.index]
        if choice.finished:
            return None, False
        detok = choice.detokenizer
        kept = output.token_ids
        if len(kept) > 1 and detok.has_stop_strings and output.finish_reason != FinishReason.ABORT:
            choice.num_output_tokens += self._up_to_stop(detok, output)
        elif kept and output.finish_reason != FinishReason.ABORT:
            choice.num_output_tokens += len(kept)
            detok.add_tokens(kept)
        stopped = detok.stopped
        stop_hit = stopped and not output.finished
        final = output.finished or stopped
        if final:
            detok.finish()
            choice.finished = True
            self._open -= 1
        # NOTE: in place, not `dataclasses.replace` (a tenth of this call): each output is
        # made by the engine for this one consumer, and nothing else holds it
        output.text = detok.take(final=final)
        if stopped:
            output.finish_reason = FinishReason.STOP.value
            output.error = output.error_code = None
        if final:
            output.num_output_tokens = choice.num_output_tokens
        return output, stop_hit

    @staticmethod
    def _up_to_stop(detok: IncrementalDetokenizer, output: RequestOutput) -> int:
        """Several tokens at once (verified drafts): added one at a time, so a stop string
        ends them at the token that completed it, as it would one token per output; the
        output's tokens and logprobs are cut there. Returns how many it kept."""
        for n, token_id in enumerate(output.token_ids):
            detok.add_tokens([token_id])
            if detok.stopped:
                output.token_ids = output.token_ids[: n + 1]
                output.logprobs = output.logprobs[: n + 1]
                break
        return len(output.token_ids)
