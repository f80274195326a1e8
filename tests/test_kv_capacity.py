"""The server says what its KV cache holds (issue 52): the start-up `kv_cache` line and the
/metrics gauges carry blocks, tokens, bytes and vLLM's "maximum concurrency" at
`max_model_len` and at a 2k context; a `max_model_len` no sequence fits in is refused at start
with the numbers, as one log line."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs
from transformers import LlamaConfig, LlamaForCausalLM

from backends.torch.kv_cache import KVLayout, plan_num_blocks
from backends.torch.runner.backend import TorchBackend
from backends.torch.testing.tiny_models import TINY, tiny_tokenizer
from gateway.arms.local import LocalArm
from gateway.obs.kv_capacity import KVCapacity
from schedulers.backend import KVCacheSpec
from schedulers.base import SchedulerConfig
from tests.conftest import sim_arm, start_server
from tests.serve_process import carousel_process, free_port

MAX_MODEL_LEN = 4096
KV_CACHE_GB = 0.01
#: fp32 K and V of TINY (2 layers, 2 KV heads of 64 / 4 = 16 dims) for one 16-token block
BYTES_PER_BLOCK = 2 * 2 * 16 * 2 * 16 * 4


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**TINY, "max_position_embeddings": MAX_MODEL_LEN}))


def tiny_backend() -> TorchBackend:
    return TorchBackend(
        tiny_llama(), tiny_tokenizer(), device="cpu", dtype="float32",
        kv_cache_gb=KV_CACHE_GB, block_size=16, cpu_kernels=False,
    )  # fmt: skip


@pytest.fixture
def backend() -> Iterator[TorchBackend]:
    built = tiny_backend()
    yield built
    built.close()


def test_the_figures_of_a_tiny_models_cache_are_what_its_tensors_hold(
    backend: TorchBackend,
) -> None:
    capacity = KVCapacity.of(backend.kv_cache_spec, backend.max_model_len)
    num_blocks = int(KV_CACHE_GB * 1024**3) // BYTES_PER_BLOCK  # the budget binds, not the cap
    assert (capacity.num_blocks, capacity.block_size) == (num_blocks, 16)
    assert capacity.num_tokens == num_blocks * 16
    assert capacity.nbytes == num_blocks * BYTES_PER_BLOCK
    tensors = sum(t.nbytes for t in [*backend.kv_cache.k, *backend.kv_cache.v])
    assert tensors == capacity.nbytes + BYTES_PER_BLOCK  # and the scratch block
    assert capacity.max_concurrency(MAX_MODEL_LEN) == pytest.approx(num_blocks / 256)
    assert capacity.max_concurrency(2048) == pytest.approx(num_blocks / 128)


def test_concurrency_counts_a_part_filled_last_block_whole_as_vllm_does() -> None:
    capacity = KVCapacity.of(KVCacheSpec(num_blocks=70, block_size=16), max_model_len=100)
    assert capacity.max_concurrency(100) == 10.0  # 7 blocks each, not 1120 / 100 = 11.2
    assert capacity.typical_context_tokens == 100  # no 2k request where 100 tokens are served
    assert capacity.nbytes == 0  # the sim's cache holds no tensors


def test_a_budget_that_cannot_hold_one_sequence_is_refused_with_the_numbers() -> None:
    layout = KVLayout(2, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError) as refused:
        plan_num_blocks(
            layout, budget_bytes=10 * BYTES_PER_BLOCK, max_model_len=4096, max_num_seqs=8
        )
    message = str(refused.value)
    assert "one 4096-token sequence (max_model_len)" in message
    assert "0.08 MiB holds 10 blocks of 16 tokens (160 tokens)" in message
    assert "needs 256 blocks (4096 tokens, 2.00 MiB)" in message


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every carousel_kv_cache_* sample of /metrics, by (name, sorted labels but model)."""
    text = httpx.get(f"{url}/metrics").text
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model"))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("carousel_kv_cache_") and s.name != "carousel_kv_cache_usage_perc"
    }


