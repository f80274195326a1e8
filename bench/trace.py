"""The engine's iteration trace (`GET /debug/trace`), and the seat layout the picture draws.

Carousel keeps, per arm, the last few thousand `IterationRecord`s of its engine (see
schedulers/outputs.py). After each run the bench fetches them and keeps the iterations that
started inside that run's wall-clock window, so a sweep's runs do not bleed into each other
(the server and the bench are assumed to share a clock: same host, or NTP).

Seats: each sequence is given one batch seat (row) from the iteration it first appears to the
one it last appears in, the lowest seat free at its start, so a request keeps its seat while it
runs. A sequence that is missing from more than `max_gap` consecutive iterations (preempted
and requeued) starts a new stay, possibly on another seat.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np


@dataclass
class ArmTrace:
    """The iterations of one arm during one run, or the reason there are none."""

    iterations: list[dict[str, Any]] = field(default_factory=list)
    max_num_seqs: int | None = None
    note: str | None = None
    starts_in_window: bool = False  # the server kept nothing older than the run's start
    #: the server's buffer dropped the run's start (`truncated`, set once the run is counted)
    truncated: bool = False

    @property
    def available(self) -> bool:
        return self.note is None and bool(self.iterations)


def server_root(api_base: str) -> str:
    """`http://host:port/v1` -> `http://host:port` (where /debug/trace lives)."""
    root = api_base.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


async def fetch_trace(
    root: str,
    arm: str | None,
    window: tuple[float, float],
    api_key: str | None = None,
    timeout_s: float = 10.0,
) -> ArmTrace:
    """Fetch and filter one arm's trace; any failure becomes a `note`, never an exception."""
    params = {"arm": arm} if arm is not None else None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
            response = await client.get(f"{root}/debug/trace", params=params, headers=headers)
    except httpx.HTTPError as exc:
        return ArmTrace(note=f"could not fetch /debug/trace ({type(exc).__name__})")
    if response.status_code == 404:
        return ArmTrace(note="the server has no /debug/trace endpoint (not Carousel?)")
    if response.status_code != 200:
        return ArmTrace(note=f"/debug/trace answered HTTP {response.status_code}")
    try:
        payload = response.json()
    except ValueError:
        return ArmTrace(note="/debug/trace did not return JSON (not Carousel?)")
    return parse_trace(payload, arm, window)


def parse_trace(payload: Any, arm: str | None, window: tuple[float, float]) -> ArmTrace:
    """Pick `arm` out of a `{"arms": {NAME: {...}}}` payload and keep the window's iterations.

    With no arm named, a payload holding exactly one arm is taken as that one.
    """
    arms = payload.get("arms") if isinstance(payload, dict) else None
    if not isinstance(arms, dict):
        return ArmTrace(note='/debug/trace has no "arms" object (not Carousel?)')
    if arm is None:
        if len(arms) != 1:
            return ArmTrace(note=f"the server has {len(arms)} arms; name one with --arm")
        arm = next(iter(arms))
    entry = arms.get(arm)
    if not isinstance(entry, dict) or not isinstance(entry.get("iterations"), list):
        return ArmTrace(note=f"/debug/trace has no iterations for arm {arm!r}")
    start, end = window
    timed = [
        it
        for it in entry["iterations"]
        if isinstance(it, dict) and isinstance(it.get("start"), int | float)
    ]
    iterations = [it for it in timed if start <= it["start"] <= end]
    iterations.sort(key=lambda it: (it["start"], it.get("iteration", 0)))
    max_num_seqs = entry.get("max_num_seqs")
    if not isinstance(max_num_seqs, int) and iterations:
        max_num_seqs = iterations[0].get("max_num_seqs")
    if not iterations:
        return ArmTrace(max_num_seqs=max_num_seqs, note="no iterations inside the run's window")
    limit = max_num_seqs if isinstance(max_num_seqs, int) else None
    oldest = min(it["start"] for it in timed)
    return ArmTrace(iterations, limit, starts_in_window=oldest >= start)


def _members(it: dict[str, Any]) -> list[tuple[Any, str]]:
    """(sequence key, request id) for each sequence in an iteration's batch."""
    seq_ids = it.get("seq_ids") or []
    request_ids = [str(r) for r in it.get("request_ids") or []]
    if len(seq_ids) == len(request_ids) and seq_ids:
        return list(zip(seq_ids, request_ids, strict=True))
    if request_ids:
        return [(r, r) for r in request_ids]
    return [(s, str(s)) for s in seq_ids]


