"""Budgeted widths: error curves from the statistics, the MACs closed form, the allocator, end to end."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, TESTS, pruned_copy, tiny_batches, tiny_vit

from corp_deploy import api
from corp_deploy.base.errors import CorpError
from corp_deploy.core import compensation as C
from corp_deploy.core.config import Budget, PruneConfig, Widths, parse_budget
from corp_deploy.core.pruner import calibrate, prune_model
from corp_deploy.core.ranking import channel_scores
from corp_deploy.core.stats import MlpStats
from corp_deploy.formats.artifact import load_pruned
from corp_deploy.plan.allocation import (
    allocate,
    block_macs,
    block_parts,
    candidate_widths,
    error_curves,
    macs_layout,
    per_unit,
    plan_budget,
)
from corp_deploy.plan.report import format_report, model_size
from corp_deploy.plan.sensitivity import split_heldout


@pytest.fixture(scope="module")
def calibrated() -> tuple[torch.nn.Module, object]:
    model = tiny_vit()
    return model, calibrate(model, tiny_batches(), PruneConfig(target="all"), "cpu", progress=False)


def _direct(s, w, b, keep, prune) -> float:
    """The compensated output error at lam = 0, straight from ``compensation`` (no Cholesky)."""
    bc = C.mlp_affine(s.mean(), s.second_moment(), keep, prune, 0.0)
    return float(C.mlp_output_error(s.mean(), s.second_moment(), w, b, keep, prune, *bc))


def test_cholesky_curve_equals_direct_errors_mlp_and_v(calibrated) -> None:
    model, stats = calibrated
    block = model.blocks[1]
    s = stats.mlp[1]
    w, b = block.mlp.fc2.weight.detach().double(), block.mlp.fc2.bias.detach().double()
    order = torch.sort(channel_scores("combined", s, w), descending=True)
    order = order.indices
    widths = candidate_widths(w.shape[1], 8)
    curve = C.affine_errors(s.mean(), s.second_moment(), w, b, order, widths)
    for k, err in zip(widths, curve, strict=True):
        keep, prune = order[:k].sort().values, order[k:].sort().values
        assert err == pytest.approx(_direct(s, w, b, keep, prune), rel=1e-6, abs=1e-12), k
    assert curve[0] == pytest.approx(0.0, abs=1e-12) and curve[-1] > curve[len(curve) // 2] > 0
    # V: rank-major order over heads; the curve at per-head width k keeps every head's top k.
    curves = error_curves(model, stats, PruneConfig(target="all"), frozenset({"v"}))
    widths, curve = curves[(1, "v")]
    s, heads = stats.proj[1], block.attn.num_heads
    w, b = block.attn.proj.weight.detach().double(), block.attn.proj.bias.detach().double()
    scores = channel_scores("combined", s, w).view(heads, -1)
    for k, err in zip(widths[1:], curve[1:], strict=True):
        keep_h = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
        keep, prune = C.head_channels(keep_h.sort(-1).values, scores.shape[1])
        assert err == pytest.approx(_direct(s, w, b, keep, prune), rel=1e-6), k


def test_logit_curve_matches_the_pruner(calibrated) -> None:
    """The Q/K curve at every width is the error the pruner reports when it prunes to that width."""
    model, stats = calibrated
    curves = error_curves(model, stats, PruneConfig(), frozenset({"qk"}))
    widths, curve = curves[(0, "qk")]
    for k, err in zip(widths[1:], curve[1:], strict=True):
        trial = copy.deepcopy(model)
        plan = [Widths(qk=k)] + [Widths()] * (len(model.blocks) - 1)
        report = prune_model(trial, stats, PruneConfig(), plan)
        assert err == pytest.approx(report[0]["qk"]["rel_error"]["corp"], rel=1e-9)


@pytest.mark.parametrize("overrides", [{}, {"reg_tokens": 3, "qkv_bias": False}])
def test_closed_form_macs_equal_counted_macs(overrides) -> None:
    """Including Q/K != V widths and register tokens, per block and in total."""
    dense = tiny_vit(**overrides)
    pruned, _ = pruned_copy(
        dense, PruneConfig(mlp_sparsity=0.25, qk_sparsity=0.5, v_sparsity=0.75, target="all", round_to=4)
    )
    dense_macs = model_size(dense)["macs"]
    for model in (dense, pruned):
        size = model_size(model)
        blocks = [block_macs(b["unit"], b["widths"]) for b in block_parts(model)]
        assert blocks == [b["macs"] for b in size["blocks"]]
        unit, fixed, widths = macs_layout(model, size["macs"], frozenset({"mlp", "qk", "v"}))
        assert fixed + sum(unit[k] * w for k, w in widths.items()) == size["macs"]
        assert fixed == macs_layout(dense, dense_macs, frozenset({"mlp", "qk", "v"}))[1]  # only widths change MACs


@pytest.mark.parametrize(("target", "fraction"), [("both", 0.62), ("all", 0.45), ("mlp", 0.83)])
def test_budget_met_exactly_with_the_counted_macs(calibrated, target, fraction) -> None:
    model, stats = calibrated
    dense_macs = model_size(model)["macs"]
    config = PruneConfig(budget=f"macs={fraction}", target=target, allocation="local")
    plan, record = plan_budget(model, stats, config, dense_macs)
    pruned = copy.deepcopy(model)
    prune_model(pruned, stats, config, plan)
    counted = model_size(pruned)["macs"]
    assert counted == record["planned_macs"] <= record["limit_macs"] == int(fraction * dense_macs)
    unit, _, _ = macs_layout(model, dense_macs, frozenset(record["planned_error"]))
    full = block_parts(model)
    for i, widths in enumerate(plan):
        for part in ("mlp", "qk", "v"):
            kept = widths.get(part)
            if kept is None or kept == full[i]["widths"][part]:
                continue
            bigger = candidate_widths(full[i]["widths"][part], 8)
            step = bigger[bigger.index(kept) - 1] - kept
            assert counted + unit[(i, part)] * step > record["limit_macs"], (i, part)  # no step can be given back


def test_flat_sensitivity_and_identical_blocks_give_a_uniform_split() -> None:
    widths = candidate_widths(128, 8)
    errors = [(1 - w / 128) ** 2 for w in widths]  # convex, as compensated errors are
    curves = {(i, "mlp"): (widths, errors) for i in range(4)}
    unit = dict.fromkeys(curves, 10)
    for fraction in (0.5, 0.3, 0.77):
        limit = int(fraction * 4 * 128 * 10)
        chosen = allocate(curves, dict.fromkeys(curves, 1.0), per_unit(unit), 0, limit)
        assert max(chosen.values()) - min(chosen.values()) <= 8, chosen
        assert sum(chosen.values()) * 10 <= limit < (sum(chosen.values()) + 8) * 10


def test_sensitivity_weights_move_width_to_the_sensitive_block() -> None:
    widths = candidate_widths(64, 8)
    errors = [(1 - w / 64) ** 2 for w in widths]
    curves = {(0, "mlp"): (widths, errors), (1, "mlp"): (widths, errors)}
    unit = dict.fromkeys(curves, 1)
    chosen = allocate(curves, {(0, "mlp"): 10.0, (1, "mlp"): 1.0}, per_unit(unit), 0, 64)
    assert chosen[(0, "mlp")] > chosen[(1, "mlp")]


def _redundant_mlp(model: torch.nn.Module, block: int) -> None:
    """Block's hidden channels 64.. copy channels ..64 (same fc1 rows), with far smaller fc2 columns: ranked last.

    Keeping the first half then loses nothing: the copies are predicted exactly from the originals.
    """
    mlp = model.blocks[block].mlp
    half = mlp.fc1.out_features // 2
    with torch.no_grad():
        mlp.fc1.weight[half:] = mlp.fc1.weight[:half]
        mlp.fc1.bias[half:] = mlp.fc1.bias[:half]
        mlp.fc2.weight[:, half:] = 1e-3 * mlp.fc2.weight[:, :half]


def test_allocator_follows_the_error_curves() -> None:
    """A block whose channels are all redundant is pruned harder than one whose channels are not.

    A uniform split (curves ignored) keeps the same width in both and fails this.
    """
    model = tiny_vit()
    _redundant_mlp(model, 1)
    config = PruneConfig(budget="macs=0.8", target="mlp", allocation="local")
    stats = calibrate(model, tiny_batches(), config, "cpu", progress=False)
    plan, record = plan_budget(model, stats, config, model_size(model)["macs"])
    redundant, normal = plan[1].mlp, plan[0].mlp
    assert redundant < normal
    widths, errors = error_curves(model, stats, config, frozenset({"mlp"}))[(1, "mlp")]
    assert errors[widths.index(64)] < 1e-6 < record["planned_error"]["mlp"][0]


def test_bad_budgets_are_refused_in_one_line() -> None:
    for text in ("macs=0", "macs=1.5", "macs=-0.2", "latency=0", "time=0.5", "0.5", "macs=half"):
        with pytest.raises(CorpError, match=r"--budget must be macs\|latency=F") as e:
            parse_budget(text)
        assert "\n" not in str(e.value)
    assert parse_budget("macs=1").fraction == 1.0
    assert parse_budget("latency=0.5") == Budget("latency", 0.5)
    with pytest.raises(CorpError, match="drop --qk-sparsity or drop --budget"):
        PruneConfig(budget="macs=0.5", qk_sparsity=0.3)
    with pytest.raises(CorpError, match="use --compensation corp"):
        PruneConfig(budget="macs=0.5", compensation="mean")
    with pytest.raises(CorpError, match="--allocation must be one of"):
        PruneConfig(budget="macs=0.5", allocation="magic")
    with pytest.raises(CorpError, match="--sensitivity-images must be >= 1"):
        PruneConfig(budget="macs=0.5", sensitivity_images=0)


def _never_read():
    raise AssertionError("calibration data read before the budget was checked")
    yield


def test_impossible_budget_fails_before_calibration() -> None:
    for config in (PruneConfig(budget="macs=0.05"), PruneConfig(budget="macs=0.5", target="mlp", round_to=128)):
        with pytest.raises(CorpError, match="is below the smallest model") as e:
            api.prune(tiny_vit(), _never_read(), config, progress=False)
        assert "\n" not in str(e.value)
    with pytest.raises(CorpError, match="holds out 32 calibration images"):
        api.prune(tiny_vit(), _never_read(), PruneConfig(budget="macs=0.7"), total=32, progress=False)


def test_split_heldout_keeps_every_image_once() -> None:
    batches = [(torch.full((5, 1), float(i)), i) for i in range(4)]
    held, rest = split_heldout(batches, 7)
    rest = list(rest)
    assert held.shape[0] == 7 and held.flatten().tolist() == [0] * 5 + [1] * 2
    assert sum(x.shape[0] for x, _ in rest) == 13 and sum(s for _, s in rest) == 6


def test_budgeted_prune_end_to_end_reloads(tmp_path) -> None:
    model = tiny_vit()
    dense = copy.deepcopy(model)
    config = PruneConfig(budget="macs=0.6", target="all", sensitivity_images=16)
    result = api.prune(model, tiny_batches(64), config, progress=False)
    report = result.report
    alloc = report["allocation"]
    assert report["calibration"]["images"] == 48 and alloc["heldout"]["images"] == 16
    assert alloc["criterion"] == "sensitivity" and set(alloc["sensitivity"]) == {"mlp", "qk", "v"}
    assert all(v > 0 for vs in alloc["sensitivity"].values() for v in vs)
    assert report["pruned"]["macs"] == alloc["planned_macs"] <= 0.6 * report["dense"]["macs"]
    assert report["config"]["budget"] == "macs=0.6" and report["config"]["sparsity"] is None
    assert "widths per block from --budget macs=0.6 (sensitivity errors)" in format_report(report)
    out = api.save(
        result,
        tmp_path / "run",
        "vit_tiny_patch16_224",
        {
            "img_size": 32,
            "patch_size": 8,
            "embed_dim": 64,
            "depth": 2,
            "num_heads": 4,
            "mlp_ratio": 2.0,
            "num_classes": 10,
        },
    )
    reloaded = load_pruned(out)
    x = torch.randn(3, 3, 32, 32)
    with torch.inference_mode():
        torch.testing.assert_close(reloaded(x), result.model(x))
        assert not torch.equal(reloaded(x), dense(x))
    widths = [(e.get("mlp", {}).get("kept"), e["qk"]["kept"], e["v"]["kept"]) for e in report["blocks"]]
    assert widths == [(b.mlp.fc1.out_features, b.attn.qk_dim, b.attn.v_dim) for b in reloaded.blocks]


def test_uniform_config_record_only_gains_the_new_fields() -> None:
    record = PruneConfig(sparsity=0.4, target="all").to_dict()
    assert record["sparsity"] == record["mlp_sparsity"] == record["v_sparsity"] == 0.4
    assert {k: record[k] for k in ("budget", "allocation", "sensitivity_images")} == {
        "budget": None,
        "allocation": "sensitivity",
        "sensitivity_images": 32,
    }


RANK_SCRIPT = """
import json, sys
import torch
sys.path.insert(0, sys.argv[2])
from helpers import tiny_batches, tiny_vit
from corp_deploy import api
from corp_deploy.core import distributed
from corp_deploy.core.config import PruneConfig

