"""The settings groups: every knob of Carousel, once, with its help text.

gateway/settings/load.py composes them into `Settings`; the flags, env vars, YAML keys and
per-arm overrides are all derived from these fields (see its docstring). Add a knob by
adding one field to its group (and its line in docs/quickstart.md); a field named like a
`SchedulerConfig` or `ServingOptions` field reaches it by that name, a torch setting by its
line in `torch_backend_config` (gateway/arms/engine_factory.py). A setting a backend ignores is
refused (`unhonoured_settings`).
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field, field_validator
from pydantic_settings import NoDecode

from backends.torch.config import TorchBackendConfig
from gateway.settings.policy_options import (
    check_policy_options,
    check_scheduler,
    policy_option_names,
)
from schedulers import defaults
from schedulers.spec_decode.config import parse_speculative_config

DEFAULT_MODEL = "default"
#: `--generation-config`'s named values (vLLM's): the model's sampling defaults, or OpenAI's
GENERATION_CONFIG_AUTO, GENERATION_CONFIG_VLLM = "auto", "vllm"
#: the file a model (or a `--generation-config` folder) writes its generation defaults in
GENERATION_CONFIG_FILE = "generation_config.json"
VLLM_BATCH_INVARIANT = "VLLM_BATCH_INVARIANT"


def torch_only() -> dict[str, Any]:
    """`json_schema_extra` of a setting only the torch backend honours (the sim refuses it)."""
    return {"torch_only": True}


def per_arm() -> dict[str, Any]:
    """`json_schema_extra` of a field outside the per-arm groups that an arm may override."""
    return {"per_arm": True}


def _speculative_json(value: Any) -> Any:
    """`--speculative-config` as given (JSON text, or a YAML mapping) -> its JSON text, checked
    now (a bad one is refused at start-up, naming the key); "" or "null" is off (an arm's way
    to turn off a top-level config)."""
    if isinstance(value, Mapping):
        value = json.dumps(dict(value))
    if isinstance(value, str):
        parse_speculative_config(value)
    return value


SpeculativeJson = Annotated[str | None, BeforeValidator(_speculative_json)]

#: the dtypes `--dtype` takes (vLLM's names; `half` and `float` are aliases)
Dtype = Literal["auto", "bfloat16", "float16", "float32"]
_DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}


def vllm_batch_invariant() -> bool:
    """Whether vLLM's `VLLM_BATCH_INVARIANT` is set to a non-zero number (as vLLM reads it)."""
    value = os.environ.get(VLLM_BATCH_INVARIANT, "0").strip() or "0"
    return value.lstrip("-").isdigit() and int(value) != 0


