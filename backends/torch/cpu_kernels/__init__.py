"""Carousel's own AVX-512 / AVX2 CPU kernels for the decode step, compiled once on first use.

Each source is written for AVX-512 with BF16 and has an AVX2 implementation (csrc/avx2/, for
CPUs without AVX-512: AMD Zen 2 and 3, Intel Haswell to Comet Lake) over the same packed
layouts; the build takes the CPU's best instruction set (`isa()`). With AVX2, bf16 weights are
widened to fp32 in registers (no native bf16 products) and `linear` works a tile in sub-tiles
of 16 columns (16 ymm registers), in 16 KB chunks of K from two rows up. On the 2-core Zen 3
EPYC, fp32, the bare decode step is 1.4-2.3x torch's kernels at 1-64 sequences, bf16 2.0-5.9x
(docs/benchmarks/history/); until then the AVX2 build was opt-in (it lost
at 32-64 sequences).

Kernels (csrc/), each where torch's own CPU kernels stay far from the machine:

- `linear`: decode-sized matmuls (1 to 128 rows) over a weight packed into 64-row tiles, each
  tile one sequential stream; bf16 products by AVX512-BF16 (`vdpbf16ps`), fp32 by FMA.
  Streaming all SmolLM2 projections from memory, it reads 1.2-1.7x faster than oneDNN's
  prepacked path at 1-8 rows and stays ahead up to 128 rows (layers/linear.py). How weights are
  asked for ahead goes by CPU vendor (`stream_plan()` in csrc/linear.cpp): on Intel, fp32
  tiles that 7-32 rows share go in 16 KB chunks of K, the next chunk streaming in while the
  later rows compute (1.09-1.23x whole passes over K); on AMD (Zen 4) whole passes and the
  hardware's own stream (1.18-1.40x the chunks at 7-16 rows).
  Where the CPU has AMX (Sapphire Rapids and later), bf16 tiles are multiplied by AMX's
  TDPBF16PS over the same layout (csrc/amx.h): 1.0x the AVX512-BF16 path at 1 row, 1.5x at 8,
  4.1x at 32, 5.4x at 64. `CAROUSEL_AMX=0` turns it off; `set_amx_min_rows(n)` sets the
  fewest rows that take it (the A/B switch of scripts/roofline.py's `--amx-ab`).
- `linear_silu_mul`: the MLP's gate and up projections and its SiLU in one pass over one
  weight that interleaves them (`pack_gate_up`): a tile's accumulators hold both halves of 32
  outputs, and only silu(gate) * up is stored.
- `decode_attention`: one query token per sequence, against its context read in place from
  the paged cache through its block table: no K/V gather, no mask (attention/cpu_paged.py).
  Keys go in groups of 16: one transposing sum gives a query head's 16 scores (a horizontal
  sum per key had been most of the work), the values sum into registers; 1.3-1.6x faster
  than key by key.
- `rms_norm`, `add_rms_norm` (the residual add and the next norm in one pass) and `silu_mul`:
  the per-token elementwise work of a layer, one pass per row instead of about eight torch
  ops and their temporaries, rounding where HF's modules round (model.py). The bare bf16
  decode step drops 7-11% with them.

They are built with torch's C++ extension loader (g++ and ninja) into Carousel's cache dir
(`cpu_kernels/<digest of the sources, flags, torch and Python>/`) the first time (all sources
in one compiler job, `_unity_source`: 96 CPU-s on the 2-core Xeon), under an flock (a build
killed half-way leaves no lock behind), logging its progress every 15 s
(`cpu_kernels_building_progress`: objects compiled so far) and naming the phase in
`/health`; later processes import the built module directly, in well under a second. Where
they cannot run (neither AVX-512 with BF16 nor AVX2 with FMA and F16C, no compiler, a failed
build, or `CAROUSEL_CPU_KERNELS=0`), `native()` returns None, the reason is logged once, and
callers keep torch's own kernels.
`cpu_kernels_ready` logs the instruction set built and whether AMX is used.
`CAROUSEL_CPU_KERNELS=avx2` builds the AVX2 implementation on any CPU with AVX2, FMA and F16C,
AVX-512 ones included: to compare the two builds, and so that the suite checks the AVX2 one
wherever it runs (tests/test_cpu_kernels_avx2.py).

An image builds them at build time (Dockerfile, the `cpu-kernels` stage: the compiler stays
in that stage) into `$CAROUSEL_CPU_KERNELS_PREBUILT/<digest>/`, which `native()` imports
before it would build.

`build_variant(csrc, name)` builds another copy of csrc/ (another commit's) under its own
module name, to time beside `native()` in one process: scripts/kernel_ab.py.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import IO

import torch
import torch.nn.functional as F

from backends.torch.cache_dir import cache_dir
from backends.torch.logs import engine_log
from backends.torch.progress import reported_phase
from schedulers.load_phase import BUILDING_KERNELS, WAITING_FOR_KERNELS

log = engine_log()

MODULE = "carousel_cpu_kernels"
#: a read-only folder of modules built ahead, by digest (the image's build stage fills it)
PREBUILT_ENV = "CAROUSEL_CPU_KERNELS_PREBUILT"
CSRC = Path(__file__).with_name("csrc")
HEADERS = (
    "kernels.h",
    "shapes.h",
    "simd.h",
    "tasks.h",
    "amx.h",
    "avx2/simd.h",
    "avx2/linear.h",
    "avx2/attention.h",
    "avx2/norm.h",
    "avx2/rotary.h",
)
SOURCES = (
    "bindings.cpp",
    "linear.cpp",
    "decode_attention.cpp",
    "norm.cpp",
    "rotary.cpp",
    "decode_layers.cpp",
)
_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
_AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma"]
#: the instruction sets the kernels are written for, best first: the CPU flags each needs, and
#: its compiler flags. Without AVX-512 the sources take their avx2/ implementations.
ISAS = {
    # AMX: the AVX-512 build with bf16 linear tiles by TDPBF16PS too (csrc/amx.h)
    "avx512_amx": (
        (*_AVX512, "amx_tile", "amx_bf16"),
        [*_AVX512_FLAGS, "-mamx-tile", "-mamx-bf16"],
    ),
    "avx512": (_AVX512, _AVX512_FLAGS),
    "avx2": (("avx2", "fma", "f16c"), ["-mavx2", "-mfma", "-mf16c"]),
}
# NOTE: -ffp-contract=off: an elementwise formula (rotary) must round after each product, as
# torch's ops do, not fuse it into the next add
COMMON_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
ENV_SWITCH = "CAROUSEL_CPU_KERNELS"
SWITCHED_OFF = ("0", "false", "no", "off")  # the values that turn a switch below off
AMX_SWITCH = "CAROUSEL_AMX"
AMX_OFF = 2**62  # set_amx_min_rows figure that no batch reaches
#: the switch's value that builds the AVX2 kernels even on a CPU with AVX-512: to time them
#: beside the AVX-512 build, and so that the test suite checks them on any AVX2 CPU
AVX2_ONLY = "avx2"

_lock = threading.Lock()
_loaded: tuple[ModuleType | None] | None = None  # (module or None) once tried


def cpu_flags() -> set[str]:
    """The CPU feature flags the kernel reports (empty where /proc/cpuinfo is not there)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def _switch() -> str:
    return os.environ.get(ENV_SWITCH, "1").strip().lower()


