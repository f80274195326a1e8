"""The HTTP surface: routes, middleware, API-key auth, Server-Sent Events."""
