"""Compile `GrammarSpec`s with xgrammar on a bounded worker pool, off the engine thread.

`GrammarCompiler.submit(spec)` never blocks and never raises: it returns a future that
resolves to a `CompiledGrammar` or a `GrammarError`. Results are cached by spec (an LRU
bounded in bytes); failures are cached too, so a schema that timed out is refused at once
the next time instead of occupying a worker again. `check_spec` runs on the worker too, within
the time limit, and its errors come back through the future.

Bounds (a pathological schema never stalls the engine or other requests):
- a compile that runs past `limits.compile_timeout_s` (counted from when a worker starts
  it) resolves to `TIMEOUT` at the deadline. xgrammar cannot be interrupted, so its worker
  stays busy until the compile ends, and it still counts as pending;
- at most `max_pending` compiles are queued or running (overrunning ones included); more
  resolve to `BUSY` at once, and one that waited `queue_timeout_s` for a worker too;
- a compiled grammar over `limits.max_grammar_bytes` resolves to `TOO_LARGE`.
xgrammar releases the GIL while it compiles and fills masks (measured: a 150 ms compile
stalls the main thread by < 7 ms), so compiles do not slow the engine thread's Python.
"""

from __future__ import annotations

import contextlib
import enum
import heapq
import itertools
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from schedulers.structured_output.schema_support import for_xgrammar
from schedulers.structured_output.spec import (
    GrammarError,
    GrammarErrorCode,
    GrammarKind,
    GrammarLimits,
    GrammarSpec,
    check_spec,
)

