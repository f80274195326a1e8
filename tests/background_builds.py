"""The AVX2 kernels built in the background while the suite runs, for
tests/test_cpu_kernels_avx2.py: a second build of all of csrc/, about 2 minutes of both cores
on the 2-core CI machine, which held one worker for all of that when the test built them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests import parallel

ROOT = Path(__file__).resolve().parents[1]
AVX2_TEST_FILE = "tests/test_cpu_kernels_avx2.py"
#: the build, at the lowest priority (its ninja and compilers inherit it)
BUILD = "import os; os.nice(19); from backends.torch import cpu_kernels; cpu_kernels.native()"


@contextmanager
def avx2_build_in_background(items: Sequence[pytest.Item]) -> Iterator[None]:
    """While the block runs, the AVX2 kernels build in a process group of their own at nice
    19, so that they take the cores the tests leave idle (a test waiting on sleeps, sockets
    and servers) and hardly any the tests use: where this session runs the AVX2 test and no
    other worker of the run started the build.

    The test's own process imports the built kernels, or waits on the build's lock for the
    rest (backends/torch/cpu_kernels `_built`). A build still running when the block ends is
    stopped; the next one resumes from the objects it finished (ninja removes a half-written
    one).
    """
    if not any(item.nodeid.startswith(AVX2_TEST_FILE) for item in items):
        yield
        return
    if not parallel.claim("avx2-kernels-build"):
        yield
        return
    from backends.torch import cpu_kernels

    env = {**os.environ, cpu_kernels.ENV_SWITCH: cpu_kernels.AVX2_ONLY, "MAX_JOBS": "2"}
    build = subprocess.Popen(
        [sys.executable, "-c", BUILD], env=env, cwd=ROOT, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield
    finally:
        if build.poll() is None:
            os.killpg(build.pid, signal.SIGTERM)
            build.wait()
