"""Timing: warm-up, interleaved timed iterations, and the statistics reported from them.

Dense and pruned are measured in the same loop, alternating in rounds (and alternating which goes
first), so clock boosts, thermal drift and noisy neighbours hit both alike and cancel in the ratio.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from corp_deploy.base.errors import CorpError

Step = Callable[[], float]
"""One timed inference; returns its own latency in seconds (the backend decides how to time it)."""


@dataclass(frozen=True)
class Method:
    """Warm-up by count and time, then iterations until both a minimum count and duration."""

    warmup_iters: int = 10
    warmup_seconds: float = 1.0
    min_iters: int = 30
    min_seconds: float = 2.0
    round_iters: int = 5

    def __post_init__(self) -> None:
        at_least = {"warmup_iters": 0, "warmup_seconds": 0, "min_iters": 1, "min_seconds": 0, "round_iters": 1}
        for name, low in at_least.items():
            if not getattr(self, name) >= low:
                raise CorpError(f"timing method {name} must be >= {low}, got {getattr(self, name)}")

    def describe(self) -> str:
        return (
            f"warm-up >= {self.warmup_iters} iterations and >= {self.warmup_seconds:g} s per model (not timed); "
            f"then >= {self.min_iters} iterations and >= {self.min_seconds:g} s per model, dense and pruned "
            f"interleaved in rounds of {self.round_iters}"
        )

    def as_dict(self) -> dict:
        return asdict(self)


def _warm_up(step: Step, method: Method) -> None:
    start, n = time.perf_counter(), 0
    while n < method.warmup_iters or time.perf_counter() - start < method.warmup_seconds:
        step()
        n += 1


def interleaved(steps: dict[str, Step], method: Method, warm_up: bool = True) -> dict[str, list[float]]:
    """Latencies (seconds) per named step, all measured in alternating rounds (after a warm-up).

    ``min_seconds`` counts the wall time spent in each model's steps, as the warm-up does, not the latencies they
    report: a step that reports less than it costs (a decode step whose session restarts after its last token) would
    otherwise run for as many iterations as its tiny latency takes to add up (minutes on a tiny test model)."""
    for step in steps.values() if warm_up else ():
        _warm_up(step, method)
    times: dict[str, list[float]] = {name: [] for name in steps}
    spent = dict.fromkeys(steps, 0.0)
    order = list(steps)
    while any(len(times[n]) < method.min_iters or spent[n] < method.min_seconds for n in steps):
        for name in order:
            start = time.perf_counter()
            times[name].extend(steps[name]() for _ in range(method.round_iters))
            spent[name] += time.perf_counter() - start
        order.reverse()
    return times


@dataclass(frozen=True)
class Stats:
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    throughput: float
    """Images per second at this batch size: batch / mean latency."""
    iters: int


def summarize(latencies_s: list[float], batch: int) -> Stats:
    ms = np.asarray(latencies_s) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    mean = float(ms.mean())
    return Stats(float(p50), float(p90), float(p99), mean, batch * 1e3 / mean, len(ms))


def median_of_repeats(repeats: list[Stats]) -> Stats:
    """Each statistic's median over repeated measurements: one disturbed repeat does not move it."""
    fields = {k: float(np.median([getattr(s, k) for s in repeats])) for k in asdict(repeats[0])}
    fields["iters"] = int(sum(s.iters for s in repeats))
    return Stats(**fields)
