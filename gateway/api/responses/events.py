"""Build a Responses API output, streamed or whole, from what the model generates.

`ResponseBuilder` takes the events of a `ToolCallStreamParser` (content text and tool call
deltas; plain text deltas when the request has no tools) and emits the typed stream events
in OpenAI's order, each with the next `sequence_number`:

    response.created, response.in_progress,
    per text item:  output_item.added, content_part.added, output_text.delta...,
                    output_text.done, content_part.done, output_item.done
    per call item:  output_item.added, function_call_arguments.delta...,
                    function_call_arguments.done, output_item.done
    response.completed (response.incomplete when max_output_tokens cut it; response.failed)

A non-streaming request feeds the same builder and returns `builder.response`, so both
paths produce the same output items.
"""

from __future__ import annotations

from collections.abc import Iterable

from gateway.api.outputs.tool_parser import StreamEvent, ToolCallDelta
from gateway.api.responses.protocol import (
    ContentPartEvent,
    FunctionCall,
    FunctionCallArgumentsDeltaEvent,
    FunctionCallArgumentsDoneEvent,
    IncompleteDetails,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    OutputTextDeltaEvent,
    OutputTextDoneEvent,
    ResponseError,
    ResponseLifecycleEvent,
    ResponseObject,
    ResponseStreamEvent,
    ResponseUsage,
)


class ResponseBuilder:
    """One response's output and its event stream (see the module docstring).

    `response` starts as the request's skeleton (`status: in_progress`, no output); call
    `start()` once, `feed(events)` per generated delta, then `finish(...)` or `fail(...)`.
    """

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self._sequence = 0
        self._open: OutputMessage | FunctionCall | None = None
        self._calls: dict[int, FunctionCall] = {}  # parser call index -> its item
        # NOTE: the open message's deltas, joined into its text when it closes (and emptied
        # there, before any next message opens): `text +=` would copy the whole text at every
        # token (quadratic in the output's length)
        self._deltas: list[str] = []

    def start(self) -> list[ResponseStreamEvent]:
        return [
            self._lifecycle("response.created"),
            self._lifecycle("response.in_progress"),
        ]

    def feed(self, events: Iterable[StreamEvent]) -> list[ResponseStreamEvent]:
        out: list[ResponseStreamEvent] = []
        for event in events:
            if isinstance(event, str):
                out += self._text(event)
            elif event.name is not None:
                out += self._begin_call(event)
            else:
                out += self._arguments(event)
        return out

    def finish(
        self, usage: ResponseUsage, finish_reason: str | None = "stop"
    ) -> list[ResponseStreamEvent]:
        """Close the open item and end the response: `length` -> `incomplete`
        (reason `max_output_tokens`), anything else -> `completed`."""
        out = self._close()
        self.response.usage = usage
        if finish_reason == "length":
            self.response.status = "incomplete"
            self.response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
            out.append(self._lifecycle("response.incomplete"))
        else:
            self.response.status = "completed"
            out.append(self._lifecycle("response.completed"))
        return out

    def fail(self, message: str, code: str = "server_error") -> list[ResponseStreamEvent]:
        """End the response with an error (after the 200 was sent)."""
        out = self._close(status="incomplete")
        self.response.status = "failed"
        self.response.error = ResponseError(code=code, message=message)
        out.append(self._lifecycle("response.failed"))
        return out

    # -- items --------------------------------------------------------------------------

    def _text(self, delta: str) -> list[ResponseStreamEvent]:
        out: list[ResponseStreamEvent] = []
        if not isinstance(self._open, OutputMessage):
            out += self._close()
            message = OutputMessage()
            out.append(self._item("response.output_item.added", message))
            message.content.append(OutputText())
            out.append(self._part("response.content_part.added", message))
            self._open = message
        message = self._open
        self._deltas.append(delta)
        out.append(
            OutputTextDeltaEvent(
                sequence_number=self._next(),
                item_id=message.id,
                output_index=self._index(message),
                content_index=0,
                delta=delta,
            )
        )
        return out

    def _begin_call(self, event: ToolCallDelta) -> list[ResponseStreamEvent]:
        out = self._close()
        assert event.id is not None and event.name is not None
        call = FunctionCall(call_id=event.id, name=event.name)
        self._calls[event.index] = call
        out.append(self._item("response.output_item.added", call))
        self._open = call
        return out

    def _arguments(self, event: ToolCallDelta) -> list[ResponseStreamEvent]:
        call = self._calls[event.index]
        if not event.arguments:
            return []
        call.arguments += event.arguments
        return [
            FunctionCallArgumentsDeltaEvent(
                sequence_number=self._next(),
                item_id=call.id,
                output_index=self._index(call),
                delta=event.arguments,
            )
        ]

    def _close(self, status: str = "completed") -> list[ResponseStreamEvent]:
        """The done events of the open item, if any."""
        item, self._open = self._open, None
        if item is None:
            return []
        out: list[ResponseStreamEvent] = []
        index = self._index(item)
        if isinstance(item, OutputMessage):
            part = item.content[0]
            part.text = "".join(self._deltas)
            self._deltas = []
            out.append(
                OutputTextDoneEvent(
                    sequence_number=self._next(),
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    text=part.text,
                )
            )
            out.append(self._part("response.content_part.done", item))
        else:
            out.append(
                FunctionCallArgumentsDoneEvent(
                    sequence_number=self._next(),
                    item_id=item.id,
                    output_index=index,
                    name=item.name,
                    arguments=item.arguments,
                )
            )
        item.status = "completed" if status == "completed" else "incomplete"
        out.append(self._item("response.output_item.done", item))
        return out

    # -- events -------------------------------------------------------------------------

    def _next(self) -> int:
        number = self._sequence
        self._sequence += 1
        return number

    def _index(self, item: OutputMessage | FunctionCall) -> int:
        return next(i for i, existing in enumerate(self.response.output) if existing is item)

    def _item(self, kind: str, item: OutputMessage | FunctionCall) -> OutputItemEvent:
        if kind == "response.output_item.added":
            self.response.output.append(item)
        return OutputItemEvent(
            sequence_number=self._next(),
            type=kind,  # type: ignore[arg-type]
            output_index=self._index(item),
            item=item.model_copy(deep=True),
        )

    def _part(self, kind: str, message: OutputMessage) -> ContentPartEvent:
        return ContentPartEvent(
            sequence_number=self._next(),
            type=kind,  # type: ignore[arg-type]
            item_id=message.id,
            output_index=self._index(message),
            content_index=0,
            part=message.content[0].model_copy(),
        )

    def _lifecycle(self, kind: str) -> ResponseLifecycleEvent:
        return ResponseLifecycleEvent(
            sequence_number=self._next(),
            type=kind,  # type: ignore[arg-type]
            response=self.response.model_copy(deep=True),
        )
