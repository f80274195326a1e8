"""A group joined from the torchrun-style environment, as across nodes (here on loopback):
rank 0 is `carousel serve`, rank 1 is `python -m backends.torch.parallel.worker`, each
started on its own with MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import SIM_MODEL
from tests.serve_process import free_port
from tests.test_tensor_parallel_faults import model_dir, wait_until  # noqa: F401 - fixture

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def rank_env(rank: int, master_port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAROUSEL_")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port), RANK=str(rank),
               WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2")  # fmt: skip
    return env


def test_ranks_started_apart_from_the_environment_serve_and_drain_together(
    model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    master, port = free_port(), free_port()
    logs = {name: (tmp_path / f"{name}.log").open("w") for name in ("server", "worker")}
    worker = subprocess.Popen(
        [sys.executable, "-m", "backends.torch.parallel.worker", "--device", "cpu"],
        cwd=REPO, env=rank_env(1, master), stdout=logs["worker"], stderr=subprocess.STDOUT,
    )  # fmt: skip
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("carousel")), "serve", "--model", str(model_dir),
         "--tensor-parallel-size", "2", "--device", "cpu", "--port", str(port),
         "--served-model-name", SIM_MODEL],
        cwd=REPO, env=rank_env(0, master), stdout=logs["server"], stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert server.poll() is None and worker.poll() is None, (
            tmp_path / "server.log"
        ).read_text()[-2000:] + (tmp_path / "worker.log").read_text()[-2000:]
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(healthy, 120, "the two ranks never served")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(
            model=SIM_MODEL,
            prompt="hello",
            max_tokens=100,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        next(chunks)
        # a launcher signals every rank at once; the worker stays for the server's drain
        worker.send_signal(signal.SIGTERM)
        server.send_signal(signal.SIGTERM)
        rest = list(chunks)  # no error: the stream ended normally during the drain
        assert rest[-1].choices[0].finish_reason == "length"
        assert server.wait(30) == 0
        assert worker.wait(30) == 0, "the worker did not leave with rank 0's shutdown"
    finally:
        for proc in (server, worker):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs.values():
            log.close()
