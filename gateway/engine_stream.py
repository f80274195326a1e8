"""Submit one or more prompts to an Engine and read their outputs as one async stream.

Unlike `Engine.generate`, submission happens in the constructor, so admission errors
(context too long, engine dead) surface before any response byte is sent, and `close()`
aborts whatever has not finished even when iteration never started.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from schedulers.engine import Engine
from schedulers.mailbox import mailbox_for
from schedulers.outputs import RequestOutput
from schedulers.sampling_params import SamplingParams


class OutputStream:
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
    ) -> None:
        self._engine = engine
        self._n = params.n
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._mailbox = mailbox_for(asyncio.get_running_loop())
        self._remaining: dict[str, int] = {}
        self._prompt_of: dict[str, int] = {}
        ids = (
            [request_id]
            if len(prompts) == 1
            else [f"{request_id}-{i}" for i in range(len(prompts))]
        )
        # NOTE: a prompt counts as pending only once `submit` accepted it.
        try:
            for index, (engine_id, prompt) in enumerate(zip(ids, prompts, strict=True)):
                self._prompt_of[engine_id] = index
                engine.submit(engine_id, prompt, params, self._sink)
                self._remaining[engine_id] = params.n
        except BaseException:
            self.close()  # abort the prompts already submitted
            raise

    def _sink(self, output: RequestOutput) -> None:
        """Called on the engine thread."""
        self._mailbox.post(self._queue, output)

    @property
    def finished(self) -> bool:
        return not any(self._remaining.values())

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while not self.finished:
            output = await self._queue.get()
            if output.finished:
                self._remaining[output.request_id] -= 1
            yield self._prompt_of[output.request_id] * self._n + output.index, output

    def close(self) -> None:
        """Abort every engine request with unfinished choices (idempotent)."""
        for engine_id, remaining in self._remaining.items():
            if remaining:
                self._engine.abort(engine_id)
                self._remaining[engine_id] = 0

    async def __aenter__(self) -> OutputStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()
