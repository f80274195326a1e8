"""The checks of scripts/compose-smoke.sh against the running compose stack.

Each subcommand prints what it saw (one line per check, for the run's summary) and exits
non-zero with a `FAIL:` line saying what is wrong:

- `traffic`: OpenAI SDK requests through the gateway: the model list, a chat and a streamed
  chat pinned to each arm with `X-Carousel-Arm`, and sticky users (no header) that land on
  each arm and stay there; writes what each arm served to `--record`.
- `metrics`: the per-arm series in a scrape of the gateway's /metrics, against that record.
- `prometheus`: every target of deploy/prometheus/prometheus.yml up, and the per-arm and
  per-engine series arrived in Prometheus.
- `dashboard`: the provisioned Grafana dashboard: valid JSON, every panel on the provisioned
  datasource, every query's metric names in a live scrape of the job it selects, and every
  query accepted by Prometheus with a series for each arm (or engine) it groups by. The
  rollout panels' series exist only while a rollout runs: without `rollout:` in
  deploy/gateway.yaml they are checked for their datasource only (and their metrics by
  tests/test_compose.py on a live gateway with a rollout).
- `break-override`, `health-state`, `health-rerun`: helpers of the shell script.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import openai
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.arms.choice import ARM_HEADER, choose_by_weight, user_point

ROOT = Path(__file__).resolve().parents[1]
GATEWAY_YAML = ROOT / "deploy" / "gateway.yaml"
ENGINE_YAML = ROOT / "deploy" / "engine.yaml"
PROMETHEUS_YML = ROOT / "deploy" / "prometheus" / "prometheus.yml"
PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "carousel-ab.json"
PROMPT = "What is the capital of France? Answer in one sentence."
#: Grafana's variables in the dashboard's queries, as Grafana would fill them in
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$model": ".*"}
#: seconds between two polls of Prometheus (it scrapes every 5 s: deploy/prometheus/)
POLL_S = 2.0


class SmokeFailure(Exception):
    """A check failed; the message says what and why."""


@dataclass
class WeightedArm:
    """An arm of deploy/gateway.yaml as gateway/arms/choice.py weighs it (its `Weighted`)."""

    name: str
    weight: float


def gateway_config() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(GATEWAY_YAML.read_text())
    return config


def arm_names() -> list[str]:
    return [arm["name"] for arm in gateway_config()["arms"]]


def served_model() -> str:
    return str(gateway_config()["served_model_name"])


# -- traffic ----------------------------------------------------------------------------------


def _describe(error: openai.APIError) -> str:
    if isinstance(error, openai.APIStatusError):
        return f"HTTP {error.status_code}: {error.message}"
    return f"{type(error).__name__}: {error}"


def _request_failed(arm: str | None, what: str, error: openai.APIError) -> SmokeFailure:
    upstream = f"engine behind arm {arm!r}" if arm else "engine of its arm"
    if isinstance(error, openai.APIStatusError) and error.status_code in (502, 503, 504):
        return SmokeFailure(
            f"{what}: the gateway could not reach the {upstream} ({_describe(error)})"
        )
    if isinstance(error, openai.APIConnectionError):
        return SmokeFailure(f"{what}: cannot connect to the gateway ({_describe(error)})")
    return SmokeFailure(f"{what}: {_describe(error)}")


def chat(client: openai.OpenAI, arm: str, model: str) -> dict[str, Any]:
    what = f"chat pinned to arm {arm!r}"
    try:
        raw = client.chat.completions.with_raw_response.create(
            model=model,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=24,
            temperature=0,
            extra_headers={ARM_HEADER: arm},
        )
    except openai.APIError as error:
        raise _request_failed(arm, what, error) from error
    served = raw.headers.get(ARM_HEADER)
    completion = raw.parse()
    text = completion.choices[0].message.content or ""
    if served != arm:
        raise SmokeFailure(f"{what}: the response header {ARM_HEADER} is {served!r}")
    if not text.strip() or completion.usage is None or completion.usage.completion_tokens < 1:
        raise SmokeFailure(f"{what}: an empty answer ({completion.model_dump_json()})")
    return {"arm": arm, "text": text, "completion_tokens": completion.usage.completion_tokens}


def stream_chat(client: openai.OpenAI, arm: str, model: str) -> dict[str, Any]:
    what = f"streamed chat pinned to arm {arm!r}"
    pieces: list[str] = []
    finish: str | None = None
    chunks = 0
    try:
        with client.chat.completions.with_streaming_response.create(
            model=model,
            messages=[{"role": "user", "content": "Name three colours."}],
            max_tokens=24,
            temperature=0,
            stream=True,
            extra_headers={ARM_HEADER: arm},
        ) as response:
            served = response.headers.get(ARM_HEADER)
            if served != arm:
                raise SmokeFailure(f"{what}: the response header {ARM_HEADER} is {served!r}")
            for chunk in response.parse():
                chunks += 1
                for choice in chunk.choices:
                    pieces.append(choice.delta.content or "")
                    finish = choice.finish_reason or finish
    except openai.APIError as error:
        raise _request_failed(arm, what, error) from error
    text = "".join(pieces)
    if chunks < 2 or not text.strip() or finish not in ("stop", "length"):
        raise SmokeFailure(f"{what}: {chunks} chunks, text {text!r}, finish_reason {finish!r}")
    return {"arm": arm, "chunks": chunks, "text": text, "finish_reason": finish}


def sticky_users(arms: list[str], per_arm: int = 1) -> dict[str, str]:
    """Users that deploy/gateway.yaml's weights send to each arm (gateway/arms/choice.py's hash)."""
    config_arms = [WeightedArm(a["name"], float(a["weight"])) for a in gateway_config()["arms"]]
    users: dict[str, str] = {}
    for i in range(1000):
        user = f"carousel-smoke-user-{i}"
        arm = choose_by_weight(config_arms, user_point(user))
        if arm is not None and arm.name in arms and list(users.values()).count(arm.name) < per_arm:
            users[user] = arm.name
        if all(list(users.values()).count(a) >= per_arm for a in arms):
            return users
    raise SmokeFailure(f"no user lands on each of {arms} with the weights in {GATEWAY_YAML}")


def sticky(client: openai.OpenAI, user: str, expected: str, model: str, repeats: int) -> list[str]:
    served: list[str] = []
    for _ in range(repeats):
        what = f"chat for user {user!r} (no {ARM_HEADER} header)"
        try:
            raw = client.chat.completions.with_raw_response.create(
                model=model,
                messages=[{"role": "user", "content": "Say hello."}],
                max_tokens=4,
                user=user,
            )
        except openai.APIError as error:
            raise _request_failed(None, what, error) from error
        served.append(str(raw.headers.get(ARM_HEADER)))
    if set(served) != {expected}:
        raise SmokeFailure(f"user {user!r} is not sticky to arm {expected!r}: served by {served}")
    return served


def cmd_traffic(args: argparse.Namespace) -> None:
    model = served_model()
    arms = [a for a in arm_names() if a not in args.skip_arm]
    client = openai.OpenAI(
        base_url=f"{args.gateway}/v1", api_key="unused", timeout=180.0, max_retries=0
    )
    try:
        ids = [m.id for m in client.models.list()]
    except openai.APIError as error:
        raise _request_failed(None, "GET /v1/models", error) from error
    if model not in ids:
        raise SmokeFailure(f"GET /v1/models lists {ids}, not {model!r}")
    print(f"check: GET /v1/models lists {model}")
    served = {arm: 0 for arm in arm_names()}
    tokens = {arm: 0 for arm in arm_names()}
    for arm in arms:
        reply = chat(client, arm, model)
        served[arm] += 1
        tokens[arm] += reply["completion_tokens"]
        print(f"check: chat via arm {arm}: {reply['text'].strip()!r}")
        streamed = stream_chat(client, arm, model)
        served[arm] += 1
        print(
            f"check: streamed chat via arm {arm}: {streamed['chunks']} chunks, "
            f"finish_reason {streamed['finish_reason']}"
        )
    repeats = 3
    for user, arm in sticky_users(arms).items():
        sticky(client, user, arm, model, repeats)
        served[arm] += repeats
        print(
            f"check: user {user} (no header) served by arm {arm} {repeats} times out of {repeats}"
        )
    Path(args.record).write_text(json.dumps({"model": model, "served": served}))


# -- the gateway's /metrics -------------------------------------------------------------------


def samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            yield sample.name, dict(sample.labels), float(sample.value)


def total(text: str, name: str, **labels: str) -> float | None:
    """The sum of `name` samples whose labels include `labels`; None if there is none."""
    values = [
        v
        for n, ls, v in samples(text)
        if n == name and all(ls.get(k) == want for k, want in labels.items())
    ]
    return sum(values) if values else None


def cmd_metrics(args: argparse.Namespace) -> None:
    record = json.loads(Path(args.record).read_text())
    scrapes = dict(_pair(s) for s in args.scrape)
    text = Path(scrapes["gateway"]).read_text()
    before = Path(args.baseline).read_text() if args.baseline else ""
    model = record["model"]
    seen_arms = sorted(
        {ls["arm"] for n, ls, _ in samples(text) if n.startswith("carousel_") and "arm" in ls}
    )

    def grew(name: str, arm: str) -> float | None:
        """How much `name` grew for `arm` since the baseline; None: no series at all."""
        after = total(text, name, arm=arm, model=model)
        return None if after is None else after - (total(before, name, arm=arm, model=model) or 0)

    for arm, sent in record["served"].items():
        requests = grew("carousel_requests_total", arm)
        if requests is None:
            raise SmokeFailure(
                f"arm {arm!r} is missing from the gateway's /metrics: no "
                f'carousel_requests_total{{arm="{arm}"}} series (arms with series: {seen_arms})'
            )
        if requests != sent:  # NOTE: the smoke's requests are the only traffic (baseline: none)
            raise SmokeFailure(
                f"gateway /metrics: carousel_requests_total{{arm={arm!r}}} grew by "
                f"{requests:g}, but the smoke sent that arm {sent} requests"
            )
        ttft = grew("carousel_time_to_first_token_seconds_count", arm)
        generated = grew("carousel_generation_tokens_total", arm)
        if not ttft or not generated:
            raise SmokeFailure(
                f"gateway /metrics: arm {arm!r} has no new TTFT observations ({ttft}) or "
                f"generated tokens ({generated})"
            )
        print(
            f"check: gateway /metrics arm {arm}: {requests:g} requests (sent {sent}), "
            f"{generated:g} generated tokens, {ttft:g} TTFT observations"
        )


def _pair(text: str) -> tuple[str, str]:
    key, _, value = text.partition("=")
    return key, value


# -- Prometheus -------------------------------------------------------------------------------


def prometheus_jobs() -> dict[str, list[str]]:
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    return {
        job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
        for job in config["scrape_configs"]
    }


def query(url: str, expr: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10.0)
    body = response.json()
    if response.status_code != 200 or body.get("status") != "success":
        raise SmokeFailure(f"Prometheus rejects {expr!r}: {body.get('error', response.text)}")
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def wait_for(timeout_s: float, check: Callable[[], Any], interval_s: float = POLL_S) -> Any:
    """`check()` until it returns something true or `timeout_s` passes; the last result."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(interval_s)


