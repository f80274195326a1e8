"""/v1/responses: protocol, conversion to chat, stream events, the response store."""
