"""The model's own sampling defaults (vLLM's `--generation-config`): what a request that leaves
temperature, top_p, top_k, min_p or repetition_penalty unset samples with.

`auto` (the default) takes them from the model's generation_config.json (as HF loaded it: the
backend's `generation_config`), `vllm` keeps OpenAI's (temperature 1, every filter off), and a
folder takes the generation_config.json in it. As vLLM's `get_diff_sampling_param`, only the
values the file writes count, never transformers' own defaults. Unlike vLLM, temperature,
top_p, top_k and min_p count only where the file sets `do_sample: true`: HF `generate` decodes
greedily otherwise and ignores them. repetition_penalty shapes greedy decoding too, so it
counts either way. A value Carousel would refuse in a request refuses the model at start-up.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.settings.groups import (
    GENERATION_CONFIG_AUTO,
    GENERATION_CONFIG_FILE,
    GENERATION_CONFIG_VLLM,
)
from schedulers.sampling_params import SamplingParams

#: the fields HF `generate` reads only when it samples (`do_sample`)
SAMPLING_ONLY = ("temperature", "top_p", "top_k", "min_p")
FIELDS = (*SAMPLING_ONLY, "repetition_penalty")


@dataclass(frozen=True)
class SamplingDefaults:
    """What an unset sampling field of a request becomes (OpenAI's unless a model says).

    `source` says where they came from (`openai`, `model`, or a folder); `ignored` names the
    sampling values the file wrote without `do_sample: true`.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    source: str = "openai"
    ignored: tuple[str, ...] = ()

    def values(self) -> dict[str, float]:
        """The defaults that differ from OpenAI's, by field name."""
        openai = SamplingDefaults()
        return {f: getattr(self, f) for f in FIELDS if getattr(self, f) != getattr(openai, f)}


def sampling_fields(request: Any, defaults: SamplingDefaults) -> dict[str, Any]:
    """temperature, top_p, top_k, min_p and repetition_penalty for `request`: its own where
    it sets them (a top_k of -1 is 0: off), else `defaults`'. A field its request model lacks
    (the Responses API has no top_k) is unset."""
    out: dict[str, Any] = {}
    for name in FIELDS:
        value = getattr(request, name, None)
        out[name] = getattr(defaults, name) if value is None else value
    out["top_k"] = max(out["top_k"], 0)
    return out


def sampling_defaults(choice: str, model_config: Mapping[str, Any]) -> SamplingDefaults:
    """The defaults `--generation-config choice` gives, `model_config` being the model's own
    generation config (its written values, as HF `GenerationConfig.to_diff_dict()`)."""
    if choice == GENERATION_CONFIG_VLLM:
        return SamplingDefaults()
    if choice == GENERATION_CONFIG_AUTO:
        return from_generation_config(model_config, "model")
    folder = Path(choice).expanduser()
    return from_generation_config(read_generation_config(folder), str(folder))


def read_generation_config(folder: Path) -> dict[str, Any]:
    """The generation_config.json of `folder`, as written."""
    path = folder / GENERATION_CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--generation-config {folder}: cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--generation-config {folder}: {path} is not a JSON object")
    return config


def from_generation_config(config: Mapping[str, Any], source: str) -> SamplingDefaults:
    """The defaults a generation config's written values give (see the module docstring)."""
    samples = config.get("do_sample") is True
    written = [f for f in FIELDS if config.get(f) is not None]
    taken = [f for f in written if samples or f not in SAMPLING_ONLY]
    try:
        values: dict[str, Any] = {f: _number(f, config[f]) for f in taken}
        SamplingParams(**values)
    except ValueError as exc:
        raise ValueError(
            f"the generation config of {source}: {exc} (`--generation-config vllm` serves "
            "OpenAI's defaults instead)"
        ) from None
    ignored = tuple(f for f in written if f not in taken)
    if not values and not ignored:
        return SamplingDefaults()
    return SamplingDefaults(**values, source=source, ignored=ignored)


def _number(name: str, value: Any) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    # NOTE: HF's top_k 0 is off as ours is; a negative one is off in vLLM's spelling (-1)
    return max(int(value), 0) if name == "top_k" else float(value)
