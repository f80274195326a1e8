"""`carousel serve | generate | bench`.

Flags are given to Settings only when the user typed them (argparse.SUPPRESS defaults), so
the precedence is flags > CAROUSEL_* env > YAML (--config) > built-in defaults.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import signal
import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any

from pydantic import ValidationError

from gateway.settings import Settings

_NOT_SETTINGS = {"command", "func", "config", "prompt", "max_tokens", "temperature", "seed", "chat"}


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """Flags shared by `serve` and `generate`: which model and how it runs."""
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", help="default | HF directory | file.gguf | hub id")
    g.add_argument("--backend", choices=["torch", "sim"], help="torch (real model) or sim")
    g.add_argument("--scheduler", help="batching policy: orca (iteration-level) or static")
    g.add_argument("--max-num-seqs", type=int, help="most sequences in one batch")
    g.add_argument("--max-num-batched-tokens", type=int, help="token budget of one iteration")
    g.add_argument("--max-model-len", type=int, help="context window (default: the model's)")
    g.add_argument("--batch-wait-ms", type=float, help="static: wait this long to fill a batch")
    g.add_argument("--enable-chunked-prefill", action="store_true", default=argparse.SUPPRESS)
    g.add_argument("--kv-cache-gb", type=float, help="KV cache size (default: planned)")
    g.add_argument("--device", help="cuda, cuda:1, cpu (default: cuda if available)")
    g.add_argument("--dtype", help="bfloat16, float16, float32")
    g.add_argument("--block-size", type=int, help="KV block size in tokens")
    g.add_argument(
        "--prepack-weights",
        action=argparse.BooleanOptionalAction,
        help="CPU: a oneDNN-prepacked weight copy for decode matmuls (default: yes)",
    )
    g.add_argument("--sim-time-scale", type=float, help="sim: sleep this x the modelled time")
    g.add_argument("--config", default=None, help="YAML settings file (or $CAROUSEL_CONFIG)")


def _add_serve(sub: Any) -> None:
    p = sub.add_parser(
        "serve", help="serve the OpenAI-compatible API", argument_default=argparse.SUPPRESS
    )
    _add_model_flags(p)
    g = p.add_argument_group("HTTP")
    g.add_argument("--served-model-name", help="name clients use (default: from --model)")
    g.add_argument("--host", help="bind address (default 127.0.0.1)")
    g.add_argument("--port", type=int, help="port (default 8000)")
    g.add_argument(
        "--api-key",
        dest="api_keys",
        action="extend",
        nargs="+",
        metavar="KEY",
        help="require one of these Bearer keys on /v1 (repeatable)",
    )
    g.add_argument("--max-body-bytes", type=int, help="413 above this request size")
    g.add_argument("--max-waiting-requests", type=int, help="429 when this many are queued")
    g.add_argument("--max-prompt-tokens", type=int, help="400 above this many prompt tokens")
    g.add_argument(
        "--max-queue-wait-s", type=float, help="429 when not scheduled within this many seconds"
    )
    g.add_argument(
        "--drain-timeout-s", type=float, help="on SIGTERM, let requests finish this long"
    )
    g.add_argument(
        "--metrics-open",
        action=argparse.BooleanOptionalAction,
        help="serve /metrics without an API key (default: yes)",
    )
    g.add_argument("--default-max-tokens", type=int, help="cap when max_tokens is absent")
    g.add_argument("--log-level", help="debug, info, warning, error")
    g.add_argument("--log-prompts", action="store_true", help="log prompt text (off by default)")
    p.set_defaults(func=serve)


def _add_generate(sub: Any) -> None:
    p = sub.add_parser(
        "generate",
        help="generate once, offline (quick manual check)",
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("prompt")
    _add_model_flags(p)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--chat",
        action="store_true",
        default=False,
        help="wrap the prompt as a user message with the chat template",
    )
    p.set_defaults(func=generate)


def _add_bench(sub: Any) -> None:
    """`carousel bench`, when bench/cli.py (another module) is present."""
    try:
        found = importlib.util.find_spec("bench.cli") is not None
    except ModuleNotFoundError:
        found = False
    if found:
        importlib.import_module("bench.cli").register(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="carousel", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    _add_serve(sub)
    _add_generate(sub)
    _add_bench(sub)
    return parser


def load_settings(args: argparse.Namespace) -> Settings:
    overrides = {k: v for k, v in vars(args).items() if k not in _NOT_SETTINGS}
    return Settings.load(getattr(args, "config", None), **overrides)


def serve(args: argparse.Namespace) -> int:
    import structlog
    import uvicorn

    from gateway.app import GatewayServer, create_app
    from gateway.logging import configure_logging

    settings = load_settings(args)
    configure_logging(settings.log_level, settings.log_json)
    structlog.get_logger("carousel.gateway").info(
        "carousel_serve",
        model=settings.model,
        served_model_name=settings.model_name,
        backend=settings.backend,
        scheduler=settings.scheduler,
        host=settings.host,
        port=settings.port,
        api_keys=len(settings.api_keys),  # NOTE: how many, never which
    )
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        log_level=settings.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    state = app.state.gateway
    server = GatewayServer(config, state, settings.drain_timeout_s)
    state.on_fatal = lambda: setattr(server, "should_exit", True)
    # NOTE: the first SIGTERM/SIGINT drains (GatewayServer). uvicorn re-raises the signal
    # that stopped it once it has shut down gracefully; a no-op handler then makes Ctrl-C /
    # docker stop exit 0 instead of dying by the signal.
    previous = {sig: signal.signal(sig, _shut_down) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 1 if state.load_failed else 0


def _shut_down(signum: int, frame: FrameType | None) -> None:
    """Stand-in signal handler around uvicorn's own (which does the graceful stop)."""


def generate(args: argparse.Namespace) -> int:
    from gateway.local_arm import load_backend, scheduler_config
    from schedulers.llm import LLM
    from schedulers.sampling_params import SamplingParams

    settings = load_settings(args)
    backend = load_backend(settings)
    prompt: str = args.prompt
    tokenizer = backend.tokenizer
    if args.chat:
        turns = [{"role": "user", "content": prompt}]
        prompt = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    ids = list(tokenizer.encode(prompt, add_special_tokens=False))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    with LLM(backend, settings.scheduler, scheduler_config(settings)) as llm:
        [result] = llm.generate([ids], params)
    choice = result.choices[0]
    if choice.error:
        print(f"error: {choice.error}", file=sys.stderr)
        return 1
    print(choice.text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args))
    except ValidationError as exc:
        print(f"carousel: invalid settings:\n{exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