class ModelSettings(BaseModel):
    """Which model, and how it runs (shared by a deployment's local arms)."""

    model: str = Field(
        DEFAULT_MODEL, description="default | gemma-3-270m | HF directory | file.gguf | hub id"
    )
    served_model_name: str | None = Field(
        None, description="the name clients use (default: from --model)"
    )
    backend: Literal["torch", "sim"] = Field(
        "torch", description="torch (the real model) or sim (a weight-free cost model)",
        json_schema_extra=per_arm(),
    )  # fmt: skip
    device: str | None = Field(
        None, description="cuda, cuda:1, cpu (default: cuda if available)",
        json_schema_extra=torch_only(),
    )  # fmt: skip
    dtype: Dtype = Field(
        "auto",
        description="auto (bf16 on cuda and on a CPU with bf16 products, else fp32; a half "
        "checkpoint keeps its dtype on cuda), bfloat16, float16, float32 (default: auto)",
        json_schema_extra=torch_only(),
    )
    max_model_len: int | None = Field(
        None, ge=1, description="context window in tokens (default: the model's)"
    )
    generation_config: str = Field(
        GENERATION_CONFIG_AUTO,
        description="what a request's unset temperature, top_p, top_k, min_p and "
        "repetition_penalty become: auto (the model's generation_config.json), vllm (OpenAI's "
        "defaults), or a folder holding a generation_config.json (default: auto)",
    )
    prepack_weights: bool = Field(
        True, description="CPU: a prepacked weight copy for decode-sized matmuls",
        json_schema_extra=torch_only(),
    )  # fmt: skip
    disable_hybrid_kv_cache_manager: bool = Field(
        False,
        description="keep every layer's KV blocks for the whole context, sliding-window layers "
        "too (vLLM's flag; default: a model whose sliding layers are at least as many as its "
        "full ones keeps only their window's blocks)",
        json_schema_extra=torch_only(),
    )
    attention_backend: str = Field(
        "auto",
        description=(
            "attention kernels: auto, sdpa, inductor_paged, cpu_paged, triton_paged "
            "(see the quickstart)"
        ),
        json_schema_extra=torch_only(),
    )
    cpu_kernels: bool = Field(
        True,
        description="CPU: Carousel's AVX-512 decode kernels (matmuls, attention) where they build",
        json_schema_extra=torch_only(),
    )
    kernels_in_background: bool = Field(
        True,
        description="CPU, kernels not built yet: serve at once on torch's ops while they build "
        "at the lowest priority, then switch between two steps (false: build them first)",
        json_schema_extra=torch_only(),
    )
    compile: bool = Field(
        False, description="torch.compile the dense part of each layer at start-up (C++ compiler)",
        json_schema_extra=torch_only(),
    )  # fmt: skip
    enforce_eager: bool = Field(
        False,
        description="CUDA: no CUDA graphs for decode steps (every step runs eager)",
        json_schema_extra=torch_only(),
    )
    quantization: Literal["auto", "gguf", "int8", "none"] = Field(
        "auto",
        description="weight-only quantised linears for small steps: auto (a GGUF's own 4-bit "
        "blocks, else none), gguf (force the blocks), int8 (per output channel), none",
        json_schema_extra={**torch_only(), **per_arm()},
    )
    quantization_max_rows: int | None = Field(
        None, ge=0, description="most rows of a step that takes the quantised weights "
        "(default: measured at load)",
        json_schema_extra={**torch_only(), **per_arm()},
    )  # fmt: skip
    batch_invariant: bool = Field(
        False, validate_default=True,
        description="a sequence's answer never depends on what else is in its steps (vLLM's "
        "VLLM_BATCH_INVARIANT, which also turns it on): one kernel per op at every row count, "
        "attention token by token; CPU kernels only, no quantised weights",
        json_schema_extra={**torch_only(), **per_arm()},
    )  # fmt: skip
    model_impl: Literal["auto", "carousel", "transformers"] = Field(
        "auto",
        description="which code runs the model (vLLM's --model-impl): carousel (native layers, "
        "the Llama family), transformers (the model's own transformers code, attention on "
        "Carousel's paged cache), auto (carousel where it implements the model, else "
        "transformers)",
        json_schema_extra={**torch_only(), **per_arm()},
    )
    sim_time_scale: float = Field(0.0, ge=0, description="sim: sleep this x the modelled time")
    sim_num_blocks: int = Field(4096, ge=1, description="sim: KV blocks of the simulated cache")
    sim_max_model_len: int = Field(4096, ge=1, description="sim: context window")

    @field_validator("batch_invariant")
    @classmethod
    def _vllm_switch(cls, value: bool) -> bool:
        """On where asked for, or where vLLM's own switch (`VLLM_BATCH_INVARIANT=1`) is set."""
        return value or vllm_batch_invariant()

    @field_validator("generation_config")
    @classmethod
    def _generation_config(cls, value: str) -> str:
        named = value in (GENERATION_CONFIG_AUTO, GENERATION_CONFIG_VLLM)
        if not named and not (Path(value).expanduser() / GENERATION_CONFIG_FILE).is_file():
            raise ValueError(
                f"must be auto, vllm or a folder holding a generation_config.json, got {value!r}"
            )
        return value

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_alias(cls, value: Any) -> Any:
        """vLLM's aliases (`half`, `float`), a `torch.` prefix, and None (auto) accepted."""
        if value is None:
            return "auto"
        if isinstance(value, str):
            name = value.strip().lower().removeprefix("torch.")
            return _DTYPE_ALIASES.get(name, name)
        return value


class CacheSettings(BaseModel):
    """The paged KV cache (per arm)."""

    block_size: int = Field(defaults.BLOCK_SIZE, ge=1, description="KV block size in tokens")
    kv_cache_gb: float | None = Field(
        None, gt=0, description="KV cache size in GiB (default: planned from the device)",
        json_schema_extra=torch_only(),
    )  # fmt: skip
    enable_prefix_caching: bool = Field(
        True, description="reuse the KV of full blocks of earlier prompts and outputs"
    )


