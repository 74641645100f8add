"""Which channels are kept: every ranker, MLP and Q/K, and ``--target`` alone.

Every other comparison in the suite uses the same ranking on both sides, so a ranking that kept the
wrong channels would pass there. Here the right kept set is known independently: from hand-built
statistics whose top-k differs for every ranker (and for energy / magnitude, the classic slip), and
from a real calibration pass whose activations the test captures and ranks itself. The kept set is
read back from the pruned weights: fc1 keeps rows, and with plain removal the pruned Q/K reproduce
exactly the kept dimensions' logits, ``q_S k_S^T``.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from helpers import PRUNE, TINY_CLI_ARGS, channel_sums, run, tiny_batches, tiny_vit
from safetensors.torch import save_file
from timm.models.vision_transformer import Attention

import corp_deploy
from corp_deploy.core.config import PruneConfig
from corp_deploy.core.pruner import calibrate, prune_model
from corp_deploy.core.ranking import RANKERS, channel_scores, split_top
from corp_deploy.core.stats import ACTIVE_EPS, CalibrationStats, MlpStats, QKStats
from corp_deploy.families.timm.surgery import PrunedAttention
from corp_deploy.plan.width_plan import plan_widths


def test_split_top_keeps_the_highest_scores_in_index_order() -> None:
    keep, prune = split_top(torch.tensor([0.1, 5.0, 3.0, 7.0, -1.0, 2.0]), 3)
    assert keep.tolist() == [1, 2, 3] and prune.tolist() == [0, 4, 5]
    per_head = torch.tensor([[1.0, 4.0, 2.0, 3.0], [9.0, 0.0, 8.0, 1.0]])
    keep, prune = split_top(per_head, 2)
    assert keep.tolist() == [[1, 3], [0, 2]] and prune.tolist() == [[0, 2], [1, 3]]
    keep, _ = split_top(torch.ones(5), 2)  # ties: the lower index wins, every time
    assert keep.tolist() == [0, 1]


# Eight hidden channels, four kept. Each ranker's top four differs from every other's, and from
# energy / magnitude, by a clear margin (no near-ties at the cut).
ENERGY = [4.0, 0.5, 2.0, 0.25, 8.0, 1.0, 16.0, 32.0]
MAGNITUDE = [1.5, 6.0, 4.0, 2.0, 8.0, 0.5, 1.0, 3.0]
ACTIVE = [10, 3, 1, 7, 9, 2, 6, 5]  # active tokens out of 10
MLP_KEPT = {"energy": [0, 4, 6, 7], "magnitude": [1, 2, 4, 7], "combined": [2, 4, 6, 7], "active": [0, 3, 4, 6]}
WRONG_COMBINED = [0, 5, 6, 7]  # the top four of energy / magnitude


def test_mlp_rankers_score_as_documented() -> None:
    energy, magnitude = torch.tensor(ENERGY, dtype=torch.float64), torch.tensor(MAGNITUDE, dtype=torch.float64)
    w2 = torch.randn(5, 8, dtype=torch.float64)
    w2 = w2 / w2.norm(dim=0) * magnitude
    active = torch.tensor(ACTIVE, dtype=torch.float64) / 10
    for ranker, kept in MLP_KEPT.items():
        scores = channel_scores(ranker, channel_sums(energy, active, torch.zeros(8, dtype=torch.float64)), w2)
        assert split_top(scores, 4)[0].tolist() == kept, ranker
    mean = torch.tensor([1.9, 0, 0, 0, 2.8, 0, 3.9, 5.65], dtype=torch.float64)  # var 0.39, .16, .79, .0775
    assert split_top(channel_scores("variance", channel_sums(energy, active, mean), w2), 4)[0].tolist() == [1, 2, 5, 6]
    assert split_top(energy / magnitude, 4)[0].tolist() == WRONG_COMBINED  # the test can tell them apart


def test_variance_ranks_by_spread_not_offset() -> None:
    """VBP's criterion through the real pruner: a channel with a large constant offset carries energy but no
    information (mean shift restores it), so ``variance`` drops it where ``energy`` keeps it."""
    model = tiny_vit(embed_dim=16, num_heads=2, mlp_ratio=0.5, depth=1)  # 8 hidden channels
    g = torch.Generator().manual_seed(0)
    offset = torch.tensor([20.0, 0, 0, 0, 15.0, 0, 0, 0], dtype=torch.float64)
    spread = torch.tensor([0.1, 3.0, 1.0, 2.0, 0.1, 0.5, 4.0, 0.2], dtype=torch.float64)
    stats = MlpStats(8)
    stats.update(offset + spread * torch.randn(4000, 8, generator=g, dtype=torch.float64))
    kept = {}
    for ranker in ("energy", "variance"):
        pruned = copy.deepcopy(model)
        config = PruneConfig(sparsity=0.5, target="mlp", ranker=ranker, compensation="mean", round_to=1)
        prune_model(pruned, CalibrationStats(mlp={0: stats}, samples=1), config, plan_widths(pruned, config))
        rows = pruned.blocks[0].mlp.fc1.weight
        kept[ranker] = [i for i in range(8) if any(torch.equal(r, model.blocks[0].mlp.fc1.weight[i]) for r in rows)]
    assert kept["variance"] == [1, 2, 3, 6]
    assert kept["energy"] == [0, 1, 4, 6]  # the offsets win on energy


def _hand_built_tokens(width: int = 8, tokens: int = 10) -> torch.Tensor:
    """Channel j is non-zero on ACTIVE[j] of 10 tokens, with E[x_j^2] = ENERGY[j] exactly."""
    x = torch.zeros(tokens, width, dtype=torch.float64)
    for j, (energy, active) in enumerate(zip(ENERGY, ACTIVE, strict=True)):
        amplitude = (energy * tokens / active) ** 0.5
        x[:active, j] = amplitude * torch.tensor([1.0, -1.0] * tokens)[:active]
    return x


def _hand_built_mlp_stats() -> MlpStats:
    x = _hand_built_tokens()
    stats = MlpStats(x.shape[1])
    stats.update(x)
    torch.testing.assert_close(stats.second_moment().diagonal(), torch.tensor(ENERGY, dtype=torch.float64))
    return stats


HAND_BUILT = [r for r in RANKERS if r not in ("variance", "obs")]
"""The hand-built channels have (nearly) zero means, where variance ranks as energy: it has its own test; obs ranks by
the compensated error, not a per-channel score (tests/core/test_obs.py)."""


@pytest.mark.parametrize("ranker", HAND_BUILT)
def test_pruner_keeps_the_mlp_channels_each_ranker_prefers(ranker) -> None:
    """Hand-built statistics through the real pruner: fc1 must keep exactly the rows of the expected set."""
    model = tiny_vit(embed_dim=16, num_heads=2, mlp_ratio=0.5, depth=1)  # 8 hidden channels
    with torch.no_grad():
        w2 = model.blocks[0].mlp.fc2.weight
        w2.copy_(w2 / w2.norm(dim=0) * torch.tensor(MAGNITUDE))
    stats = CalibrationStats(mlp={0: _hand_built_mlp_stats()}, samples=1)
    pruned = copy.deepcopy(model)
    config = PruneConfig(sparsity=0.5, target="mlp", ranker=ranker, round_to=1)
    prune_model(pruned, stats, config, plan_widths(pruned, config, stats))
    kept = MLP_KEPT[ranker]
    assert torch.equal(pruned.blocks[0].mlp.fc1.weight, model.blocks[0].mlp.fc1.weight[kept])
    assert torch.equal(pruned.blocks[0].mlp.fc1.bias, model.blocks[0].mlp.fc1.bias[kept])


@pytest.mark.parametrize("ranker", HAND_BUILT)
@torch.no_grad()
def test_pruner_keeps_the_v_channels_each_ranker_prefers_within_every_head(ranker) -> None:
    """Two heads of eight V channels at proj's input: head 0 is the MLP case, head 1 the same channels
    reversed with 100x the energy and magnitude. Every head keeps four: a global top-8 would take
    head 1 only, and per-head ranks must follow the ranker as for the MLP."""
    model = tiny_vit(embed_dim=16, num_heads=2, depth=1)  # 2 heads of 8 dims, proj 16 -> 16
    tokens = _hand_built_tokens()
    stats = MlpStats(16)
    stats.update(torch.cat([tokens, 10 * tokens.flip(1)], dim=1))
    magnitude = torch.tensor(MAGNITUDE)
    w = model.blocks[0].attn.proj.weight
    w.copy_(w / w.norm(dim=0) * torch.cat([magnitude, 100 * magnitude.flip(0)]))
    pruned = copy.deepcopy(model)
    config = PruneConfig(target="v", ranker=ranker, round_to=1)
    prune_model(pruned, CalibrationStats(proj={0: stats}, samples=1), config, plan_widths(pruned, config))
    kept = MLP_KEPT[ranker]
    expected = kept + sorted(8 + 7 - j for j in kept)
    attn = pruned.blocks[0].attn
    assert isinstance(attn, PrunedAttention) and (attn.qk_dim, attn.v_dim) == (8, 4)
    dense_qkv = model.blocks[0].attn.qkv
    assert torch.equal(attn.qkv.weight[32:], dense_qkv.weight[32:][expected])
    assert torch.equal(attn.qkv.bias[32:], dense_qkv.bias[32:][expected])
    assert torch.equal(attn.qkv.weight[:32], dense_qkv.weight[:32])  # Q/K untouched


# Two heads of eight Q/K dims, four kept per head. Logit energy and weight magnitude disagree.
LOGIT_ENERGY = [[9.0, 1.0, 4.0, 16.0, 0.5, 2.0, 25.0, 0.25], [1.0, 36.0, 2.0, 9.0, 49.0, 0.5, 4.0, 64.0]]
QK_MAGNITUDE = [[4.0, 3.0, 0.5, 1.0, 6.0, 5.0, 0.25, 2.0], [0.5, 1.0, 8.0, 2.0, 0.25, 6.0, 4.0, 3.0]]
QK_KEPT = {"logit energy": [[0, 2, 3, 6], [1, 3, 4, 7]], "magnitude": [[0, 1, 4, 5], [2, 5, 6, 7]]}


def _hand_built_attn_stats(images: int = 3, tokens: int = 5) -> QKStats:
    """q_j = s_j z, k_j = t_j z' with z, z' = +-1, so sum_b ||q_j||^2 ||k_j||^2 is proportional to (s_j t_j)^2."""
    g = torch.Generator().manual_seed(0)
    sign = lambda: torch.randint(0, 2, (images, tokens, 2, 8), generator=g).double() * 2 - 1  # noqa: E731
    root = torch.tensor(LOGIT_ENERGY, dtype=torch.float64).sqrt()
    stats = QKStats(heads=2, head_dim=8)
    stats.update(sign() * root.sqrt(), sign() * root.sqrt())
    return stats


def _qk(model: torch.nn.Module, x: torch.Tensor, heads: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head (heads, tokens, d) queries and keys of block 0's qkv on tokens ``x``."""
    out = model.blocks[0].attn.qkv(x)
    q = out[..., : heads * d].unflatten(-1, (heads, d)).transpose(0, 1)
    k = out[..., heads * d : 2 * heads * d].unflatten(-1, (heads, d)).transpose(0, 1)
    return q, k


