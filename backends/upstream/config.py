"""Configuration of one upstream arm: where its replicas live and how patiently to talk to them."""

from __future__ import annotations

from dataclasses import dataclass

import httpx


@dataclass(frozen=True, repr=False)
class UpstreamConfig:
    """One OpenAI-compatible upstream model served by one or more replicas.

    `base_urls` end where the OpenAI paths begin, e.g. ``"http://127.0.0.1:8001/v1"``.
    `api_key` is sent as ``Authorization: Bearer``; ``repr`` hides it and URL credentials.
    `read_timeout_s` bounds the wait for each chunk (and for the response headers), not
    the whole request. `health_interval_s <= 0` disables the background health checks.
    `retries` is how many *other* replicas are tried after a connect error or a 5xx
    before the first byte, so at most ``min(1 + retries, len(base_urls))`` attempts.
    """

    base_urls: tuple[str, ...]
    model: str
    api_key: str | None = None
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0
    health_interval_s: float = 10.0
    max_connections: int = 256
    retries: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.base_urls, str):
            raise ValueError("base_urls must be a sequence of URLs, not one string")
        object.__setattr__(self, "base_urls", tuple(self.base_urls))
        if not self.base_urls:
            raise ValueError("an upstream needs at least one base URL")
        for url in self.base_urls:
            if httpx.URL(url).scheme not in ("http", "https"):
                raise ValueError(f"upstream base URL must be http(s): {display_url(url)}")
        if not self.model:
            raise ValueError("upstream model name must not be empty")
        if self.connect_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise ValueError("upstream timeouts must be positive")
        if self.max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        if self.retries < 0:
            raise ValueError("retries must be >= 0")

    def __repr__(self) -> str:
        urls = tuple(display_url(url) for url in self.base_urls)
        return (
            f"UpstreamConfig(base_urls={urls!r}, model={self.model!r}, "
            f"api_key={'***' if self.api_key else None}, "
            f"connect_timeout_s={self.connect_timeout_s}, read_timeout_s={self.read_timeout_s}, "
            f"health_interval_s={self.health_interval_s}, "
            f"max_connections={self.max_connections}, retries={self.retries})"
        )


def display_url(url: str) -> str:
    """`url` without userinfo or query string, safe to log or expose as a metric label."""
    try:
        return str(httpx.URL(url).copy_with(userinfo=b"", query=None, fragment=None))
    except (httpx.InvalidURL, TypeError):
        return "<invalid url>"
