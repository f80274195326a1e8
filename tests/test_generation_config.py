"""The model's own sampling defaults (`--generation-config`, vLLM's flag): a request that
leaves temperature, top_p, top_k, min_p or repetition_penalty unset samples with the values of
the model's generation_config.json, on chat, completions and the Responses API alike; a
request's own values win; `vllm` serves OpenAI's defaults; a folder's file replaces the
model's. Asserted on the SamplingParams the engine receives, through a live server over a tiny
model directory loaded as `carousel serve DIR` loads one."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from structlog.testing import capture_logs
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from backends.torch.testing.tiny_models import TINY, tiny_tokenizer
from gateway.api.pipeline import ServingOptions
from gateway.api.sampling_defaults import (
    SamplingDefaults,
    from_generation_config,
    sampling_defaults,
)
from gateway.app import create_app
from gateway.arms.local import log_sampling_defaults
from gateway.settings.load import Settings
from schedulers.sampling_params import SamplingParams
from tests.conftest import SIM_MODEL, serve_app, sim_arm, start_server

MODEL = "tiny-sampler"
TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
#: what the tiny model's generation_config.json recommends
MODEL_DEFAULTS = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20}
OPENAI = (1.0, 1.0, 0)
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def picked(params: SamplingParams) -> tuple[float, float, int]:
    return params.temperature, params.top_p, params.top_k


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama saved as an HF directory, its generation_config.json sampling."""
    folder = tmp_path_factory.mktemp("tiny-sampler")
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TEMPLATE
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, eos_token_id=tokenizer.eos_token_id))
    model.generation_config = GenerationConfig(**MODEL_DEFAULTS)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class Served:
    """A live server over `model_dir` and the SamplingParams its engine received."""

    def __init__(self, stack: ExitStack, model_dir: Path, generation_config: str) -> None:
        settings = Settings(
            model=str(model_dir),
            served_model_name=MODEL,
            generation_config=generation_config,
            device="cpu",
            dtype="float32",
            cpu_kernels=False,
            prepack_weights=False,
            attention_backend="sdpa",
            quantization="none",
            kv_cache_gb=0.05,
            max_num_seqs=4,
        )
        app = create_app(settings)
        self.url = stack.enter_context(serve_app(app))
        [(_, arm)] = list(app.state.gateway.deployments.arms())
        self.received: list[SamplingParams] = []
        engine, submit = arm.engine, arm.engine.submit

        def recording(
            request_id: str, prompt: list[int], params: SamplingParams, *a: Any, **kw: Any
        ) -> Any:
            self.received.append(params)
            return submit(request_id, prompt, params, *a, **kw)

        engine.submit = recording  # type: ignore[method-assign]

    def params(self, path: str, body: dict[str, Any]) -> SamplingParams:
        """The SamplingParams the engine received for POST `path` with `body`."""
        before = len(self.received)
        reply = httpx.post(f"{self.url}/v1{path}", json={"model": MODEL, **body}, timeout=60)
        assert reply.status_code == 200, reply.text
        assert len(self.received) == before + 1
        return self.received[-1]


@pytest.fixture(scope="module")
def auto(model_dir: Path) -> Iterator[Served]:
    with ExitStack() as stack:
        yield Served(stack, model_dir, "auto")


def test_a_chat_request_without_sampling_fields_takes_the_models_defaults(auto: Served) -> None:
    params = auto.params("/chat/completions", CHAT)
    assert picked(params) == (0.6, 0.9, 20)
    assert (params.min_p, params.repetition_penalty) == (0.0, 1.0)  # the file writes neither


def test_completions_and_responses_take_the_models_defaults_too(auto: Served) -> None:
    completion = auto.params("/completions", {"prompt": "Hi", "max_tokens": 2})
    response = auto.params("/responses", {"input": "Hi", "max_output_tokens": 2})
    assert picked(completion) == picked(response) == (0.6, 0.9, 20)


