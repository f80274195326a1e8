"""Every `carousel ...` command in a fenced block of README.md and docs/*.md runs as written.

A doc's commands drift from the CLI silently: a renamed flag, a forgotten `--url`, a model
name the server answers with 404. This test reads each command from the fenced code blocks
(continuation lines joined, leading `VAR=value` words and a `.venv/bin/` prefix allowed) and:

- `carousel bench ...` and `carousel ab ...` run, in this process, against one shared
  `carousel serve --backend sim` server this module starts (arms `orca` and `static`, the
  default served name, recording its traffic to `traffic.jsonl` in the commands' folder);
- every other command (`serve`, `generate`: they need a real model, a GPU or minutes) goes
  through the CLI parser with its exact argv (prefix matching off), and `serve`/`generate`
  through the settings' validation too (files they name included), so a renamed flag or a
  bad value fails here;
- a `curl` of a local URL is sent, its method, headers and body as written, to the same sim
  server, which must answer 200 (a `"stream": true` body: a stream ending `data: [DONE]`), so
  a wrong path, model name or JSON body fails here.

The substitutions, all of them (each keeps a command's meaning while fitting a test):

- `http://127.0.0.1:PORT` and `http://localhost:PORT` become the sim server's address;
- a bench's `--num-requests N` / `--num-prompts N` become 4 (one is added when absent), so
  a documented 200-request sweep takes seconds;
- `ab report --window D` waits 2 s, not D;
- a command naming any other host (`http://gpu-box:8000`) is parsed only: that host is not
  here.

A doc marks a block with an HTML comment on the line before its fence, used sparingly:
`<!-- docs-test: skip REASON -->` (a synopsis, not a command) or
`<!-- docs-test: parse-only REASON -->` (it names a file the doc builds, a device, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from gateway.cli import build_parser, load_settings, main
from tests.serve_process import carousel_serve

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*docs-test:\s*(skip|parse-only)\b\s*(.*?)\s*-->")
FENCE = re.compile(r"^\s*(```|~~~)")
LOCAL_URL = re.compile(r"http://(?:127\.0\.0\.1|localhost):\d+")
ANY_URL = re.compile(r"\bhttps?://([^/:\s]+)")
ENV_WORD = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")
#: how many requests a documented bench sends here
NUM_REQUESTS = "4"
WINDOW = "2s"
RUNS_AGAINST_SERVER = ("bench", "ab")


@dataclass(frozen=True)
class DocCommand:
    """One documented command: where it is, its argv after `carousel`, and how to check it."""

    where: str
    argv: tuple[str, ...]
    mode: str  # run | parse (argv and settings) | parse-only (argv) | skip

    def __str__(self) -> str:
        return f"{self.where}: carousel {shlex.join(self.argv)}"


def fenced_blocks(text: str) -> Iterator[tuple[int, list[str], str | None]]:
    """(first line number, lines, marker) of each fenced block; the marker is the
    `docs-test:` comment on the nearest non-blank line above the fence, if any."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if not FENCE.match(lines[i]):
            i += 1
            continue
        above = next((line for line in reversed(lines[:i]) if line.strip()), "")
        found = MARKER.search(above)
        start, i = i + 1, i + 1
        while i < len(lines) and not FENCE.match(lines[i]):
            i += 1
        yield start + 1, lines[start:i], found.group(1) if found else None
        i += 1


def joined(lines: list[str]) -> Iterator[tuple[int, str]]:
    """(offset, logical line) with `\\` continuation lines joined."""
    pending, first = "", 0
    for offset, line in enumerate(lines):
        if not pending:
            first = offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield first, pending + line
        pending = ""
    if pending:
        yield first, pending


