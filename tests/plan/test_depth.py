"""Depth compression (``--depth``): a block's attention or MLP replaced by its closed-form ridge prediction."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from helpers import PRUNE, TINY, run, tiny_batches, tiny_vit
from timm.models.vision_transformer import ResPostBlock

from corp_deploy import api
from corp_deploy.base.errors import CorpError
from corp_deploy.bench.backends import BACKENDS
from corp_deploy.bench.meter import BackendMeter
from corp_deploy.core import compensation as C
from corp_deploy.core.config import MODULES, PruneConfig, Widths
from corp_deploy.core.distributed import World
from corp_deploy.core.pruner import Timer, calibrate, prune_model
from corp_deploy.core.stats import BranchStats, collect, empty_stats
from corp_deploy.families import structure
from corp_deploy.families.layers import AffineBranch
from corp_deploy.families.timm.surgery import replace_branch
from corp_deploy.formats.artifact import load_pruned, save_pruned
from corp_deploy.plan import latency, speed
from corp_deploy.plan.allocation import MODULE_KEYS, budget_limit, error_curves, plan_budget
from corp_deploy.plan.latency import LatencyTable
from corp_deploy.plan.sensitivity import measure
from corp_deploy.plan.width_plan import check_parts

LATENCY = {"budget": "latency=0.7"}


def branch_samples(model: torch.nn.Module, block: int, module: str, batches) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token's (z = [x, x_bar], y) of one branch, in float64, from hooks independent of the statistics."""
    blk = model.blocks[block]
    norm, scale = (blk.norm1, blk.ls1) if module == "attn" else (blk.norm2, blk.ls2)
    xs, ys = [], []
    h1 = norm.register_forward_pre_hook(lambda _m, a: xs.append(a[0].double()))
    h2 = scale.register_forward_hook(lambda _m, _a, out: ys.append(out.double()))
    with torch.no_grad():
        for images, _ in batches:
            model(images)
    h1.remove()
    h2.remove()
    x, y = torch.cat(xs), torch.cat(ys)
    z = torch.cat([x, x.mean(1, keepdim=True).expand_as(x)], -1)
    return z.flatten(0, 1), y.flatten(0, 1)


