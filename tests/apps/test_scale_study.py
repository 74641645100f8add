"""The scaling study's row and fit (``studies.scale_study``): what docs/BENCHMARKS.md's scaling table and the growth
line under it are made of, from reports as ``run`` writes them (no prune here)."""

from __future__ import annotations

import pytest

from studies import scale_study


def _report(params: float, b: dict[str, float], share: float = 0.5) -> dict:
    """A run whose steps took 1e-6 * params^b CPU seconds on ``share`` of the cores (the load took the rest)."""
    seconds = {step: 1e-6 * params ** b[step] / share for step in scale_study.STEPS}
    wall = 2 * sum(seconds.values())
    return {
        "shape": "x",
        "dims": "4 / 8 / 2",
        "seconds": seconds,
        "wall_s": wall,
        "cpu_s": share * wall,
        "load": [3.0, 4.5],
        "dense": {"params": params},
        "calibration": {"mode": "one-pass"},
        "peak_rss_gib": 1.5,
        "memory": {"host_rss_mib": 1024.0, "plan": {"peak_gib": 2.0}},
    }


def test_the_fit_recovers_each_steps_exponent_from_cpu_seconds_whatever_the_load() -> None:
    """Steps growing as params^1, ^1.5 and ^2 in CPU seconds are fitted so though each run got another share of the
    cores (their wall seconds grow otherwise)."""
    b = {"calibration": 1.0, "ranking": 1.5, "compensation": 2.0}
    growth = scale_study.fit([_report(p, b, share) for p, share in ((2e7, 0.3), (9e7, 0.6), (3e8, 0.9))])
    assert {k: round(v, 6) for k, v in growth.items() if k != "command"} == b
    assert 1.0 < growth["command"] < 2.0
    with pytest.raises(ValueError, match="two sizes"):
        scale_study.fit([_report(2e7, b), _report(2e7, b)])


def test_a_row_gives_cpu_seconds_beside_wall_and_the_load() -> None:
    row = scale_study.row(_report(5e5, {"calibration": 1.0, "ranking": 1.0, "compensation": 1.0}))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:3] == ["x", "4 / 8 / 2", "one-pass"]
    assert cells[3:] == ["1.0", "1.0", "1.0", "6.0", "3", "2.00", "1.50", "3.0 -> 4.5"]