#: failures remembered (by spec) so they are refused again without recompiling
MAX_REMEMBERED_FAILURES = 1024
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: )?")


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A spec compiled against one tokenizer; shared by every sequence that uses it."""

    spec: GrammarSpec
    handle: Any  # xgrammar.CompiledGrammar
    memory_bytes: int
    compile_s: float


@dataclass(eq=False)
class _Job:
    spec: GrammarSpec
    future: Future[CompiledGrammar | GrammarError]
    started: bool = False


def build_tokenizer_info(
    tokenizer: Any,
    vocab_size: int | None = None,
    stop_token_ids: Iterable[int] | None = None,
    banned_bytes: frozenset[int] = frozenset(),
) -> Any:
    """xgrammar's TokenizerInfo for an HF tokenizer, sized to the model's logits width.

    Special added tokens (`<|im_start|>`, `<|endoftext|>`, ...) other than the stop tokens
    are given an empty text, which xgrammar treats as never allowed: otherwise they count as
    their literal text and could appear inside a JSON string. So are tokens containing any
    of `banned_bytes` (see `Vocabulary`).
    """
    import xgrammar as xgr

    stops = sorted(set(stop_token_ids or ())) or None
    base = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stops
    )
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special = {i for i, token in added.items() if getattr(token, "special", False)}
    special -= set(base.stop_token_ids)
    if not special and not banned_bytes:
        return base
    vocab = [
        b"" if i in special or not banned_bytes.isdisjoint(text) else text
        for i, text in enumerate(base.decoded_vocab)
    ]
    for stop in base.stop_token_ids:
        vocab[stop] = base.decoded_vocab[stop]
    return xgr.TokenizerInfo(
        vocab,
        xgr.VocabType.RAW,  # decoded_vocab is already raw bytes
        vocab_size=base.vocab_size,
        stop_token_ids=base.stop_token_ids,
        add_prefix_space=base.add_prefix_space,
    )


class Vocabulary(enum.Enum):
    """Which tokens a grammar kind may ever use: the bytes banned from every token.

    NOTE: xgrammar 0.2.9 compiles a `minLength`/`maxLength` string to a rule that admits raw
    control characters (invalid JSON; docs/structured-outputs.md). Compact JSON never
    contains a byte below 0x20 (escapes are `\\n`, two printable bytes), so JSON kinds use a
    vocabulary without such tokens, which also keeps the fast length rule. Tool-call tags
    need newlines around the JSON: their vocabulary keeps `\\n` only (the buggy rule excludes
    it). Regexes and EBNF grammars get every token.
    """

    ALL = "all"
    JSON = "json"
    TAGS = "tags"

    @property
    def banned_bytes(self) -> frozenset[int]:
        return _BANNED_BYTES[self]


_BANNED_BYTES = {
    Vocabulary.ALL: frozenset(),
    Vocabulary.JSON: frozenset(range(0x20)),
    Vocabulary.TAGS: frozenset(range(0x20)) - {0x0A},
}


def tokenizer_vocab_size(tokenizer: Any) -> int:
    """The number of ids the tokenizer can produce (as xgrammar counts them)."""
    vocab = tokenizer.get_vocab()
    return max(len(vocab), max(vocab.values()) + 1)


class GrammarCompiler:
    """Compiles specs for one tokenizer on `num_workers` threads, with a cache and limits.

    `vocab_size` is the model's logits width (it may exceed the tokenizer's: padded ids are
    never allowed); bitmasks have `bitmask_width` int32 words per row. `stop_token_ids` are
    the ids that end a sequence (EOS): the only ones allowed once a grammar is complete.
    `any_whitespace=False` (the default) decodes JSON in one compact layout (`", "`, `": "`),
    so a model cannot spend its budget on whitespace.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        vocab_size: int | None = None,
        stop_token_ids: Iterable[int] | None = None,
        limits: GrammarLimits | None = None,
        num_workers: int = 2,
        max_pending: int = 64,
        queue_timeout_s: float | None = None,
        cache_bytes: int = 256 << 20,
        any_whitespace: bool = False,
    ) -> None:
        self.limits = limits or GrammarLimits()
        self.vocab_size = vocab_size or tokenizer_vocab_size(tokenizer)
        self.max_pending = max_pending
        self.queue_timeout_s = (
            self.limits.compile_timeout_s if queue_timeout_s is None else queue_timeout_s
        )
        self.cache_bytes = cache_bytes
        self.any_whitespace = any_whitespace
        self._tokenizer = tokenizer
        self._stop_token_ids = tuple(stop_token_ids or ())
        self._infos: dict[Vocabulary, Any] = {}
        self._info_lock = threading.Lock()
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._cached_bytes = 0
        self._failures: OrderedDict[GrammarSpec, GrammarError] = OrderedDict()
        self._inflight: dict[GrammarSpec, _Job] = {}
        self._num_pending = 0
        self._closed = False
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="grammar-compile")
        self._watchdog = _Watchdog()

    @property
    def bitmask_width(self) -> int:
        """int32 words per bitmask row: ceil(vocab_size / 32)."""
        return (self.vocab_size + 31) // 32

    @property
    def num_pending(self) -> int:
        """Compiles queued or running, overrunning ones included."""
        return self._num_pending

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    def submit(self, spec: GrammarSpec) -> Future[CompiledGrammar | GrammarError]:
        """A future of `spec` compiled, or of why it cannot be; never blocks, never raises.

        NOTE: `check_spec` runs on the worker (validating a large schema against its
        meta-schema takes ~0.1 s per 10 KB), so its errors come back through the future too.
        """
        if len(spec.text) > self.limits.max_spec_bytes:  # chars <= bytes: a cheap first cut
            problem = check_spec(spec, self.limits)
            if problem is not None:
                return _resolved(problem)
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
                return _resolved(cached)
            failure = self._failures.get(spec)
            if failure is not None:
                return _resolved(failure)
            job = self._inflight.get(spec)
            if job is not None:
                return job.future
            if self._closed:
                return _resolved(_busy("it is shutting down"))
            if self._num_pending >= self.max_pending:
                return _resolved(_busy(f"{self._num_pending} grammars are already compiling"))
            job = _Job(spec, Future())
            self._inflight[spec] = job
            self._num_pending += 1
        self._watchdog.call_at(
            time.monotonic() + self.queue_timeout_s, lambda: self._expire_queued(job)
        )
        with contextlib.suppress(RuntimeError):  # closed meanwhile: close() answered the job
            self._pool.submit(self._run, job)
        return job.future

    def compile(self, spec: GrammarSpec) -> CompiledGrammar | GrammarError:
        """`submit(spec)` and wait for it (for scripts and tests; never on the engine thread)."""
        return self.submit(spec).result()

    def warm_up(self) -> Future[None]:
        """Build the tokenizer info on a worker now (it takes ~0.2-0.4 s), not on first use."""
        return self._pool.submit(self._tokenizer_info, Vocabulary.JSON)

    def close(self) -> None:
        """Stop the workers (running compiles finish in the background) and the watchdog;
        every compile still pending resolves to `BUSY`, and so does any later submit."""
        with self._lock:
            self._closed = True
            jobs, self._inflight = list(self._inflight.values()), {}
            for job in jobs:
                if not job.future.done():
                    job.future.set_result(_busy("it is shutting down"))
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._watchdog.stop()

    # -- workers ---------------------------------------------------------------------------

    def _run(self, job: _Job) -> None:
        with self._lock:
            if job.future.done():  # waited too long in the queue: already answered BUSY
                self._finish(job)
                return
            job.started = True
        result: CompiledGrammar | GrammarError | None = None
        try:  # the tokenizer info (built on first use) does not count against the deadline
            compiler = self._thread_compiler(_vocabulary(job.spec, self.any_whitespace))
        except Exception as exc:
            result = GrammarError(GrammarErrorCode.COMPILE, _compile_message(exc))
        self._watchdog.call_at(
            time.monotonic() + self.limits.compile_timeout_s, lambda: self._expire_running(job)
        )
        start = time.perf_counter()
        try:
            if result is None:
                result = check_spec(job.spec, self.limits)
            if result is None:
                handle = _compile(compiler, job.spec, self.any_whitespace)
                result = CompiledGrammar(
                    job.spec, handle, int(handle.memory_size_bytes), time.perf_counter() - start
                )
        except Exception as exc:  # xgrammar's RuntimeError/ValueError name the problem
            result = GrammarError(GrammarErrorCode.COMPILE, _compile_message(exc))
        limit = self.limits.max_grammar_bytes
        if isinstance(result, CompiledGrammar) and result.memory_bytes > limit:
            result = GrammarError(
                GrammarErrorCode.TOO_LARGE,
                f"The compiled grammar takes {result.memory_bytes >> 20} MiB; the limit is "
                f"{limit >> 20} MiB.",
            )
        with self._lock:
            self._finish(job)
            if job.future.done():  # the deadline passed first: the result is dropped
                return
            self._remember(job.spec, result)
            job.future.set_result(result)

    def _finish(self, job: _Job) -> None:
        """Book-keeping when a job leaves its worker (call with the lock held)."""
        self._num_pending -= 1
        if self._inflight.get(job.spec) is job:
            del self._inflight[job.spec]

    def _expire_queued(self, job: _Job) -> None:
        with self._lock:
            if job.started or job.future.done():
                return
            if self._inflight.get(job.spec) is job:
                del self._inflight[job.spec]
            job.future.set_result(_busy(f"no worker was free for {self.queue_timeout_s:g} s"))

    def _expire_running(self, job: _Job) -> None:
        with self._lock:
            if job.future.done():
                return
            if self._inflight.get(job.spec) is job:
                del self._inflight[job.spec]
            error = GrammarError(
                GrammarErrorCode.TIMEOUT,
                f"Compiling the {job.spec.kind} took longer than the "
                f"{self.limits.compile_timeout_s:g} s limit; simplify it.",
            )
            self._remember(job.spec, error)
            job.future.set_result(error)

    def _remember(self, spec: GrammarSpec, result: CompiledGrammar | GrammarError) -> None:
        """Cache a result (call with the lock held): grammars within `cache_bytes` (LRU),
        failures by count."""
        if isinstance(result, GrammarError):
            self._failures[spec] = result
            while len(self._failures) > MAX_REMEMBERED_FAILURES:
                self._failures.popitem(last=False)
            return
        if result.memory_bytes > self.cache_bytes:
            return
        self._cache[spec] = result
        self._cached_bytes += result.memory_bytes
        while self._cached_bytes > self.cache_bytes:
            _, evicted = self._cache.popitem(last=False)
            self._cached_bytes -= evicted.memory_bytes

    def _tokenizer_info(self, vocabulary: Vocabulary) -> Any:
        with self._info_lock:
            info = self._infos.get(vocabulary)
            if info is None:
                info = build_tokenizer_info(
                    self._tokenizer, self.vocab_size, self._stop_token_ids, vocabulary.banned_bytes
                )
                self._infos[vocabulary] = info
            return info

    def _thread_compiler(self, vocabulary: Vocabulary) -> Any:
        """This worker's own xgrammar compiler for `vocabulary` (its cache off: ours is the
        cache)."""
        compilers: dict[Vocabulary, Any] = self._local.__dict__.setdefault("compilers", {})
        compiler = compilers.get(vocabulary)
        if compiler is None:
            import xgrammar as xgr

            compiler = xgr.GrammarCompiler(
                self._tokenizer_info(vocabulary), max_threads=1, cache_enabled=False
            )
            compilers[vocabulary] = compiler
        return compiler