def carousel_argv(line: str) -> list[str] | None:
    """The argv after `carousel` when `line` runs it (after `$ `, `VAR=x` words, a path)."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return None
    if words[:1] == ["$"]:
        words = words[1:]
    while words and ENV_WORD.match(words[0]):
        words = words[1:]
    if not words or Path(words[0]).name != "carousel":
        return None
    return words[1:]


def mode_of(argv: list[str], marker: str | None) -> str:
    if marker in ("skip", "parse-only"):
        return marker
    if argv[:1] and argv[0] not in RUNS_AGAINST_SERVER:
        return "parse"
    hosts = {h for h in ANY_URL.findall(" ".join(argv)) if h not in ("127.0.0.1", "localhost")}
    return "parse-only" if hosts else "run"


def doc_commands(paths: list[Path] = DOCS) -> list[DocCommand]:
    found = []
    for path in paths:
        for start, lines, marker in fenced_blocks(path.read_text()):
            for offset, line in joined(lines):
                argv = carousel_argv(line)
                if argv is not None:
                    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
                    where = f"{shown}:{start + offset}"
                    found.append(DocCommand(where, tuple(argv), mode_of(argv, marker)))
    return found


def substituted(argv: tuple[str, ...], base_url: str) -> list[str]:
    """`argv` as run here (the module docstring lists every substitution)."""
    out = [LOCAL_URL.sub(base_url, word) for word in argv]
    for i, word in enumerate(out[:-1]):
        if word in ("--num-requests", "--num-prompts"):
            out[i + 1] = NUM_REQUESTS
        if word == "--window" and out[:2] == ["ab", "report"]:
            out[i + 1] = WINDOW
    counted = {"--num-requests", "--num-prompts"} & set(out)
    if out[:1] == ["bench"] and not counted:
        out += ["--num-requests", NUM_REQUESTS]
    return out


COMMANDS = doc_commands()


def test_the_docs_have_commands_of_each_kind() -> None:
    modes = {c.mode for c in COMMANDS}
    assert {"run", "parse"} <= modes, COMMANDS
    assert any(c.argv[:1] == ("serve",) for c in COMMANDS)


PARSED = [c for c in COMMANDS if c.mode in ("parse", "parse-only")]


@pytest.mark.parametrize("command", PARSED, ids=str)
def test_documented_command_parses(command: DocCommand) -> None:
    args = parse(command)
    if command.mode == "parse" and command.argv[0] in ("serve", "generate"):
        load_settings(args)  # raises on a bad value, an unknown setting, a missing file


def strict_parser() -> argparse.ArgumentParser:
    """The CLI's parser with argparse's prefix matching off (in it and every subcommand),
    so a documented `--max-num-seq` is not read as `--max-num-seqs`: a doc names a flag
    whole, and a rename that keeps the old name as a prefix must fail too."""
    parser = build_parser()
    pending = [parser]
    while pending:
        current = pending.pop()
        current.allow_abbrev = False
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                pending.extend(action.choices.values())
    return parser


def parse(command: DocCommand) -> argparse.Namespace:
    try:
        return strict_parser().parse_args(list(command.argv))
    except SystemExit as exc:
        pytest.fail(f"{command} is refused by the CLI parser (exit {exc.code})")


# -- the commands that run against a server --------------------------------------------------


@dataclass
class SimServer:
    url: str
    folder: Path


ARMS_YAML = """\
served_model_name: smollm2-135m-instruct
backend: sim
arms:
  - {name: static, scheduler: static}
  - {name: orca, scheduler: orca}
"""


@pytest.fixture(scope="module")
def sim_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimServer]:
    """`carousel serve --backend sim` with the docs' arms, recording its traffic."""
    folder = tmp_path_factory.mktemp("docs-commands")
    (folder / "arms.yaml").write_text(ARMS_YAML)
    args = ["--config", "arms.yaml", "--record-traffic", "traffic.jsonl"]
    with carousel_serve(args, folder) as url:
        _seed_traffic(url)
        yield SimServer(url, folder)


