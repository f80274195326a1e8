"""`carousel serve [MODEL] | generate | bench | rollout`.

The flags are derived from the settings (gateway/settings/flags.py) and given to Settings only
when the user typed them, so the precedence is flags > CAROUSEL_* env > YAML (--config) >
built-in defaults. Invalid settings are refused before the server starts, one line per
problem and no secret shown (gateway/settings/errors.py).
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

import structlog
import uvicorn
from pydantic import ValidationError

from gateway import carousel_version
from gateway.app import GatewayServer, create_app
from gateway.arms.engine_factory import load_backend, scheduler_config
from gateway.obs.logging import configure_logging, json_logs
from gateway.rollout_cli import add_rollout
from gateway.settings.errors import problem_lines
from gateway.settings.flags import add_setting_flags, settings_kwargs
from gateway.settings.groups import GROUPS
from gateway.settings.load import Settings
from schedulers.llm import LLM
from schedulers.sampling_params import SamplingParams


def _add_serve(sub: Any) -> None:
    p = sub.add_parser(
        "serve", help="serve the OpenAI-compatible API", argument_default=argparse.SUPPRESS
    )
    p.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="the model to serve, as `vllm serve MODEL` (the same as --model)",
    )
    add_setting_flags(p, tuple(GROUPS))
    p.add_argument("--config", default=None, help="YAML settings file (or $CAROUSEL_CONFIG)")
    p.set_defaults(func=serve)


def _add_generate(sub: Any) -> None:
    p = sub.add_parser(
        "generate",
        help="generate once, offline (quick manual check)",
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("prompt")
    add_setting_flags(p, ("model", "cache", "scheduler"))
    p.add_argument("--config", default=None, help="YAML settings file (or $CAROUSEL_CONFIG)")
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
    parser.add_argument("--version", action="version", version=f"carousel {carousel_version()}")
    sub = parser.add_subparsers(dest="command")
    _add_serve(sub)
    _add_generate(sub)
    _add_bench(sub)
    add_rollout(sub)
    return parser


def load_settings(args: argparse.Namespace) -> Settings:
    return Settings.load(getattr(args, "config", None), **settings_kwargs(model_args(args)))


def model_args(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with the positional MODEL as `--model` (refused when both name a model)."""
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return args
    given = getattr(args, "model", None)
    if given is not None and given != tag:
        raise SettingsError([f"model: given twice, as {tag!r} and --model {given!r}"])
    return argparse.Namespace(**{**vars(args), "model": tag})


class SettingsError(Exception):
    """Settings refused before anything starts, one line per problem."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


def serve(args: argparse.Namespace) -> int:
    settings = load_settings(args)
    configure_logging(settings.log_level, json_logs(settings.log_format, sys.stderr))
    structlog.get_logger("carousel.gateway").info(
        "carousel_serve",
        model=settings.model,
        served_model_name=settings.model_name,
        backend=settings.backend,
        scheduler=settings.scheduler,
        host=settings.host,
        port=settings.port,
        api_keys=len(settings.key_principals()),  # NOTE: how many, never which
        response_store="memory" if settings.response_store == "memory" else "redis",
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
    state.freeze_gc_when_ready = True  # this process is the server (state.py's _freeze_gc)
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
    config = scheduler_config(settings)
    with LLM(backend, settings.scheduler, config, settings.scheduler_options) as llm:
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
        return _refused(problem_lines(exc))
    except SettingsError as exc:
        return _refused(exc.lines)


def _refused(lines: list[str]) -> int:
    """Print the settings' problems, one line each, and return the usage-error status."""
    noun = "problem" if len(lines) == 1 else "problems"
    print(f"carousel: invalid settings ({len(lines)} {noun}):", file=sys.stderr)
    for line in lines:
        print(f"  {line}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