@pytest.mark.parametrize("ranker", RANKERS)
@torch.no_grad()
def test_pruner_keeps_the_qk_dims_each_ranker_prefers(ranker) -> None:
    model = tiny_vit(embed_dim=16, num_heads=2, depth=1)  # 2 heads of 8 dims
    qkv = model.blocks[0].attn.qkv
    w = qkv.weight.view(3, 2, 8, 16)
    w[:2] = w[:2] / w[:2].norm(dim=-1, keepdim=True) * torch.tensor(QK_MAGNITUDE).sqrt()[..., None]
    stats = CalibrationStats(qk={0: _hand_built_attn_stats()}, samples=3)
    pruned = copy.deepcopy(model)
    config = PruneConfig(sparsity=0.5, target="attn", ranker=ranker, compensation="none", round_to=1)
    prune_model(pruned, stats, config, plan_widths(pruned, config, stats))
    assert isinstance(pruned.blocks[0].attn, PrunedAttention) and pruned.blocks[0].attn.qk_dim == 4

    x = torch.randn(7, 16)
    q, k = _qk(model, x, 2, 8)
    q_p, k_p = _qk(pruned, x, 2, 4)
    kept = QK_KEPT["magnitude" if ranker == "magnitude" else "logit energy"]
    for h, dims in enumerate(kept):
        expected = q[h][:, dims] @ k[h][:, dims].T
        torch.testing.assert_close(q_p[h] @ k_p[h].T, expected, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------- a real calibration pass, ranked here


@pytest.fixture(scope="module")
def calibrated():
    """A dense tiny ViT (ReLU, so channels differ in how often they are active), its statistics, and
    what the test captured from the same pass: fc2 inputs and qkv inputs of every block."""
    model = tiny_vit(act_layer=torch.nn.ReLU)
    batches = tiny_batches()
    captured: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for i, block in enumerate(model.blocks):
        for name, module in ((f"fc2.{i}", block.mlp.fc2), (f"qkv.{i}", block.attn.qkv)):
            hooks.append(
                module.register_forward_pre_hook(lambda _m, args, n=name: captured.setdefault(n, []).append(args[0]))
            )
    stats = calibrate(model, batches, PruneConfig(), "cpu", progress=False)
    for h in hooks:
        h.remove()
    return model, stats, {k: torch.cat(v) for k, v in captured.items()}


def _expected_mlp_keep(ranker: str, x: torch.Tensor, w2: torch.Tensor, kept: int) -> list[int]:
    x = x.reshape(-1, x.shape[-1]).double()
    scores = {
        "energy": (x**2).mean(0),
        "magnitude": w2.double().norm(dim=0),
        "combined": (x**2).mean(0) * w2.double().norm(dim=0),
        "active": (x.abs() > ACTIVE_EPS).double().mean(0),
        "variance": x.var(0, correction=0),
    }[ranker]
    order = torch.sort(scores, descending=True, stable=True)
    assert order.values[kept - 1] > order.values[kept]  # a clear cut, so the check can fail
    return order.indices[:kept].sort().values.tolist()


@pytest.mark.parametrize("ranker", [r for r in RANKERS if r != "obs"])  # obs: no per-channel score (test_obs.py)
@torch.no_grad()
def test_real_pass_keeps_the_top_mlp_channels(calibrated, ranker) -> None:
    model, stats, captured = calibrated
    pruned = copy.deepcopy(model)
    config = PruneConfig(sparsity=0.5, target="mlp", ranker=ranker, round_to=4)
    prune_model(pruned, stats, config, plan_widths(pruned, config, stats))
    for i, block in enumerate(model.blocks):
        keep = _expected_mlp_keep(ranker, captured[f"fc2.{i}"], block.mlp.fc2.weight, 64)
        assert torch.equal(pruned.blocks[i].mlp.fc1.weight, block.mlp.fc1.weight[keep]), (ranker, i)


def _heads(t: torch.Tensor, heads: int = 4) -> torch.Tensor:
    """(images, tokens, heads * d) -> (images, heads, tokens, d)."""
    return t.unflatten(-1, (heads, -1)).transpose(1, 2)


def _take(t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Dims ``keep[h]`` of every head: (images, heads, tokens, d) -> (images, heads, tokens, kept)."""
    index = keep[None, :, None, :].expand(t.shape[0], -1, t.shape[2], -1)
    return t.gather(-1, index)


@pytest.mark.parametrize("ranker", ["combined", "magnitude"])
@torch.no_grad()
def test_real_pass_keeps_the_top_qk_dims_and_attention_keeps_the_original_scale(calibrated, ranker) -> None:
    """With plain removal the pruned block computes softmax(q_S k_S^T / sqrt(d)) v exactly, d the ORIGINAL width."""
    model, stats, captured = calibrated
    pruned = copy.deepcopy(model)
    config = PruneConfig(sparsity=0.5, target="attn", ranker=ranker, compensation="none", round_to=4)
    prune_model(pruned, stats, config, plan_widths(pruned, config, stats))
    for i, block in enumerate(model.blocks):
        x = captured[f"qkv.{i}"]  # the dense block's normed input, (images, tokens, 64)
        q, k, v = (_heads(t) for t in block.attn.qkv(x).chunk(3, dim=-1))
        if ranker == "magnitude":
            w = block.attn.qkv.weight.double().unflatten(0, (3, 4, 16))
            scores = w[0].norm(dim=-1) * w[1].norm(dim=-1)
        else:
            scores = ((q.double() ** 2).sum(2) * (k.double() ** 2).sum(2)).sum(0)  # sum_b ||q_j||^2 ||k_j||^2
        order = torch.sort(scores, dim=-1, descending=True, stable=True)
        assert (order.values[:, 7] > order.values[:, 8]).all()
        keep = order.indices[:, :8].sort(dim=-1).values
        q_s, k_s = _take(q, keep), _take(k, keep)
        attn = pruned.blocks[i].attn
        q_p, k_p, _ = attn.qkv(x).split([32, 32, 64], dim=-1)
        torch.testing.assert_close(
            _heads(q_p) @ _heads(k_p).transpose(-1, -2), q_s @ k_s.transpose(-1, -2), rtol=1e-4, atol=1e-4
        )
        assert attn.scale == pytest.approx(16**-0.5)
        expected = F.softmax(q_s @ k_s.transpose(-1, -2) * 16**-0.5, dim=-1) @ v
        expected = block.attn.proj(expected.transpose(1, 2).flatten(2))
        torch.testing.assert_close(attn(x), expected, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------ --target alone


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "dense.safetensors"
    save_file(tiny_vit().state_dict(), str(path))
    return path


@pytest.mark.parametrize("target", ["mlp", "attn"])
@torch.no_grad()
@pytest.mark.e2e
def test_target_prunes_only_its_part_end_to_end(checkpoint, tmp_path, capsys, target) -> None:
    out = tmp_path / "run"
    argv = ["prune", "deit_tiny", "--checkpoint", str(checkpoint), *TINY_CLI_ARGS, *PRUNE[PRUNE.index("--round-to") :]]
    code, _, stderr = run([*argv, "--calib", "synthetic", "--target", target, "--out", str(out)], capsys)
    assert code == 0, stderr
    meta = json.loads((out / "corp.json").read_text())
    part = {"mlp": "mlp", "attn": "qk"}[target]  # attn: the older spelling of qk, recorded as qk
    assert meta["report"]["config"]["target"] == part
    widths = {"mlp": (64, 16), "qk": (128, 8)}[part]
    assert [(b["mlp_hidden"], b["qk_dim"]) for b in meta["structure"]] == [widths] * 2
    assert all(set(b) == {"block", part} for b in meta["report"]["blocks"])

    dense, pruned = tiny_vit(), corp_deploy.load_pruned(out)
    for d, p in zip(dense.blocks, pruned.blocks, strict=True):
        if target == "mlp":  # attention untouched, bit for bit; fc1 keeps a subset of the dense rows
            assert isinstance(p.attn, Attention) and not isinstance(p.attn, PrunedAttention)
            assert torch.equal(p.attn.qkv.weight, d.attn.qkv.weight)
            rows = (p.mlp.fc1.weight[:, None, :] == d.mlp.fc1.weight[None]).all(-1)
            assert (rows.sum(1) == 1).all()
        else:  # MLP untouched, bit for bit; V rows of qkv untouched
            assert isinstance(p.attn, PrunedAttention)
            for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
                assert torch.equal(p.mlp.get_parameter(name), d.mlp.get_parameter(name)), name
            assert torch.equal(p.attn.qkv.weight[64:], d.attn.qkv.weight[128:])