def _seed_traffic(url: str) -> None:
    """A few requests on each arm, so `--replay traffic.jsonl` and `ab report` have some."""
    for i in range(6):
        body = {"model": "smollm2-135m-instruct", "prompt": f"seed {i}", "max_tokens": 4}
        arm = ("static", "orca")[i % 2]
        reply = httpx.post(f"{url}/v1/completions", json=body, headers={"X-Carousel-Arm": arm})
        reply.raise_for_status()


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.mode == "run"], ids=str)
def test_documented_command_runs(
    command: DocCommand, sim_server: SimServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [k for k in os.environ if k.startswith("CAROUSEL_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(sim_server.folder)
    argv = substituted(command.argv, sim_server.url)
    assert main(argv) == 0, f"{command} (run as: carousel {shlex.join(argv)}) failed"


# -- the curl requests ------------------------------------------------------------------------


@dataclass(frozen=True)
class DocCurl:
    """One documented `curl` of a local URL: where it is and the request it sends."""

    where: str
    method: str
    url: str
    headers: tuple[tuple[str, str], ...]
    data: str | None

    def __str__(self) -> str:
        return f"{self.where}: curl {self.method} {self.url}"


#: the curl options the docs use, and whether each takes a value
CURL_OPTIONS = {"-N": False, "--no-buffer": False, "-s": False, "-sS": False, "-S": False,
                "-H": True, "--header": True, "-d": True, "--data": True, "-X": True}  # fmt: skip


def shell_lines(lines: list[str]) -> Iterator[tuple[int, str]]:
    """(offset, command) of a block's lines: `joined`'s, and a quote left open (a JSON body
    over several lines) runs on into the next line."""
    pending, first = "", 0
    for offset, line in joined(lines):
        if not pending:
            first = offset
        pending += ("\n" if pending else "") + line
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # an open quote
            continue
        yield first, pending
        pending = ""


def curl_request(words: list[str], where: str) -> DocCurl:
    """The request a `curl ...` command line sends (its words after `curl`)."""
    method, url, headers, data = "", "", [], None
    i = 0
    while i < len(words):
        word = words[i]
        if word.startswith("-"):
            assert word in CURL_OPTIONS, f"{where}: curl {word}: an option this test cannot read"
            value = words[i + 1] if CURL_OPTIONS[word] else ""
            if word in ("-H", "--header"):
                name, _, content = value.partition(":")
                headers.append((name.strip(), content.strip()))
            elif word in ("-d", "--data"):
                data = value
            elif word == "-X":
                method = value
            i += 2 if CURL_OPTIONS[word] else 1
            continue
        url, i = word, i + 1
    return DocCurl(where, method or ("POST" if data else "GET"), url, tuple(headers), data)


def doc_curls(paths: list[Path] = DOCS) -> list[DocCurl]:
    """Every `curl` of a local URL in the docs' fenced blocks."""
    found = []
    for path in paths:
        for start, lines, marker in fenced_blocks(path.read_text()):
            if marker == "skip":
                continue
            for offset, line in shell_lines(lines):
                words = shlex.split(line, comments=True)
                if words[:1] == ["$"]:
                    words = words[1:]
                if words[:1] != ["curl"]:
                    continue
                shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
                curl = curl_request(words[1:], f"{shown}:{start + offset}")
                if LOCAL_URL.match(curl.url):
                    found.append(curl)
    return found


CURLS = doc_curls()


def test_the_readme_streams_its_first_request_with_curl() -> None:
    [first, *_] = [c for c in CURLS if c.where.startswith("README.md:")]
    assert first.data is not None and '"stream": true' in first.data, first


@pytest.mark.parametrize("curl", CURLS, ids=str)
def test_documented_curl_answers(curl: DocCurl, sim_server: SimServer) -> None:
    url = LOCAL_URL.sub(sim_server.url, curl.url)
    body = curl.data.encode() if curl.data is not None else None
    reply = httpx.request(curl.method, url, headers=dict(curl.headers), content=body, timeout=60)
    assert reply.status_code == 200, f"{curl}: {reply.status_code} {reply.text[:500]}"
    if curl.data is not None and json.loads(curl.data).get("stream"):
        events = [line for line in reply.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]", f"{curl}: {reply.text[-500:]}"
        assert len(events) > 2, f"{curl}: no content chunk in {reply.text[:500]}"


# -- the rules themselves --------------------------------------------------------------------


def test_a_renamed_flag_fails_the_parse(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "```bash\ncarousel serve --max-num-seqs 4\ncarousel serve --max-num-sequences 4\n"
        "carousel serve --max-num-seq 4   # a prefix of the real flag\n```\n"
    )
    real, renamed, prefix = doc_commands([doc])
    test_documented_command_parses(real)
    for wrong in (renamed, prefix):
        with pytest.raises(pytest.fail.Exception, match="refused by the CLI parser"):
            test_documented_command_parses(wrong)


def test_blocks_markers_continuations_and_prefixes_are_read(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "<!-- docs-test: skip a synopsis -->\n```\ncarousel serve [--model M]\n```\n\n"
        "```bash\nX=1 Y=2 \\\n    .venv/bin/carousel bench --url http://127.0.0.1:8000/v1 \\\n"
        "    --model m   # a comment\ntorchrun -- carousel serve\n```\n"
        "<!-- docs-test: parse-only needs arms.yaml -->\n\n```\ncarousel ab report --url U\n```\n"
        "```\ncarousel ab report --url http://gpu-box:8000\n```\n"
    )
    found = [(c.argv, c.mode) for c in doc_commands([doc])]
    assert found == [
        (("serve", "[--model", "M]"), "skip"),
        (("bench", "--url", "http://127.0.0.1:8000/v1", "--model", "m"), "run"),
        (("ab", "report", "--url", "U"), "parse-only"),
        (("ab", "report", "--url", "http://gpu-box:8000"), "parse-only"),
    ]


def test_substitutions_are_the_documented_ones() -> None:
    url = "http://127.0.0.1:5555"
    bench = ("bench", "--url", "http://localhost:8000/v1", "--num-requests", "200")
    assert substituted(bench, url) == ["bench", "--url", f"{url}/v1", "--num-requests", "4"]
    assert substituted(("bench", "--url", "http://127.0.0.1:8000"), url)[-2:] == [
        "--num-requests",
        "4",
    ]
    report = ("ab", "report", "--url", "http://127.0.0.1:8000", "--window", "10m")
    assert substituted(report, url) == ["ab", "report", "--url", url, "--window", "2s"]


def test_a_curl_over_several_lines_is_read_as_one_request(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "```bash\ncurl -N http://localhost:8000/v1/chat/completions -H 'A: b' \\\n"
        '  -d \'{"model": "m",\n       "stream": true}\'\n'
        "curl http://gpu-box:8000/v1/models\n```\n"
    )
    [curl] = doc_curls([doc])
    assert (curl.method, curl.url, curl.headers) == (
        "POST",
        "http://localhost:8000/v1/chat/completions",
        (("A", "b"),),
    )
    assert json.loads(curl.data or "") == {"model": "m", "stream": True}