def branch_stats(model, block, module, batches) -> BranchStats:
    stats = empty_stats(model, mlp=False, qk=False, device="cpu", blocks=[block], depth=[module])
    collect(model, batches, stats, "cpu", progress=False)
    return stats.depth[(block, module)]


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("fit", C.DEPTH_FITS)
def test_fit_and_its_error_equal_least_squares_on_the_tokens(module: str, fit: str) -> None:
    """alpha = 0 is the least-squares fit of y on [features, 1]; the moment-form error is its residual energy.

    More images than channels, so that the token means span their space and least squares has one solution."""
    model, batches = tiny_vit(), tiny_batches(160, 32)
    z, y = branch_samples(model, 1, module, batches)
    s = branch_stats(model, 1, module, batches)
    features = C.branch_features(fit, z.shape[1] // 2)
    mean_z, second_z, mean_y, cross, energy = s.moments()
    w, b = C.branch_fit(mean_z, second_z, mean_y, cross, features, 0.0)
    design = torch.cat([z[:, features], torch.ones(z.shape[0], 1, dtype=z.dtype)], 1)
    coef = torch.linalg.lstsq(design, y).solution
    predicted = z[:, features] @ w.T + b
    assert torch.allclose(predicted, design @ coef, atol=1e-6 * y.abs().max())
    brute = (y - predicted).square().sum() / y.square().sum()
    error = C.branch_error(mean_z, second_z, mean_y, cross, energy, features, w, b)
    assert torch.isclose(error, brute, rtol=1e-4, atol=1e-9)  # float32 products summed in float64
    if fit == "mean":
        assert torch.allclose(b, y.mean(0)) and w.numel() == 0


def test_richer_fits_never_predict_worse_and_removal_alone_is_error_one() -> None:
    """Nested features: mean >= affine >= affine-mean (least squares); W = b = 0 is the plain removal."""
    model, batches = tiny_vit(), tiny_batches()
    s = branch_stats(model, 0, "attn", batches)
    mean_z, second_z, mean_y, cross, energy = s.moments()
    errors = []
    for fit in C.DEPTH_FITS:
        features = C.branch_features(fit, mean_y.numel())
        w, b = C.branch_fit(mean_z, second_z, mean_y, cross, features, 0.0)
        errors.append(float(C.branch_error(mean_z, second_z, mean_y, cross, energy, features, w, b)))
    assert errors[0] >= errors[1] - 1e-9 >= errors[2] - 2e-9 and errors[2] < errors[0]
    zero = C.branch_features("affine", mean_y.numel())
    w0 = torch.zeros(mean_y.numel(), mean_y.numel(), dtype=torch.float64)
    removal = C.branch_error(mean_z, second_z, mean_y, cross, energy, zero, w0, torch.zeros_like(mean_y))
    assert torch.isclose(removal, torch.ones((), dtype=torch.float64))


@pytest.mark.parametrize("module", MODULES)
def test_replaced_block_computes_the_closed_form_on_calibration_data(module: str) -> None:
    """After replacement the block is x + W z + b exactly (its other branch untouched)."""
    model, batches = tiny_vit(), tiny_batches()
    config = PruneConfig(sparsity=0.0, target="mlp", depth=module, **LATENCY)
    stats = calibrate(model, batches, config, "cpu", progress=False)
    w, b, error = C.branch_stand_in(*stats.depth[(1, module)].moments(), config.depth_fit, config.ridge)
    branch = AffineBranch(w.shape[0], config.depth_fit).fill(w.float(), b.float())
    pruned = copy.deepcopy(model)
    plan = [Widths(), Widths(replace=(module,))]
    report = prune_model(pruned, stats, config, plan, Timer())
    assert report[1]["replaced"][module]["rel_error"] == pytest.approx(error) and 0 < error < 1
    images = batches[0][0]
    with torch.no_grad():
        x = model.patch_embed(images)
        x = model.blocks[0](model.norm_pre(model._pos_embed(x)))
        dense1 = model.blocks[1]
        if module == "attn":
            expected = x + branch(x)
            expected = expected + dense1.ls2(dense1.mlp(dense1.norm2(expected)))
        else:
            mid = x + dense1.ls1(dense1.attn(dense1.norm1(x)))
            expected = mid + branch(mid)
        assert torch.allclose(pruned.blocks[1](x), expected, atol=1e-5)
        assert isinstance(getattr(pruned.blocks[1], module), AffineBranch)


def depth_pruned(modules=("attn", "mlp")) -> torch.nn.Module:
    model = tiny_vit()
    config = PruneConfig(sparsity=0.0, target="mlp,qk", depth=",".join(modules), **LATENCY)
    stats = calibrate(model, tiny_batches(), config, "cpu", progress=False)
    plan = [Widths(qk=8, replace=("mlp",)), Widths(mlp=64, replace=("attn",))]
    prune_model(model, stats, config, plan, Timer())
    return model


def test_artifact_records_replaced_modules_and_reloads_identically(tmp_path) -> None:
    model = depth_pruned()
    assert structure(model) == [
        {"mlp": "affine-mean", "qk_dim": 8, "v_dim": 16, "heads": 4},
        {"mlp_hidden": 64, "attn": "affine-mean"},
    ]
    save_pruned(
        model, tmp_path / "art", {"model": {"name": "vit_tiny_patch16_224", "args": {**TINY, "num_classes": 10}}}
    )
    loaded = load_pruned(tmp_path / "art")
    images = tiny_batches()[0][0]
    with torch.no_grad():
        assert torch.equal(loaded(images), model(images))


def test_onnx_export_of_a_depth_pruned_model_matches_torch(tmp_path) -> None:
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    import onnxruntime as ort

    from corp_deploy.exporters.onnx_export import export_onnx

    model = depth_pruned()
    path = export_onnx(model, tmp_path / "depth.onnx", (3, 32, 32))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for n in (1, 5):
        images = torch.randn(n, 3, 32, 32)
        (got,) = session.run(None, {session.get_inputs()[0].name: images.numpy()})
        with torch.no_grad():
            assert torch.allclose(torch.from_numpy(got), model(images), atol=1e-4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"depth": "attn"}, "latency budget"),
        ({"depth": "attn", "budget": "macs=0.5"}, "latency budget"),
        ({"depth": "attn", "budget": "latency=0.5", "allocation": "local"}, "allocation sensitivity"),
        ({"depth": "attn", "budget": "latency=0.5", "sequential": True}, "--sequential"),
        ({"depth": "norm"}, "--depth takes"),
        ({"depth": "attn", "budget": "latency=0.5", "depth_fit": "cubic"}, "--depth-fit"),
    ],
)
def test_refusals(kwargs, message) -> None:
    with pytest.raises(CorpError, match=message):
        PruneConfig(**kwargs)


