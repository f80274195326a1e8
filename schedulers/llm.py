"""A small synchronous API over the engine, for scripts, tests and `carousel generate`."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from schedulers import defaults
from schedulers.backend import Backend
from schedulers.base import SchedulerConfig
from schedulers.client import open_stream
from schedulers.engine import Engine
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import TokenLogprob


@dataclass
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    #: prompt tokens the prefix cache served when this choice was admitted
    num_cached_tokens: int = 0


@dataclass
class Generation:
    request_id: str
    prompt_token_ids: list[int]
    choices: list[Choice]


class LLM:
    """Submit prompts (text or token ids), optionally staggered in time, and wait."""

    def __init__(
        self,
        backend: Backend,
        scheduler: str = defaults.SCHEDULER,
        config: SchedulerConfig | None = None,
        policy_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.engine = Engine(backend, scheduler, config, policy_options=policy_options)
        self.engine.start()

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self.engine.stop()

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        delays_s: list[float] | None = None,
        timeout_s: float = 600.0,
    ) -> list[Generation]:
        """Run every prompt; prompt i is submitted `delays_s[i]` seconds after the first.

        NOTE: runs its own asyncio loop, so it cannot be called from inside a running one
        (there, use schedulers/client.py directly).
        """
        params_list = (
            params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        )
        token_lists = [self._tokenize(p) for p in prompts]
        delays = delays_s or [0.0] * len(prompts)
        runs = zip(token_lists, params_list, delays, strict=True)
        return asyncio.run(asyncio.wait_for(self._generate_all(list(runs)), timeout_s))

    async def _generate_all(
        self, runs: list[tuple[list[int], SamplingParams, float]]
    ) -> list[Generation]:
        start = time.monotonic()
        return list(await asyncio.gather(*(self._generate_one(*run, start) for run in runs)))

    async def _generate_one(
        self, token_ids: list[int], params: SamplingParams, delay_s: float, start: float
    ) -> Generation:
        await asyncio.sleep(max(0.0, start + delay_s - time.monotonic()))
        request_id = f"gen-{uuid.uuid4().hex[:12]}"
        result = Generation(request_id, token_ids, [Choice(index=i) for i in range(params.n)])
        try:
            stream = open_stream(self.engine, request_id, [token_ids], params)
        except ValueError as exc:  # AdmissionError, or parameters the engine refused
            for choice in result.choices:
                choice.finish_reason, choice.error = "error", str(exc)
            return result
        with contextlib.closing(stream):
            async for index, out in stream:
                choice = result.choices[index]
                choice.text += out.text
                choice.token_ids += out.token_ids
                choice.logprobs += out.logprobs
                if out.finished:
                    choice.finish_reason, choice.error = out.finish_reason, out.error
                    choice.num_cached_tokens = out.num_cached_tokens
        return result

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.engine.backend.tokenizer.encode(prompt))
        return list(prompt)
