"""The order in which `make test` (xdist's `--dist loadfile`) hands the suite's files to its
two workers: the longest first, then xdist's own order.

`loadfile` keeps each file on one worker (its module fixtures, servers and models are set up
once), and by default hands out the files with the most tests first. The files of one or two
long tests (the live A/B reads, the soak, a Triton interpreter run) then came last, and the
run ended on one worker's long file while the other sat idle. Longest first (the classic
longest-processing-time rule) leaves the short files to even out the end.

A test marked `serial` (tests/parallel.py) waits for the other worker's current test to end,
and a test of several minutes left one worker idle for over two: so the files with `serial`
tests go last, once the long files are done.

Both lists come from a run's per-file durations and markers; a file missing from them only
runs in xdist's own order, and a file listed that no longer exists is passed over.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
from xdist.scheduler import LoadFileScheduling

#: the suite's longest files, longest first (seconds on the 2-core machine, both workers busy,
#: 2026-12-07)
LONGEST_FILES = (
    "tests/test_triton_attention.py",  # 306: the Triton interpreter's runs
    "tests/test_oracle.py",  # 192
    "tests/test_compose_smoke.py",  # 176 where a container engine runs it
    "tests/test_rollout_sim.py",  # 161
    "tests/test_prefix_cache_oracle.py",  # 86
    "tests/test_grammar_scheduling.py",  # 62
    "tests/test_reliability_soak.py",  # 61
    "tests/test_docs_commands.py",  # 60
    "tests/test_rollout_replicas.py",  # 50
    "tests/test_structured_live.py",  # 48
    "tests/test_bf16_oracle.py",  # 45
    "tests/test_tensor_parallel_real_model.py",  # 42
)
#: the files with `serial` tests, handed out last
SERIAL_FILES = (
    "tests/test_bench_aa_live.py",  # two live A/B reads one after the other, about 130 s
    "tests/test_bench_client.py",
    "tests/test_bench_replay.py",
    "tests/test_engine.py",
    "tests/test_rollout_e2e.py",
    "tests/test_schema_work_shutdown.py",
    "tests/test_scheduler_plugins.py",
    "tests/test_tensor_parallel_faults.py",
    "tests/test_traffic_record.py",
    "tests/test_traffic_record_live.py",
    "tests/test_upstream.py",
)


def reorder(workqueue: OrderedDict[str, Any]) -> None:
    """`workqueue` (file -> its tests, in hand-out order) with `LONGEST_FILES` first, in their
    order, and `SERIAL_FILES` last; the others keep theirs."""
    for name in SERIAL_FILES:
        if name in workqueue:
            workqueue.move_to_end(name)
    for name in reversed(LONGEST_FILES):
        if name in workqueue:
            workqueue.move_to_end(name, last=False)


class LongestFilesFirst(LoadFileScheduling):
    """xdist's `loadfile` scheduling, its files handed out in `reorder`'s order."""

    def __init__(self, config: pytest.Config, log: Any = None) -> None:
        super().__init__(config, log)
        self.reordered = False

    def _assign_work_unit(self, node: Any) -> None:
        if not self.reordered:  # the first call: xdist has just filled its work queue
            self.reordered = True
            reorder(self.workqueue)
        super()._assign_work_unit(node)