class SchedulerSettings(BaseModel):
    """The batching policy and its budgets (per arm)."""

    scheduler: str = Field(
        defaults.SCHEDULER,
        description="batching policy: orca, static, lpm, priority, sjf, hrrn, edf, fair, another "
        "registered name, or package.module:ClassName (default: orca)",
    )
    max_num_seqs: int = Field(
        defaults.MAX_NUM_SEQS, ge=1, description="most sequences in one batch"
    )
    max_num_batched_tokens: int = Field(
        defaults.MAX_NUM_BATCHED_TOKENS, ge=1, description="token budget of one iteration"
    )
    enable_chunked_prefill: bool = Field(
        False, description="split long prefills over iterations under the token budget"
    )
    max_queue_wait_s: float | None = Field(
        None, gt=0, description="429 when a request is not scheduled within this many seconds"
    )
    speculative_config: SpeculativeJson = Field(
        None, description="torch: speculative decoding, vLLM's JSON (e.g. {\"method\": "
        "\"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}): prompt-lookup "
        "drafts verified inside each step (default: off)",
        json_schema_extra={**torch_only(), "metavar": "JSON"},
    )  # fmt: skip
    #: the policies' own knobs by name (flat keys such as `batch_wait_ms` land here)
    scheduler_options: dict[str, Any] = Field(default_factory=dict, exclude=False)

    @field_validator("scheduler")
    @classmethod
    def _known_scheduler(cls, value: str) -> str:
        return check_scheduler(value)

    @field_validator("scheduler_options")
    @classmethod
    def _valid_options(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_policy_options(value)


class EngineSettings(BaseModel):
    """Limits every local engine applies to its requests (per arm)."""

    default_max_tokens: int = Field(
        4096, ge=1, description="completion budget when max_tokens is absent (capped by context)"
    )
    max_waiting_requests: int | None = Field(
        1024, ge=0, description="429 while this many requests wait in an engine (none: never)"
    )
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="400 above this many prompt tokens (default: the context)"
    )
    grammar_compile_timeout_s: float = Field(
        defaults.GRAMMAR_COMPILE_TIMEOUT_S, gt=0,
        description="400 grammar_compile_timeout for an output grammar (schema, "
        "tools) still compiling after this many seconds; its compile process is killed",
    )  # fmt: skip
    tensor_parallel_size: int = Field(
        1, ge=1, description="torch: split the model over this many ranks (docs/parallelism.md)",
        json_schema_extra=torch_only(),
    )  # fmt: skip


class ServerSettings(BaseModel):
    """HTTP, logs and lifecycle (per process)."""

    host: str = Field("127.0.0.1", description="bind address")
    port: int = Field(8000, ge=0, le=65535, description="port")
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="require one of these Bearer keys on /v1 (repeatable)",
        json_schema_extra={"flag": "--api-key", "metavar": "KEY"},
    )
    api_key_file: str | None = Field(
        None,
        description="a YAML file of principals, their API keys and limits (keys off the "
        "command line; docs/reliability.md)",
        json_schema_extra={"metavar": "FILE"},
    )
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1, description="413 above this body size")
    retry_after_s: int = Field(1, ge=0, description="Retry-After of 429 and 503 answers")
    sse_ping_s: float = Field(0.0, ge=0, description="SSE keep-alive comment interval (0: off)")
    responses_store_size: int = Field(
        1024,
        ge=1,
        description="stored Responses API responses (`store: true`) kept for "
        "previous_response_id and GET, least recently used evicted first; also how many "
        "response ids' creating arms are remembered (routing GET/DELETE to upstream arms); "
        "per principal",
    )
    responses_store_max_bytes: int = Field(
        64 << 20,
        ge=1024,
        description="bytes of stored responses each principal keeps (a principal's "
        "max_stored_bytes overrides); one key's traffic evicts only its own",
    )
    redis_url: str | None = Field(
        None,
        description="one Redis (redis://host:port/db) for all that replicas share: the "
        "Responses store and the `rollout:` state; response_store or rollout_store, where "
        "given, wins for its own (default: none, both in this process's memory)",
        json_schema_extra={"metavar": "URL"},
    )
    response_store: str = Field(
        "memory",
        description="where stored responses live: memory (this process) or redis://host:port/db "
        "(shared by replicas) (default: redis_url, else memory)",
        json_schema_extra={"metavar": "URL"},
    )
    disconnect_poll_s: float = Field(
        0.1, gt=0, description="how often a non-streaming request checks for its client"
    )
    drain_timeout_s: float = Field(
        10.0, ge=0, description="on SIGTERM, let requests in flight finish this long"
    )
    metrics_open: bool = Field(True, description="serve /metrics without an API key")
    metrics_require_key: bool = Field(
        False, description="require an API key on /metrics too (needs api_keys; overrides "
        "metrics_open)",
    )  # fmt: skip
    log_level: str = Field("info", description="debug, info, warning, error")
    log_prompts: bool = Field(False, description="log prompt text (off by default)")
    log_format: Literal["auto", "text", "json"] = Field(
        "auto", description="log lines: text on a terminal and JSON elsewhere (auto), or either"
    )
    record_traffic: str | None = Field(
        None,
        description="append one JSONL line per request to this file, for `carousel bench "
        "--replay` (off by default)",
        json_schema_extra={"metavar": "FILE"},
    )
    rollout_store: str | None = Field(
        None,
        description="keep the `rollout:` state in this JSON file, or in Redis (a redis:// "
        "URL) shared by replicas; a restarted gateway resumes the rollout (default: redis_url, "
        "else memory)",
        json_schema_extra={"metavar": "FILE|URL"},
    )
    admin_api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="keys that may call /admin/... (default: any API key, or none without keys)",
    )
    record_redact: bool = Field(
        False, description="record lengths and parameters only, never the text"
    )
    record_max_bytes: int = Field(
        256 * 1024 * 1024, ge=1024, description="rotate the traffic record at this size"
    )


