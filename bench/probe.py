"""One probe request per arm before a run, so a bench that cannot work says why at once.

The probe is the workload's first request cut to one output token, sent the way the run will
send it (streamed, same endpoint, same headers). A failure names its cause: the server is not
there (connection refused), the model is not served (404, with the models `/v1/models` lists),
or the request is refused (400, with the server's message). An endpoint that refuses
`ignore_eos` (OpenAI's API, some proxies) is probed again without it; when that succeeds the
run sends no `ignore_eos` to that arm and says so, instead of failing every request.

The probe also reads how the server counts a prompt: two probes whose prompts differ only in
their number of `PROBE_WORD`s give the tokens per word and the fixed cost around them (chat
template, BOS) from the reported `usage.prompt_tokens`, so a trace's prompt lengths can be
synthesised exactly (bench/exact_prompts.py).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from bench.client import (
    ENDPOINT_PATHS,
    ClientConfig,
    build_body,
    build_headers,
    chunk_usage,
    endpoint_of,
)
from bench.exact_prompts import PromptCost, probe_prompt
from bench.workload import RequestSpec

PROBE_TIMEOUT_S = 60.0
#: sent with every probe, so a server's logs (and bench/fake_server.py) can tell them apart
PROBE_HEADER = "X-Carousel-Bench"
#: prompt sizes (in words) of the two probes that measure the server's token cost
CALIBRATION_WORDS = (8, 24)
_LENGTH_KEYS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


class ProbeError(Exception):
    """The probe failed; the message names the cause."""


@dataclass(frozen=True)
class ProbeResult:
    """What the probe of one arm found."""

    arm: str | None
    accepts_ignore_eos: bool
    prompt_tokens: int | None
    note: str | None = None  # said in the terminal and the report (e.g. ignore_eos dropped)


def _probe_body(cfg: ClientConfig, spec: RequestSpec) -> dict[str, Any]:
    body = build_body(cfg, spec)
    for key in _LENGTH_KEYS:
        if key in body:
            body[key] = 1
    return body


def _error_of(response: httpx.Response) -> tuple[str, str | None]:
    """The error message and `param` of an OpenAI-shaped error body (else the raw text)."""
    try:
        payload = response.json()
    except ValueError:
        return response.text[:200] or response.reason_phrase, None
    err = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, dict):
        return str(err.get("message") or err), err.get("param")
    if isinstance(payload, dict) and payload.get("detail") is not None:
        return str(payload["detail"]), None
    return str(payload)[:200], None


def served_models(client: httpx.Client, api_base: str, headers: dict[str, str]) -> list[str]:
    """The model ids `GET /v1/models` lists (empty when it lists none or fails)."""
    try:
        return _listed(client.get(api_base + "/models", headers=headers))
    except httpx.HTTPError:
        return []


def _listed(response: httpx.Response) -> list[str]:
    """The model ids in a `GET /v1/models` answer (empty for an error or another shape)."""
    try:
        data = response.json().get("data") if response.status_code == 200 else None
    except (ValueError, AttributeError):
        return []
    return [str(m["id"]) for m in data or [] if isinstance(m, dict) and "id" in m]


@contextmanager
def _reaching(api_base: str) -> Iterator[None]:
    """httpx's transport errors in the block as ProbeErrors naming `api_base` (and, for a
    refused connection, what to start)."""
    try:
        yield
    except httpx.ConnectError as exc:
        raise ProbeError(
            f"cannot connect to {api_base} ({exc}): is the server running? "
            "(carousel serve starts one on http://127.0.0.1:8000)"
        ) from exc
    except httpx.HTTPError as exc:
        raise ProbeError(f"{api_base}: {type(exc).__name__}: {exc}") from exc


def _refuses_ignore_eos(status: int, message: str, param: str | None) -> bool:
    return status in (400, 422) and (param == "ignore_eos" or "ignore_eos" in message)


def _send(
    client: httpx.Client, cfg: ClientConfig, spec: RequestSpec, arm: str | None
) -> tuple[httpx.Response, int | None]:
    """POST the probe, read its stream to the end; (response, reported prompt tokens)."""
    endpoint = endpoint_of(cfg, spec)
    url = cfg.api_base + ENDPOINT_PATHS[endpoint]
    headers = {**build_headers(cfg, arm, spec.deadline_ms), PROBE_HEADER: "probe"}
    with client.stream("POST", url, json=_probe_body(cfg, spec), headers=headers) as response:
        if response.status_code != 200:
            response.read()
            return response, None
        prompt_tokens = None
        for line in response.iter_lines():
            data = line[5:].strip() if line.startswith("data:") else ""
            if not data or data == "[DONE]":
                continue
            try:
                chunk = json.loads(data)
            except ValueError:
                continue
            usage = chunk_usage(chunk, endpoint) if isinstance(chunk, dict) else None
            if usage is not None and isinstance(usage.get("prompt_tokens"), int):
                prompt_tokens = usage["prompt_tokens"]
        return response, prompt_tokens


def _cause(
    client: httpx.Client, cfg: ClientConfig, arm: str | None, response: httpx.Response
) -> str:
    message, _ = _error_of(response)
    where = f"arm {arm}" if arm is not None else cfg.api_base
    text = f"{where}: HTTP {response.status_code}: {message}"
    if response.status_code == 404:
        headers = build_headers(cfg, None)
        models = served_models(client, cfg.api_base, headers)
        served = ", ".join(models) if models else "none listed at /v1/models"
        text += f" (model {cfg.model!r}; the server serves: {served})"
    elif response.status_code in (401, 403):
        text += " (give the key with --api-key or $OPENAI_API_KEY)"
    return text


def probe_arm(
    client: httpx.Client, cfg: ClientConfig, spec: RequestSpec, arm: str | None
) -> ProbeResult:
    """Probe one arm with `spec` (see the module docstring); ProbeError names the cause."""
    with _reaching(cfg.api_base):
        response, prompt_tokens = _send(client, cfg, spec, arm)
        if response.status_code == 200:
            return ProbeResult(arm, True, prompt_tokens)
        message, param = _error_of(response)
        if cfg.ignore_eos and _refuses_ignore_eos(response.status_code, message, param):
            without = dataclasses.replace(cfg, ignore_eos=False)
            retry, prompt_tokens = _send(client, without, spec, arm)
            if retry.status_code == 200:
                note = (
                    f"{'arm ' + arm if arm else 'the endpoint'} refuses ignore_eos "
                    f"({message}): sending without it, so outputs may stop before max_tokens"
                )
                return ProbeResult(arm, False, prompt_tokens, note)
            response = retry
    raise ProbeError(_cause(client, cfg, arm, response))


def probe_arms(cfg: ClientConfig, spec: RequestSpec, arms: list[str | None]) -> list[ProbeResult]:
    """Probe every arm in turn; ProbeError at the first that fails."""
    timeout = httpx.Timeout(min(cfg.timeout_s, PROBE_TIMEOUT_S))
    with httpx.Client(timeout=timeout, trust_env=False) as client:
        return [probe_arm(client, cfg, spec, arm) for arm in arms]


def default_model(api_base: str, api_key: str | None) -> str:
    """The one model the server lists at /v1/models (vLLM's bench does the same without
    --model); ProbeError when it lists none or several, or cannot be reached."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(timeout=PROBE_TIMEOUT_S, trust_env=False) as client, _reaching(api_base):
        models = _listed(client.get(api_base + "/models", headers=headers))
    if len(models) != 1:
        listed = ", ".join(models) if models else "none"
        raise ProbeError(f"name the model with --model (the server serves: {listed})")
    return models[0]


def measure_prompt_cost(cfg: ClientConfig, arm: str | None, endpoint: str) -> PromptCost | None:
    """Tokens per `PROBE_WORD` and the fixed cost around a prompt, from two probes' usage;
    None when the server reports no prompt tokens or the two disagree with a straight line."""
    counts = []
    with httpx.Client(timeout=PROBE_TIMEOUT_S, trust_env=False) as client:
        for words in CALIBRATION_WORDS:
            spec = RequestSpec(0, 1, prompt=probe_prompt(words))
            probe_cfg = dataclasses.replace(cfg, endpoint=endpoint)  # type: ignore[arg-type]
            try:
                response, tokens = _send(client, probe_cfg, spec, arm)
            except httpx.HTTPError:
                return None
            if response.status_code != 200 or tokens is None:
                return None
            counts.append(tokens)
    (w1, w2), (t1, t2) = CALIBRATION_WORDS, counts
    per_word, rest = divmod(t2 - t1, w2 - w1)
    fixed = t1 - per_word * w1
    if rest or per_word < 1 or fixed < 0:
        return None
    return PromptCost(per_word, fixed)
