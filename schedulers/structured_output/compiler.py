"""Compile `GrammarSpec`s with xgrammar on a bounded pool of killable child processes.

`GrammarCompiler.submit(spec, principal)` never blocks and never raises: it returns a future
that resolves to a `CompiledGrammar` or a `GrammarError`. Results are cached by spec (an LRU
bounded in bytes); failures are cached by the spec's normalised form (canonical JSON without
annotations), so a schema that timed out is refused at once the next time, however its text
is varied, instead of occupying a worker again. `check_spec` runs in the child too, within
the time limit, and its errors come back through the future.

Bounds (a pathological schema never stalls the engine, other requests or the shutdown):
- each of `num_workers` threads drives one child process (compile_process.py); a compile
  that runs past `limits.compile_timeout_s` (counted from when its child starts it)
  resolves to `TIMEOUT` and its child is killed, so the worker is free again at once and
  `close()` leaves nothing running;
- at most `max_pending` compiles are queued or running, and at most `max_pending_per_principal`
  of one named principal's (an API key's); more resolve to `BUSY` at once, and one that waited
  `queue_timeout_s` for a worker too;
- a compiled grammar over `limits.max_grammar_bytes` resolves to `TOO_LARGE`.
The compiled grammar crosses back as xgrammar's JSON serialisation, made by the child within
the same deadline and rebuilt against this process's `TokenizerInfo`; one whose serialisation
is over `limits.max_handback_bytes`, or does not end by the deadline, resolves to `TOO_LARGE`
(its child killed). Nothing is ever compiled in this process: the only grammar work here is
the rebuild, bounded by the hand-back limit. A child that dies mid-compile (a crash, a kill)
resolves to `COMPILE` and its worker takes a fresh one.
"""

from __future__ import annotations

import contextlib
import enum
import heapq
import itertools
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from schedulers.structured_output.compile_process import (
    CompiledText,
    CompileJob,
    CompileProcess,
    Overrun,
    compile_message,
)
from schedulers.structured_output.spec import (
    GrammarError,
    GrammarErrorCode,
    GrammarKind,
    GrammarLimits,
    GrammarSpec,
    check_spec,
)

