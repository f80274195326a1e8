"""xgrammar compiles in a child process, so a compile that overruns its deadline is killed.

xgrammar cannot be interrupted: a compile in a thread runs to its end however long that
takes, holding its worker (and delaying the process's exit). A `CompileProcess` runs the
compile in a child forked from a forkserver that has xgrammar (and torch) imported already,
so a new child is ready in milliseconds, not the seconds a fresh interpreter takes. The
parent waits at most the deadline; past it, the child is killed and the next compile gets a
fresh one. The compiled grammar comes back as xgrammar's JSON serialisation (made in the
child, within the same deadline, and at most `GrammarLimits.max_handback_bytes`) and is
rebuilt against the parent's own `TokenizerInfo`: the parent never compiles.

    process = CompileProcess()
    reply = process.compile(job, info, timeout_s)   # an Overrun: kill it
    process.kill()

NOTE: the serialisation is 10-100x the grammar's memory and costs more than the compile (a
2 MiB grammar compiled in 0.05 s serialises to 256 MB in 10 s), so a grammar too large to
hand back is refused (`TOO_LARGE`), never compiled a second time in the parent, where
nothing could stop it. A shared-memory or file channel would not help: the cost is the
serialisation, not the pipe.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import multiprocessing.context
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import forkserver, popen_forkserver, reduction, spawn, util
from multiprocessing.connection import Connection
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

#: how long a child may take to load a tokenizer info (not counted against a compile)
SETUP_TIMEOUT_S = 60.0
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: )?")
_context_lock = threading.Lock()
_context: multiprocessing.context.ForkServerContext | None = None


@dataclass(frozen=True)
class CompileJob:
    """What a child needs to compile one spec (picklable)."""

    spec: GrammarSpec
    vocabulary: str
    any_whitespace: bool
    limits: GrammarLimits


@dataclass(frozen=True)
class Compiled:
    """The child's notice that a compile ended and its grammar is being serialised."""

    memory_bytes: int
    compile_s: float


@dataclass(frozen=True)
class CompiledText:
    """A compiled grammar as it crosses the pipe: xgrammar's serialisation and its cost."""

    serialized: str
    memory_bytes: int
    compile_s: float


@dataclass(frozen=True)
class Overrun:
    """The deadline passed while compiling (`compiled` None) or while handing the grammar
    back (`compiled`: what the child reported); the child is still busy: kill it."""

    compiled: Compiled | None = None

    def error(self, kind: GrammarKind, limits: GrammarLimits) -> GrammarError:
        timeout_s = limits.compile_timeout_s
        if self.compiled is None:
            return GrammarError(
                GrammarErrorCode.TIMEOUT,
                f"Compiling the {kind} took longer than the {timeout_s:g} s limit; simplify it.",
            )
        why = f"serialising it did not end within the {timeout_s:g} s limit"
        return too_big_to_hand_back(kind, self.compiled.memory_bytes, why)


def too_big_to_hand_back(kind: GrammarKind, memory_bytes: int, why: str) -> GrammarError:
    """`TOO_LARGE`: a compiled grammar the compile process cannot hand back, and why."""
    return GrammarError(
        GrammarErrorCode.TOO_LARGE,
        f"The compiled {kind} ({memory_bytes / (1 << 20):.1f} MiB) is too large to hand back "
        f"from the compile process: {why}. Simplify it (fewer optional properties or anyOf "
        "branches).",
    )


class CompileProcess:
    """One child process that compiles grammars, one at a time, for one worker thread."""

    def __init__(self) -> None:
        self._conn, child_conn = _forkserver_context().Pipe()
        self._process = _CompileChild(
            target=serve, args=(child_conn,), name="grammar-compile", daemon=True
        )
        self._process.start()
        child_conn.close()
        self._vocabularies: set[str] = set()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def compile(
        self, job: CompileJob, tokenizer_info: Any, timeout_s: float
    ) -> CompiledText | GrammarError | Overrun:
        """Compile `job` in the child and hand its grammar back within `timeout_s`: the
        result, or an `Overrun` (the child is still busy: call `kill` and use a new one).
        Raises `EOFError` or `OSError` when the child died or was killed meanwhile."""
        if job.vocabulary not in self._vocabularies:
            self._conn.send(("info", job.vocabulary, tokenizer_info.serialize_json()))
            if not self._conn.poll(SETUP_TIMEOUT_S):
                return Overrun()
            self._conn.recv()
            self._vocabularies.add(job.vocabulary)
        deadline = time.monotonic() + timeout_s
        self._conn.send(("compile", job))
        reply = self._receive(deadline, Overrun())
        if isinstance(reply, Compiled):  # compiled: now its serialisation, same deadline
            reply = self._receive(deadline, Overrun(reply))
        assert not isinstance(reply, Compiled)
        return reply

    def _receive(
        self, deadline: float, overrun: Overrun
    ) -> CompiledText | GrammarError | Compiled | Overrun:
        """The child's next message, or `overrun` when none came before `deadline`."""
        if not self._conn.poll(max(0.0, deadline - time.monotonic())):
            return overrun
        reply = self._conn.recv()
        assert isinstance(reply, CompiledText | GrammarError | Compiled)
        return reply

    def kill(self) -> None:
        """End the child now (SIGKILL), whatever it is doing."""
        self._process.kill()
        self._process.join(5)
        self._conn.close()


