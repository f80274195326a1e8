"""The table of served OpenAI endpoints: adding one is its entry here and its pipeline.

Routes (gateway/http/routes.py), metrics labels, the refusal accounting of the middlewares and
the upstream arms all read this table; nothing else lists endpoints.
"""

from __future__ import annotations

from gateway.api.chat.serving import ChatEndpoint
from gateway.api.completions.serving import CompletionEndpoint
from gateway.api.endpoint import TYPED_EVENTS, Endpoint
from gateway.api.protocol import ChatCompletionRequest, CompletionRequest
from gateway.api.responses.protocol import ResponsesRequest
from gateway.api.responses.serving import ResponsesEndpoint

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