def test_metrics_and_the_start_up_log_carry_the_torch_caches_figures() -> None:
    arm = LocalArm.from_backend(tiny_backend(), config=SchedulerConfig(max_num_seqs=4))
    with ExitStack() as stack, capture_logs() as logs:
        server = start_server(stack, arm)
        samples = scrape(server.url)
    num_blocks = int(KV_CACHE_GB * 1024**3) // BYTES_PER_BLOCK
    arm_label = (("arm", "orca"),)
    assert samples == {
        ("carousel_kv_cache_blocks", arm_label): num_blocks,
        ("carousel_kv_cache_block_size", arm_label): 16,
        ("carousel_kv_cache_tokens", arm_label): num_blocks * 16,
        ("carousel_kv_cache_bytes", arm_label): num_blocks * BYTES_PER_BLOCK,
        ("carousel_kv_cache_max_concurrency", (*arm_label, ("context_tokens", "2048"))): (
            num_blocks / 128
        ),
        ("carousel_kv_cache_max_concurrency", (*arm_label, ("context_tokens", "4096"))): (
            num_blocks / 256
        ),
    }
    [line] = [entry for entry in logs if entry["event"] == "kv_cache"]
    assert line["num_blocks"] == num_blocks and line["gib"] == round(KV_CACHE_GB, 3)
    assert line["max_concurrency"] == f"{num_blocks / 256:.2f}x"
    assert (line["typical_context"], line["typical_concurrency"]) == (
        2048,
        f"{num_blocks / 128:.2f}x",
    )


def test_the_sims_simulated_cache_has_the_same_gauges_but_bytes() -> None:
    with ExitStack() as stack:
        server = start_server(stack, sim_arm(num_blocks=512, max_model_len=1024))
        samples = scrape(server.url)
    assert samples[("carousel_kv_cache_blocks", (("arm", "orca"),))] == 512
    concurrency = (
        "carousel_kv_cache_max_concurrency",
        (("arm", "orca"), ("context_tokens", "1024")),
    )
    assert samples[concurrency] == 512 / 64  # the served context is the typical one too
    assert not any(name == "carousel_kv_cache_bytes" for name, _ in samples)


def test_carousel_serve_refuses_a_max_model_len_no_sequence_fits_in_one_line(
    tmp_path: Path,
) -> None:
    model_dir = tmp_path / "tiny"
    tiny_llama().save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    args = ["serve", str(model_dir), "--device", "cpu", "--dtype", "float32", "--no-cpu-kernels"]
    args += ["--max-model-len", "4096", "--kv-cache-gb", "0.0001", "--port", str(free_port())]
    with carousel_process(args, tmp_path, "refused") as proc:
        try:
            status = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail("carousel serve kept running with a KV cache too small for one sequence")
    log = (tmp_path / "refused.log").read_text()
    assert status == 1, log
    assert "Traceback" not in log, log
    [line] = [row for row in log.splitlines() if "arm_load_failed" in row]
    assert "cannot hold one 4096-token sequence (max_model_len)" in line
    assert "needs 256 blocks (4096 tokens, 2.00 MiB)" in line


def test_a_request_holds_its_window_groups_window_beside_its_full_table() -> None:
    # Gemma 3 270M's five window groups of window 512, 16-token blocks: an 8k request holds
    # 512 full blocks and 33 per window group (32 for the window, one for where it ends)
    capacity = KVCapacity(10_000, 16, 0, 8192, windows=(512,) * 5)
    assert capacity.max_concurrency(8192) == 10_000 / (512 + 5 * 33)
    assert capacity.max_concurrency(64) == 10_000 / (4 + 5 * 4)  # shorter than the window
    assert capacity.log_fields()["window_groups"] == [512] * 5
    assert capacity.num_tokens == 10_000 * 16 // 6  # a block holds one group's layers
