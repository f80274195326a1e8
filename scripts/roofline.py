"""The bare decode step against what this machine can physically do, all in one run.

    python scripts/roofline.py [--batch-sizes 1,8,32,64] [--dtypes float32,bfloat16]
                               [--steps 24] [--repeats 3] [--variant NAME:KEY=VALUE,...]

1. Read bandwidth: the best of several `sum`s over a 512 MiB fp32 tensor (bytes / time).
2. Matmul peak per dtype: the best of `torch.mm` and a oneDNN-prepacked linear (the kernel the
   backend uses, backends/torch/layers/linear.py) on 2048 x 2048 operands, in FLOP/s.
   Both are measured before and after the steps; the higher figure is the floor's.
3. The bare decode step: the backend's `execute` in a loop (scripts/bench_forward.py), B
   sequences with 64-token prompts decoding together, at each B and dtype. Repeats are
   interleaved (every dtype and B once per repeat); the median of every step timed is
   reported (a shared machine stalls single steps; the median does not move with them).
4. Each step's floor is max(weight bytes / bandwidth, 2 x params x B / peak): reading every
   weight once, or doing every multiply-add once, whichever takes longer. share = floor / step.

`--variant NAME:KEY=VALUE,...` adds a backend over the same weights with other
`TorchBackend` keyword arguments (e.g. `eager:compile=false`), measured interleaved with the
shipped one, so levers are compared side by side. `--amx-ab` adds the shipped backend with
its bf16 linears kept off AMX tiles (`set_amx_min_rows`, backends/torch/cpu_kernels), as
variant `no-amx`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_forward import decode_step_times  # noqa: E402

from backends.torch.cpu_kernels import AMX_OFF, amx_from_row, native  # noqa: E402
from backends.torch.layers.linear import onednn_packs  # noqa: E402
from backends.torch.runner.backend import TorchBackend, cpu_has_native_bf16  # noqa: E402
from backends.torch.runner.device_thread import run_on_device_thread  # noqa: E402

MATMUL_N = 2048
NO_AMX = "no-amx"


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` calls of `fn`, in seconds (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def read_bandwidth(repeats: int = 10) -> float:
    """Bytes per second that a full read of a 512 MiB tensor reaches."""
    x = torch.ones(128 * 1024 * 1024)  # 512 MiB of fp32, far beyond any cache
    return x.numel() * x.element_size() / best_time(x.sum, repeats)


def matmul_peak(dtype: torch.dtype, repeats: int = 5) -> float:
    """FLOP/s of the best 2048 x 2048 x 2048 matmul torch has here for `dtype`."""
    a = torch.randn(MATMUL_N, MATMUL_N).to(dtype)
    b = torch.randn(MATMUL_N, MATMUL_N).to(dtype)
    kernels: list[Callable[[], object]] = [lambda: a @ b]
    if onednn_packs(dtype):
        packed = torch.ops.mkldnn._reorder_linear_weight(b, MATMUL_N)
        kernels.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
    flops = 2 * MATMUL_N**3
    return max(flops / best_time(kernel, repeats) for kernel in kernels)


def arithmetic_peak(dtype: torch.dtype) -> float:
    """The dtype's matmul peak; bf16 on a CPU without native bf16 products takes fp32's.

    There every bf16 product is an fp32 FMA after widening (torch's own bf16 matmul emulates
    it: under 0.5 GFLOP/s on the 2-core Zen 3 EPYC, against 140-160 in fp32, which made a
    floor of seconds a step)."""
    if dtype == torch.bfloat16 and not cpu_has_native_bf16():
        return matmul_peak(torch.float32)
    return matmul_peak(dtype)


@dataclass(frozen=True)
class Machine:
    bandwidth: float  # bytes/s
    peak: dict[torch.dtype, float]  # FLOP/s

    @classmethod
    def measure(cls, dtypes: list[torch.dtype]) -> Machine:
        return cls(read_bandwidth(), {d: arithmetic_peak(d) for d in dtypes})

    def best(self, other: Machine) -> Machine:
        peak = {d: max(p, other.peak[d]) for d, p in self.peak.items()}
        return Machine(max(self.bandwidth, other.bandwidth), peak)


def weight_stats(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters, bytes) of the model's distinct weight tensors (tied ones counted once)."""
    seen: dict[int, torch.Tensor] = {}
    for param in model.parameters():
        seen.setdefault(param.data_ptr(), param)
    params = sum(p.numel() for p in seen.values())
    return params, sum(p.numel() * p.element_size() for p in seen.values())


def floor_s(machine: Machine, dtype: torch.dtype, params: int, nbytes: int, batch: int) -> float:
    return max(nbytes / machine.bandwidth, 2 * params * batch / machine.peak[dtype])