def _vocabulary(spec: GrammarSpec, any_whitespace: bool) -> Vocabulary:
    if spec.kind in (GrammarKind.JSON_SCHEMA, GrammarKind.JSON_OBJECT):
        return Vocabulary.ALL if any_whitespace else Vocabulary.JSON
    if spec.kind is GrammarKind.STRUCTURAL_TAG:
        return Vocabulary.TAGS
    return Vocabulary.ALL


def _compile(compiler: Any, spec: GrammarSpec, any_whitespace: bool) -> Any:
    """The xgrammar CompiledGrammar of `spec` (raises what xgrammar raises)."""
    if spec.kind is GrammarKind.JSON_SCHEMA or spec.kind is GrammarKind.JSON_OBJECT:
        schema = spec.text if spec.kind is GrammarKind.JSON_SCHEMA else '{"type":"object"}'
        if any_whitespace:  # raw tabs are legal between tokens: rewrite the buggy rule
            schema = json.dumps(for_xgrammar(json.loads(schema)))
        return compiler.compile_json_schema(schema, any_whitespace=any_whitespace, strict_mode=True)
    if spec.kind is GrammarKind.REGEX:
        return compiler.compile_regex(spec.text)
    if spec.kind is GrammarKind.CHOICE:
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choices())
        return compiler.compile_grammar(f"root ::= {alternatives}")
    if spec.kind is GrammarKind.GRAMMAR:
        return compiler.compile_grammar(spec.text)
    return compiler.compile_structural_tag(spec.text)


