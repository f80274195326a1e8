"""A sample `carousel bench` report without a model: static against Orca on a toy server.

The toy server (bench/fake_server.py) emits one token per running sequence every few
milliseconds, with request-level batching on the `static` arm and per-iteration refills on the
`orca` arm, and serves /debug/trace, so the report shows every table and picture.

    .venv/bin/python scripts/bench_demo.py [OUT_DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cli import main  # noqa: E402
from bench.fake_server import FakeOptions, fake_server  # noqa: E402


def demo(out: str) -> int:
    """Run two arms on a heavy-tailed workload at two rates; write the report to `out`."""
    with fake_server(FakeOptions(max_num_seqs=8, step_s=0.002)) as (url, _):
        return main(
            [
                "--url", url, "--model", "toy", "--arm", "static", "--arm", "orca",
                "--num-requests", "60", "--sweep-rates", "100,400",
                "--input-len", "fixed:8", "--output-len", "heavy-tail",
                "--slo-ttft", "200", "--slo-tpot", "10", "--out", out,
            ]
        )  # fmt: skip


if __name__ == "__main__":
    sys.exit(demo(sys.argv[1] if len(sys.argv) > 1 else "bench-results/demo"))