def cmd_prometheus(args: argparse.Namespace) -> None:
    jobs = prometheus_jobs()
    url = args.url

    def targets() -> list[dict[str, Any]]:
        response = httpx.get(f"{url}/api/v1/targets", timeout=10.0)
        active: list[dict[str, Any]] = response.json()["data"]["activeTargets"]
        return active

    def all_up() -> bool:
        active = targets()
        got = {(t["labels"]["job"], t["labels"]["instance"]) for t in active if t["health"] == "up"}
        return got == {(job, target) for job, ts in jobs.items() for target in ts}

    if not wait_for(args.timeout, all_up):
        states = [
            f"{t['labels']['job']} {t['scrapeUrl']}: {t['health']} {t.get('lastError', '')}".strip()
            for t in targets()
        ]
        raise SmokeFailure(f"not every Prometheus target is up after {args.timeout:g} s: {states}")
    print(f"check: prometheus targets up: {', '.join(sorted(jobs))}")

    record = json.loads(Path(args.record).read_text())
    arms = sorted(arm for arm, sent in record["served"].items() if sent)
    expr = 'sum by (arm) (carousel_requests_total{job="gateway"})'

    def per_arm() -> dict[str, float]:
        got = {r["metric"].get("arm", ""): float(r["value"][1]) for r in query(url, expr)}
        ok = all(got.get(arm, 0) >= record["served"][arm] for arm in arms)
        return got if ok else {}

    got = wait_for(args.timeout, per_arm)
    if not got:
        raise SmokeFailure(f"Prometheus: {expr} has no series for every arm in {arms}")
    print(f"check: prometheus {expr}: {json.dumps(got, sort_keys=True)}")
    engines = sorted(job for job in jobs if job != "gateway")
    expr = 'sum by (job) (carousel_iteration_tokens_count{job=~"engine-.*"})'

    def per_engine() -> dict[str, float]:
        got = {r["metric"]["job"]: float(r["value"][1]) for r in query(url, expr)}
        return got if all(got.get(job, 0) > 0 for job in engines) else {}

    got = wait_for(args.timeout, per_engine)
    if not got:
        raise SmokeFailure(f"Prometheus: {expr} has no iterations for each of {engines}")
    print(f"check: prometheus {expr}: {json.dumps(got, sort_keys=True)}")