#: the groups, in --help order; their fields are the settings
GROUPS: dict[str, type[BaseModel]] = {
    "model": ModelSettings,
    "cache": CacheSettings,
    "scheduler": SchedulerSettings,
    "engine": EngineSettings,
    "server": ServerSettings,
}
#: groups whose every field a local arm may set for itself
PER_ARM_GROUPS = ("cache", "scheduler", "engine")
#: fields that are not settings a user types (derived, or filled from other keys)
INTERNAL_FIELDS = frozenset({"scheduler_options"})


def group_fields(group: str) -> Iterator[tuple[str, Any]]:
    """(name, FieldInfo) of the settings a user can set in `group`, in declaration order."""
    for name, info in GROUPS[group].model_fields.items():
        if name not in INTERNAL_FIELDS:
            yield name, info


def setting_names() -> list[str]:
    """Every key a YAML file, an env var (upper-cased) or a flag may set."""
    names = [name for group in GROUPS for name, _ in group_fields(group)]
    return [*names, *policy_option_names(), "arms"]


def per_arm_names() -> list[str]:
    """The settings a local arm may override for itself (policy options included)."""
    names = [name for group in PER_ARM_GROUPS for name, _ in group_fields(group)]
    extra = [
        name
        for group in GROUPS
        if group not in PER_ARM_GROUPS
        for name, info in group_fields(group)
        if (info.json_schema_extra or {}).get("per_arm")
    ]
    return [*extra, *names, *policy_option_names()]


def torch_only_defaults() -> dict[str, Any]:
    """The settings only the torch backend honours (`torch_only`), at their defaults."""
    return {
        name: info.default
        for group in GROUPS
        for name, info in group_fields(group)
        if (info.json_schema_extra or {}).get("torch_only")  # type: ignore[union-attr]
    }


def unhonoured_settings(settings: BaseModel) -> list[str]:
    """The settings given a value that `settings.backend` would ignore."""
    torch_settings = torch_only_defaults()
    values = {name: getattr(settings, name) for name in (*torch_settings, "backend")}
    if values["backend"] == "sim":
        return [k for k, v in torch_settings.items() if values[k] != v]
    # NOTE: the torch backend's config owns which of them run together (it imports no torch)
    names = TorchBackendConfig.unhonoured(values)
    if values["speculative_config"] and values["tensor_parallel_size"] > 1:
        names.append("speculative_config")  # its ranks' steps carry no drafts
    return names


def unhonoured_message(settings: BaseModel) -> str | None:
    """A refusal naming the settings `settings.backend` cannot honour (None: it honours all)."""
    names = unhonoured_settings(settings)
    if not names:
        return None
    backend = getattr(settings, "backend", "torch")
    if backend == "torch":
        size = getattr(settings, "tensor_parallel_size", 1)
        backend = f"the torch backend with tensor_parallel_size {size}"
        if getattr(settings, "model_impl", None) == "transformers":
            backend += " and model_impl transformers"
    them = "it" if len(names) == 1 else "them"
    message = f"{backend} cannot honour {', '.join(names)}: drop {them} or choose a backend that "
    message += "does"
    if "batch_invariant" in names and backend != "sim":
        message += (
            " (batch_invariant runs only Carousel's CPU kernels, without quantisation, "
            "compile or tensor parallelism: docs/batch-invariance.md)"
        )
    return message


def unknown_keys_message(unknown: list[str], valid: list[str]) -> str:
    """A refusal naming each unknown key, its closest valid key, and every valid one."""
    parts = []
    for key in unknown:
        close = difflib.get_close_matches(key, valid, n=1)
        parts.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return f"unknown setting {', '.join(parts)}; valid settings are: {', '.join(valid)}"
