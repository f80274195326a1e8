"""Where Carousel keeps what it builds and converts on disk (`CAROUSEL_CACHE_DIR`).

A module of its own, importing nothing of Carousel's: the CPU kernels' build reads it, and
the image's `cpu-kernels` stage copies only what that build imports (Dockerfile).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of Carousel's on-disk cache (converted models live under `models/`)."""
    env = os.environ.get("CAROUSEL_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "carousel"