# -- the Grafana dashboard ----------------------------------------------------------------------


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in items:
        yield panel
        yield from panels(panel.get("panels", []))


def grafana_filled(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    if "$" in expr:
        raise SmokeFailure(f"dashboard query uses a variable this check cannot fill: {expr}")
    return expr


def selected_jobs(expr: str, jobs: list[str]) -> list[str]:
    selectors = set(re.findall(r'job(=~?)"([^"]+)"', expr))
    if len(selectors) != 1:
        raise SmokeFailure(f"dashboard query selects {len(selectors)} job selectors: {expr}")
    [(op, value)] = selectors
    matched = [j for j in jobs if (re.fullmatch(value, j) if op == "=~" else j == value)]
    if not matched:
        raise SmokeFailure(f"dashboard query selects no Prometheus job of {jobs}: {expr}")
    return matched


def label_values(url: str, definition: str) -> list[str]:
    """What Grafana's `label_values(metric, label)` variable query gives, from Prometheus."""
    m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", definition.strip())
    if m is None:
        raise SmokeFailure(f"dashboard variable query this check cannot run: {definition!r}")
    metric, label = m.groups()
    response = httpx.get(
        f"{url}/api/v1/label/{label}/values", params={"match[]": metric}, timeout=10.0
    )
    values: list[str] = response.json()["data"]
    return values


@dataclass(frozen=True)
class PanelQuery:
    """A dashboard query and what it must answer once the traffic is scraped: a series for
    each of `want` in `label` (its `by (arm)` or `by (job)`), or any series (`label` None)."""

    title: str
    expr: str
    label: str | None
    want: frozenset[str]

    def shortfall(self, prometheus: str) -> str | None:
        """What Prometheus's answer lacks now; None once the panel would be filled.

        NOTE: a `rate()` has a series only once its window holds two scrapes of the counter:
        right after the traffic it can lack some, hence the polling (`unfilled`)."""
        result = query(prometheus, grafana_filled(self.expr))
        if self.label is None:
            return None if result else f"Prometheus returns no series for {self.expr}"
        got = {r["metric"].get(self.label) for r in result}
        if self.want <= got:
            return None
        return (
            f"Prometheus has series for {sorted(got - {None})}, not each of "
            f"{sorted(self.want)}: {self.expr}"
        )


def unfilled(prometheus: str, queries: list[PanelQuery], timeout_s: float) -> dict[str, str]:
    """The panels whose queries still lack series after polling Prometheus for up to
    `timeout_s` (title -> what its first unfilled query lacks); empty once all are filled."""
    pending = list(queries)
    lacking: dict[str, str] = {}

    def all_filled() -> bool:
        nonlocal pending
        lacking.clear()
        still = []
        for panel_query in pending:
            why = panel_query.shortfall(prometheus)
            if why is not None:
                still.append(panel_query)
                lacking.setdefault(panel_query.title, why)
        pending = still
        return not pending

    wait_for(timeout_s, all_filled)
    return dict(lacking)


def lists_the_model(url: str, definition: str) -> bool:
    """Whether the dashboard's `label_values` variable offers the served model yet."""
    return served_model() in label_values(url, definition)


def cmd_dashboard(args: argparse.Namespace) -> None:
    try:
        dashboard = json.loads(DASHBOARD.read_text())
    except json.JSONDecodeError as error:
        raise SmokeFailure(f"{DASHBOARD} is not valid JSON: {error}") from error
    [datasource] = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yaml").read_text())[
        "datasources"
    ]
    uid = datasource["uid"]
    scraped = {
        job: {name for name, _, _ in samples(Path(path).read_text())}
        for job, path in (_pair(s) for s in args.scrape)
    }
    shown = [p for p in panels(dashboard["panels"]) if p.get("type") != "row"]
    if not shown:
        raise SmokeFailure("the dashboard has no panels")
    # the rollout's series exist only while a rollout runs
    unchecked = [] if "rollout" in gateway_config() else [p for p in shown if needs_a_rollout(p)]
    queries: list[PanelQuery] = []
    for panel in shown:
        check_datasources(panel, datasource)
        if panel not in unchecked:
            queries += panel_queries(panel, scraped)
    lacking = unfilled(args.prometheus, queries, args.timeout)
    if lacking:
        title, why = next(iter(lacking.items()))
        raise SmokeFailure(
            f"panel {title!r}: {why} (still, {args.timeout:g} s after the check began; "
            f"{len(lacking)} panel(s) unfilled)"
        )
    for variable in dashboard.get("templating", {}).get("list", []):
        source = variable.get("datasource") or {}
        if source.get("uid") != uid:
            raise SmokeFailure(f"dashboard variable {variable['name']}: datasource {source}")
        definition = variable.get("definition", "")
        if not wait_for(args.timeout, partial(lists_the_model, args.prometheus, definition)):
            raise SmokeFailure(
                f"dashboard variable {variable['name']}: {definition} gives "
                f"{label_values(args.prometheus, definition)}, not the served model "
                f"{served_model()!r}"
            )
    skipped = (
        f" ({len(unchecked)} rollout panels not checked live: {GATEWAY_YAML.name} has no "
        "`rollout:`; tests/test_compose.py checks their metrics on a gateway with one)"
        if unchecked
        else ""
    )
    print(
        f"check: dashboard {DASHBOARD.name}: valid JSON, {len(shown)} panels on datasource {uid}, "
        f"{len(queries)} queries whose metrics are in live scrapes and that Prometheus answers "
        f"per arm/job{skipped}"
    )


