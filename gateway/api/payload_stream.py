"""A reply's stream of chunk payloads, which closes its engine request however it ends."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable


class PayloadStream(AsyncIterator[str]):
    """Chunk payloads from `chunks`; `aclose()` runs `on_close` even if never iterated.

    (Closing an async generator that never started skips its `finally`; an engine request
    submitted before the first chunk would then run on for nobody.)
    """

    def __init__(self, chunks: AsyncGenerator[str, None], on_close: Callable[[], None]) -> None:
        self._chunks = chunks
        self._on_close = on_close

    def __aiter__(self) -> PayloadStream:
        return self

    def __anext__(self) -> Awaitable[str]:  # NOTE: no coroutine of its own per chunk
        return self._chunks.__anext__()

    async def aclose(self) -> None:
        try:
            await self._chunks.aclose()
        finally:
            self._on_close()
