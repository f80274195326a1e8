"""Tool calls parsed out of generated text, whole or streamed: both always agree."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.api.outputs.tool_parser import (
    ParsedOutput,
    ToolCall,
    ToolCallDelta,
    ToolCallStreamParser,
    chat_finish_reason,
    new_call_id,
    parse_tool_calls,
)

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def test_only_calls_give_null_content_and_the_arguments_as_written() -> None:
    parsed = parse_tool_calls(CALL + "\n" + CALL.replace("Paris", "Rome"), ids())
    assert parsed.content is None
    assert parsed.tool_calls == [
        ToolCall("call_0", "get_weather", '{"city": "Paris"}'),
        ToolCall("call_1", "get_weather", '{"city": "Rome"}'),
    ]


def test_text_around_calls_is_content_stripped() -> None:
    parsed = parse_tool_calls(f"  Let me look.\n{CALL}\nDone. ", ids())
    assert parsed.content == "Let me look.\n\nDone."
    assert [c.name for c in parsed.tool_calls] == ["get_weather"]
    assert parse_tool_calls("just text") == ParsedOutput("just text", [])
    assert parse_tool_calls("") == ParsedOutput("", [])


def test_a_call_without_a_header_is_given_back_as_content_never_dropped() -> None:
    text = "<tool_call>not json</tool_call> then"
    assert parse_tool_calls(text) == ParsedOutput(text, [])
    unfinished = "Hi <tool_call>\n{"
    assert parse_tool_calls(unfinished) == ParsedOutput(unfinished, [])


def test_other_key_orders_and_a_parameters_key_still_parse() -> None:
    parsed = parse_tool_calls('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', ids())
    assert parsed.tool_calls == [ToolCall("call_0", "f", '{"a": 1}')]
    parsed = parse_tool_calls('<tool_call>{"name": "f", "parameters": {}}</tool_call>', ids())
    assert parsed.tool_calls == [ToolCall("call_0", "f", "{}")]


def test_a_call_cut_short_keeps_the_arguments_written_so_far() -> None:
    parsed = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {"q": "abc', ids())
    assert parsed.tool_calls == [ToolCall("call_0", "f", '{"q": "abc')]
    assert parsed.content is None


def test_braces_and_tags_inside_argument_strings_do_not_end_the_call() -> None:
    args = {"code": "if x: {print('}')}", "note": "</tool_call> is a tag", "q": '"quoted"'}
    text = f'<tool_call>{{"name": "run", "arguments": {json.dumps(args)}}}</tool_call>'
    (call,) = parse_tool_calls(text).tool_calls
    assert json.loads(call.arguments) == args


def test_streaming_sends_the_header_first_then_argument_fragments() -> None:
    parser = ToolCallStreamParser(ids())
    events = []
    for chunk in ["Sure.", " <tool", '_call>\n{"name": "get_', 'weather", "arguments": {"ci']:
        events += parser.feed(chunk)
    events += parser.feed('ty": "Paris"}}\n</tool_call>')
    events += parser.finish()
    assert events == [
        "Sure.",
        ToolCallDelta(0, id="call_0", name="get_weather", arguments=""),
        ToolCallDelta(0, arguments='{"ci'),
        ToolCallDelta(0, arguments='ty": "Paris"}'),
    ]


def test_whitespace_before_the_arguments_is_not_part_of_them_however_it_is_split() -> None:
    parser = ToolCallStreamParser(ids())
    events = parser.feed('<tool_call>{"name": "f", "arguments":') + parser.feed(" ")
    events += parser.feed(' {"a": 1}}</tool_call>') + parser.finish()
    assert reassemble(events).tool_calls == [ToolCall("call_0", "f", '{"a": 1}')]


def test_a_partial_tag_is_held_back_and_released_when_it_is_not_a_call() -> None:
    parser = ToolCallStreamParser()
    assert parser.feed("Hello <tool") == ["Hello"]
    assert parser.feed("box> ok") == [" <toolbox> ok"]
    assert parser.finish() == []


def test_call_ids_look_like_openais() -> None:
    call_id = new_call_id()
    assert call_id.startswith("call_") and len(call_id) == 29 and call_id[5:].isalnum()
    assert new_call_id() != call_id


def reassemble(events: list[str | ToolCallDelta]) -> ParsedOutput:
    """What an OpenAI client rebuilds from the stream (checking the delta order rules)."""
    content = ""
    calls: dict[int, dict[str, str]] = {}
    for event in events:
        if isinstance(event, str):
            content += event
            continue
        if event.index not in calls:
            assert event.id and event.name and event.arguments == "", "header first"
            assert event.index == len(calls), "indexes count up from 0"
            calls[event.index] = {"id": event.id, "name": event.name, "arguments": ""}
        else:
            assert event.id is None and event.name is None
            calls[event.index]["arguments"] += event.arguments
    tool_calls = [ToolCall(c["id"], c["name"], c["arguments"]) for c in calls.values()]
    return ParsedOutput(content or (None if tool_calls else ""), tool_calls)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=6,
)
NAMES = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_-]{0,10}", fullmatch=True)
SPACE = st.sampled_from(["", " ", "\n", "  \n"])


@st.composite
def calls(draw: st.DrawFn) -> str:
    arguments = json.dumps(draw(st.dictionaries(st.text(max_size=5), JSON_VALUES, max_size=3)))
    name = draw(NAMES)
    s = [draw(SPACE) for _ in range(5)]
    header = f'{{"name": "{name}",{s[1]}"arguments":{s[2]}'
    return f"<tool_call>{s[0]}{header}{arguments}{s[3]}}}{s[4]}</tool_call>"


TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
NOISE = st.sampled_from(["<", "<tool", "<tool_call", "</tool_call>", "{", '"', "}"])
OUTPUTS = st.lists(st.one_of(calls(), TEXT, NOISE, SPACE), max_size=6).map("".join)


@settings(max_examples=300, deadline=None)
@given(output=OUTPUTS, data=st.data())
def test_any_split_of_an_output_streams_the_same_calls_and_content(
    output: str, data: st.DataObject
) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(output)), max_size=12)))
    chunks = [output[a:b] for a, b in zip([0, *cuts], [*cuts, len(output)], strict=True)]
    parser = ToolCallStreamParser(ids())
    events = [event for chunk in chunks for event in parser.feed(chunk)] + parser.finish()
    whole = parse_tool_calls(output, ids())
    assert reassemble(events) == whole == parser.result()


@settings(max_examples=100, deadline=None)
@given(pieces=st.lists(calls(), min_size=1, max_size=3), data=st.data())
def test_valid_calls_always_parse_back_to_their_names_and_arguments(
    pieces: list[str], data: st.DataObject
) -> None:
    output = "\n".join(pieces)
    cut = data.draw(st.integers(0, len(output)))
    parser = ToolCallStreamParser(ids())
    events = parser.feed(output[:cut]) + parser.feed(output[cut:]) + parser.finish()
    parsed = reassemble(events)
    assert parsed.content is None
    assert len(parsed.tool_calls) == len(pieces)
    for piece, call in zip(pieces, parsed.tool_calls, strict=True):
        body = json.loads(piece.removeprefix("<tool_call>").removesuffix("</tool_call>"))
        assert call.name == body["name"]
        assert json.loads(call.arguments) == body["arguments"]


def test_the_sdk_reassembles_our_chat_chunks_into_the_same_message() -> None:
    """Chat chunks carrying our deltas, through the openai SDK's own stream accumulator."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    output = "Checking. " + CALL + "\n" + CALL.replace("Paris", "Oslo")
    parser = ToolCallStreamParser(ids())
    chunks = [output[i : i + 7] for i in range(0, len(output), 7)]
    events = [e for chunk in chunks for e in parser.feed(chunk)] + parser.finish()
    parsed = parser.result()
    state: ChatCompletionStreamState[object] = ChatCompletionStreamState()

    def chunk(delta: dict[str, object], finish_reason: str | None = None) -> None:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        body = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m"}
        body["choices"] = [choice]
        state.handle_chunk(ChatCompletionChunk.model_validate(body))

    chunk({"role": "assistant", "content": ""})
    for event in events:
        if isinstance(event, str):
            chunk({"content": event})
        else:
            chunk({"tool_calls": [event.as_openai()]})
    chunk({}, chat_finish_reason(bool(parsed.tool_calls), "stop"))
    final = state.get_final_completion()
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert message.content == parsed.content == "Checking."
    rebuilt = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert rebuilt == [(c.id, c.name, c.arguments) for c in parsed.tool_calls]
    assert [c.index for c in message.tool_calls or []] == [0, 1]
    body = {"id": "c", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": None,
                "tool_calls": [c.as_openai() for c in parsed.tool_calls]}}]}  # fmt: skip
    assert ChatCompletion.model_validate(body).choices[0].message.tool_calls is not None
    assert chat_finish_reason(True, "length") == "length"
    assert chat_finish_reason(False, "stop") == "stop"
