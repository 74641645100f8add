"""Prune's steps as separate functions, and the defects the review found in them (each test fails before its fix).

The steps: ``api.check`` (data-free: the calibration step, the widths), ``calibration.calibration_data`` (held-out
images), ``pruner.calibrate`` (exact float32), ``plan.width_plan.plan`` / ``plan_widths`` (uniform, VBP's global
threshold, a budget), ``pruner.prune_model``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import PRUNE, run, tiny_batches, tiny_llama, tiny_vit
from PIL import Image

from corp_deploy import api
from corp_deploy.base.errors import CorpError
from corp_deploy.core import compensation as C
from corp_deploy.core import pruner
from corp_deploy.core.config import Budget, PruneConfig, Widths
from corp_deploy.core.fit import COMPENSATIONS, Compensation
from corp_deploy.core.pruner import calibrate, prune_model
from corp_deploy.core.ranking import SELECTIONS, Selection, global_widths, kept_width
from corp_deploy.formats.data import split
from corp_deploy.plan.width_plan import plan_widths


def _never_read():
    raise AssertionError("calibration data read before the configuration was checked")
    yield


# ------------------------------------------------------------------------------------------ config


def test_target_and_budget_are_parsed_once_into_typed_fields() -> None:
    config = PruneConfig(target="both", budget="macs=0.5")
    assert config.target == ("mlp", "qk") and config.budget == Budget("macs", 0.5)
    assert PruneConfig(target=["v", "mlp"]).target == ("mlp", "v")  # PARTS order, whatever the spelling
    assert PruneConfig(target="attn").target == ("qk",) and PruneConfig(target="all").target == ("mlp", "qk", "v")
    record = PruneConfig(target="all", budget="macs=0.5").to_dict()
    assert record["target"] == "mlp,qk,v" and record["budget"] == "macs=0.5" and record["qk_sparsity"] is None
    json.dumps(record)  # what corp.json stores
    with pytest.raises(CorpError, match="--target names nothing"):
        PruneConfig(target=[])


def test_a_target_left_out_is_the_clis_default_narrowed_to_the_family_by_the_api() -> None:
    """A Python caller gets the CLI's default: mlp,qk (all three under a latency budget), less what the family cannot
    prune (Llama: no Q/K under RoPE); a target given stands, and the one check refuses what the family cannot take."""
    assert PruneConfig().target == ("mlp", "qk") and not PruneConfig().chose_target
    assert PruneConfig(budget="latency=0.5").target == ("mlp", "qk", "v")
    assert "chose_target" not in PruneConfig().to_dict()  # corp.json records the target pruned, no new field
    llama = tiny_llama()
    assert api.for_model(PruneConfig(), llama).target == ("mlp",)
    assert api.for_model(PruneConfig(budget="latency=0.5"), llama).target == ("mlp", "v")
    chosen = api.for_model(PruneConfig(target="mlp,qk"), llama)
    assert chosen.target == ("mlp", "qk")
    with pytest.raises(CorpError, match="qk pruning is not supported"):
        api.check(llama, chosen, 0)
    assert api.for_model(PruneConfig(), tiny_vit()).target == ("mlp", "qk")


def test_a_registered_compensation_is_accepted_fitted_and_reported(monkeypatch) -> None:
    """A new compensation is its closed forms and a registration: half the mean shift, ``c = mu_P / 2``. Its error is
    exactly a quarter of the way from the mean shift's to plain removal's (the error is quadratic in c, least at
    mu_P), and every part's report carries it beside the others."""
    half = Compensation(
        lambda mean, second, keep, prune, alpha: (mean.new_zeros(prune.numel(), keep.numel()), mean[prune] / 2),
        C.mean_shift_regression,
        logits=False,
        constant=True,
    )
    monkeypatch.setitem(COMPENSATIONS, "half", half)
    config = PruneConfig(sparsity=0.5, target="mlp", compensation="half")
    model = tiny_vit()
    stats = calibrate(model, tiny_batches(16), config, "cpu", progress=False)
    errors = prune_model(model, stats, config, plan_widths(model, config))[0]["mlp"]["rel_error"]
    assert set(errors) == {"corp", "mean", "none", "half"}
    assert errors["half"] == pytest.approx(errors["mean"] + (errors["none"] - errors["mean"]) / 4, rel=1e-9)
    with pytest.raises(CorpError, match="--compensation must be one of corp, mean, none, half"):
        PruneConfig(compensation="quarter")


