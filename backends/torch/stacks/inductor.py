"""Set-up shared by the torch.compile'd paths (Inductor's CPU C++ code generation).

- Compiled code is cached across restarts: Inductor's on-disk caches live under
  `$TORCHINDUCTOR_CACHE_DIR`, which defaults here to Carousel's cache dir (`inductor/`) instead
  of a per-boot /tmp path. A restart then re-traces (about a second) but skips code generation
  and the C++ compiler.
- Compiles run in this process (`compile_threads = 1`), so a server keeps no pool of idle
  compile workers afterwards.
- Every compiled shape is dynamic and marked *unbacked* (`mark_unbacked`), so one graph
  serves every batch size, 1 included: nothing compiles after start-up.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterable

import torch

from backends.torch.loader import cache_dir
from backends.torch.logs import engine_log

log = engine_log()

_lock = threading.Lock()
_configured = False


def compiler_available() -> bool:
    """Whether Inductor can build CPU kernels here (it needs a C++ compiler)."""
    from torch._inductor import config

    candidates = config.cpp.cxx if isinstance(config.cpp.cxx, tuple) else (config.cpp.cxx,)
    names = [c for c in candidates if c] + ["g++", "c++", "clang++"]
    return any(shutil.which(name) for name in names)


def configure() -> None:
    """Point Inductor's caches at Carousel's cache dir and compile in-process (once)."""
    global _configured
    with _lock:
        if _configured:
            return
        from torch._inductor import config
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        # NOTE: importing transformers already sets the variable to torch's per-boot default;
        # only a value someone chose is kept.
        if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) == default_cache_dir():
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")

        if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
            config.compile_threads = 1
        _configured = True


def mark_dynamic(tensors: Iterable[tuple[torch.Tensor, tuple[int, ...]]]) -> None:
    """Mark these dims of these tensors as dynamic sizes, 0 and 1 included (unbacked)."""
    for tensor, dims in tensors:
        torch._dynamo.decorators.mark_unbacked(tensor, list(dims))
