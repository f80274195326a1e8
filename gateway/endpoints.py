"""The table of served OpenAI endpoints: adding one is its entry here and its pipeline.

Routes (gateway/routes.py), metrics labels, the refusal accounting of the middlewares and
the upstream arms all read this table; nothing else lists endpoints.
"""

from __future__ import annotations

from gateway.endpoint import TYPED_EVENTS, Endpoint
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.protocol_responses import ResponsesRequest
from gateway.serving_chat import ChatEndpoint
from gateway.serving_completion import CompletionEndpoint
from gateway.serving_responses import ResponsesEndpoint

ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("chat", "/v1/chat/completions", ChatCompletionRequest, ChatEndpoint()),
    Endpoint("completions", "/v1/completions", CompletionRequest, CompletionEndpoint()),
    Endpoint(
        "responses",
        "/v1/responses",
        ResponsesRequest,
        ResponsesEndpoint(),
        stream_format=TYPED_EVENTS,
        usage_via_stream_options=False,
    ),
)

#: endpoint label by route path
BY_PATH = {endpoint.path: endpoint for endpoint in ENDPOINTS}
