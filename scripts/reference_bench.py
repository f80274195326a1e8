"""`make bench`: the reference comparison on the default model, written to bench-results/.

1. `carousel serve --config examples/ab.yaml` (arms `orca` and `static`, shared weights), then
   `carousel bench` against each arm in turn on the same workloads:
   a heavy-tailed burst and a moderate Poisson rate.
2. The same chat workload (no ignore_eos: the peer rejects it) against Carousel's orca arm
   and against `transformers serve --continuous-batching` on the same converted model.
3. --doc (bench-results/reference.md): tables, ratios, plots, exact commands; raw reports stay under
   --out (default bench-results/reference).

Every server listens on 127.0.0.1 only and is stopped by its pid; each is also wrapped in
`timeout` so it ends by itself.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
SERVED = "smollm2-135m-instruct"
BURST_SEED = 1
AB_MAX_NUM_SEQS = 16  # examples/ab.yaml


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start(cmd: list[str], health: str, log: Path) -> subprocess.Popen[bytes]:
    print("$", shlex.join(cmd), flush=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(["timeout", "3600", *cmd], cwd=ROOT, stdout=out, stderr=out)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(health, timeout=5).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited; see {log}")
        time.sleep(0.5)
    stop(proc)
    raise RuntimeError(f"{cmd} did not become healthy")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def serve_carousel(
    args: list[str], commands: list[str], log: Path
) -> tuple[subprocess.Popen[bytes], str]:
    """`carousel serve ARGS` on a free loopback port, once healthy; recorded in `commands`."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [PY, "-m", "gateway.cli", "serve", *args, "--port", str(port)]
    commands.append(shlex.join(["carousel", *cmd[3:]]))
    return start(cmd, f"{url}/health", log), url


def bench(args: list[str], commands: list[str], quiet: bool = False) -> None:
    """One `carousel bench ARGS` (recorded in `commands`; its report printed unless `quiet`)."""
    cmd = [PY, "-m", "bench", "--no-progress", *args]
    commands.append(shlex.join(["carousel", "bench", *cmd[3:]]))
    print("$", commands[-1], flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL if quiet else None)


def load(path: Path) -> dict[str, Any]:
    return json.loads((path / "report.json").read_text())


def metrics_by_arm(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {str(run["arm"] or "default"): run["metrics"] for run in report["runs"]}


def row(name: str, m: dict[str, Any]) -> str:
    return (
        f"| {name} | {m['completed']}/{m['num_sent']} | {m['output_throughput']:.1f} | "
        f"{m['request_throughput']:.2f} | {m['ttft_ms']['p50']:.0f} | {m['ttft_ms']['p99']:.0f} | "
        f"{m['tpot_ms']['p50']:.0f} | {m['e2e_latency_ms']['p50']:.0f} | "
        f"{m['e2e_latency_ms']['p99']:.0f} |"
    )


HEADER = (
    "| run | ok/sent | output tok/s | req/s | p50 TTFT ms | p99 TTFT ms | p50 TPOT ms "
    "| p50 e2e ms | p99 e2e ms |\n|---|---|---|---|---|---|---|---|---|"
)


def copy_plots(src: Path, dest: Path, prefix: str) -> list[str]:
    dest.mkdir(parents=True, exist_ok=True)
    names = []
    for png in sorted(src.glob("*.png")):
        target = dest / f"{prefix}-{png.name}"
        shutil.copy(png, target)
        names.append(target.name)
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "reference")
    parser.add_argument("--doc", type=Path, default=ROOT / "bench-results" / "reference.md")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--poisson-rate", type=float, default=0.6)
    parser.add_argument("--poisson-requests", type=int, default=40)
    parser.add_argument("--input-len", default="uniform:16:64", help="prompt words (DIST)")
    parser.add_argument("--peer-requests", type=int, default=32)
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--skip-ab", action="store_true", help="reuse the burst/poisson reports")
    parser.add_argument("--dtype", default="float32", help="model dtype for both servers")
    parser.add_argument(
        "--peer-dtype", default=None,
        help="transformers serve's dtype when not --dtype ('auto': its own default)",
    )  # fmt: skip
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    commands: list[str] = []

    os.environ["CAROUSEL_DTYPE"] = args.dtype
    commands.append(f"# every carousel serve below runs with CAROUSEL_DTYPE={args.dtype}")
    workload = ["--input-len", args.input_len, "--output-len", "heavy-tail",
                "--seed", str(BURST_SEED)]  # fmt: skip
    if args.skip_ab:
        commands.append(f"# A/B tables: an earlier run's reports, reused from {out} (--skip-ab)")
    else:
        ab = ["--config", "examples/ab.yaml"]
        server, url = serve_carousel(ab, commands, out / "carousel.log")
        try:
            common = ["--url", f"{url}/v1", "--model", SERVED, "--arm", "orca", "--arm", "static"]
            bench([*common, "--num-requests", str(args.num_requests), "--rate", "inf",
                   *workload, "--out", str(out / "burst")], commands)  # fmt: skip
            rate = str(args.poisson_rate)
            bench([*common, "--num-requests", str(args.poisson_requests), "--rate", rate,
                   *workload, "--out", str(out / "poisson")], commands)  # fmt: skip
        finally:
            stop(server)
    peer_load = ["--num-requests", str(args.peer_requests), "--rate", "inf",
                 "--input-len", args.input_len, "--output-len", "heavy-tail", "--seed", "2",
                 "--no-ignore-eos"]  # fmt: skip
    if not args.skip_peer:
        # NOTE: the peer batches every request of the burst at once, so Carousel gets seats
        # for all of them too (its own default scheduler, orca).
        seats = ["--max-num-seqs", str(max(64, args.peer_requests))]
        server, url = serve_carousel(seats, commands, out / "carousel-peer.log")
        try:
            bench(["--url", f"{url}/v1", "--model", SERVED, *peer_load,
                   "--out", str(out / "peer-carousel")], commands)  # fmt: skip
        finally:
            stop(server)

    if not args.skip_peer:
        from backends.torch.loader import resolve_model

        model_dir = resolve_model("default")
        tport = free_port()
        tserve = [str(Path(PY).parent / "transformers"), "serve", model_dir,
                  "--continuous-batching", "--device", "cpu", "--port", str(tport),
                  "--dtype", args.peer_dtype or args.dtype]  # fmt: skip
        commands.append(shlex.join(["transformers", *tserve[1:]]))
        peer = start(tserve, f"http://127.0.0.1:{tport}/health", out / "transformers.log")
        try:
            bench(["--url", f"http://127.0.0.1:{tport}/v1", "--model", model_dir, *peer_load,
                   "--no-trace", "--out", str(out / "peer-transformers")], commands)  # fmt: skip
        finally:
            stop(peer)
    write_doc(args, out, commands)


