"""V pruning: the MLP compensation at proj's input, equal-width attention, artifacts and ONNX.

The V channels a block keeps are read back from the pruned qkv's V rows (a subset of the dense
rows); the expected set and the expected compensation are computed here from activations the test
captures itself, never from the library's statistics.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import PRUNE, run, tiny_batches, tiny_vit

import corp_deploy
from corp_deploy import api
from corp_deploy.base.errors import CorpError
from corp_deploy.core import compensation as C
from corp_deploy.core.config import PruneConfig
from corp_deploy.core.pruner import calibrate, prune_model
from corp_deploy.families.timm.surgery import PrunedAttention, pad_qk
from corp_deploy.plan.width_plan import plan_widths

DIM, HEADS, D = 64, 4, 16
MANY = tiny_batches(n=480, batch=96)
"""480 images x 17 tokens: enough tokens that a 32-regressor fit generalises (48 images overfit)."""
HELD_OUT = tiny_batches(n=64, batch=64, seed=7)[0][0]


@pytest.fixture(scope="module")
def calibrated():
    """A dense tiny ViT, its statistics for every part, and the proj inputs / attention inputs it saw."""
    model = tiny_vit()
    captured: dict[str, list[torch.Tensor]] = {}
    hooks = [
        module.register_forward_pre_hook(lambda _m, args, n=name: captured.setdefault(n, []).append(args[0]))
        for i, block in enumerate(model.blocks)
        for name, module in ((f"proj.{i}", block.attn.proj), (f"attn.{i}", block.attn))
    ]
    stats = calibrate(model, MANY, PruneConfig(target="all"), "cpu", progress=False)
    for h in hooks:
        h.remove()
    return model, stats, {k: torch.cat(v) for k, v in captured.items()}


def _kept_v(dense_attn, pruned_attn) -> torch.Tensor:
    """Indices into ``[v_1 | ... | v_H]`` of the dense V rows the pruned qkv kept, in order."""
    dense_v = dense_attn.qkv.weight[2 * DIM :]
    pruned_v = pruned_attn.qkv.weight[2 * pruned_attn.num_heads * pruned_attn.qk_dim :]
    match = (pruned_v[:, None, :] == dense_v[None]).all(-1)
    assert (match.sum(1) == 1).all()
    return match.float().argmax(1)


def _expected_keep(z: torch.Tensor, kept: int) -> torch.Tensor:
    """Energy ranking within every head, from the captured proj inputs."""
    scores = (z.reshape(-1, DIM).double() ** 2).mean(0).view(HEADS, D)
    order = torch.sort(scores, dim=-1, descending=True, stable=True)
    assert (order.values[:, kept - 1] > order.values[:, kept]).all()  # a clear cut, so the check can fail
    keep = order.indices[:, :kept].sort(dim=-1).values
    return (keep + D * torch.arange(HEADS)[:, None]).flatten()


def test_head_channels_flattens_per_head_sets() -> None:
    keep, prune = C.head_channels(torch.tensor([[0, 3], [1, 2]]), 4)
    assert keep.tolist() == [0, 3, 5, 6] and prune.tolist() == [1, 2, 4, 7]


@torch.no_grad()
def test_v_compensation_equals_least_squares_on_proj_inputs_as_ridge_goes_to_zero(calibrated) -> None:
    """W_S' = W_S + W_P B and b' = b + W_P c with (B, c) the direct least-squares fit of z_P on [z_S, 1]."""
    model, stats, captured = calibrated
    pruned = copy.deepcopy(model)
    config = PruneConfig(sparsity=0.5, target="v", ranker="energy", ridge=0.0, round_to=4)
    prune_model(pruned, stats, config, plan_widths(pruned, config, stats))
    for i, block in enumerate(model.blocks):
        z = captured[f"proj.{i}"].reshape(-1, DIM).double()
        keep = _expected_keep(z, 8)
        assert torch.equal(_kept_v(block.attn, pruned.blocks[i].attn), keep)
        prune = torch.tensor(sorted(set(range(DIM)) - set(keep.tolist())))
        design = torch.cat([z[:, keep], torch.ones(len(z), 1, dtype=z.dtype)], dim=1)
        coef = torch.linalg.lstsq(design, z[:, prune]).solution
        w, b = block.attn.proj.weight.double(), block.attn.proj.bias.double()
        expected_w = w[:, keep] + w[:, prune] @ coef[:-1].T
        expected_b = b + w[:, prune] @ coef[-1]
        proj = pruned.blocks[i].attn.proj
        torch.testing.assert_close(proj.weight.double(), expected_w, rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(proj.bias.double(), expected_b, rtol=1e-3, atol=1e-4)
        assert not torch.allclose(proj.weight.double(), w[:, keep], atol=1e-3)  # compensation did change proj


@torch.no_grad()
def test_compensated_proj_output_error_is_below_uncompensated_on_held_out_images(calibrated) -> None:
    model, stats, _ = calibrated
    inputs: dict[int, torch.Tensor] = {}
    hooks = [
        b.attn.register_forward_pre_hook(lambda _m, a, i=i: inputs.__setitem__(i, a[0]))
        for i, b in enumerate(model.blocks)
    ]
    model(HELD_OUT)
    for h in hooks:
        h.remove()
    errors: dict[str, list[float]] = {}
    for comp in ("none", "mean", "corp"):
        pruned = copy.deepcopy(model)
        config = PruneConfig(sparsity=0.5, target="v", compensation=comp, round_to=4)
        reports = prune_model(pruned, stats, config, plan_widths(pruned, config, stats))
        for i, block in enumerate(model.blocks):
            reference = block.attn(inputs[i])
            err = float((pruned.blocks[i].attn(inputs[i]) - reference).square().sum() / reference.square().sum())
            errors.setdefault(comp, []).append(err)
            assert reports[i]["v"]["kept"] == 8
    for i in range(len(model.blocks)):
        assert errors["corp"][i] < errors["mean"][i] <= errors["none"][i] * 1.01, errors
        assert errors["corp"][i] < 0.6 * errors["none"][i], errors


@torch.no_grad()
def test_equal_width_attention_is_plain_attention_with_the_original_scale(calibrated) -> None:
    """Q/K and V both at 8: softmax(q_S k_S^T / sqrt(16)) v_S then proj restricted to S, computed by hand."""
    model, stats, captured = calibrated
    pruned = copy.deepcopy(model)
    config = PruneConfig(sparsity=0.5, target="qk,v", ranker="energy", compensation="none", round_to=4)
    prune_model(pruned, stats, config, plan_widths(pruned, config, stats))
    for i, block in enumerate(model.blocks):
        attn = pruned.blocks[i].attn
        assert isinstance(attn, PrunedAttention) and attn.qk_dim == attn.v_dim == 8
        assert attn.scale == pytest.approx(D**-0.5)
        x = captured[f"attn.{i}"][:8]
        q, k, v = (t.unflatten(-1, (HEADS, 8)).transpose(1, 2) for t in attn.qkv(x).split(32, dim=-1))
        keep = _kept_v(block.attn, attn)
        dense_v = block.attn.qkv(x)[..., 2 * DIM :][..., keep].unflatten(-1, (HEADS, 8)).transpose(1, 2)
        torch.testing.assert_close(v, dense_v)  # plain removal: V is the dense V's kept channels
        o = F.softmax(q @ k.transpose(-1, -2) * D**-0.5, dim=-1) @ v
        w, b = block.attn.proj.weight, block.attn.proj.bias
        expected = o.transpose(1, 2).flatten(2) @ w[:, keep].T + b
        torch.testing.assert_close(attn(x), expected, rtol=1e-5, atol=1e-5)


def test_parameter_count_with_all_three_parts() -> None:
    model = tiny_vit()
    config = PruneConfig(mlp_sparsity=0.25, qk_sparsity=0.5, v_sparsity=0.75, target="all", round_to=4)
    stats = calibrate(model, tiny_batches(), config, "cpu", progress=False)
    pruned = copy.deepcopy(model)
    prune_model(pruned, stats, config, plan_widths(pruned, config, stats))
    hidden, kept_h, kept_qk, kept_v = 128, 96, 8, 4
    for block in pruned.blocks:
        assert block.attn.qkv.weight.shape == (HEADS * (2 * kept_qk + kept_v), DIM)
        assert block.attn.proj.weight.shape == (DIM, HEADS * kept_v)
    removed = (
        2 * (hidden - kept_h) * DIM
        + (hidden - kept_h)  # fc1 rows + bias, fc2 columns
        + 2 * HEADS * (D - kept_qk) * (DIM + 1)  # q and k rows + biases
        + HEADS * (D - kept_v) * (DIM + 1)  # v rows + biases
        + HEADS * (D - kept_v) * DIM  # proj columns
    )
    assert sum(p.numel() for p in pruned.parameters()) == sum(p.numel() for p in model.parameters()) - 2 * removed


def test_target_parsing_and_sparsity_overrides() -> None:
    assert PruneConfig(target="both").prunes("mlp") and PruneConfig(target="both").prunes("qk")
    assert not PruneConfig(target="both").prunes("v") and not PruneConfig(target="attn").prunes("mlp")
    config = PruneConfig(sparsity=0.5, v_sparsity=0.25, target="mlp, v")
    assert (config.part_sparsity("mlp"), config.part_sparsity("qk"), config.part_sparsity("v")) == (
        0.5,
        0,
        0.25,
    )
    assert PruneConfig(target="all").to_dict()["v_sparsity"] == 0.5
    with pytest.raises(CorpError, match="--target must be a comma-separated combination"):
        PruneConfig(target="mlp,vv")


@pytest.mark.parametrize(
    ("overrides", "config", "message"),
    [
        ({}, PruneConfig(v_sparsity=0.9, target="all", round_to=8), r"leaves 0 of 16 V channels per head \(block 0\)"),
        ({"scale_attn_norm": True}, PruneConfig(target="all"), "V pruning is not supported for block 0"),
        ({"proj_bias": False}, PruneConfig(target="v"), "no proj bias"),
    ],
    ids=["zero-left", "scale-norm", "no-proj-bias"],
)
def test_impossible_v_pruning_fails_before_calibration(overrides, config, message) -> None:
    model = tiny_vit(**overrides)

    def no_batches():
        raise AssertionError("calibration started")
        yield

    with pytest.raises(CorpError, match=message):
        corp_deploy.prune(model, no_batches(), config, device="cpu", progress=False)
    with pytest.raises(CorpError, match=message):
        api.check(model, config, 0)


ARGS = {"img_size": 32, "patch_size": 8, "embed_dim": 64, "depth": 2, "num_heads": 4, "mlp_ratio": 2.0}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = corp_deploy.create_model("deit_tiny", weights="random", model_args=ARGS)
    config = PruneConfig(sparsity=0.5, target="all", round_to=4)
    result = corp_deploy.prune(model, tiny_batches(), config, device="cpu", progress=False)
    out = tmp_path_factory.mktemp("v") / "run"
    return result, corp_deploy.save(result, out, "deit_tiny_patch16_224", ARGS, weights="random")


@torch.no_grad()
def test_save_then_load_rebuilds_v_widths(saved) -> None:
    result, out = saved
    meta = json.loads((out / "corp.json").read_text())
    assert [(b["qk_dim"], b["v_dim"]) for b in meta["structure"]] == [(8, 8)] * 2
    assert meta["report"]["config"]["v_sparsity"] == 0.5 and all("v" in b for b in meta["report"]["blocks"])
    loaded = corp_deploy.load_pruned(out)
    assert all(b.attn.v_dim == 8 and b.attn.proj.in_features == 32 for b in loaded.blocks)
    x = torch.randn(3, 3, 32, 32)
    torch.testing.assert_close(loaded(x), result.model(x), rtol=0, atol=0)


@torch.no_grad()
def test_artifacts_without_v_widths_still_load(tmp_path) -> None:
    """A format-1 artifact (no ``v_dim``, V never pruned, no ``family``, report keys ``attn``) loads with V at
    the dense head width, as a timm ViT."""
    model = corp_deploy.create_model("deit_tiny", weights="random", model_args=ARGS)
    result = corp_deploy.prune(model, tiny_batches(), PruneConfig(round_to=4), device="cpu", progress=False)
    out = corp_deploy.save(result, tmp_path / "old", "deit_tiny_patch16_224", ARGS, weights="random")
    meta = json.loads((out / "corp.json").read_text())
    meta["format_version"] = 1
    del meta["family"]
    for block in meta["structure"]:
        del block["v_dim"]
    for entry in meta["report"]["blocks"]:
        entry["attn"] = entry.pop("qk")
    (out / "corp.json").write_text(json.dumps(meta))
    loaded = corp_deploy.load_pruned(out)
    assert all(b.attn.qk_dim == 8 and b.attn.v_dim == 16 for b in loaded.blocks)
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(loaded(x), result.model(x), rtol=0, atol=0)


@torch.no_grad()
def test_pad_qk_is_exact_and_gives_one_head_size() -> None:
    stats = calibrate(tiny_vit(), tiny_batches(), PruneConfig(), "cpu", progress=False)
    pruned = tiny_vit()
    config = PruneConfig(round_to=4)
    prune_model(pruned, stats, config, plan_widths(pruned, config, stats))
    x = torch.randn(2, 3, 32, 32)
    reference = pruned(x)
    shapes = []
    real_sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        shapes.append((q.shape[-1], k.shape[-1], v.shape[-1]))
        return real_sdpa(q, k, v, **kw)

    assert pad_qk(pruned) == 2
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(F, "scaled_dot_product_attention", spy)
        padded = pruned(x)
    assert shapes == [(16, 16, 16)] * 2
    torch.testing.assert_close(padded, reference, rtol=1e-5, atol=1e-5)
    assert pad_qk(pruned, enable=False) == 2 and not any(b.attn.pad_qk for b in pruned.blocks)


@pytest.mark.e2e
def test_cli_prunes_all_three_with_a_v_override(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    argv = [*PRUNE, "--calib", "synthetic", "--target", "mlp,qk,v", "--v-sparsity", "0.75", "--out", str(out)]
    code, stdout, stderr = run(argv, capsys)
    assert code == 0, stderr
    assert "v kept" in stdout and "4/16" in stdout
    meta = json.loads((out / "corp.json").read_text())
    assert [(b["mlp_hidden"], b["qk_dim"], b["v_dim"]) for b in meta["structure"]] == [(64, 8, 4)] * 2
    assert corp_deploy.load_pruned(out)(torch.randn(2, 3, 32, 32)).shape == (2, 10)


@pytest.fixture(scope="module")
def variants():
    """Dense, Q/K-only pruned, equal-width pruned and Q/K-padded models of one tiny ViT at 50%."""
    dense = tiny_vit()
    stats = calibrate(dense, tiny_batches(), PruneConfig(target="all"), "cpu", progress=False)
    out = {"dense": dense}
    for name, target in (("qk_pruned", "mlp,qk"), ("equal_width", "all"), ("qk_padded", "mlp,qk")):
        out[name] = copy.deepcopy(dense)
        config = PruneConfig(target=target, round_to=4)
        prune_model(out[name], stats, config, plan_widths(out[name], config, stats))
    pad_qk(out["qk_padded"])
    return out


@torch.no_grad()
def test_sdpa_backend_on_cpu_follows_the_head_widths(variants) -> None:
    """Flash for one head size (dense, equal widths, padded Q/K); math for Q/K narrower than V."""
    from tools.gpu_suite.attention import _dispatched

    x = torch.randn(2, 3, 32, 32)
    expected = {"dense": "flash", "qk_pruned": "math", "equal_width": "flash", "qk_padded": "flash"}
    assert {name: _dispatched(lambda m=m: m(x)) for name, m in variants.items()} == expected


def test_onnx_of_equal_width_and_padded_models_matches_pytorch(variants, tmp_path) -> None:
    pytest.importorskip("onnxscript", reason="onnxscript not installed (pip install '.[onnx]')")
    from corp_deploy.exporters.compare import FP32, image_inputs, verify
    from corp_deploy.exporters.pipeline import export_verified
    from corp_deploy.exporters.runners import OrtRunner, TorchRunner
    from corp_deploy.formats.sources import describe

    sizes = {}
    for name in ("qk_pruned", "equal_width", "qk_padded"):
        model, path = variants[name], tmp_path / f"{name}.onnx"
        record = export_verified(model, path, describe(model, "tiny", {}, "random"))
        assert [(b["qk_dim"], b["v_dim"]) for b in record["structure"]] == [(8, 8 if name == "equal_width" else 16)] * 2
        for comparison in verify(
            TorchRunner(model), OrtRunner(path, "cpu"), image_inputs((3, 32, 32)), batches=(1, 3, 8)
        ):
            assert comparison.within(FP32) and comparison.top1 == 1.0, (name, comparison)
        sizes[name] = path.stat().st_size
    params = {name: sum(p.numel() for p in variants[name].parameters()) for name in sizes}
    assert sizes["qk_pruned"] - sizes["equal_width"] > 0.95 * 4 * (params["qk_pruned"] - params["equal_width"]) > 0
    assert sizes["qk_padded"] == pytest.approx(sizes["qk_pruned"], rel=0.02)  # padding adds no weights


@pytest.mark.e2e
def test_export_pad_qk_from_the_command_line(variants, tmp_path, capsys) -> None:
    """``export --pad-qk`` writes a verified graph of the Q/K-pruned artifact and says what it padded."""
    result = corp_deploy.PruneResult(variants["qk_pruned"], {})
    src = corp_deploy.save(result, tmp_path / "run", "vit_tiny_patch16_224", {**ARGS, "num_classes": 10})
    out = tmp_path / "padded.onnx"
    code, _, stderr = run(["export", str(src), "--pad-qk", "--out", str(out)], capsys)
    assert code == 0, stderr
    record = json.loads(Path(f"{out}.json").read_text())
    assert record["pad_qk_blocks"] == 2 and record["verify"]["cosine"] > 0.99999


def test_proj_statistics_merge_like_the_others() -> None:
    """Shards summed with ``+=`` (what the all-reduce of ``tensors()`` does) equal one pass over all images."""
    model, config = tiny_vit(), PruneConfig(target="all")
    whole = calibrate(model, tiny_batches(), config, "cpu", progress=False)
    shards = [calibrate(model, [b], config, "cpu", progress=False) for b in tiny_batches()]
    merged = shards[0]
    for shard in shards[1:]:
        merged += shard
    assert len(whole.tensors()) == 4 * 2 + 2 * 2 + 4 * 2  # mlp, attn and proj sums of both blocks
    assert set(whole.proj) == {0, 1} and whole.proj[0].sum.numel() == DIM
    for mine, theirs in zip(merged.tensors(), whole.tensors(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-9, atol=1e-6)