@dataclass(frozen=True)
class SeatGrid:
    """`cells[seat, column]` = colour index of the request in that seat, or -1 when empty."""

    cells: np.ndarray  # (num_seats, num_iterations)
    num_requests: int

    @property
    def occupancy(self) -> float:
        """Fraction of all seat-iterations that were occupied."""
        return float((self.cells >= 0).mean()) if self.cells.size else 0.0


@dataclass
class _Stay:
    """One uninterrupted stay of a sequence in the batch, columns `first..last`."""

    key: Any
    request: str
    first: int
    last: int


def _stays(iterations: list[dict[str, Any]], max_gap: int) -> list[_Stay]:
    """Every stay, in order of arrival (batch order within an iteration)."""
    stays: list[_Stay] = []
    current: dict[Any, _Stay] = {}
    for col, it in enumerate(iterations):
        for key, request in _members(it):
            stay = current.get(key)
            if stay is not None and col - stay.last <= max_gap + 1:
                stay.last = col
                continue
            current[key] = _Stay(key, request, col, col)
            stays.append(current[key])
    return stays


def seat_grid(
    iterations: list[dict[str, Any]], max_num_seqs: int | None, max_gap: int = 4
) -> SeatGrid:
    """Assign stable seats (see the module docstring); rows grow past `max_num_seqs` if needed."""
    colours: dict[str, int] = {}
    taken_until: list[int] = []  # per seat: the last column its current stay occupies
    placed: list[tuple[int, _Stay]] = []
    for stay in _stays(iterations, max_gap):
        colours.setdefault(stay.request, len(colours))
        seat = next((i for i, last in enumerate(taken_until) if last < stay.first), None)
        if seat is None:
            seat = len(taken_until)
            taken_until.append(stay.last)
        taken_until[seat] = stay.last
        placed.append((seat, stay))

    num_seats = max(len(taken_until), max_num_seqs or 0, 1)
    cells = np.full((num_seats, len(iterations)), -1, dtype=np.int32)
    present = [{key for key, _ in _members(it)} for it in iterations]
    for seat, stay in placed:
        for col in range(stay.first, stay.last + 1):
            if stay.key in present[col]:
                cells[seat, col] = colours[stay.request]
    return SeatGrid(cells, len(colours))


def trace_summary(trace: ArmTrace, num_completed: int) -> dict[str, Any]:
    """JSON-ready facts about a run's trace, for report.json.

    `truncated`: the server's ring buffer dropped the start of the run, seen as a trace that
    begins inside the run and holds fewer requests than completed.
    """
    if not trace.available:
        return {"available": False, "note": trace.note}
    sizes = [len(_members(it)) for it in trace.iterations]
    grid = seat_grid(trace.iterations, trace.max_num_seqs)
    return {
        "available": True,
        "note": None,
        "num_iterations": len(trace.iterations),
        "max_num_seqs": trace.max_num_seqs,
        "mean_batch_size": float(np.mean(sizes)),
        "seat_occupancy": grid.occupancy,
        "num_preempted": int(sum(int(it.get("num_preempted") or 0) for it in trace.iterations)),
        "truncated": truncated(trace, num_completed),
        **spec_decode_summary(trace.iterations),
    }


def spec_decode_summary(iterations: list[dict[str, Any]]) -> dict[str, Any]:
    """Speculative decoding over the run, from the iterations' marks (vLLM's counters): steps
    that verified drafts, drafts (one per row per step), draft and accepted tokens, and the mean
    acceptance length (vLLM's: 1 + accepted / drafts, the bonus token included); empty for a
    run that verified none (an arm without `--speculative-config`)."""
    counts = {
        key: sum(int(it.get(key) or 0) for it in iterations)
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    }
    if not counts["num_drafts"]:
        return {}
    return {
        "num_verified_steps": sum(1 for it in iterations if it.get("num_drafts")),
        **counts,
        "mean_acceptance_length": 1 + counts["num_accepted_tokens"] / counts["num_drafts"],
    }


def truncated(trace: ArmTrace, num_completed: int) -> bool:
    """Whether the server's ring buffer dropped the start of the run: the trace begins inside
    the run and holds fewer requests than completed."""
    requests = {request for it in trace.iterations for _, request in _members(it)}
    return trace.starts_in_window and len(requests) < num_completed