def isa() -> str | None:
    """The best instruction set of `ISAS` this CPU has (None: none of them); only AVX2 where
    `CAROUSEL_CPU_KERNELS=avx2` asks for it."""
    have = cpu_flags()
    names = [AVX2_ONLY] if _switch() == AVX2_ONLY else list(ISAS)
    for name in names:
        if all(flag in have for flag in ISAS[name][0]):
            return name
    return None


def build_flags() -> list[str]:
    """The compiler flags for this CPU's instruction set."""
    name = isa()
    if name is None:
        raise RuntimeError("no instruction set of ISAS on this CPU")
    return [*COMMON_FLAGS, *ISAS[name][1]]


def unavailable_reason() -> str | None:
    """Why the kernels cannot be built here, or None where they can be tried."""
    if _switch() in SWITCHED_OFF:
        return f"{ENV_SWITCH}=0"
    if sys.platform != "linux":
        return f"built for Linux only, not {sys.platform}"
    if isa() is None:
        missing = [f for f in ISAS["avx2"][0] if f not in cpu_flags()]
        return f"this CPU lacks {', '.join(missing)}"
    if not any(shutil.which(c) for c in ("c++", "g++")) and _prebuilt(_digest()) is None:
        return "no C++ compiler (c++ or g++) on PATH"  # NOTE: a module built ahead needs none
    return None