def _compile_message(exc: Exception) -> str:
    """xgrammar's message without its C++ source prefix, on one line."""
    lines = [line for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    return _CPP_PREFIX.sub("", lines[0]).strip()


def _resolved(result: CompiledGrammar | GrammarError) -> Future[CompiledGrammar | GrammarError]:
    future: Future[CompiledGrammar | GrammarError] = Future()
    future.set_result(result)
    return future


def _busy(why: str) -> GrammarError:
    return GrammarError(
        GrammarErrorCode.BUSY, f"The grammar compiler is busy ({why}); retry shortly."
    )


@dataclass(order=True)
class _Deadline:
    at: float
    seq: int
    callback: Callable[[], None] = field(compare=False)


class _Watchdog:
    """One daemon thread that runs callbacks at their deadlines (cheaper than a Timer each)."""

    def __init__(self) -> None:
        self._heap: list[_Deadline] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="grammar-watchdog", daemon=True)
        self._thread.start()

    def call_at(self, at: float, callback: Callable[[], None]) -> None:
        with self._cond:
            heapq.heappush(self._heap, _Deadline(at, next(self._seq), callback))
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (not self._heap or self._heap[0].at > time.monotonic()):
                    timeout = self._heap[0].at - time.monotonic() if self._heap else None
                    self._cond.wait(timeout)
                if self._stopped:
                    return
                due = heapq.heappop(self._heap)
            due.callback()
