"""A measurement never mixes two paths: wait while a local arm's CPU kernels build.

A Carousel server on a machine whose kernels are not built yet serves at once on torch's ops
and switches to its own CPU kernels between two steps once they are built (about 2x faster a
token; backends/torch/runner/kernel_switch.py). Its `/health` names each local arm's path
(`"kernels": {"model/arm": "torch" | "building" | "carousel"}`) and `/metrics` has
`carousel_cpu_kernels_building`. `carousel bench` waits, up to a deadline, until no arm says
`building` before it measures, and checks afterwards that no arm switched during the run;
`carousel ab report` refuses scrapes in which a compared arm was building (`building_in`,
bench/prom.py). A server without
the field (another server, an older Carousel) is taken as having nothing to wait for.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

#: the word an arm's entry of `/health`'s `kernels` has while they build in the background
BUILDING = "building"
#: how long `carousel bench` waits by default for the kernels to serve
DEFAULT_WAIT_S = 600.0
POLL_S = 2.0


class KernelsNotReady(RuntimeError):
    """The kernels did not serve before the deadline, or an arm switched during the run."""


def serving_kernels(root: str, api_key: str | None) -> dict[str, str]:
    """Each local arm's path as the server's `/health` names it (`model/arm` -> path); empty
    where it names none (or is not Carousel)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client(timeout=10, trust_env=False) as client:
            response = client.get(root.rstrip("/") + "/health", headers=headers)
        body = response.json() if response.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}
    kernels = body.get("kernels") if isinstance(body, dict) else None
    return {str(k): str(v) for k, v in kernels.items()} if isinstance(kernels, dict) else {}


def building(kernels: dict[str, str]) -> list[str]:
    """The arms whose kernels are still building."""
    return sorted(arm for arm, path in kernels.items() if path == BUILDING)


def wait_for_kernels(
    read: Callable[[], dict[str, str]],
    deadline_s: float,
    *,
    poll_s: float = POLL_S,
    say: Callable[[str], None] = lambda line: None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, str]:
    """`read()` once no arm is building (what it then says); KernelsNotReady after
    `deadline_s` with the arms still building."""
    end = clock() + deadline_s
    kernels = read()
    if building(kernels):
        arms = ", ".join(building(kernels))
        say(f"waiting for the CPU kernels of {arms} (up to {deadline_s:g} s)")
    while building(kernels):
        if clock() >= end:
            raise KernelsNotReady(
                f"the CPU kernels of {', '.join(building(kernels))} were still building after "
                f"{deadline_s:g} s (torch's ops serve meanwhile, about half as fast a token): a "
                "run now would measure one path and then the other; wait, or raise --kernels-wait-s"
            )
        sleep(poll_s)
        kernels = read()
    return kernels


def switched(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """Why a run that began at `before` and ended at `after` mixed two paths (empty: it did
    not): each arm whose path changed."""
    return [
        f"{arm}: {before.get(arm, 'none')} -> {after.get(arm, 'none')}"
        for arm in sorted(set(before) | set(after))
        if before.get(arm) != after.get(arm)
    ]
