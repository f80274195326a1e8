"""What a request's output must be, decided before anything is queued: its tools, its
`tool_choice`, the grammar that constrains it, and whether calls are parsed back out.

    plan = await off_loop(chat_plan, request)       # 400 naming the param, or a plan
    pending = start_compile(compiler, plan, who)    # the arm's GrammarCompiler, off-thread
    grammar = await finish_compile(pending, plan)   # 400 / 503 before the engine sees it

Checking and analysing schemas costs time a request controls, so `off_loop` runs it on the
schema threads under a budget (`SCHEMA_CHECK_BUDGET_S`; past it, a 400 `schema_too_complex`):
the event loop, `/health` and every other request go on meanwhile.

The request-shaping helpers (response_format.py, tool_calls.py) return problems as values;
here they become OpenAI-shaped errors. A `GrammarError` from the compiler becomes a 400 with
the `param` the grammar came from (its `code` is the error's: `invalid_grammar`,
`unsupported_grammar_feature`, `grammar_too_large`, `grammar_compile_timeout`, ...), or a
503 for `grammar_compiler_busy`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from gateway.api.errors import APIError, invalid, not_found, unavailable
from gateway.api.outputs.response_format import (
    grammar_for_response_format,
    grammar_for_structured_outputs,
)
from gateway.api.outputs.tools import (
    FunctionTool,
    ToolChoice,
    check_tools,
    resolve_tool_choice,
    tool_grammar,
)
from gateway.api.problems import ParamProblem
from schedulers.structured_output import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarError,
    GrammarErrorCode,
    GrammarSpec,
    check_spec,
)
from schedulers.structured_output.schema_support import SchemaBudgetExceeded, schema_budget

NO_TOOLS = ToolChoice("none", ())
#: wall time one request's tool and answer schemas may take to check and analyse
SCHEMA_CHECK_BUDGET_S = 2.0
#: the threads schema work runs on (off the event loop; each request within its budget)
_SCHEMA_THREADS = ThreadPoolExecutor(4, thread_name_prefix="schema-check")


@dataclass(frozen=True)
class OutputPlan:
    """The output constraint of one request (see the module docstring).

    `tools` are the declared tools (shown to the model while `tool_choice` allows calls);
    `spec` the grammar (None: unconstrained), and `spec_param` the request field named when
    it cannot be compiled.
    """

    tools: tuple[FunctionTool, ...] = ()
    tool_choice: ToolChoice = NO_TOOLS
    spec: GrammarSpec | None = None
    spec_param: str | None = None
    #: the Responses API's conversation as chat messages (None: the endpoint's own)
    messages: list[dict[str, Any]] | None = None
    #: anything else the endpoint keeps for this request (the Responses history)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def parses_tools(self) -> bool:
        """Whether the output is read for `<tool_call>` blocks."""
        return self.tool_choice.mode != "none"

    @property
    def shown_tools(self) -> tuple[FunctionTool, ...]:
        """The tools the prompt shows: the declared ones, unless calls are off."""
        return self.tools if self.parses_tools else ()


def problem_error(problem: ParamProblem) -> APIError:
    """The OpenAI error of a problem (400, or its own status: 404 for a missing id)."""
    if problem.status == 404:
        return not_found(problem.message, problem.param, problem.code)
    return invalid(problem.message, problem.param, problem.code)


def answer_spec(request: Any) -> tuple[GrammarSpec | None, str | None]:
    """The output format of a chat or completions request: `response_format` or vLLM's
    `structured_outputs` (not both), with the param a compile error names."""
    by_format = grammar_for_response_format(request.response_format)
    if isinstance(by_format, ParamProblem):
        raise problem_error(by_format)
    by_outputs = grammar_for_structured_outputs(request.structured_outputs)
    if isinstance(by_outputs, ParamProblem):
        raise problem_error(by_outputs)
    if by_format is not None and by_outputs is not None:
        raise invalid(
            "Set either response_format or structured_outputs, not both.", "structured_outputs"
        )
    if by_format is not None:
        return by_format, _format_param(request.response_format)
    if by_outputs is not None:
        key = next(k for k, v in request.structured_outputs.items() if v not in (None, False))
        return by_outputs, f"structured_outputs.{key}"
    return None, None


def tools_plan(
    tools: Sequence[Any] | None,
    tool_choice: Any,
    parallel_tool_calls: bool,
    answer: GrammarSpec | None,
    answer_param: str | None,
    rename: dict[str, str] | None = None,
) -> OutputPlan:
    """Validate tools and `tool_choice`, and the grammar of both with the answer format.
    `rename` maps chat param spellings to the endpoint's (the Responses API's flat tools)."""
    if not tools and tool_choice not in (None, "none"):
        raise invalid(
            "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are "
            "specified.",
            "tool_choice",
        )
    checked = check_tools(tools)
    if isinstance(checked, ParamProblem):
        raise problem_error(_renamed(checked, rename))
    choice = resolve_tool_choice(tool_choice, checked)
    if isinstance(choice, ParamProblem):
        raise problem_error(_renamed(choice, rename))
    constrains_calls = choice.mode != "none" and bool(choice.tools)
    if constrains_calls and answer is not None:
        # NOTE: checked alone first, so a bad answer schema is named as such, not as `tools`
        error = check_spec(answer)
        if error is not None:
            raise grammar_error(error, answer_param)
    spec = tool_grammar(choice, parallel_tool_calls, answer)
    return OutputPlan(
        tools=tuple(checked),
        tool_choice=choice,
        spec=spec,
        spec_param=("tools" if constrains_calls else answer_param),
    )


def chat_plan(request: Any) -> OutputPlan:
    """The plan of a chat completions request."""
    answer, param = answer_spec(request)
    return tools_plan(
        request.tools, request.tool_choice, request.parallel_tool_calls is not False, answer, param
    )


def completion_plan(request: Any) -> OutputPlan:
    """The plan of a completions request (a format, never tools)."""
    answer, param = answer_spec(request)
    return OutputPlan(spec=answer, spec_param=param)


def has_schemas(request: Any) -> bool:
    """Whether a chat or completions request declares tools or an output format (whose
    schemas `off_loop` should check)."""
    return bool(
        getattr(request, "tools", None)
        or getattr(request, "response_format", None) is not None
        or getattr(request, "structured_outputs", None)
    )


async def off_loop(build: Callable[..., OutputPlan], *args: Any) -> OutputPlan:
    """`build(*args)` (chat_plan, tools_plan, ...) on the schema threads, within
    `SCHEMA_CHECK_BUDGET_S`: the plan, its errors, or a 400 `schema_too_complex` past it.

    NOTE: the spec's normalised form (the compiler's failure key) is computed there too, so
    nothing proportional to the schemas runs on the event loop.
    """
    budget_s = SCHEMA_CHECK_BUDGET_S

    def run() -> OutputPlan:
        with schema_budget(budget_s):
            plan = build(*args)
            if plan.spec is not None:
                _ = plan.spec.normalized
            return plan

    try:
        return await asyncio.get_running_loop().run_in_executor(_SCHEMA_THREADS, run)
    except SchemaBudgetExceeded as exc:
        raise invalid(
            f"{exc} Simplify the tools' parameters or the output format's schema.",
            None,
            "schema_too_complex",
        ) from None


# -- compiling -----------------------------------------------------------------------------

PendingGrammar = Future[CompiledGrammar | GrammarError] | None


def start_compile(
    compiler: GrammarCompiler | None, plan: OutputPlan, principal: str = "anonymous"
) -> PendingGrammar:
    """Submit the plan's grammar to the arm's compiler (None: nothing to compile), on behalf
    of `principal` (whose compiles in flight the compiler caps).

    Raises a 400 naming the grammar's param when the arm cannot constrain its output."""
    if plan.spec is None:
        return None
    if compiler is None:
        raise invalid(
            "This model's backend cannot constrain its output (no grammar compiler), so it "
            "serves neither structured outputs nor tools.",
            plan.spec_param,
            "structured_outputs_unsupported",
        )
    future: Future[CompiledGrammar | GrammarError] = compiler.submit(plan.spec, principal)
    return future


async def finish_compile(
    pending: PendingGrammar, plan: OutputPlan, retry_after_s: int = 1
) -> CompiledGrammar | None:
    """Await the compile: the grammar, or the OpenAI error of why it cannot be served."""
    if pending is None:
        return None
    result = await asyncio.wrap_future(pending)
    if isinstance(result, GrammarError):
        raise grammar_error(result, plan.spec_param, retry_after_s)
    return result


def grammar_error(error: GrammarError, param: str | None, retry_after_s: int = 1) -> APIError:
    """400 naming `param` (503 with Retry-After when the compiler is busy)."""
    if error.code is GrammarErrorCode.BUSY:
        return unavailable(error.message, retry_after_s, str(error.code))
    return invalid(error.message, param, str(error.code))


def _format_param(response_format: Any) -> str:
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    return "response_format.json_schema.schema" if kind == "json_schema" else "response_format"


def _renamed(problem: ParamProblem, rename: dict[str, str] | None) -> ParamProblem:
    if not rename or problem.param is None:
        return problem
    param = problem.param
    for old, new in rename.items():
        param = param.replace(old, new)
    return ParamProblem(param, problem.message, problem.code, problem.status)