def test_a_registered_selection_chooses_the_mlp_widths_from_the_statistics(monkeypatch) -> None:
    """A new selection is a counts function and a registration; a scored one waits for the statistics: the data-free
    check leaves the widths to the plan, and a bounded-memory calibration (no statistics of every block at once) is
    refused for it."""
    monkeypatch.setitem(SELECTIONS, "first", Selection(lambda full, s, r, what, scores: [full[0], r], scored=True))
    model = tiny_vit()
    config = PruneConfig(sparsity=0.5, target="mlp,qk", selection="first")
    assert api.check(model, config, 0) == ("one-pass", None)
    with pytest.raises(CorpError, match="--selection first compares every block's statistics"):
        api.check(model, config, 0, max_stats_gib=1.0)
    stats = calibrate(model, tiny_batches(16), config, "cpu", progress=False)
    assert plan_widths(model, config, stats) == [Widths(mlp=128, qk=8), Widths(mlp=8, qk=8)]


# ------------------------------------------------------------------------------------ kept widths


@pytest.mark.parametrize(
    "width, sparsity, round_to, kept",
    [
        (80, 0.35, 8, 56),  # 6.5 steps: an exact half goes UP (Python's round gave 48 = 60%)
        (80, 0.65, 8, 32),  # 3.5000000000000004 steps in binary float: the decimal 3.5, up
        (40, 0.5, 8, 24),  # 2.5 steps (round-half-even gave 16)
        (64, 0.5, 8, 32),
        (1536, 0.3, 8, 1072),  # 134.4 steps -> 134
        (64, 0.0, 8, 64),
    ],
)
def test_kept_width_rounds_to_the_nearest_multiple_exact_halves_up(width, sparsity, round_to, kept) -> None:
    assert kept_width(width, sparsity, round_to, "dims") == kept


# --------------------------------------------------------------------------------- planning checks


def test_a_budget_refuses_a_bias_free_fc2_before_calibration() -> None:
    """The budget path skipped the check the uniform path makes: CORP's constant term has nowhere to go."""
    model = tiny_vit(proj_bias=False)
    assert model.blocks[0].mlp.fc2.bias is None
    config = PruneConfig(budget="macs=0.7", target="mlp", allocation="local")
    with pytest.raises(CorpError, match="fc2 has no bias"):
        api.prune(model, _never_read(), config, "cpu", progress=False)
    with pytest.raises(CorpError, match="fc2 has no bias"):
        api.prune(tiny_vit(proj_bias=False), _never_read(), PruneConfig(target="mlp", selection="global"), "cpu")


def test_combinations_no_step_supports_are_refused_before_any_data() -> None:
    cases = {
        "--selection global compares every block's statistics": (PruneConfig(selection="global"), 1.0),
        "--budget compares every block's statistics": (PruneConfig(budget="macs=0.5"), 1.0),
    }
    for message, (config, bound) in cases.items():
        with pytest.raises(CorpError, match=message):
            api.prune(tiny_vit(), _never_read(), config, "cpu", progress=False, max_stats_gib=bound)
    with pytest.raises(CorpError, match="--budget allocates every block's widths itself"):
        PruneConfig(budget="macs=0.5", selection="global")
    with pytest.raises(CorpError, match="add mlp to --target"):
        PruneConfig(target="qk", selection="global")


# ------------------------------------------------------------------------------- exact float32


def test_calibration_runs_in_exact_fp32_and_restores_the_callers_setting(monkeypatch) -> None:
    """A process that enabled TF32 must not get TF32 sums: the Q/K systems are solved from them."""
    seen = []
    real_collect = pruner.collect

    def spy(*args, **kwargs):
        seen.append((torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32))
        return real_collect(*args, **kwargs)

    monkeypatch.setattr(pruner, "collect", spy)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        torch.backends.cuda.matmul.allow_tf32 = True
        calibrate(tiny_vit(), tiny_batches(16), PruneConfig(), "cpu", progress=False)
        assert seen == [("highest", False)]
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.set_float32_matmul_precision(before)


# ----------------------------------------------------------------------------------- held-out set


def test_split_draws_across_the_whole_sample_and_keeps_the_rest_in_order() -> None:
    items = list(range(100))
    rest, held = split(items, 10, seed=0)
    assert rest == sorted(rest) and sorted(rest + held) == items and len(held) == 10
    assert max(held) - min(held) > 50  # not the first ten
    assert split(items, 10, seed=0) == (rest, held) and split(items, 10, seed=1)[1] != held


