"""A small synchronous API over the engine, for scripts, tests and `carousel generate`."""

from __future__ import annotations

import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from types import TracebackType

from schedulers.backend import Backend
from schedulers.base import SchedulerConfig
from schedulers.engine import Engine
from schedulers.outputs import RequestOutput
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
        scheduler: str = "orca",
        config: SchedulerConfig | None = None,
    ) -> None:
        self.engine = Engine(backend, scheduler, config)
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
        """Run every prompt; prompt i is submitted `delays_s[i]` seconds after the first."""
        params_list = (
            params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        )
        token_lists = [self._tokenize(p) for p in prompts]
        outputs: queue.Queue[RequestOutput] = queue.Queue()
        ids = [f"gen-{uuid.uuid4().hex[:12]}" for _ in prompts]
        submitter = threading.Thread(
            target=self._submit_all, args=(ids, token_lists, params_list, delays_s, outputs)
        )
        submitter.start()
        results = {
            rid: Generation(rid, toks, [Choice(index=i) for i in range(p.n)])
            for rid, toks, p in zip(ids, token_lists, params_list, strict=True)
        }
        remaining = sum(p.n for p in params_list)
        deadline = time.monotonic() + timeout_s
        while remaining:
            out = outputs.get(timeout=max(0.0, deadline - time.monotonic()))
            choice = results[out.request_id].choices[out.index]
            choice.text += out.text
            choice.token_ids += out.token_ids
            choice.logprobs += out.logprobs
            if out.finished:
                choice.finish_reason, choice.error = out.finish_reason, out.error
                remaining -= 1
        submitter.join()
        return [results[rid] for rid in ids]

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.engine.backend.tokenizer.encode(prompt))
        return list(prompt)

    def _submit_all(
        self,
        ids: list[str],
        token_lists: list[list[int]],
        params_list: list[SamplingParams],
        delays_s: list[float] | None,
        outputs: queue.Queue[RequestOutput],
    ) -> None:
        start = time.monotonic()
        for i, (rid, toks, p) in enumerate(zip(ids, token_lists, params_list, strict=True)):
            if delays_s:
                time.sleep(max(0.0, start + delays_s[i] - time.monotonic()))
            try:
                self.engine.submit(rid, toks, p, outputs.put)
            except ValueError as exc:
                for index in range(p.n):
                    outputs.put(RequestOutput(rid, index, finish_reason="error", error=str(exc)))
