"""The table of served OpenAI endpoints: adding one is its entry here and its pipeline.

Routes (gateway/http/routes.py), metrics labels, the refusal accounting of the middlewares and
the upstream arms all read this table; nothing else lists endpoints. The Responses API's
store is injected here, when a table is built: the gateway builds its own over its store
(`GatewayState.endpoints`); `ENDPOINTS`, built with none, is what routes and labels are
declared from and what shadow copies are served by (nothing is found in it, nothing kept).
"""

from __future__ import annotations

from functools import partial

from gateway.api.chat.serving import ChatEndpoint
from gateway.api.completions.serving import CompletionEndpoint
from gateway.api.endpoint import TYPED_EVENTS, Endpoint
from gateway.api.protocol import ChatCompletionRequest, CompletionRequest
from gateway.api.responses.protocol import ResponsesRequest
from gateway.api.responses.serving import ResponsesEndpoint
from gateway.api.responses.store import ResponseStore


def endpoint_table(response_store: ResponseStore | None) -> tuple[Endpoint, ...]:
    """The served endpoints, the Responses API's keeping its responses in `response_store`
    (None: none are kept, and no `previous_response_id` is found)."""
    return (
        Endpoint("chat", "/v1/chat/completions", ChatCompletionRequest, ChatEndpoint),
        Endpoint("completions", "/v1/completions", CompletionRequest, CompletionEndpoint),
        Endpoint(
            "responses",
            "/v1/responses",
            ResponsesRequest,
            partial(ResponsesEndpoint, store=response_store),
            stream_format=TYPED_EVENTS,
            usage_via_stream_options=False,
        ),
    )


#: the table without a store: routes, metrics labels and shadow copies
ENDPOINTS: tuple[Endpoint, ...] = endpoint_table(None)

#: endpoint label by route path
BY_PATH = {endpoint.path: endpoint for endpoint in ENDPOINTS}
