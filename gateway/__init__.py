"""Carousel's HTTP gateway: OpenAI wire format, SSE, auth, arms, metrics, settings, CLI."""

from __future__ import annotations

from importlib import metadata


def carousel_version() -> str:
    """The installed package version (0.0.0 when running from an uninstalled tree)."""
    try:
        return metadata.version("carousel-serve")
    except metadata.PackageNotFoundError:
        return "0.0.0"