def _class_tree(root, classes: int = 4, per_class: int = 12):
    rng = np.random.default_rng(0)
    for c in range(classes):
        folder = root / f"class{c}"
        folder.mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return root


@pytest.mark.e2e
def test_budget_holds_out_images_from_across_the_classes_and_says_which(tmp_path, capsys) -> None:
    """The sensitivity pass's images were the stream's first 32: with a sample in path order, the first classes."""
    tree = _class_tree(tmp_path / "tree")
    out = tmp_path / "run"
    argv = [*PRUNE, "--calib-dir", str(tree), "--workers", "0", "--num-calib", "48", "--budget", "macs=0.8"]
    code, _, stderr = run([*argv, "--sensitivity-images", "12", "--out", str(out)], capsys)
    assert code == 0, stderr
    report = json.loads((out / "corp.json").read_text())["report"]
    heldout = report["allocation"]["heldout"]
    assert heldout["images"] == 12 and sum(heldout["folders"].values()) == 12
    assert len(heldout["folders"]) >= 3, heldout  # drawn across the classes, not class0 alone
    assert report["calibration"]["images"] == 36


# ---------------------------------------------------------------------------- VBP: global selection


def test_global_widths_use_one_threshold_across_blocks() -> None:
    scores = [torch.arange(8.0), torch.arange(10.0, 18.0)]  # block 1 outscores block 0 everywhere
    assert global_widths(scores, 0.5, 1) == [1, 8]  # one channel kept in block 0: no block is emptied
    assert global_widths(scores, 0.25, 4) == [4, 8]  # 12 kept: 4 + 8
    assert global_widths([torch.ones(8), torch.ones(8)], 0.5, 4) == [8, 4]  # ties: stable (block 0 first); floor
    mixed = [torch.tensor([5.0, 1, 1, 1, 1, 1, 1, 1]), torch.tensor([4.0, 4, 4, 4, 4, 4, 0, 0])]
    assert global_widths(mixed, 0.5, 4) == [4, 8]  # 2 + 6 kept: exact halves of a step round up, to 4 and 8


def test_global_selection_moves_channels_to_the_block_that_needs_them() -> None:
    """Block 1's MLP activations are scaled down 2x (the function is kept): VBP's one global variance threshold
    takes channels from it and gives them to block 0; the total stays half, up to rounding each block to 8."""
    model = tiny_vit(act_layer=torch.nn.ReLU)
    with torch.no_grad():
        model.blocks[1].mlp.fc1.weight.mul_(0.5)
        model.blocks[1].mlp.fc1.bias.mul_(0.5)
        model.blocks[1].mlp.fc2.weight.mul_(2)  # ReLU is homogeneous: same function, smaller activations
    config = PruneConfig(sparsity=0.5, target="mlp", ranker="variance", compensation="mean", selection="global")
    stats = calibrate(model, tiny_batches(), config, "cpu", progress=False)
    widths = plan_widths(model, config, stats)
    assert widths[0].mlp > 64 > widths[1].mlp and abs(widths[0].mlp + widths[1].mlp - 128) <= 8, widths
    assert all(w.mlp % 8 == 0 and w.qk is None for w in widths)
    blocks = prune_model(model, stats, config, widths)
    assert [b["mlp"]["kept"] for b in blocks] == [w.mlp for w in widths]


@pytest.mark.e2e
def test_vbp_baseline_runs_through_the_cli(tmp_path, capsys) -> None:
    out = tmp_path / "vbp"
    argv = [*PRUNE, "--calib", "synthetic", "--target", "mlp", "--ranker", "variance", "--compensation", "mean"]
    code, stdout, stderr = run([*argv, "--selection", "global", "--out", str(out)], capsys)
    assert code == 0, stderr
    meta = json.loads((out / "corp.json").read_text())
    config = meta["report"]["config"]
    assert (config["ranker"], config["compensation"], config["selection"]) == ("variance", "mean", "global")
    assert sum(b["mlp_hidden"] for b in meta["structure"]) == 128  # half of 2 x 128, split by one threshold
    code, _, stderr = run([*PRUNE, "--calib", "synthetic", "--selection", "global", "--budget", "macs=0.5"], capsys)
    assert code == 1 and stderr.count("\n") == 1 and "--budget allocates every block's widths itself" in stderr


def test_widths_are_typed() -> None:
    w = Widths(mlp=64)
    assert (w.get("mlp"), w.get("qk"), w.get("v")) == (64, None, None)
