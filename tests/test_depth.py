"""Depth compression (``--depth``): a block's attention or MLP replaced by its closed-form ridge prediction."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import TINY, tiny_batches, tiny_vit

from corp_deploy import compensation as C
from corp_deploy.artifact import load_pruned, save_pruned
from corp_deploy.errors import CorpError
from corp_deploy.family import structure
from corp_deploy.pruner import MODULES, PruneConfig, Timer, Widths, calibrate, fit_branch, prune_model
from corp_deploy.stats import BranchStats, collect, empty_stats
from corp_deploy.surgery import AffineBranch

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
    branch, error = fit_branch(stats.depth[(1, module)], config.depth_fit, config.ridge)
    pruned = copy.deepcopy(model)
    plan = [Widths(), Widths(replace=(module,))]
    report = prune_model(pruned, stats, config, Timer(), plan)
    assert report[1][module]["rel_error"] == pytest.approx(error) and 0 < error < 1
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
    prune_model(model, stats, config, Timer(), plan)
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
