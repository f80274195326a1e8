"""The engine loop: schedule -> backend.execute -> update, on its own thread.

It works in tokens only: `submit` takes a callback that receives token-level outputs
(`RequestOutput` with empty `text`) on the engine thread. Callers read text through the one
async client (schedulers/client.py), which detokenizes and checks stop strings on its own
loop (schedulers/output_processor.py). Commands cross threads through a lock-protected
deque; the loop sleeps on an Event when it has nothing to do.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from schedulers import defaults
from schedulers.backend import Backend, BackendDeadError
from schedulers.base import AdmissionError, SchedulerConfig
from schedulers.batch import Batch, ExecuteOutput
from schedulers.block_manager import BlockManager
from schedulers.mailbox import held_wakeups
from schedulers.outputs import IterationRecord, RequestOutput
from schedulers.registry import create_scheduler
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import FinishReason, Sequence
from schedulers.structured_output.compiler import GrammarCompiler
from schedulers.structured_output.matcher import SequenceGrammar
from schedulers.structured_output.spec import GrammarLimits

try:  # NOTE: the engine path runs without the HTTP layer's packages (scripts/gpu-check.sh)
    import structlog

    _log: Any = structlog.get_logger("carousel.engine")
except ImportError:  # pragma: no cover - exercised on bare GPU machines
    import logging

    _log = None


def log_exception(event: str, **fields: Any) -> None:
    """Log `event` with the current exception, through structlog when it is installed."""
    if _log is not None:
        _log.exception(event, **fields)
    else:  # pragma: no cover
        logging.getLogger("carousel.engine").exception("%s %s", event, fields)


OutputSink = Callable[[RequestOutput], None]
__all__ = ["AdmissionError", "Engine", "EngineDeadError", "OutputSink"]


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


@dataclass
class _Request:
    request_id: str
    seqs: list[Sequence]
    sink: OutputSink


class Engine:
    """One scheduler and one backend, driven by a loop thread."""

    def __init__(
        self,
        backend: Backend,
        scheduler: str = defaults.SCHEDULER,
        config: SchedulerConfig | None = None,
        *,
        policy_options: Mapping[str, Any] | None = None,
        name: str = "default",
        trace_capacity: int = 4096,
        grammar_limits: GrammarLimits | None = None,
    ) -> None:
        config = config or SchedulerConfig()
        # NOTE: the one place the served context window is decided: what was asked, capped
        # at what the backend can serve (None: the backend's).
        asked = config.max_model_len or backend.max_model_len
        self.max_model_len = min(asked, backend.max_model_len)
        self.config = dataclasses.replace(config, max_model_len=self.max_model_len)
        if self.config.speculative_config is not None and not backend.verifies_drafts:
            raise ValueError(
                f"{type(backend).__name__} cannot verify draft tokens: drop "
                "--speculative-config for it (the single-device torch backend verifies them)"
            )
        spec = backend.kv_cache_spec
        self.backend = backend
        self.name = name
        self.block_manager = BlockManager(
            spec.num_blocks,
            spec.block_size,
            enable_prefix_caching=self.config.enable_prefix_caching,
            windows=spec.windows,
        )
        self.scheduler = create_scheduler(
            scheduler, self.config, self.block_manager, policy_options
        )
        if self.scheduler.drafter is not None:
            self.scheduler.drafter.fast_rows = backend.fast_rows
        self.trace: deque[IterationRecord] = deque(maxlen=trace_capacity)
        self.iteration_listeners: list[Callable[[IterationRecord], None]] = []
        self.finish_listeners: list[Callable[[Sequence], None]] = []
        self.dead_reason: str | None = None
        self._requests: dict[str, _Request] = {}
        self._commands: deque[tuple[str, Any]] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._stopped = False
        #: sequences submitted but not yet in the scheduler's queue (counted as waiting)
        self._num_queued_seqs = 0
        self._seq_ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._grammar_limits = grammar_limits or GrammarLimits(
            compile_timeout_s=self.config.grammar_compile_timeout_s
        )
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        #: the drafter's (drafts, draft tokens, accepted tokens) at the last verified step
        self._spec_seen = (0, 0, 0)

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self.backend.watch(lambda reason: self._command("dead", reason))  # backend died idle
            self._thread = threading.Thread(
                target=self._run, name=f"carousel-engine-{self.name}", daemon=True
            )
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still in flight end with an error."""
        self._stopped = True
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._fail_all("the engine shut down before the request finished")
        with self._grammar_lock:
            if self._grammar_compiler is not None:
                self._grammar_compiler.close()

    @property
    def grammar_compiler(self) -> GrammarCompiler | None:
        """The compiler of this engine's output grammars (structured outputs, tool calls),
        built on first use from the backend's tokenizer, logits width and EOS ids; None when
        the backend cannot constrain its sampling (`Backend.grammar_vocab_size` is None).

        Callers compile a `GrammarSpec` with `submit(spec)` (a future, never blocking) and
        pass the result, or the future itself, as `SamplingParams.grammar`.
        """
        vocab_size = self.backend.grammar_vocab_size
        if vocab_size is None:
            return None
        with self._grammar_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(
                    self.backend.tokenizer,
                    vocab_size=vocab_size,
                    stop_token_ids=self.backend.eos_token_ids,
                    limits=self._grammar_limits,
                )
            return self._grammar_compiler

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def was_stopped(self) -> bool:
        """Whether `stop()` ended the loop (a shutdown, not a crash: see `dead_reason`)."""
        return self._stopped

    # -- caller-facing API (any thread) --------------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sink: OutputSink,
        *,
        priority: int = 0,
    ) -> None:
        """Queue a request; `sink` is called on the engine thread with every output.

        `priority` (lower runs first) is read by policies that order by it (`priority`).
        `params.grammar` (a compiled grammar or the compiler's future of one) constrains
        each choice; a choice is not scheduled before its grammar is ready.
        Raises AdmissionError at once when the request can never fit (or asks for a grammar
        this backend cannot enforce: `structured_outputs_unsupported`) and EngineDeadError
        when the loop is not running.
        """
        if not self.is_alive:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        if not prompt_token_ids:
            raise AdmissionError("the prompt is empty", code="invalid_prompt")
        if params.grammar is not None and self.backend.grammar_vocab_size is None:
            raise AdmissionError(
                "this model's backend cannot constrain its output to a grammar",
                code="structured_outputs_unsupported",
            )
        seqs = self._make_seqs(request_id, prompt_token_ids, params, priority)
        self.scheduler.check_admissible(seqs[0])
        if isinstance(params.grammar, Future):  # NOTE: the loop may sleep until it compiles
            params.grammar.add_done_callback(lambda _: self._wake.set())
        self._command("add", _Request(request_id, seqs, sink))

    def abort(self, request_id: str) -> None:
        """Cancel a request; its KV blocks are freed at the start of the next iteration."""
        self._command("abort", request_id)

    def stop_choice(self, request_id: str, index: int) -> None:
        """End choice `index` with `stop` (a stop string matched on the client's side)."""
        self._command("stop", (request_id, index))

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Sequences queued, including those submitted since the loop last took commands."""
        return len(self.scheduler.waiting) + self._num_queued_seqs

    @property
    def kv_usage(self) -> float:
        return self.block_manager.usage

    # -- the loop (engine thread) --------------------------------------------------------

    def _command(self, kind: str, payload: Any) -> None:
        with self._lock:
            self._commands.append((kind, payload))
            if kind == "add":
                self._num_queued_seqs += len(payload.seqs)
        self._wake.set()

    def _make_seqs(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int
    ) -> list[Sequence]:
        seqs: list[Sequence] = []
        for index in range(params.n):
            seed = None if params.seed is None else params.seed + index
            seq_params = dataclasses.replace(params, seed=seed, n=1)
            grammar = None if params.grammar is None else SequenceGrammar(params.grammar)
            seqs.append(
                Sequence(
                    seq_id=next(self._seq_ids),
                    request_id=request_id,
                    prompt_token_ids=list(prompt_token_ids),
                    sampling_params=seq_params,
                    index=index,
                    eos_token_ids=self.backend.eos_token_ids,
                    priority=priority,
                    leader=seqs[0] if seqs else None,
                    grammar=grammar,
                )
            )
        return seqs

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._wake.clear()
                with held_wakeups():  # NOTE: aborts, stops and expiries: one wake-up for all
                    self._drain_commands()
                    self._expire_waiting()
                    self._fail_grammar_errors()
                if not self.scheduler.has_work:
                    self._wake.wait()
                    continue
                batch = self.scheduler.schedule()
                if batch.is_empty:
                    wake_at = self.scheduler.next_wakeup()
                    timeout = 0.05 if wake_at is None else max(0.0, wake_at - time.monotonic())
                    self._wake.wait(timeout)
                    continue
                self._step(batch)
        except BaseException as exc:  # the loop itself failed: make it visible, fail everyone
            dead = isinstance(exc, BackendDeadError)
            self.dead_reason = str(exc) if dead else f"engine loop died: {exc!r}"
            log_exception("engine_loop_died", engine=self.name)
            self._stopping = True
            self._fail_all(self.dead_reason)

    def _drain_commands(self) -> None:
        with self._lock:
            commands = list(self._commands)
            self._commands.clear()
        for kind, payload in commands:
            if kind == "add":
                self._add(payload)
                with self._lock:
                    self._num_queued_seqs -= len(payload.seqs)
            elif kind == "stop":
                self._stop_choice(*payload)
            elif kind == "dead":
                raise BackendDeadError(payload)
            else:
                self._abort(payload)

    def _expire_waiting(self) -> None:
        """End the requests that waited longer than `max_queue_wait_s` (queue_timeout)."""
        self._emit_finished(self.scheduler.expire_waiting(time.monotonic()))

    def _fail_grammar_errors(self) -> None:
        """End the sequences whose grammar failed to compile (with the compiler's message)."""
        self._emit_finished(self.scheduler.fail_grammar_errors())

    def _emit_finished(self, seqs: list[Sequence]) -> None:
        """Send the last output of each of `seqs`, which the scheduler just finished."""
        # NOTE: look requests up first: emitting a request's last choice forgets the request.
        emits = [(request, seq) for seq in seqs if (request := self._requests.get(seq.request_id))]
        for request, seq in emits:
            self._emit(request, seq, [], final=True)

    def _add(self, request: _Request) -> None:
        if request.request_id in self._requests:
            self._finish_request_with_error(request, "duplicate request id")
            return
        try:
            for seq in request.seqs:
                self.scheduler.add(seq)
        except AdmissionError as exc:
            for seq in request.seqs:
                self.scheduler.finish_running(seq, FinishReason.ERROR, str(exc))
            self._finish_request_with_error(request, str(exc))
            return
        self._requests[request.request_id] = request

    def _abort(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish_running(seq, FinishReason.ABORT)
                self._emit(request, seq, [], final=True)

    def _stop_choice(self, request_id: str, index: int) -> None:
        request = self._requests.get(request_id)
        if request is None:
            return
        for seq in request.seqs:
            if seq.index == index and not seq.is_finished:
                self.scheduler.finish_running(seq, FinishReason.STOP)
                self._emit(request, seq, [], final=True)

    def _step(self, batch: Batch) -> None:
        start_wall, start = time.time(), time.monotonic()
        try:
            output = self.backend.execute(batch)
            self.scheduler.update(batch, output)
        except BackendDeadError:  # fatal: the loop ends and fails every request
            raise
        except Exception as exc:  # fail only this step's requests; the loop goes on
            log_exception("engine_step_failed", engine=self.name, iteration=batch.iteration)
            message = f"the engine failed while running this request: {exc!r}"
            failed = [(self._requests.get(seq.request_id), seq) for seq in batch.seqs]
            for request, seq in failed:
                self.scheduler.finish_running(seq, FinishReason.ERROR, message)
                if request is not None:
                    self._emit(request, seq, [], final=True)
            return
        self._record(batch, start_wall, time.monotonic() - start)
        # NOTE: look requests up first: emitting a request's last choice forgets the request.
        emits = [
            (request, seq, tokens)
            for seq, tokens in self._sampled_seqs(batch, output)
            if (request := self._requests.get(seq.request_id)) is not None
        ]
        with held_wakeups():  # NOTE: the consumers' loops wake to the whole iteration
            for request, seq, tokens in emits:
                self._emit(request, seq, tokens, final=seq.is_finished)

    @staticmethod
    def _sampled_seqs(batch: Batch, output: ExecuteOutput) -> list[tuple[Sequence, list[Any]]]:
        """Each sequence's tokens of this step: its sampled one, or what its verified drafts
        emitted (`ExecuteOutput.verified`: all in one output, so one stream chunk)."""
        sampled, verified = output.sampled, output.verified
        if verified:
            return [
                (seq, verified[seq.seq_id] if seq.seq_id in verified else [sampled[seq.seq_id]])
                for seq in batch.seqs
                if seq.seq_id in verified or seq.seq_id in sampled
            ]
        return [(seq, [sampled[seq.seq_id]]) for seq in batch.seqs if seq.seq_id in sampled]

    def _emit(self, request: _Request, seq: Sequence, new: list[Any], final: bool) -> None:
        want_logprobs = seq.sampling_params.logprobs is not None
        output = RequestOutput(
            request_id=request.request_id,
            index=seq.index,
            token_ids=[t.token_id for t in new],
            logprobs=list(new) if want_logprobs else [],
            finish_reason=seq.finish_reason.value if final and seq.finish_reason else None,
            error=seq.error if final else None,
            error_code=seq.error_code if final else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            arrival_time=seq.arrival_time,
            first_scheduled_time=seq.first_scheduled_time,
            first_token_time=seq.first_token_time,
        )
        if final:
            self.backend.release(seq.seq_id)
            for listener in self.finish_listeners:
                listener(seq)
            if all(s.is_finished for s in request.seqs):
                self._requests.pop(request.request_id, None)
        self._deliver(request, output)

    def _deliver(self, request: _Request, output: RequestOutput) -> None:
        try:
            request.sink(output)
        except Exception:  # a broken consumer must not stop the loop
            log_exception("output_sink_failed", request_id=request.request_id)

    def _finish_request_with_error(self, request: _Request, message: str) -> None:
        for seq in request.seqs:
            self._deliver(
                request,
                RequestOutput(
                    request_id=request.request_id,
                    index=seq.index,
                    finish_reason=FinishReason.ERROR.value,
                    error=message,
                    num_prompt_tokens=seq.num_prompt_tokens,
                    arrival_time=seq.arrival_time,
                ),
            )

    def _fail_all(self, message: str) -> None:
        with self._lock:
            pending = [p for kind, p in self._commands if kind == "add"]
            self._commands.clear()
            self._num_queued_seqs = 0
        for request in pending:
            self._finish_request_with_error(request, message)
        for request in list(self._requests.values()):
            for seq in request.seqs:
                if not seq.is_finished:
                    self.scheduler.finish_running(seq, FinishReason.ERROR, message)
                    self._emit(request, seq, [], final=True)
        self._requests.clear()

    def _verified(self) -> dict[str, int]:
        """The trace's marks of a step that verified drafts: what it added to the drafter's
        counters (vLLM's: drafts, draft tokens, accepted tokens; rows aborted meanwhile are
        not counted)."""
        drafter = self.scheduler.drafter
        assert drafter is not None
        stats = drafter.stats
        now = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
        step = [a - b for a, b in zip(now, self._spec_seen, strict=True)]
        self._spec_seen = now
        return dict(
            zip(("num_drafts", "num_draft_tokens", "num_accepted_tokens"), step, strict=True)
        )

    def _record(self, batch: Batch, start_wall: float, duration: float) -> None:
        record = IterationRecord(
            iteration=batch.iteration,
            start=start_wall,
            duration_s=duration,
            seq_ids=tuple(s.seq_id for s in batch.seqs),
            request_ids=tuple(s.request_id for s in batch.seqs),
            num_prefill_tokens=batch.num_prefill_tokens,
            num_decode_tokens=batch.num_decode_tokens,
            num_cached_tokens=batch.num_cached_tokens,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preempted=len(batch.preempted),
            kv_usage=self.block_manager.usage,
            max_num_seqs=self.config.max_num_seqs,
            **(self._verified() if batch.num_draft_tokens else {}),
        )
        self.trace.append(record)
        for listener in self.iteration_listeners:
            listener(record)
