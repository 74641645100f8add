"""The suite's sections, in the order they run: name, what runs, and how its record reads in markdown."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tools.gpu_suite.attention import run_sdpa, sdpa_markdown
from tools.gpu_suite.core import Context
from tools.gpu_suite.engines import engines_markdown, run_engines
from tools.gpu_suite.sections import (
    latency_markdown,
    profile_markdown,
    prune_markdown,
    run_latency,
    run_profile,
    run_prune,
    run_tests,
    tests_markdown,
)
from tools.gpu_suite.speedup import run_speedup, speedup_markdown


@dataclass(frozen=True)
class Section:
    name: str
    run: Callable[[Context], dict[str, Any]]
    markdown: Callable[[dict[str, Any]], list[str]]


SECTIONS: dict[str, Section] = {
    s.name: s
    for s in (
        Section("tests", run_tests, tests_markdown),
        Section("prune", run_prune, prune_markdown),
        Section("sdpa", run_sdpa, sdpa_markdown),
        Section("engines", run_engines, engines_markdown),
        Section("speedup", run_speedup, speedup_markdown),
        Section("latency", run_latency, latency_markdown),  # the longest: last, under the time budget
        Section("profile", run_profile, profile_markdown),
    )
}
