"""The one async client of an Engine, used by the gateway, `LLM` and the tests alike.

`open_stream` submits one or more prompts at once, so admission errors (context too long,
engine dead) surface before any response byte is sent; the returned `RequestStream` yields
text outputs (detokenized and stop-string-checked here, on the consumer's loop: see
output_processor.py) and `close()` aborts whatever has not finished, even when iteration
never started.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from schedulers.engine import Engine
from schedulers.mailbox import Inbox, mailbox_for
from schedulers.output_processor import OutputProcessor
from schedulers.outputs import RequestOutput
from schedulers.sampling_params import SamplingParams


class RequestStream:
    """Outputs of `len(prompts) * params.n` choices; choice `p * n + i` is prompt p's i-th.

    Iterating yields `(choice_index, output)` until every choice has finished. Always
    `close()` it (or use `async with`): unfinished engine requests are aborted, which frees
    their KV blocks at the engine's next iteration.
    """

    def __init__(
        self,
        engine: Engine,
        request_id: str,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        priority: int = 0,
    ) -> None:
        self._engine = engine
        self._n = params.n
        self._queue: Inbox[RequestOutput] = Inbox()
        self._mailbox = mailbox_for(asyncio.get_running_loop())
        self._processors: dict[str, OutputProcessor] = {}
        self._closed = False
        self._prompt_of: dict[str, int] = {}
        #: choices not yet finished (one `finished` check per token would cost more)
        self._open = 0
        ids = (
            [request_id]
            if len(prompts) == 1
            else [f"{request_id}-{i}" for i in range(len(prompts))]
        )
        tokenizer = engine.backend.tokenizer
        # NOTE: a prompt counts as pending only once `submit` accepted it.
        try:
            for index, (engine_id, prompt) in enumerate(zip(ids, prompts, strict=True)):
                self._prompt_of[engine_id] = index
                engine.submit(engine_id, prompt, params, self._sink, priority=priority)
                self._processors[engine_id] = OutputProcessor(tokenizer, prompt, params)
                self._open += params.n
        except BaseException:
            self.close()  # abort the prompts already submitted
            raise

    def _sink(self, output: RequestOutput) -> None:
        """Called on the engine thread."""
        self._mailbox.post(self._queue, output)

    @property
    def finished(self) -> bool:
        return self._closed or self._open == 0

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while not self.finished:
            raw = await self._queue.get()
            processor = self._processors.get(raw.request_id)
            if processor is None:  # NOTE: submit refused it; its error reached us anyway
                continue
            output, stop_hit = processor.process(raw)
            if stop_hit:
                self._engine.stop_choice(raw.request_id, raw.index)
            if output is not None:
                if output.finished:  # NOTE: a choice's one final output (later ones are None)
                    self._open -= 1
                yield self._prompt_of[raw.request_id] * self._n + raw.index, output

    def close(self) -> None:
        """Abort every engine request with unfinished choices (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for engine_id, processor in self._processors.items():
            if not processor.finished:
                self._engine.abort(engine_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


def open_stream(
    engine: Engine,
    request_id: str,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    priority: int = 0,
) -> RequestStream:
    """Submit `prompts` now (raising AdmissionError / EngineDeadError at once); stream later.

    Must be called on the asyncio loop that will read the stream.
    """
    return RequestStream(engine, request_id, prompts, params, priority)


async def generate(
    engine: Engine, request_id: str, prompt_token_ids: list[int], params: SamplingParams
) -> AsyncIterator[RequestOutput]:
    """Submit one prompt and stream its outputs; closing the iterator early aborts it."""
    stream = open_stream(engine, request_id, [prompt_token_ids], params)
    try:
        async for _, output in stream:
            yield output
    finally:
        stream.close()