def burst_ceiling(args: argparse.Namespace) -> str:
    """The orca / static ratio this burst would show if a step cost the same at any batch."""
    from bench.bounds import step_bound
    from bench.workload import build_workload, parse_dist

    specs = build_workload(
        args.num_requests, parse_dist(args.input_len, "input"),
        parse_dist("heavy-tail", "output"), BURST_SEED,
    )  # fmt: skip
    bound = step_bound([spec.max_tokens for spec in specs], seats=AB_MAX_NUM_SEQS)
    return (
        f"Ceiling for this exact workload (`bench/bounds.py`): with "
        f"{AB_MAX_NUM_SEQS} seats in arrival order, static needs {bound.static_steps} decode "
        f"steps and orca {bound.orca_steps}, so even at a flat step cost (whatever the batch "
        f"size) orca could reach at most **{bound.ratio:.2f}x**."
    )


def write_doc(args: argparse.Namespace, out: Path, commands: list[str]) -> None:
    doc: Path = args.doc
    images = doc.parent / "bench"
    burst, poisson = load(out / "burst"), load(out / "poisson")
    b, p = metrics_by_arm(burst), metrics_by_arm(poisson)
    peer = "" if args.peer_dtype in (None, args.dtype) else f", peer {args.peer_dtype}"
    header = f"## Reference comparison (`make bench`, {args.dtype}{peer})"
    lines = [
        header,
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on this project's CPU machine (2 cores), the "
        f"default model (SmolLM2-135M-Instruct, {args.dtype}), one run, arms measured one "
        "after the other on the same workload. Ratios matter; absolute numbers move with the "
        "machine.",
        "",
        f"### Heavy-tailed burst: {args.num_requests} requests at once, input {args.input_len} "
        "words, output lognormal (median 48, capped at 256), max_num_seqs 16",
        "",
        HEADER,
        row("orca", b["orca"]),
        row("static", b["static"]),
        "",
        f"orca / static output throughput: **{b['orca']['output_throughput'] / b['static']['output_throughput']:.2f}x**",  # noqa: E501
        "",
        burst_ceiling(args),
        "",
        f"### Poisson arrivals: {args.poisson_requests} requests at {args.poisson_rate} req/s, "
        "same length distributions",
        "",
        HEADER,
        row("orca", p["orca"]),
        row("static", p["static"]),
        "",
        f"orca p99 e2e latency / static's: **{p['orca']['e2e_latency_ms']['p99'] / p['static']['e2e_latency_ms']['p99']:.2f}**",  # noqa: E501
        "",
    ]
    for run in ("burst", "poisson"):
        for name in copy_plots(out / run, images, f"{args.dtype}-{run}"):
            lines.append(f"![{name}](bench/{name})")
    if (out / "peer-transformers").exists():
        c = next(iter(metrics_by_arm(load(out / "peer-carousel")).values()))
        t = metrics_by_arm(load(out / "peer-transformers"))["default"]
        lines += [
            "",
            f"### Against `transformers serve --continuous-batching` ({args.peer_requests}-request "
            "burst, greedy, stopping at EOS on both: the peer rejects `ignore_eos`; carousel "
            f"{args.dtype}, the peer {args.peer_dtype or args.dtype})",
            "",
            HEADER,
            row("carousel (orca, max_num_seqs 64)", c),
            row("transformers serve", t),
            "",
            f"output throughput ratio carousel / transformers: "
            f"**{c['output_throughput'] / t['output_throughput']:.2f}x**; p50 TTFT "
            f"{c['ttft_ms']['p50']:.0f} ms vs {t['ttft_ms']['p50']:.0f} ms",
        ]
    lines += ["", "Commands:", "", "```", *commands, "```", ""]
    section = "\n".join(lines)
    replace_section(doc, header, section)


def replace_section(doc: Path, header: str, section: str) -> None:
    """Write `section` into `doc` in place of the `## ` section that starts with `header`
    (up to the next `## `), or at its end when there is none yet."""
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    start = text.find(header + "\n")
    if start >= 0:
        end = text.find("\n## ", start + 5)
        rest = text[end + 1 :] if end >= 0 else ""
        text = text[:start] + section.rstrip("\n") + "\n" + ("\n" + rest if rest else "")
    else:
        text = text.rstrip() + "\n\n" + section
    doc.write_text(text)
    print(f"wrote {doc}")


if __name__ == "__main__":
    main()