def check_datasources(panel: dict[str, Any], datasource: dict[str, Any]) -> None:
    """The panel and each of its queries read the provisioned datasource."""
    sources = [panel.get("datasource")] + [t.get("datasource") for t in panel.get("targets", [])]
    for source in sources:
        if (
            not source
            or source.get("uid") != datasource["uid"]
            or source.get("type") != datasource["type"]
        ):
            raise SmokeFailure(
                f"panel {panel.get('title')!r}: datasource {source} is not the provisioned "
                f"{datasource['uid']!r}"
            )


def panel_queries(panel: dict[str, Any], scraped: dict[str, set[str]]) -> list[PanelQuery]:
    """The panel's queries, each naming metrics that a live scrape of its job has, with the
    series each must answer with (one per arm, or per job, of its `by (...)`)."""
    title = str(panel.get("title"))
    jobs = sorted(prometheus_jobs())
    queries = []
    for target in panel.get("targets", []):
        expr = target["expr"]
        names = set(re.findall(r"\bcarousel_[a-z0-9_]+", expr))
        if not names:
            raise SmokeFailure(f"panel {title!r}: a query names no Carousel metric: {expr}")
        for job in selected_jobs(expr, jobs):
            missing = sorted(names - scraped[job])
            if missing:
                raise SmokeFailure(
                    f"panel {title!r}: {missing} not in a live scrape of {job}'s /metrics: {expr}"
                )
        by = re.search(r"by \((?:le, )?(arm|job|status)\)", expr)
        label = by.group(1) if by and by.group(1) in ("arm", "job") else None
        want = set(arm_names()) if label == "arm" else set(selected_jobs(expr, jobs))
        queries.append(PanelQuery(title, expr, label, frozenset(want if label else ())))
    return queries