# ------------------------------------------------------------------------------ latency and allocation

ATTN_GONE_S, MLP_GONE_S = 2e-4, 3e-4


def fake_time(model: torch.nn.Module) -> float:
    """A made-up time: additive per block, linear in widths; a replaced module costs a constant."""
    total = 0.01
    for b in structure(model):
        mlp = MLP_GONE_S if "mlp" in b else 1e-4 * b["mlp_hidden"]
        attn = ATTN_GONE_S if "attn" in b else 3e-4 * b["qk_dim"] + 2e-4 * b["v_dim"]
        total += mlp + attn + 1e-3
    return total


def depth_table() -> LatencyTable:
    key = speed.key("deit_tiny", {"depth": 2}, BackendMeter(BACKENDS["ort-cpu-fp32"]), 8, 2, ("attn", "mlp"))
    timer = lambda models: {n: fake_time(m) for n, m in models.items()}  # noqa: E731
    return speed.build_table(tiny_vit(), key, BackendMeter(BACKENDS["ort-cpu-fp32"]), timer=timer)


def test_latency_table_learns_blocks_with_a_module_replaced() -> None:
    """The grid's no-attn / no-mlp models give the replaced blocks' times; width 0 stands for a replaced module."""
    table = depth_table()
    assert set(table.removed) == {"attn", "mlp"}
    model = tiny_vit()
    for widths in ([(40, 0, 0), (0, 8, 12)], [(0, 0, 0), (128, 16, 16)]):
        assert table.predict(widths) == pytest.approx(fake_time(speed.with_widths(model, widths)))
    plain = latency.fit(table.key, table.shape, False, {n: 1.0 for n in latency.grid(table.shape, False)})
    with pytest.raises(CorpError, match="no time for a block without its attn"):
        plain.predict([(128, 0, 0)])


def _floor(table: LatencyTable, depth: str) -> float:
    """The smallest model's share of dense latency that ``budget_limit`` reports for ``depth``."""
    config = PruneConfig(budget="latency=0.01", target="mlp,qk,v", depth=depth, round_to=4)
    with pytest.raises(CorpError, match="below the smallest model") as e:
        budget_limit(tiny_vit(), config, 0, table)
    return float(str(e.value).split("(")[1].split(" of the dense")[0])


def test_the_smallest_model_keeps_a_module_whose_replacement_costs_more() -> None:
    """A replaceable module is kept at its smallest widths where that is cheaper than its stand-in (an H200 at batch 1
    measured an MLP's stand-in GEMM slower than a narrow MLP): one more lever never raises the floor of a budget."""
    table = depth_table()
    slow_stand_in = dataclasses.replace(table, removed=table.removed | {"mlp": table.dense_block_s})
    attn_only, both = _floor(slow_stand_in, "attn"), _floor(slow_stand_in, "attn,mlp")
    assert both <= attn_only
    assert _floor(table, "attn,mlp") < attn_only  # where the stand-in is cheap, replacing the MLP lowers the floor
    just_above = PruneConfig(budget=f"latency={attn_only + 0.002}", target="mlp,qk,v", depth="attn,mlp", round_to=4)
    assert budget_limit(tiny_vit(), just_above, 0, slow_stand_in) > 0


def plan_with(weight: float) -> tuple[list[Widths], dict]:
    """A latency budget (0.8 of dense) with attention replaceable, its removal's end-to-end weight set to
    ``weight`` x the widths' typical one; the widths' own weights 1."""
    model = tiny_vit()
    config = PruneConfig(budget="latency=0.8", target="mlp,qk,v", depth="attn", round_to=4)
    stats = calibrate(model, tiny_batches(), config, "cpu", progress=False)
    curves = error_curves(model, stats, config, config.target)
    weights = dict.fromkeys(curves, 1.0)
    for i in range(2):
        weights[(i, MODULE_KEYS["attn"])] = weight
    return plan_budget(model, stats, config, 0, weights, curves, depth_table())