def why_off() -> str:
    """Why `native()` is None: the reason they cannot run here, or their failed build."""
    return unavailable_reason() or "their build failed (see the log)"


def native(*, background: bool = False) -> ModuleType | None:
    """The compiled kernels' module (built on the first call), or None where they can't run.

    `background`: a build this call starts runs while the server serves on torch's ops
    (runner/kernel_switch.py): logged, but not a load phase, so `/health` stays ready.
    """
    global _loaded
    if _loaded is not None:
        return _loaded[0]
    with _lock:
        if _loaded is None:
            _loaded = (_build(background=background),)
    return _loaded[0]


def is_built() -> bool:
    """Whether `native()` would answer without compiling: loaded already, or built on disk
    (the cache dir's or the image's prebuilt module), or unable to run here at all (None at
    once). Compiles nothing, imports nothing: a backend asks it to decide whether to serve on
    torch's ops while the kernels build in the background."""
    if _loaded is not None or unavailable_reason() is not None:
        return True
    digest = _digest()
    built = cache_dir() / "cpu_kernels" / digest / f"{MODULE}.so"
    return _prebuilt(digest) is not None or built.is_file()


def _build(*, background: bool = False) -> ModuleType | None:
    reason = unavailable_reason()
    if reason is not None:
        log.info("cpu_kernels_off", reason=reason)
        return None
    try:
        prebuilt = _prebuilt(_digest())
        if prebuilt is not None:
            module = _import(prebuilt, MODULE)
        else:
            build_dir = cache_dir() / "cpu_kernels" / _digest()
            module = _built(build_dir, CSRC, MODULE, background=background)
    except Exception as exc:  # noqa: BLE001 - any build failure falls back to torch's kernels
        log.warning("cpu_kernels_build_failed", error=str(exc)[-2000:])
        return None
    amx = _amx_on(module)
    if not amx:
        module.set_amx_min_rows(AMX_OFF)
    log.info("cpu_kernels_ready", module=str(module.__file__), isa=isa(), amx=amx)
    return module


def _prebuilt(digest: str) -> Path | None:
    """The module an image built ahead (`$CAROUSEL_CPU_KERNELS_PREBUILT/<digest>/`), if
    there is one for these sources, flags, torch and Python: the image has no compiler."""
    root = os.environ.get(PREBUILT_ENV)
    if not root:
        return None
    path = Path(root) / digest / f"{MODULE}.so"
    return path if path.is_file() else None


def amx_wanted() -> bool:
    """Whether bf16 linears may take AMX tiles (`CAROUSEL_AMX=0` keeps them on AVX512-BF16)."""
    return os.environ.get(AMX_SWITCH, "1").strip().lower() not in SWITCHED_OFF


def amx_on() -> bool:
    """Whether bf16 linears take AMX tiles here: the kernels built for AMX, the OS grants the
    tile state, and `CAROUSEL_AMX` does not switch them off."""
    module = native()
    return module is not None and _amx_on(module)


def _amx_on(module: ModuleType) -> bool:
    return bool(module.amx_built()) and amx_wanted()


@contextmanager
def amx_from_row(module: ModuleType, rows: int) -> Iterator[None]:
    """`module`'s AMX threshold set to `rows` for the block (`AMX_OFF`: never), then put back."""
    before = module.set_amx_min_rows(rows)
    try:
        yield
    finally:
        module.set_amx_min_rows(before)