def needs_a_rollout(panel: dict[str, Any]) -> bool:
    """A panel of the rollout's series only (`carousel_rollout_*`), which a gateway exports
    only while it runs a rollout (docs/rollout.md)."""
    names = {n for t in panel.get("targets", []) for n in re.findall(r"\bcarousel_\w+", t["expr"])}
    return bool(names) and all(n.startswith("carousel_rollout_") for n in names)


# -- helpers of the shell script ----------------------------------------------------------------


def cmd_health_state(args: argparse.Namespace) -> None:
    """`<state> <health>` of a container, from `docker|podman inspect` JSON."""
    [info] = json.loads(Path(args.inspect).read_text()) or [{}]
    state = info.get("State", {})
    health = state.get("Health") or state.get("Healthcheck") or {}
    status = state.get("Status", "missing")
    if state.get("Restarting"):
        status = "restarting"
    print(status, health.get("Status") or "none")


def cmd_health_rerun(args: argparse.Namespace) -> None:
    """A container's healthcheck command run once more, by exec: its exit and last line.

    (podman keeps only the first 500 bytes of a check's output, which of a Python traceback
    is the part that does not say what went wrong.)"""
    [info] = json.loads(Path(args.inspect).read_text()) or [{}]
    config = info.get("Config", {}).get("Healthcheck") or {}
    test = config.get("Test") or []
    if not test or test[0] not in ("CMD", "CMD-SHELL"):
        print(f"no healthcheck command in {test}")
        return
    argv = test[1:] if test[0] == "CMD" else ["/bin/sh", "-c", test[1]]
    try:
        done = subprocess.run(
            [args.engine, "exec", info["Id"], *argv], capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        print("the healthcheck command hangs (over 30 s)")
        return
    lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    print(f"exit {done.returncode}: {lines[-1] if lines else 'no output'}")


def kernel_events(log_text: str) -> list[dict[str, Any]]:
    """The CPU kernels' JSON log lines (`cpu_kernels_*`) in a container's log."""
    events = []
    for line in log_text.splitlines():
        start = line.find("{")
        if start < 0:
            continue
        try:
            entry = json.loads(line[start:])
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict) and str(entry.get("event", "")).startswith("cpu_kernels_"):
            events.append(entry)
    return events