def serve(conn: Connection) -> None:
    """The child's loop: load tokenizer infos, compile jobs, until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the parent's to handle
    import xgrammar as xgr

    compilers: dict[str, Any] = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[0] == "info":
            _, vocabulary, info_json = message
            info = xgr.TokenizerInfo.deserialize_json(info_json)
            compilers[vocabulary] = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            conn.send(("ready", vocabulary))
        else:
            job: CompileJob = message[1]
            conn.send(compile_job(compilers[job.vocabulary], job, conn.send))


def compile_job(
    compiler: Any, job: CompileJob, notify: Callable[[Compiled], None] = lambda _: None
) -> CompiledText | GrammarError:
    """Check and compile `job.spec` with `compiler` (an xgrammar GrammarCompiler), then
    serialise it; `notify` hears when the compile ended and serialising starts."""
    start = time.perf_counter()
    try:
        problem = check_spec(job.spec, job.limits)
        if problem is not None:
            return problem
        handle = compile_spec(compiler, job.spec, job.any_whitespace)
    except Exception as exc:  # xgrammar's RuntimeError/ValueError name the problem
        return GrammarError(GrammarErrorCode.COMPILE, compile_message(exc))
    memory_bytes = int(handle.memory_size_bytes)
    limit = job.limits.max_grammar_bytes
    if memory_bytes > limit:
        return GrammarError(
            GrammarErrorCode.TOO_LARGE,
            f"The compiled grammar takes {memory_bytes >> 20} MiB; the limit is {limit >> 20} MiB.",
        )
    compiled = Compiled(memory_bytes, time.perf_counter() - start)
    notify(compiled)
    return handed_back(handle, compiled, job)


def handed_back(handle: Any, compiled: Compiled, job: CompileJob) -> CompiledText | GrammarError:
    """The compiled grammar serialised for the parent, or `TOO_LARGE` past the hand-back
    limit (the parent would take too long to rebuild it)."""
    serialized = handle.serialize_json()  # NOTE: counted in characters (nearly all ASCII)
    limit = job.limits.max_handback_bytes
    if len(serialized) > limit:
        why = f"it serialises to {_size(len(serialized))}, over the {_size(limit)} limit"
        return too_big_to_hand_back(job.spec.kind, compiled.memory_bytes, why)
    return CompiledText(serialized, compiled.memory_bytes, compiled.compile_s)


def _size(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.0f} MiB" if num_bytes >= 1 << 20 else f"{num_bytes} bytes"


def compile_spec(compiler: Any, spec: GrammarSpec, any_whitespace: bool) -> Any:
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


def compile_message(exc: Exception) -> str:
    """xgrammar's message without its C++ source prefix, on one line."""
    lines = [line for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    return _CPP_PREFIX.sub("", lines[0]).strip()


class _Popen(popen_forkserver.Popen):
    """The forkserver's Popen, except that the child never imports the parent's `__main__`.

    NOTE: multiprocessing re-imports the main module in every child: a script without an
    `if __name__ == "__main__"` guard (an `LLM.generate` script) would run again there, and
    `python -m gateway.cli` would load the whole gateway. The child needs only this module.
    """

    def _launch(self, process_obj: Any) -> None:
        prep_data = spawn.get_preparation_data(process_obj._name)
        prep_data.pop("init_main_from_name", None)
        prep_data.pop("init_main_from_path", None)
        buf = io.BytesIO()
        multiprocessing.context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            multiprocessing.context.set_spawning_popen(None)
        self.sentinel, w = forkserver.connect_to_new_process(self._fds)  # type: ignore[attr-defined]
        _parent_w = os.dup(w)
        close = util.close_fds  # type: ignore[attr-defined]  # (private, as the base class uses)
        self.finalizer = util.Finalize(self, close, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class _CompileChild(multiprocessing.context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> _Popen:
        _forkserver_context()  # the preload is set before the forkserver starts
        return _Popen(process_obj)


def _forkserver_context() -> multiprocessing.context.ForkServerContext:
    """The forkserver context, its server preloading xgrammar (set once per process).

    NOTE: the forkserver is started by a fresh interpreter, not forked from this threaded
    process, so its children are safe to fork; they share its imported pages.
    """
    global _context
    with _context_lock:
        if _context is None:
            context = multiprocessing.get_context("forkserver")
            assert isinstance(context, multiprocessing.context.ForkServerContext)
            context.set_forkserver_preload(["xgrammar", __name__])
            _context = context
        return _context