@contextmanager
def stream_plan(module: ModuleType, *, own_lines: bool, chunked: bool) -> Iterator[None]:
    """`module`'s AVX-512 linear with another weight-streaming plan for the block (by default
    the CPU vendor's: csrc/linear.cpp `stream_plan()`), then put back. The AVX2 build has one
    plan and ignores it."""
    before = module.set_stream_plan(own_lines, chunked)
    try:
        yield
    finally:
        module.set_stream_plan(*before)


def _digest(csrc: Path = CSRC) -> str:
    """What the built module depends on: the sources, the flags, torch and Python (a header
    that another commit's csrc/ lacks, `build_variant`'s, counts as absent)."""
    digest = hashlib.sha256()
    for name in [*SOURCES, *HEADERS]:
        path = csrc / name
        digest.update(name.encode() + b"\0" + (path.read_bytes() if path.exists() else b"\1"))
    digest.update(" ".join(build_flags()).encode())
    digest.update(f"{torch.__version__} {sys.version}".encode())
    return digest.hexdigest()[:16]


def _compile(build_dir: Path, csrc: Path, name: str) -> ModuleType:
    _put_ninja_on_path()
    from torch.utils import cpp_extension

    flags = build_flags()
    if name != MODULE:
        # NOTE: pybind11 registers each C++ class once per internals ID: a second build's
        # DecodeStack needs its own ID to load beside the first (quoted for ninja's shell)
        flags = [*flags, f'-DPYBIND11_COMPILER_TYPE=\\"_{name}\\"']
    module: ModuleType = cpp_extension.load(
        name=name,
        sources=[str(_unity_source(build_dir, csrc, name))],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        verbose=False,
    )
    return module


def _unity_source(build_dir: Path, csrc: Path, name: str) -> Path:
    """One translation unit that includes every source (written into `build_dir`).

    Each source includes torch/extension.h (through kernels.h), whose parse and inline code
    were most of each object's compile. `native()`'s AMX build on the 2-core Xeon, one after
    the other under a load average of 5-7 (2026-12-07): six objects 829 CPU-s (911 s), one
    unit 96 CPU-s (146 s). The code compiled is the same (no source changes, the same flags:
    -ffp-contract=off keeps every rounding where it was; the kernel tests pass bit for bit),
    one compiler job instead of ninja's two, the other core left to whatever runs beside it.
    """
    unit = build_dir / f"{name}_all.cpp"
    unit.write_text("".join(f'#include "{(csrc / s).resolve()}"\n' for s in SOURCES))
    return unit


def build_variant(csrc: Path, name: str) -> ModuleType:
    """The kernels built from another copy of csrc/ (another commit's) as module `name`, to
    time beside `native()` in one process (scripts/kernel_ab.py). Two builds under one module
    name cannot: Python keeps an extension module by its name, so the second import returns
    the first build. Built once into the cache dir, like `native()`'s."""
    if name == MODULE:
        raise ValueError(f"a variant needs a module name other than {MODULE}")
    return _built(cache_dir() / "cpu_kernels" / f"{name}-{_digest(csrc)}", csrc, name)


def _built(build_dir: Path, csrc: Path, name: str, *, background: bool = False) -> ModuleType:
    """Module `name` from `build_dir`: imported where an earlier process built it, else built
    from `csrc` there, one process at a time (`background`: see `native`)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    # NOTE: an flock, not torch's own lock file: the OS releases it when its holder dies, so a
    # build killed half-way (a server stopped while starting) never leaves every later process
    # waiting on its lock file forever
    with (build_dir / "carousel.lock").open("w") as lock:
        _wait_for_lock(lock, build_dir, background=background)
        built = build_dir / f"{name}.so"
        if built.exists():
            return _import(built, name)
        (build_dir / "lock").unlink(missing_ok=True)  # torch's, from a build that died
        with reported_phase(
            BUILDING_KERNELS,
            "building the CPU kernels, once (about 2 minutes, one compiler job)",
            "cpu_kernels_building",
            progress=lambda: {"objects_built": f"{_objects_built(build_dir)}/1"},
            background=background,
            build_dir=str(build_dir),
        ):
            return _compile(build_dir, csrc, name)


def _wait_for_lock(lock: IO[str], build_dir: Path, *, background: bool = False) -> None:
    """Take the build lock, saying so (as a load phase, unless `background`) while another
    process builds."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    with reported_phase(
        WAITING_FOR_KERNELS,
        "waiting for another process's build of the CPU kernels",
        "cpu_kernels_waiting",
        background=background,
        build_dir=str(build_dir),
    ):
        fcntl.flock(lock, fcntl.LOCK_EX)


