"""Tools: validated with their `param`, rendered for any template, calls constrained."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from backends.torch.testing.tiny_models import VOCAB, tiny_tokenizer
from gateway.api.outputs.tool_parser import parse_tool_calls
from gateway.api.outputs.tools import (
    FunctionTool,
    ParamProblem,
    ToolChoice,
    check_tools,
    format_tool_call,
    render_conversation,
    resolve_tool_choice,
    template_renders_tools,
    tool_grammar,
    tool_prompt,
)
from schedulers.structured_output import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarSpec,
    SequenceGrammar,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: any object
#: a template that ignores `tools` (as SmolLM2's does) and one that renders them (Qwen-like)
PLAIN_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TOOLS_TEMPLATE = (
    "{% if tools %}<|tools|>{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments.city }}]"
    "{% endfor %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tools(*specs: dict[str, Any]) -> list[FunctionTool]:
    checked = check_tools(list(specs))
    assert not isinstance(checked, ParamProblem), checked
    return checked


def problem_param(result: object) -> str | None:
    assert isinstance(result, ParamProblem), result
    return result.param


def test_valid_tools_pass_and_invalid_ones_name_their_param() -> None:
    assert [t.name for t in tools(WEATHER, TIME)] == ["get_weather", "get_time"]
    bad_name = {"type": "function", "function": {"name": "get weather!"}}
    assert problem_param(check_tools([WEATHER, bad_name])) == "tools[1].function.name"
    assert problem_param(check_tools([{"type": "web_search"}])) == "tools[0].type"
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}
    result = check_tools([bad_schema])
    assert problem_param(result) == "tools[0].function.parameters"
    assert isinstance(result, ParamProblem) and "Invalid JSON schema" in result.message
    unenforced = {"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}
    assert problem_param(check_tools([unenforced])) == "tools[0].function.parameters"
    assert problem_param(check_tools([WEATHER, WEATHER])) == "tools[1].function.name"
    assert problem_param(check_tools([{"type": "function"}])) == "tools[0].function"


def test_tool_choice_resolves_against_the_declared_tools() -> None:
    both = tools(WEATHER, TIME)
    assert resolve_tool_choice(None, both) == ToolChoice("auto", tuple(both))
    assert resolve_tool_choice(None, []) == ToolChoice("none", ())
    assert resolve_tool_choice("none", both) == ToolChoice("none", ())
    assert resolve_tool_choice("required", both) == ToolChoice("required", tuple(both))
    named = {"type": "function", "function": {"name": "get_time"}}
    assert resolve_tool_choice(named, both) == ToolChoice("required", (both[1],), forced=True)
    flat = {"type": "function", "name": "get_time"}  # the Responses API's shape
    assert resolve_tool_choice(flat, both) == ToolChoice("required", (both[1],), forced=True)
    allowed = {"type": "allowed_tools", "mode": "required", "tools": [flat]}
    assert resolve_tool_choice(allowed, both) == ToolChoice("required", (both[1],))


def test_tool_choice_problems_name_their_param() -> None:
    both = tools(WEATHER, TIME)
    unknown = {"type": "function", "function": {"name": "nope"}}
    assert problem_param(resolve_tool_choice(unknown, both)) == "tool_choice.function.name"
    assert problem_param(resolve_tool_choice("required", [])) == "tool_choice"
    assert problem_param(resolve_tool_choice("sometimes", both)) == "tool_choice"
    assert problem_param(resolve_tool_choice({"type": "file_search"}, both)) == "tool_choice.type"


@pytest.fixture(scope="module")
def plain_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = PLAIN_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def tools_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TOOLS_TEMPLATE
    return tokenizer


def test_a_template_that_ignores_tools_is_detected(
    plain_tokenizer: PreTrainedTokenizerFast, tools_tokenizer: PreTrainedTokenizerFast
) -> None:
    assert not template_renders_tools(plain_tokenizer)
    assert template_renders_tools(tools_tokenizer)
    assert not template_renders_tools(tiny_tokenizer())  # no template at all


HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_a",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
            },
            {
                "id": "call_b",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'},
            },
        ],
    },  # fmt: skip
    {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_b", "content": [{"type": "text", "text": "rain"}]},
]


def test_without_template_support_tools_and_history_become_plain_messages(
    plain_tokenizer: PreTrainedTokenizerFast,
) -> None:
    rendered = render_conversation(HISTORY, tools(WEATHER), renders_tools=False)
    assert not isinstance(rendered, ParamProblem) and rendered.tools is None
    system, user, assistant, results = rendered.messages
    assert system == {"role": "system", "content": "Be brief.\n\n" + tool_prompt(tools(WEATHER))}
    assert '"name": "get_weather"' in system["content"] and "<tools>" in system["content"]
    assert assistant["content"] == "\n".join(
        [format_tool_call("get_weather", '{"city": "Paris"}'),
         format_tool_call("get_weather", '{"city": "Rome"}')]
    )  # fmt: skip
    assert results == {
        "role": "user",
        "content": "<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nrain\n</tool_response>",
    }
    prompt = plain_tokenizer.apply_chat_template(
        rendered.messages, tokenize=False, add_generation_prompt=True
    )
    assert "<tool_call>" in prompt and "None" not in prompt
    calls = parse_tool_calls(assistant["content"]).tool_calls
    assert [c.arguments for c in calls] == ['{"city": "Paris"}', '{"city": "Rome"}']


def test_without_a_system_message_the_tool_prompt_becomes_one() -> None:
    rendered = render_conversation(HISTORY[1:2], tools(TIME), renders_tools=False)
    assert not isinstance(rendered, ParamProblem)
    assert rendered.messages[0] == {"role": "system", "content": tool_prompt(tools(TIME))}
    no_tools = render_conversation(HISTORY[1:2], [], renders_tools=False)
    assert not isinstance(no_tools, ParamProblem) and len(no_tools.messages) == 1


def test_with_template_support_the_template_gets_the_tools_and_the_history(
    tools_tokenizer: PreTrainedTokenizerFast,
) -> None:
    rendered = render_conversation(HISTORY, tools(WEATHER), renders_tools=True)
    assert not isinstance(rendered, ParamProblem)
    assert rendered.tools == [tools(WEATHER)[0].as_openai()]
    assert rendered.messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert [m["role"] for m in rendered.messages] == ["system", "user", "assistant", "tool", "tool"]
    prompt = tools_tokenizer.apply_chat_template(
        rendered.messages, tools=rendered.tools, tokenize=False, add_generation_prompt=True
    )
    assert "<|tools|>get_weather;" in prompt and "[call get_weather Paris]" in prompt


def test_tool_messages_must_answer_an_earlier_call() -> None:
    missing = [*HISTORY[:3], {"role": "tool", "content": "sunny"}]
    assert problem_param(render_conversation(missing, [], renders_tools=False)) == (
        "messages[3].tool_call_id"
    )
    unknown = [*HISTORY[:3], {"role": "tool", "tool_call_id": "call_zzz", "content": "x"}]
    assert problem_param(render_conversation(unknown, [], renders_tools=True)) == (
        "messages[3].tool_call_id"
    )
    bad_call = [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f",
                 "arguments": {"not": "a string"}}}]}]  # fmt: skip
    assert problem_param(render_conversation(bad_call, [], renders_tools=False)) == (
        "messages[0].tool_calls[0].function.arguments"
    )


# -- the constraints, compiled ----------------------------------------------------------


@pytest.fixture(scope="module")
def compiler() -> Iterator[GrammarCompiler]:
    tokenizer = tiny_tokenizer()
    grammar_compiler = GrammarCompiler(
        tokenizer, vocab_size=VOCAB, stop_token_ids=[tokenizer.eos_token_id]
    )
    yield grammar_compiler
    grammar_compiler.close()


def accepts(compiler: GrammarCompiler, choice: Any, text: str, parallel: bool = True) -> bool:
    """Whether the whole of `text` is a complete output under the tool constraint."""
    resolved = resolve_tool_choice(choice, tools(WEATHER, TIME))
    assert not isinstance(resolved, ParamProblem)
    spec = tool_grammar(resolved, parallel_tool_calls=parallel)
    assert spec is not None
    grammar = compiler.compile(spec)
    assert isinstance(grammar, CompiledGrammar), grammar
    state = SequenceGrammar(grammar)
    tokenizer = tiny_tokenizer()
    ok = all(state.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))
    return ok and state.is_completed


PARIS = format_tool_call("get_weather", '{"city": "Paris"}')
NOW = format_tool_call("get_time", "{}")


def test_required_allows_only_valid_calls_of_declared_tools(compiler: GrammarCompiler) -> None:
    assert accepts(compiler, "required", PARIS)
    assert accepts(compiler, "required", PARIS + "\n" + NOW)
    assert not accepts(compiler, "required", "The weather is nice.")
    assert not accepts(compiler, "required", format_tool_call("get_news", "{}"))
    assert not accepts(compiler, "required", format_tool_call("get_weather", '{"days": 2}'))
    assert not accepts(compiler, "required", format_tool_call("get_weather", '{"city": 5}'))
    assert not accepts(compiler, "required", PARIS + "\n" + NOW, parallel=False)


def test_a_named_function_allows_exactly_one_call_of_it(compiler: GrammarCompiler) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    assert accepts(compiler, named, NOW)
    assert not accepts(compiler, named, PARIS)
    assert not accepts(compiler, named, NOW + "\n" + NOW)


def test_auto_allows_text_and_makes_a_started_call_valid(compiler: GrammarCompiler) -> None:
    assert accepts(compiler, "auto", "Just chatting, no tools needed.")
    assert accepts(compiler, "auto", "Checking. " + PARIS + " Done.")
    assert not accepts(compiler, "auto", "Checking. " + format_tool_call("get_weather", "{}"))
    assert tool_grammar(ToolChoice("none", ())) is None


def test_what_the_grammar_accepts_parses_back_to_the_same_call(compiler: GrammarCompiler) -> None:
    text = format_tool_call("get_weather", '{"city": "Oslo", "days": 3}')
    assert accepts(compiler, "required", text)
    (call,) = parse_tool_calls(text).tool_calls
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Oslo", "days": 3}')


@pytest.mark.real_model
def test_the_default_models_template_ignores_tools_and_renders_the_plain_history() -> None:
    from transformers import AutoTokenizer

    from backends.torch.loader import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("default"))
    assert not template_renders_tools(tokenizer)
    rendered = render_conversation(HISTORY, tools(WEATHER), renders_tools=False)
    assert not isinstance(rendered, ParamProblem)
    prompt = tokenizer.apply_chat_template(
        rendered.messages, tokenize=False, add_generation_prompt=True
    )
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert "<tool_response>\nsunny\n</tool_response>" in prompt


def test_auto_with_an_answer_format_allows_calls_or_a_valid_answer_only(
    compiler: GrammarCompiler,
) -> None:
    answer = GrammarSpec.json_schema({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                      "required": ["ok"]})  # fmt: skip
    both = tools(WEATHER, TIME)
    spec = tool_grammar(ToolChoice("auto", tuple(both)), answer=answer)
    assert spec is not None
    grammar = compiler.compile(spec)
    assert isinstance(grammar, CompiledGrammar), grammar
    tokenizer = tiny_tokenizer()

    def complete(text: str) -> bool:
        state = SequenceGrammar(grammar)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return all(state.accept(t) for t in ids) and state.is_completed

    assert complete('{"ok": true}') and complete(PARIS) and complete(PARIS + "\n" + NOW)
    assert not complete("free text") and not complete('{"ok": 1}')
    assert tool_grammar(ToolChoice("none", ()), answer=answer) == answer
    assert tool_grammar(ToolChoice("required", tuple(both)), answer=answer) == tool_grammar(
        ToolChoice("required", tuple(both))
    )
