"""The ``speedup`` section: prune to a speed, not a sparsity, on the GPU, and time it against dense.

A latency budget (``--speedup S``) of the plan's model on its backend (``torch-cuda-fp16-graph`` on a GPU) at
each planned batch: the latency table measured on that backend (cached per key), CORP's allocation against it,
and the closed loop (``plan.loop.LatencyLoop``: dense and pruned interleaved, corrected and re-allocated while the
measured speedup misses). Each row is judged against its goal (issue 23: >= 1.65x at batch 64; a p50 ratio
<= 0.8, i.e. >= 1.25x, at batch 1) with the measured number, met or missed, never adjusted.

Random weights and noise calibration: the speed of a pruned model does not depend on its weights' values, and
its accuracy is not measured here (the real-weights study does that). ``LEVERS`` are the pruning settings timed
per goal: width alone (MLP, Q/K and V channels), and width with whole attention modules replaceable by their
closed-form fit (``--depth attn,mlp``: the lever for batch 1, where fixed costs dominate).
"""

from __future__ import annotations

import copy
import time
import warnings
from typing import Any

import torch

from corp_deploy.base.errors import CorpError
from corp_deploy.base.tables import markdown_table
from tools.gpu_suite.core import Context, create, warm_device

LEVERS: dict[str, dict[str, Any]] = {
    "width": {"target": "mlp,qk,v", "allocation": "local"},
    "width+depth": {
        "target": "mlp,qk,v",
        "depth": "attn,mlp",
        "allocation": "sensitivity",
        "sensitivity_images": 16,
    },
}
"""Lever name -> PruneConfig fields besides the budget: what the allocator may remove. On an H200 (fp16, CUDA
graph, deit_base, batch 1) replacing attention alone lowered the floor only from 0.824 to 0.821 of dense latency
(2026-11-26): a block there costs its kernel launches, so the depth lever may also replace whole MLPs."""


def run_speedup(ctx: Context) -> dict[str, Any]:
    """Per lever and (batch, goal) of the plan: the latency-budgeted prune, its prediction and its measured speedup;
    the whole section skipped, with the reason, where the plan's backend cannot run."""
    from corp_deploy.bench import meter

    name, backend_name, goals = ctx.plan.speedup
    try:
        backend = meter.check_backend(backend_name)
    except CorpError as e:
        ctx.log(f"speedup: skipped: {e}")
        return {"model": name, "backend": backend_name, "skipped": str(e), "rows": []}
    warm_device(ctx)
    dense = create(name, ctx.plan.models.get(name, {}))
    rows, skipped = [], []
    for lever, fields in LEVERS.items():
        for batch, goal in goals:
            what = f"{name} {lever} batch {batch} goal {goal:.2f}x"
            if ctx.time_left() < 0:
                skipped.append({"what": what, "why": "time budget spent"})
                continue
            start = time.perf_counter()
            try:
                check = _budgeted(ctx, name, copy.deepcopy(dense), backend, batch, goal, fields)
            except CorpError as e:  # e.g. a goal no allowed widths reach on this backend: a finding, not a crash
                skipped.append({"what": what, "why": str(e)})
                ctx.log(f"speedup {what}: refused: {e}")
                continue
            rows.append({"lever": lever, "batch": batch, "goal": goal, "seconds": time.perf_counter() - start, **check})
            verdict = "met" if check["goal_met"] else "MISSED"
            ctx.log(
                f"speedup {what}: predicted {check['predicted_speedup']:.2f}x, measured "
                f"{check['measured_speedup']:.2f}x +-{check['spread']:.1%} after {check['rounds']} round(s): {verdict}"
            )
    return {
        "model": name,
        "backend": backend_name,
        "weights": "random; calibration on noise images",
        "rows": rows,
        "skipped": skipped,
    }


def _budgeted(
    ctx: Context, name: str, model: torch.nn.Module, backend: Any, batch: int, goal: float, fields: dict[str, Any]
) -> dict[str, Any]:
    """One latency-budgeted prune of ``model`` (dense, timm ``name``) to ``goal`` at ``batch``, closed loop on
    ``backend``: its record. The latency table is the cached one for its key, else measured now."""
    import corp_deploy
    from corp_deploy import api
    from corp_deploy.formats import calibration
    from corp_deploy.plan import speed
    from corp_deploy.plan.loop import LatencyLoop

    threads = torch.get_num_threads()
    config = corp_deploy.PruneConfig(budget=f"latency={1 / goal!r}", **fields)
    key = speed.key(name, ctx.plan.models.get(name, {}), backend, batch, threads, config.depth, config.depth_fit)
    table = speed.table_for(model, key, backend)
    loop = LatencyLoop(lambda d, p: speed.measure_pair(d, p, backend, batch, threads), rounds=3)
    held = config.sensitivity_images if config.allocation == "sensitivity" else 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # noise images, on purpose
        data = calibration.calibration_data(
            model, "synthetic", ctx.plan.latency_images + held, ctx.plan.calib_batch, hold_out=held
        )
        result = api.prune(
            model, data.batches, config, ctx.device, data.total, False, heldout=data.heldout, table=table, loop=loop
        )
    check = result.report["latency"]
    last = check["history"][-1]
    return {
        "target_speedup": check["target_speedup"],
        "predicted_speedup": check["predicted_speedup"],
        "measured_speedup": check["measured_speedup"],
        "spread": check["spread"],
        "rounds": check["rounds"],
        "loop_met": check["met"],
        "goal_met": check["measured_speedup"] >= goal,
        "dense_p50_ms": last["dense_ms"],
        "pruned_p50_ms": last["pruned_ms"],
        "p50_ratio": last["pruned_ms"] / last["dense_ms"],
        "macs": [result.report["dense"]["macs"], result.report["pruned"]["macs"]],
        "history": check["history"],
    }


def speedup_markdown(s: dict[str, Any]) -> list[str]:
    title = f"**Prune to a speed** ({s['model']} on {s['backend']}, latency budget, closed loop):"
    if s.get("skipped") and not s["rows"]:
        return [title, "", f"- not measured: {s['skipped']}"]
    head = ["lever", "batch", "goal", "predicted", "measured", "band", "rounds", "dense p50 ms", "pruned p50 ms"]
    head += ["p50 ratio", "MACs kept", "goal"]
    rows = [
        [r["lever"], r["batch"], f">= {r['goal']:.2f}x", f"{r['predicted_speedup']:.2f}x"]
        + [f"{r['measured_speedup']:.2f}x", f"+-{r['spread']:.1%}", r["rounds"], f"{r['dense_p50_ms']:.3f}"]
        + [f"{r['pruned_p50_ms']:.3f}", f"{r['p50_ratio']:.2f}", f"{r['macs'][1] / r['macs'][0]:.2f}"]
        + ["met" if r["goal_met"] else "MISSED"]
        for r in s["rows"]
    ]
    lines = [title, "", markdown_table(head, rows)]
    return lines + [f"- not measured: {k['what']}: {k['why']}" for k in s["skipped"]]