@contextmanager
def amx_setting(variant: str) -> Iterator[None]:
    """AMX off in the kernels while `variant` is `NO_AMX`'s steps run (else as it is)."""
    kernels = native()
    if variant != NO_AMX or kernels is None:
        yield
        return
    with amx_from_row(kernels, AMX_OFF):
        yield


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """`name:key=value,key=value` -> (name, kwargs); values parse as bool, int, float or str."""
    name, _, spec = text.partition(":")
    kwargs: dict[str, Any] = {}
    for item in filter(None, spec.split(",")):
        key, _, raw = item.partition("=")
        value: Any = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            for kind in (int, float):
                try:
                    value = kind(raw)
                    break
                except ValueError:
                    pass
        kwargs[key] = value
    return name, kwargs


def main() -> None:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="default")
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variant", action="append", default=[], help="NAME:KEY=VALUE,...")
    parser.add_argument("--amx-ab", action="store_true", help="add the shipped one without AMX")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    variants = [("shipped", {}), *map(parse_variant, args.variant)]
    if args.amx_ab:
        variants.append((NO_AMX, {}))
    began = time.monotonic()
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}, "
          f"load {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
    # NOTE: on the device thread, as the steps: a second OpenMP pool on this thread would
    # oversubscribe the cores and slow every later step (docs/benchmarks/history/)
    machine = run_on_device_thread(Machine.measure, dtypes)

    backends: dict[tuple[str, torch.dtype], TorchBackend] = {}
    stats: dict[torch.dtype, tuple[int, int]] = {}
    for dtype in dtypes:
        base = TorchBackend.load(args.model, device="cpu", dtype=str(dtype), kv_cache_gb=1.0,
                                 max_model_len=1024)  # fmt: skip
        stats[dtype] = weight_stats(base.hf_model)
        for name, kwargs in variants:
            backends[name, dtype] = base if not kwargs else TorchBackend.create(
                base.hf_model, base.tokenizer, device="cpu", dtype=dtype, kv_cache_gb=1.0,
                max_model_len=1024, **kwargs,
            )  # fmt: skip
    for backend in backends.values():  # warm-up, also of every compiled shape
        for b in sizes:
            decode_step_times(backend, b, args.prompt_len, 2)

    times: dict[tuple[str, torch.dtype, int], list[float]] = {k: [] for k in
             ((n, d, b) for n, _ in variants for d in dtypes for b in sizes)}  # fmt: skip
    for repeat in range(args.repeats):
        for b in sizes:
            for dtype in dtypes:
                for name, _ in variants:
                    with amx_setting(name):
                        steps = decode_step_times(backends[name, dtype], b, args.prompt_len,
                                                  args.steps)  # fmt: skip
                    times[name, dtype, b].extend(steps)
        print(f"# repeat {repeat + 1}/{args.repeats} done, load {os.getloadavg()[0]:.2f}",
              flush=True)  # fmt: skip
    machine = machine.best(run_on_device_thread(Machine.measure, dtypes))

    print(f"read bandwidth {machine.bandwidth / 1e9:.1f} GB/s; matmul peak "
          + ", ".join(f"{d} {p / 1e9:.0f} GFLOP/s" for d, p in machine.peak.items()))  # fmt: skip
    if torch.bfloat16 in dtypes and not cpu_has_native_bf16():
        print("# no native bf16 products on this CPU: bf16's peak is fp32's (arithmetic_peak)")
    for dtype in dtypes:
        params, nbytes = stats[dtype]
        print(f"{dtype}: {params / 1e6:.1f} M params, {nbytes / 1e6:.0f} MB of weights")
    timed = f"median of {args.repeats} x {args.steps}"
    print(f"| variant | dtype | B | step ms ({timed}) | floor ms | bound | share |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for name, kwargs in variants:
        for dtype in dtypes:
            params, nbytes = stats[dtype]
            for b in sizes:
                step = statistics.median(times[name, dtype, b])
                floor = floor_s(machine, dtype, params, nbytes, b)
                bound = "compute" if floor > nbytes / machine.bandwidth else "bandwidth"
                dname = str(dtype).removeprefix("torch.")
                print(f"| {name} | {dname} | {b} | {step * 1e3:.1f} | {floor * 1e3:.1f} | "
                      f"{bound} | **{floor / step:.0%}** |")  # fmt: skip
                rows.append({"variant": name, "kwargs": kwargs, "dtype": dname, "batch": b,
                             "step_s": times[name, dtype, b], "floor_s": floor})  # fmt: skip
    print(f"# {time.monotonic() - began:.0f} s, load {os.getloadavg()[0]:.2f}; "
          f"command: {' '.join(sys.argv)}")  # fmt: skip
    if args.json_out:
        summary = {
            "bandwidth": machine.bandwidth,
            "peak": {str(d): p for d, p in machine.peak.items()},
            "rows": rows,
        }
        Path(args.json_out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