def test_a_request_keeps_the_sampling_fields_it_sets(auto: Served) -> None:
    own = {"temperature": 0.2, "top_p": 0.5, "top_k": 3}
    assert picked(auto.params("/chat/completions", {**CHAT, **own})) == (0.2, 0.5, 3)
    assert picked(auto.params("/completions", {"prompt": "Hi", "max_tokens": 2, **own})) == (
        0.2,
        0.5,
        3,
    )
    # the Responses API has no top_k: the model's stays
    response = {"input": "Hi", "max_output_tokens": 2, "temperature": 0.2, "top_p": 0.5}
    assert picked(auto.params("/responses", response)) == (0.2, 0.5, 20)


def test_temperature_zero_is_greedy_whatever_the_models_filters(auto: Served) -> None:
    params = auto.params("/chat/completions", {**CHAT, "temperature": 0, "top_k": -1})
    assert params.greedy and params.top_k == 0


def test_vllm_opts_out_to_openais_defaults(model_dir: Path) -> None:
    with ExitStack() as stack:
        served = Served(stack, model_dir, "vllm")
        assert picked(served.params("/chat/completions", CHAT)) == OPENAI
        assert picked(served.params("/responses", {"input": "Hi", "max_output_tokens": 2})) == (
            OPENAI
        )


def test_a_folders_generation_config_replaces_the_models(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        '{"do_sample": true, "temperature": 0.7, "min_p": 0.05, "repetition_penalty": 1.1}'
    )
    options = ServingOptions(generation_config=str(tmp_path))
    with ExitStack() as stack:
        server = start_server(stack, sim_arm(options=options))
        seen: list[SamplingParams] = []
        submit = server.arm.engine.submit
        server.arm.engine.submit = lambda i, p, params, *a, **kw: (  # type: ignore[method-assign]
            seen.append(params) or submit(i, p, params, *a, **kw)
        )
        body = {"model": SIM_MODEL, **CHAT}
        assert httpx.post(f"{server.v1}/chat/completions", json=body).status_code == 200
    [params] = seen
    assert (params.temperature, params.top_p, params.min_p, params.repetition_penalty) == (
        0.7,
        1.0,
        0.05,
        1.1,
    )


def test_sampling_values_count_only_where_the_file_samples() -> None:
    written = {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.05}
    greedy = from_generation_config(written, "model")
    assert greedy.values() == {"repetition_penalty": 1.05}  # shapes greedy decoding too
    assert greedy.ignored == ("temperature", "top_p")
    sampled = from_generation_config({**written, "do_sample": True}, "model")
    assert sampled.values() == written and sampled.source == "model"


def test_a_file_without_sampling_values_keeps_openais_defaults() -> None:
    # what SmolLM2's converted directory writes (bos, eos, pad, use_cache)
    written = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "use_cache": True}
    assert from_generation_config(written, "model") == SamplingDefaults()


def test_a_value_carousel_would_refuse_refuses_the_model_naming_the_way_out() -> None:
    with pytest.raises(
        ValueError, match=r"temperature must be in \[0, 2\].*generation-config vllm"
    ):
        from_generation_config({"do_sample": True, "temperature": 3.0}, "model")
    with pytest.raises(ValueError, match="top_p must be a number"):
        from_generation_config({"do_sample": True, "top_p": "high"}, "model")


def test_a_generation_config_that_is_no_folder_is_refused_at_start_up() -> None:
    with pytest.raises(ValueError, match="auto, vllm or a folder holding a generation_config"):
        Settings(generation_config="/no/such/folder")


def test_the_start_up_log_says_which_defaults_apply() -> None:
    defaults = dataclasses.replace(SamplingDefaults(temperature=0.6, top_k=20), source="model")
    with capture_logs() as logs:
        log_sampling_defaults("orca", "auto", defaults)
    [line] = logs
    assert line["event"] == "sampling_defaults"
    assert (line["source"], line["temperature"], line["top_k"]) == ("model", 0.6, 20)
    assert "top_p" not in line  # OpenAI's own value: not an override


@pytest.mark.real_model
def test_the_default_model_keeps_openais_defaults() -> None:
    """SmolLM2's converted directory writes no sampling values: nothing changes for it."""
    from backends.torch.loader import resolve_model

    folder = resolve_model("default")
    as_loaded = GenerationConfig.from_pretrained(folder).to_diff_dict()  # the backend's view
    assert sampling_defaults("auto", as_loaded) == SamplingDefaults()
    assert sampling_defaults(folder, {}) == SamplingDefaults()