def test_allocation_replaces_attention_when_it_saves_much_at_small_end_to_end_error() -> None:
    widths, record = plan_with(1e-3)
    assert [w.replace for w in widths].count(("attn",)) >= 1
    assert record["replaced"]["attn"] and record["latency"]["planned_s"] <= record["latency"]["limit_s"]
    replaced = next(w for w in widths if w.replace)
    assert replaced.qk is None and replaced.v is None  # nothing left to cut
    kept, _ = plan_with(1e3)
    assert all(not w.replace for w in kept)


def test_sensitivity_of_a_replacement_is_its_measured_end_to_end_error() -> None:
    """weight x local residual = relative error of the final features with that module replaced alone."""
    model = tiny_vit()
    config = PruneConfig(budget="latency=0.8", target="mlp", depth="attn")
    stats = calibrate(model, tiny_batches(), config, "cpu", progress=False)
    held = tiny_batches(8, 8, seed=5)[0][0]
    weights = measure(model, stats, config, held)
    for i in range(2):
        w, b, local = C.branch_stand_in(*stats.depth[(i, "attn")].moments(), config.depth_fit, config.ridge)
        branch = AffineBranch(w.shape[0], config.depth_fit).fill(w.float(), b.float())
        trial = copy.deepcopy(model)
        replace_branch(trial.blocks[i], "attn", branch)
        with torch.no_grad():
            dense, got = (m.forward_head(m.forward_features(held), pre_logits=True) for m in (model, trial))
        final = float((got - dense).double().square().sum() / dense.double().square().sum())
        assert weights[(i, MODULE_KEYS["attn"])] * local == pytest.approx(final, rel=1e-4)


def test_cli_refuses_depth_without_a_latency_budget(capsys) -> None:
    code, _, err = run([*PRUNE, "--calib", "synthetic", "--depth", "attn"], capsys)
    assert code == 1 and "--depth replaces modules within a latency budget" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_depth_refuses_torchrun_and_blocks_it_cannot_replace_before_any_data() -> None:
    config = PruneConfig(budget="latency=0.5", depth="attn")
    with pytest.raises(CorpError, match="--depth runs in one process"):
        api.check(tiny_vit(), config, 0, world=World(rank=0, size=2))
    model = tiny_vit(block_fn=ResPostBlock)  # norm after the branch: no x + ls(module(norm(x))) to replace
    with pytest.raises(CorpError, match="plain Block only; block 0 is a ResPostBlock"):
        check_parts(model, config)


@pytest.mark.e2e
def test_prune_export_with_depth_replaces_attention_a_width_only_plan_cannot_do_without(
    tmp_path, capsys, monkeypatch
) -> None:
    """3.3x of the fake cost is below every width-only model (the fixed per-block cost): only replacing
    attention modules meets it. The command records the replaced modules, exports and verifies the model."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(speed, "time_models", lambda models, *_: {n: [fake_time(m)] * 6 for n, m in models.items()})
    monkeypatch.setattr(speed, "time_against", lambda _, models, *__: {n: fake_time(m) for n, m in models.items()})
    out = tmp_path / "run"
    flags = [
        "--speedup",
        "3.3",
        "--latency-on",
        "ort-cpu-fp32",
        "--latency-batch-size",
        "2",
        "--sensitivity-images",
        "4",
    ]
    argv = ["prune-export", *PRUNE[1:], "--calib", "synthetic", "--precision", "fp32", *flags, "--out", str(out)]
    code, _, err = run([*argv, "--depth", "attn"], capsys)
    assert code == 0, err
    meta = json.loads((out / "pruned" / "corp.json").read_text())
    replaced = meta["report"]["allocation"]["replaced"]["attn"]
    assert replaced and meta["report"]["config"]["depth"] == "attn"
    assert [i for i, b in enumerate(meta["structure"]) if b.get("attn") == "affine-mean"] == replaced
    assert all(set(meta["report"]["blocks"][i]["replaced"]) == {"attn"} for i in replaced)
    code, _, err = run([*argv, "--overwrite"], capsys)  # the same budget without --depth: out of reach, one line
    assert code == 1 and "below the smallest model" in err and len(err.strip().splitlines()) == 1