#: failures remembered (by normalised spec) so they are refused again without recompiling
MAX_REMEMBERED_FAILURES = 1024
#: who a compile is for when the caller does not say (RequestContext.principal's default)
ANONYMOUS = "anonymous"


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
    principal: str = ANONYMOUS
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
    """Compiles specs for one tokenizer on `num_workers` child processes, with a cache and
    limits.

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
        max_pending_per_principal: int = 4,
        queue_timeout_s: float | None = None,
        cache_bytes: int = 256 << 20,
        any_whitespace: bool = False,
    ) -> None:
        self.limits = limits or GrammarLimits()
        self.vocab_size = vocab_size or tokenizer_vocab_size(tokenizer)
        self.max_pending = max_pending
        self.max_pending_per_principal = max_pending_per_principal
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
        self._failures: OrderedDict[str, GrammarError] = OrderedDict()
        self._inflight: dict[GrammarSpec, _Job] = {}
        self._num_pending = 0
        self._pending_by_principal: Counter[str] = Counter()
        self._closed = False
        self._local = threading.local()
        self._processes: set[CompileProcess] = set()
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="grammar-compile")
        self._watchdog = _Watchdog()

    @property
    def bitmask_width(self) -> int:
        """int32 words per bitmask row: ceil(vocab_size / 32)."""
        return (self.vocab_size + 31) // 32

    @property
    def num_pending(self) -> int:
        """Compiles queued or running."""
        return self._num_pending

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    @property
    def process_ids(self) -> list[int]:
        """The pids of the compile processes alive now (for tests and operators)."""
        with self._lock:
            return [p.pid for p in self._processes if p.pid is not None]

    def submit(
        self, spec: GrammarSpec, principal: str = ANONYMOUS
    ) -> Future[CompiledGrammar | GrammarError]:
        """A future of `spec` compiled, or of why it cannot be; never blocks, never raises.

        `principal` is who asked (RequestContext.principal): one principal has at most
        `max_pending_per_principal` compiles queued or running (`anonymous`, every request
        of a gateway without API keys, is bounded by `max_pending` only).
        NOTE: `check_spec` runs in the compile process (validating a large schema against
        its meta-schema takes ~0.1 s per 10 KB), so its errors come back through the future.
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
            failure = self._failures.get(spec.normalized)
            if failure is not None:
                return _resolved(failure)
            job = self._inflight.get(spec)
            if job is not None:
                return job.future
            if self._closed:
                return _resolved(_busy("it is shutting down"))
            if self._num_pending >= self.max_pending:
                return _resolved(_busy(f"{self._num_pending} grammars are already compiling"))
            # NOTE: not `anonymous`: without API keys every request is it (max_pending
            # bounds them all), and one key holder cannot starve another
            capped = principal != ANONYMOUS
            if capped and self._pending_by_principal[principal] >= self.max_pending_per_principal:
                return _resolved(
                    _busy(f"this key already has {self.max_pending_per_principal} compiling")
                )
            job = _Job(spec, Future(), principal)
            self._inflight[spec] = job
            self._num_pending += 1
            self._pending_by_principal[principal] += 1
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
        """Build the JSON tokenizer info and start a compile process on a worker now (they
        take ~0.2-3 s), not on first use."""
        return self._pool.submit(self._warm_up)

    def close(self) -> None:
        """Stop the workers and kill their compile processes (nothing keeps running); every
        compile still pending resolves to `BUSY`, and so does any later submit."""
        with self._lock:
            self._closed = True
            jobs, self._inflight = list(self._inflight.values()), {}
            for job in jobs:
                if not job.future.done():
                    job.future.set_result(_busy("it is shutting down"))
            processes = list(self._processes)
        self._pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.kill()
        self._watchdog.stop()

    # -- workers ---------------------------------------------------------------------------

    def _warm_up(self) -> None:
        self._tokenizer_info(Vocabulary.JSON)
        self._thread_process()

    def _run(self, job: _Job) -> None:
        with self._lock:
            if job.future.done():  # waited too long in the queue, or closed: answered
                self._finish(job)
                return
            job.started = True
        try:
            result = self._compile(job)
        except Exception as exc:  # the tokenizer info failed, or the child died
            result = GrammarError(GrammarErrorCode.COMPILE, compile_message(exc))
        with self._lock:
            self._finish(job)
            if job.future.done():  # closed meanwhile: already answered
                return
            self._remember(job.spec, result)
            job.future.set_result(result)

    def _compile(self, job: _Job) -> CompiledGrammar | GrammarError:
        """Compile `job` in this worker's child process, killing it past the deadline.
        The tokenizer info (built on first use) does not count against the deadline."""
        vocabulary = _vocabulary(job.spec, self.any_whitespace)
        info = self._tokenizer_info(vocabulary)
        process = self._thread_process()
        request = CompileJob(job.spec, vocabulary.value, self.any_whitespace, self.limits)
        try:
            reply = process.compile(request, info, self.limits.compile_timeout_s)
        except (EOFError, OSError):  # it died: a crash, or close() killed it
            self._replace_process(process)
            why = f"The compile process exited while compiling the {job.spec.kind}."
            return GrammarError(GrammarErrorCode.COMPILE, why)
        if isinstance(reply, Overrun):
            self._replace_process(process)
            return reply.error(job.spec.kind, self.limits)
        if isinstance(reply, GrammarError):
            return reply
        return _rebuilt(job.spec, reply, info)

    def _thread_process(self) -> CompileProcess:
        """This worker's compile process (started on first use, or after a kill)."""
        process: CompileProcess | None = getattr(self._local, "process", None)
        if process is None:
            process = CompileProcess()
            with self._lock:
                closed = self._closed
                self._processes.add(process)
            if closed:  # close() ran while it started: it would be left alive
                process.kill()
            self._local.process = process
        return process

    def _replace_process(self, process: CompileProcess) -> None:
        """Kill an overrunning compile's process; the worker's next job starts a new one."""
        process.kill()
        with self._lock:
            self._processes.discard(process)
        self._local.process = None

    def _finish(self, job: _Job) -> None:
        """Book-keeping when a job leaves its worker (call with the lock held)."""
        self._num_pending -= 1
        self._pending_by_principal[job.principal] -= 1
        if self._pending_by_principal[job.principal] <= 0:
            del self._pending_by_principal[job.principal]
        if self._inflight.get(job.spec) is job:
            del self._inflight[job.spec]

    def _expire_queued(self, job: _Job) -> None:
        with self._lock:
            if job.started or job.future.done():
                return
            if self._inflight.get(job.spec) is job:
                del self._inflight[job.spec]
            job.future.set_result(_busy(f"no worker was free for {self.queue_timeout_s:g} s"))

    def _remember(self, spec: GrammarSpec, result: CompiledGrammar | GrammarError) -> None:
        """Cache a result (call with the lock held): grammars within `cache_bytes` (LRU),
        failures by count, under the spec's normalised form."""
        if isinstance(result, GrammarError):
            self._failures[spec.normalized] = result
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


def _rebuilt(spec: GrammarSpec, reply: CompiledText, info: Any) -> CompiledGrammar:
    """The child's compiled grammar as an xgrammar object of this process."""
    import xgrammar as xgr

    handle = xgr.CompiledGrammar.deserialize_json(reply.serialized, info)
    return CompiledGrammar(spec, handle, reply.memory_bytes, reply.compile_s)


def _vocabulary(spec: GrammarSpec, any_whitespace: bool) -> Vocabulary:
    if spec.kind in (GrammarKind.JSON_SCHEMA, GrammarKind.JSON_OBJECT):
        return Vocabulary.ALL if any_whitespace else Vocabulary.JSON
    if spec.kind is GrammarKind.STRUCTURAL_TAG:
        return Vocabulary.TAGS
    return Vocabulary.ALL


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