world, _ = distributed.init(torch.device("cpu"), 120)
batches = [b for i, b in enumerate(tiny_batches(64, 8)) if i % world.size == world.rank]
for allocation in ("local", "sensitivity"):  # one job, two prunes: each a fresh model and its own all-reduced sums
    config = PruneConfig(budget="macs=0.6", target="all", allocation=allocation, sensitivity_images=8)
    result = api.prune(tiny_vit(), batches, config, "cpu", progress=False, world=world)
    assert (result is None) == (world.rank != 0)
    if result is not None:
        json.dump({"allocation": result.report["allocation"], "calibration": result.report["calibration"],
                   "widths": [[e[p]["kept"] for p in ("mlp", "qk", "v")] for e in result.report["blocks"]]},
                  open(sys.argv[1] + "-" + allocation + ".json", "w"))
distributed.finish()
"""


def test_budget_under_two_gloo_processes(tmp_path) -> None:
    """Sums are all-reduced; rank 0 holds out its first images, measures sensitivity and plans alone."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    run = subprocess.run(  # one torchrun job prunes with both allocations (a launch costs seconds of imports)
        [*torchrun, str(script), str(tmp_path / "out"), str(TESTS)],
        cwd=ROOT,
        env={**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert run.returncode == 0, run.stderr[:3000]
    local, sens = (json.loads((tmp_path / f"out-{a}.json").read_text()) for a in ("local", "sensitivity"))
    single = api.prune(
        tiny_vit(),
        tiny_batches(64, 8),
        PruneConfig(budget="macs=0.6", target="all", allocation="local"),
        progress=False,
    )
    assert local["calibration"] == {"images": 64, "skipped": 0, "mode": "one-pass", "unit": "images", "processes": 2}
    assert local["widths"] == [[e[p]["kept"] for p in ("mlp", "qk", "v")] for e in single.report["blocks"]]
    assert sens["calibration"]["images"] == 56 and sens["allocation"]["heldout"]["images"] == 8
    assert sens["allocation"]["planned_macs"] <= sens["allocation"]["limit_macs"]


def test_curves_survive_an_indefinite_covariance() -> None:
    """Few tokens make the covariance singular and float rounding makes it slightly indefinite (seen on DINOv2 with
    16 images): the curve must still come out, finite and falling with the kept width, not as a traceback."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g, dtype=torch.float64) @ torch.randn(8, 32, generator=g, dtype=torch.float64)
    s = MlpStats(32)
    s.update(x + 3.0)
    null = torch.linalg.svd(x - x.mean(0)).Vh[-1]  # a direction the tokens never take
    s.outer -= 1e-7 * s.count * s.second_moment().diagonal().mean() * torch.outer(null, null)
    w = torch.randn(16, 32, generator=g, dtype=torch.float64)
    kept = candidate_widths(32, 4)
    errors = C.affine_errors(
        s.mean(), s.second_moment(), w, torch.zeros(16, dtype=torch.float64), torch.arange(32), kept
    )
    assert all(math.isfinite(e) for e in errors)
    assert errors == sorted(errors) and errors[0] == 0.0  # widths descend, errors rise; the full width is exact
    rank8 = [e for k, e in zip(kept, errors, strict=True) if k >= 8]
    assert max(rank8) < 1e-4 < errors[-1]  # 8 generic channels predict the other 24 (the tokens have rank 8)