def _objects_built(build_dir: Path) -> int:
    """How many objects ninja has compiled so far (its `.o` files: one, all sources in one
    unit, `_unity_source`)."""
    return sum(1 for _ in build_dir.glob("*.o"))


def _import(path: Path, name: str) -> ModuleType:
    """The already-built module at `path` (no compiler, no ninja run)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def _put_ninja_on_path() -> None:
    """torch's loader runs `ninja` from PATH: add the `ninja` package's binary when it is there."""
    try:
        import ninja
    except ImportError:
        return
    bin_dir = getattr(ninja, "BIN_DIR", None)
    path = os.environ.get("PATH", "")
    if bin_dir and bin_dir not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([bin_dir, path]) if path else bin_dir


#: the dtypes every kernel computes in
DTYPES = (torch.float32, torch.bfloat16)
MAX_HEAD_DIM = 256  # decode_attention's widest head (csrc/decode_attention.cpp)
TILE_COLS = 64  # output rows of one packed weight tile (kTileCols in csrc/kernels.h)


def packable(weight: torch.Tensor) -> bool:
    """Whether `linear` can take this (N, K) weight (fp32, or bf16 with an even K)."""
    return weight.dtype in DTYPES and (weight.dtype != torch.bfloat16 or weight.shape[1] % 2 == 0)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (N, K) in `linear`'s tile layout (rows zero-padded to whole tiles).

    bf16: (N / 64, K / 2 * 64 * 2) as [tile][K / 2][64][2] (vdpbf16ps takes pairs of K);
    fp32: [tile][K][64]. Returned as (tiles, K * 64 / step, step) contiguous.
    """
    n, k = weight.shape
    tiles = -(-n // TILE_COLS)
    w = F.pad(weight.detach(), (0, 0, 0, tiles * TILE_COLS - n)).contiguous()
    if weight.dtype == torch.bfloat16:
        if k % 2:
            raise ValueError("bf16 packing needs an even number of input features")
        return w.view(tiles, TILE_COLS, k // 2, 2).permute(0, 2, 1, 3).reshape(tiles, -1, 2)
    if weight.dtype == torch.float32:
        return w.view(tiles, TILE_COLS, k).permute(0, 2, 1).contiguous()
    raise ValueError(f"linear supports float32 and bfloat16, not {weight.dtype}")


def pack_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The MLP's `gate` and `up` (I, K) weights packed together for `linear_silu_mul`.

    Each tile holds 32 rows of gate and then the same 32 rows of up (rows zero-padded to a
    multiple of 32), so a tile's outputs are both halves of 32 intermediate features.
    """
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError("gate and up must have one shape and dtype")
    half = TILE_COLS // 2
    i, k = gate.shape
    rows = -(-i // half) * half
    pad = (0, 0, 0, rows - i)
    g = F.pad(gate.detach(), pad).view(rows // half, half, k)
    u = F.pad(up.detach(), pad).view(rows // half, half, k)
    return pack_weight(torch.stack((g, u), dim=1).reshape(2 * rows, k))


def pack_bias(bias: torch.Tensor | None, out_features: int) -> torch.Tensor | None:
    """`bias` as `linear` takes it: fp32, zero-padded to whole tiles."""
    if bias is None:
        return None
    tiles = -(-out_features // TILE_COLS)
    return F.pad(bias.detach().float(), (0, tiles * TILE_COLS - out_features)).contiguous()