def cmd_kernels_ready(args: argparse.Namespace) -> None:
    """An engine container ran Carousel's CPU kernels, built into the image: its log has
    `cpu_kernels_ready` and no build at start-up (the image has no compiler)."""
    events = kernel_events(Path(args.log).read_text(errors="replace"))
    names = [e["event"] for e in events]
    if "cpu_kernels_ready" not in names:
        why = next((e for e in events if e["event"] != "cpu_kernels_ready"), None)
        reason = json.dumps(why) if why else "no cpu_kernels_* line at all"
        raise SmokeFailure(f"{args.service}: the CPU kernels are not running ({reason})")
    if "cpu_kernels_building" in names:
        raise SmokeFailure(
            f"{args.service}: the CPU kernels were built at start-up, not in the image"
        )
    ready = events[names.index("cpu_kernels_ready")]
    print(
        f"check: {args.service} runs the CPU kernels built into the image (isa {ready.get('isa')})"
    )


def load_compose_service(name: str) -> dict[str, Any]:
    service: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"][name]
    return service


def cmd_break_override(args: argparse.Namespace) -> None:
    """A compose override file that breaks one thing (CAROUSEL_SMOKE_BREAK), on stdout."""
    work = Path(args.work)
    override: dict[str, Any]
    if args.mode == "engine-unreachable":
        config = gateway_config()
        for arm in config["arms"]:
            if arm["name"] == "static":
                arm["upstream"]["base_urls"] = ["http://engine-static:8009/v1"]
        broken = work / "gateway-broken.yaml"
        broken.write_text(yaml.safe_dump(config, sort_keys=False))
        override = {
            "services": {
                "gateway": {
                    "command": ["--config", "/etc/carousel/gateway-broken.yaml"],
                    "volumes": [f"{broken}:/etc/carousel/gateway-broken.yaml:ro"],
                }
            }
        }
        why = "the gateway's static arm points at engine-static:8009, where nothing listens"
    elif args.mode == "unhealthy":
        # NOTE: `command` replaces the service's (compose merges most lists by appending)
        command = load_compose_service("engine-static")["command"]
        override = {
            "services": {
                "engine-static": {
                    "command": [*command, "--port", "8001"],
                    "healthcheck": {
                        "interval": "5s",
                        "timeout": "3s",
                        "retries": 2,
                        "start_period": "10s",
                    },
                }
            }
        }
        why = "engine-static serves on port 8001, its healthcheck probes 8000"
    else:
        raise SmokeFailure(f"no override for {args.mode!r}")
    print(f"# {why}")
    print(yaml.safe_dump(override, sort_keys=False), end="")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("traffic")
    p.add_argument("--gateway", required=True)
    p.add_argument("--record", required=True)
    p.add_argument("--skip-arm", action="append", default=[])
    p.set_defaults(run=cmd_traffic)
    p = sub.add_parser("metrics")
    p.add_argument("--record", required=True)
    p.add_argument("--scrape", action="append", default=[], help="job=path of a /metrics text")
    p.add_argument("--baseline", help="the gateway's /metrics before the traffic")
    p.set_defaults(run=cmd_metrics)
    p = sub.add_parser("prometheus")
    p.add_argument("--url", required=True)
    p.add_argument("--record", required=True)
    p.add_argument("--timeout", type=float, default=90.0)
    p.set_defaults(run=cmd_prometheus)
    p = sub.add_parser("dashboard")
    p.add_argument("--prometheus", required=True)
    p.add_argument("--scrape", action="append", default=[], help="job=path of a /metrics text")
    p.add_argument(
        "--timeout", type=float, default=90.0, help="seconds to wait for each panel's series"
    )
    p.set_defaults(run=cmd_dashboard)
    p = sub.add_parser("health-state")
    p.add_argument("inspect")
    p.set_defaults(run=cmd_health_state)
    p = sub.add_parser("health-rerun")
    p.add_argument("--engine", required=True)
    p.add_argument("inspect")
    p.set_defaults(run=cmd_health_rerun)
    p = sub.add_parser("kernels-ready")
    p.add_argument("--service", required=True)
    p.add_argument("log")
    p.set_defaults(run=cmd_kernels_ready)
    p = sub.add_parser("break-override")
    p.add_argument("--mode", required=True)
    p.add_argument("--work", required=True)
    p.set_defaults(run=cmd_break_override)
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except SmokeFailure as failure:
        print(f"FAIL: {failure}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
