"""The table of served OpenAI endpoints: adding one is its entry here and its pipeline.

Routes (gateway/routes.py), metrics labels, the refusal accounting of the middlewares and
the upstream arms all read this table; nothing else lists endpoints.
"""

from __future__ import annotations

from gateway.endpoint import Endpoint
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.serving_chat import ChatEndpoint
from gateway.serving_completion import CompletionEndpoint

ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("chat", "/v1/chat/completions", ChatCompletionRequest, ChatEndpoint()),
    Endpoint("completions", "/v1/completions", CompletionRequest, CompletionEndpoint()),
)

#: endpoint label by route path
BY_PATH = {endpoint.path: endpoint for endpoint in ENDPOINTS}
