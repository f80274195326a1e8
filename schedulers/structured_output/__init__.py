"""Structured outputs: grammar specs, their checks, a compiler off the engine thread, and the
per-sequence matcher state (docs/structured-outputs.md).

Importing this package imports neither xgrammar nor torch (the gateway validates specs with
it); `compiler.py` and `matcher.py` import xgrammar when they first compile or match.
"""

from schedulers.structured_output.compiler import CompiledGrammar, GrammarCompiler
from schedulers.structured_output.matcher import SequenceGrammar
from schedulers.structured_output.spec import (
    GrammarError,
    GrammarErrorCode,
    GrammarKind,
    GrammarLimits,
    GrammarSpec,
    check_depth,
    check_spec,
)

__all__ = [
    "CompiledGrammar",
    "GrammarCompiler",
    "SequenceGrammar",
    "GrammarError",
    "GrammarErrorCode",
    "GrammarKind",
    "GrammarLimits",
    "GrammarSpec",
    "check_depth",
    "check_spec",
]
