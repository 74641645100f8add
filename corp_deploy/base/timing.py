"""Timing: warm-up, interleaved timed iterations, the statistics reported from them, and a decoder's generation as
timed steps (``Session``: prefill, then decode a token at a time).

Dense and pruned are measured in the same loop, alternating in rounds (and alternating which goes
first), so clock boosts, thermal drift and noisy neighbours hit both alike and cancel in the ratio.
Here, below every floor that times something, so the exporters (choosing the fastest INT8 or INT4 recipe) and the
benchmarks share one method without importing each other. Loads neither torch nor an inference runtime: a
session's runtime is handed in (``GenaiSession``'s onnxruntime-genai module).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from corp_deploy.base.errors import CorpError

Step = Callable[[], float]
"""One timed inference; returns its own latency in seconds (the backend decides how to time it)."""


@dataclass(frozen=True)
class Workload:
    """What models are timed on: a batch of ``batch`` (x ``seq_len`` tokens for a text encoder) on ``threads`` CPU
    threads, with ``rewrites`` (``exporters.rewrites``; None: the runtime's own) applied as the deployed model would
    have them. What the plan hands a meter (``plan.speed.Meter.loaded``)."""

    batch: int
    threads: int
    rewrites: tuple[str, ...] | None = None
    seq_len: int | None = None


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
class Race:
    """Successive elimination (racing, as irace and Hyperband's brackets do it): interleaved rounds of one call per
    candidate still in the race; from round ``min_rounds`` on, a candidate whose fastest call is slower than the
    leader's median leaves, and the race ends when one is left, when those left are within ``tie`` of the leader
    (any of them is as fast), or after ``max_rounds``. The clearly slower candidates cost ``min_rounds`` calls and
    the close ones up to ``max_rounds``: where three calls each could not order candidates 4% apart on a quiet
    2-core machine (docs/BENCHMARKS.md, "Scale: time to artifact")."""

    min_rounds: int = 3
    max_rounds: int = 8
    tie: float = 0.01

    def as_dict(self) -> dict:
        return asdict(self)


def race(steps: dict[str, Step], rule: Race) -> dict[str, list[float]]:
    """Latencies (seconds) per named step, raced as ``rule`` says (no warm-up: the caller's)."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    live = list(steps)
    for done in range(1, rule.max_rounds + 1):
        for name in live if done % 2 else live[::-1]:
            times[name].append(steps[name]())
        if done < rule.min_rounds:
            continue
        median = {name: float(np.median(times[name])) for name in live}
        lead = min(live, key=median.__getitem__)
        live = [name for name in live if name == lead or min(times[name]) <= median[lead]]
        if all(median[name] <= median[lead] * (1 + rule.tie) for name in live):
            break
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


NEW_TOKENS = 32
"""Decode steps per session before a fresh prefill: the context grows by at most this much while timed."""


class Session:
    """One model generating greedily at (batch, prompt): ``prefill`` and ``decode`` return their own seconds.

    Subclasses run a runtime; this class keeps the cache bookkeeping: ``decode`` prefills afresh (untimed) when
    ``new_tokens`` steps have been taken, so every timed step sees a context in the same band."""

    def __init__(self, batch: int, prompt: int, vocab: int, new_tokens: int = NEW_TOKENS) -> None:
        if new_tokens < 1:
            raise CorpError(f"--new-tokens must be >= 1, got {new_tokens}")
        self.ids = np.random.default_rng(batch * 100003 + prompt).integers(0, vocab, (batch, prompt))
        self.new_tokens, self.steps = new_tokens, new_tokens

    def start(self) -> np.ndarray:
        """Run the prompt from an empty cache; return the next token per sequence (batch, 1)."""
        raise NotImplementedError

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """Feed one token per sequence through the cache; return the next ones."""
        raise NotImplementedError

    def prefill(self) -> float:
        begin = time.perf_counter()
        self.start()
        return time.perf_counter() - begin

    def decode(self) -> float:
        if self.steps >= self.new_tokens:
            self.tokens, self.steps = self.start(), 0
        begin = time.perf_counter()
        self.tokens = self.step(self.tokens)
        self.steps += 1
        return time.perf_counter() - begin


class GenaiSession(Session):
    """An onnxruntime-genai ``Model`` generating greedily: ``append_tokens`` runs the prompt (prefill), each
    ``generate_next_token`` picks a token and runs it through the graph with genai's own cache (decode). genai picks
    the first new token in the first step, so ``start`` returns the prompt's last token and ``step`` ignores its
    argument. ``min_length`` equals ``max_length``: end-of-sequence never stops a session early."""

    def __init__(self, og: Any, model: Any, vocab: int, batch: int, prompt: int, new_tokens: int = NEW_TOKENS) -> None:
        super().__init__(batch, prompt, vocab, new_tokens)
        self.og, self.model = og, model

    def start(self) -> np.ndarray:
        params = self.og.GeneratorParams(self.model)
        total = self.ids.shape[1] + self.new_tokens + 1
        params.set_search_options(batch_size=self.ids.shape[0], max_length=total, min_length=total, do_sample=False)
        self.generator = self.og.Generator(self.model, params)
        self.generator.append_tokens(self.ids.astype(np.int32))
        return self.generator.get_next_tokens()

    def step(self, tokens: np.ndarray) -> np.ndarray:
        self.generator.generate_next_token()
        return self.generator.get_next_tokens()
