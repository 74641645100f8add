"""A latency budget's closed loop: the pruned model timed against the dense one on the table's backend, the table
corrected with the measured pair and the widths re-allocated from the same statistics while the speedup misses its
target by more than the timing's noise band (``close_loop``). ``latency_loop`` builds the timing a command asks for,
``check_loop`` refuses what the loop cannot re-plan before any data is read."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from corp_deploy.base.errors import CorpError
from corp_deploy.core.config import PruneConfig, Widths
from corp_deploy.core.pruner import Timer, prune_model
from corp_deploy.core.stats import CalibrationStats
from corp_deploy.plan import speed
from corp_deploy.plan.allocation import widths_of
from corp_deploy.plan.latency import LatencyTable, Timing, workload
from corp_deploy.plan.width_plan import Replan


def check_loop(config: PruneConfig, max_stats_gib: float | None, processes: int, table: LatencyTable | None) -> None:
    """What the closed loop (``LatencyLoop``) cannot re-plan."""
    if config.budget is None or config.budget.kind != "latency":
        raise CorpError("the latency check times a latency budget: pass --speedup S or --budget latency=F")
    if config.sequential or max_stats_gib is not None:
        raise CorpError(
            "the latency check re-allocates from the statistics of one pass; --sequential would re-walk the data "
            "for every plan, so it is refused here: drop --sequential, or use corp-deploy prune (no check)"
        )
    if processes > 1:
        raise CorpError("the latency check times on one machine; run it without torchrun")
    if table is None:
        raise CorpError("the closed loop corrects a latency table: pass the table the budget was planned with")


@dataclass(frozen=True)
class LatencyLoop:
    """A latency budget's closed loop: after pruning, ``timing(dense, pruned)`` measures both in one run on the
    table's backend; while the measured speedup misses the target by more than the noise band, the table is
    corrected with the measured point and the widths re-allocated from the same statistics, ``rounds`` at most."""

    timing: Callable[[nn.Module, nn.Module], Timing]
    rounds: int = 3

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise CorpError(f"--latency-rounds must be >= 1, got {self.rounds}")


def latency_loop(latency: speed.Latency, say: Callable[[str], None] = lambda line: None) -> LatencyLoop | None:
    """The closed loop on ``latency``'s backend and batch (dense and pruned timed interleaved, each timing said), or
    None without ``rounds``."""
    if latency.rounds is None:
        return None
    threads = torch.get_num_threads()
    at = workload({"batch": latency.batch, "seq_len": latency.seq_len})

    def timing(dense: nn.Module, pruned: nn.Module) -> Timing:
        say(f"latency check: timing dense and pruned on {latency.meter.name} at {at}, interleaved")
        t = speed.measure_pair(dense, pruned, latency.meter, latency.batch, threads, speed.LOOP_METHOD, latency.seq_len)
        say(f"  dense {t.dense_s * 1e3:.1f} ms, pruned {t.pruned_s * 1e3:.1f} ms: {t.speedup:.2f}x +-{t.band:.1%}")
        return t

    return LatencyLoop(timing, latency.rounds)


def close_loop(
    dense: nn.Module,
    model: nn.Module,
    blocks: list[dict],
    stats: CalibrationStats,
    config: PruneConfig,
    replan: Replan,
    table: LatencyTable,
    widths: list[Widths],
    record: dict[str, Any],
    loop: LatencyLoop,
    timer: Timer,
) -> tuple[nn.Module, list[dict], dict[str, Any], dict[str, Any]]:
    """Time, correct, re-plan and re-prune (from a copy of ``dense``) until the speedup is met or rounds run out.

    Returns the pruned model, its block reports, the allocation record and the loop's record for ``corp.json``.
    """
    target = 1 / config.budget.fraction
    history: list[dict[str, Any]] = []
    while True:
        start = time.perf_counter()
        measured = loop.timing(dense, model)
        timer.add("latency check", start)
        history.append(
            {
                "predicted_speedup": record["latency"]["predicted_speedup"],
                "measured_speedup": measured.speedup,
                "spread": measured.band,
                "dense_ms": measured.dense_s * 1e3,
                "pruned_ms": measured.pruned_s * 1e3,
                "widths": [list(widths_of(dense, w)) for w in widths],
            }
        )
        within_band = abs(measured.speedup / target - 1) <= measured.band
        if within_band or len(history) == loop.rounds:
            break
        planned = [widths_of(dense, w) for w in widths]
        try:  # a pair no correction follows, or a corrected table that puts the target out of reach: keep this one
            table = table.corrected(measured.dense_s, measured.pruned_s, planned)
            widths, record = replan(table)
        except CorpError as e:
            history[-1]["stopped"] = str(e)
            break
        model = copy.deepcopy(dense)
        blocks = prune_model(model, stats, config, widths, timer)
    last = history[-1]
    reached = last["measured_speedup"] >= target
    return (
        model,
        blocks,
        record,
        {
            "backend": table.key["backend"],
            "batch": table.key["batch"],
            **({"seq_len": table.key["seq_len"]} if "seq_len" in table.key else {}),
            "target_speedup": target,
            "predicted_speedup": last["predicted_speedup"],
            "measured_speedup": last["measured_speedup"],
            "spread": last["spread"],
            "rounds": len(history),
            "met": reached,
            "within_band": within_band,
            "history": history,
        },
    )
