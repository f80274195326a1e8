"""The prompt text of a conversation: the chat template over its messages and the plan's
tools. Chat completions and the Responses API render their prompts alike (the Responses API
converts its input items to chat messages first), so the rendering is here, for both.
"""

from __future__ import annotations

from typing import Any

from gateway.api.errors import invalid
from gateway.api.outputs.plan import OutputPlan, problem_error
from gateway.api.outputs.tools import render_conversation
from gateway.api.pipeline import EngineRuntime
from gateway.api.problems import ParamProblem


def chat_prompt(
    runtime: EngineRuntime, messages: list[dict[str, Any]], plan: OutputPlan, param: str
) -> str:
    """The prompt text of a conversation with the plan's tools (gateway/api/outputs/tools.py
    renders the tools and the call history for templates that ignore them); a 400 naming
    `param` for a conversation it cannot render."""
    rendered = render_conversation(
        messages, plan.shown_tools, renders_tools=runtime.renders_tools, param=param
    )
    if isinstance(rendered, ParamProblem):
        raise problem_error(rendered)
    return render_prompt(runtime.tokenizer, rendered.messages, rendered.tools)


def render_prompt(
    tokenizer: Any, turns: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> str:
    """The model's chat template over `turns` (and `tools`), ready to generate the next
    assistant turn; a 400 when the model has none or the template refuses the turns."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise invalid(
            "This model has no chat template, so it cannot serve chat completions; "
            "use /v1/completions.",
            "messages",
        )
    try:
        text = tokenizer.apply_chat_template(
            turns, tools=tools, tokenize=False, add_generation_prompt=True
        )
    except Exception as exc:  # jinja TemplateError, ValueError: the template refused them
        raise invalid(
            f"The chat template cannot render these messages: {exc}", "messages"
        ) from None
    return str(text)
