"""Greedy OBS channel selection (``corp_deploy.core.obs``, ``--ranker obs``): its error is compensation's, its
greedy steps are the brute-force greedy steps, it beats the paper's diagonal ranker on tiny layers, and it prunes
real models."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from helpers import TEXT_VOCAB, TINY, channel_sums, run, tiny_batches, tiny_text_folder, tiny_vit
from torch import Tensor

import corp_deploy
from corp_deploy.base.errors import CorpError
from corp_deploy.core import compensation as C
from corp_deploy.core import obs
from corp_deploy.core.config import PruneConfig, Widths
from corp_deploy.core.pruner import calibrate, prune_model
from corp_deploy.core.ranking import channel_scores, split_top, value_scores
from corp_deploy.core.stats import MlpStats
from corp_deploy.plan.allocation import error_curves

F64 = torch.float64


def layer(seed: int, n: int = 8, out: int = 5, tokens: int = 64) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Correlated tokens (tokens x n) with a non-zero mean, a reading weight (out x n): (x, w, E[x], E[x x^T])."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, n, generator=g, dtype=F64) @ torch.randn(n, n, generator=g, dtype=F64)
    x = x + torch.randn(n, generator=g, dtype=F64)
    w = torch.randn(out, n, generator=g, dtype=F64)
    return x, w, x.mean(0), x.T @ x / tokens


def split(n: int, prune: list[int] | Tensor) -> tuple[Tensor, Tensor]:
    prune = sorted(int(p) for p in prune)
    return torch.tensor([i for i in range(n) if i not in prune]), torch.tensor(prune, dtype=torch.long)


def compensated(mean: Tensor, second: Tensor, w: Tensor, keep: Tensor, prune: Tensor, alpha: float = 0.0) -> float:
    """compensation.py's closed-form output error of CORP's fit for this kept set, absolute (not relative)."""
    b = torch.zeros(w.shape[0], dtype=F64)
    fit = C.mlp_affine(mean, second, keep, prune, alpha)
    return float(C.mlp_output_error(mean, second, w, b, keep, prune, *fit) * C.output_energy(mean, second, w, b))


def best_subset(mean: Tensor, second: Tensor, w: Tensor, removed: int) -> float:
    n = mean.numel()
    return min(compensated(mean, second, w, *split(n, p)) for p in itertools.combinations(range(n), removed))


def test_error_is_compensations_and_a_direct_refit() -> None:
    """At every width, the greedy's running error is compensation.py's closed form for the removed set, and the
    error of refitting the removed channels from the kept ones (and a constant) by least squares on the tokens."""
    x, w, mean, second = layer(0)
    order, errors = obs.removal_order(mean, second, w, 0.0)
    assert sorted(order.tolist()) == list(range(8))
    for t in range(1, 8):
        keep, prune = split(8, order[:t])
        design = torch.cat([x[:, keep], torch.ones(len(x), 1, dtype=F64)], 1)
        fit = torch.linalg.lstsq(design, x[:, prune]).solution
        direct = float(((x[:, prune] - design @ fit) @ w[:, prune].T).square().sum(1).mean())
        assert float(errors[t - 1]) == pytest.approx(compensated(mean, second, w, keep, prune), rel=1e-9)
        assert float(errors[t - 1]) == pytest.approx(direct, rel=1e-9)


def test_damped_error_is_the_ridge_fit_on_noisy_inputs() -> None:
    """With damping, the greedy minimises the ridge fit's error on inputs plus white noise of variance lam: the same B
    as compensation's ridge at the matching alpha, and the clean error plus ``lam (||W_P||^2 + ||W_P B||^2)``."""
    _, w, mean, second = layer(1)
    alpha = 1e-2
    order, errors = obs.removal_order(mean, second, w, alpha)
    cov = second - torch.outer(mean, mean)
    lam = alpha * float(cov.diagonal().mean())
    noisy = second + lam * torch.eye(8, dtype=F64)
    for t in range(1, 8):
        keep, prune = split(8, order[:t])
        b_noisy, _ = C.mlp_affine(mean, noisy, keep, prune, 0.0)
        b_ridge, _ = C.mlp_affine(mean, second, keep, prune, lam / float(cov[keep][:, keep].diagonal().mean()))
        torch.testing.assert_close(b_noisy, b_ridge, rtol=1e-9, atol=1e-12)
        assert float(errors[t - 1]) == pytest.approx(compensated(mean, noisy, w, keep, prune), rel=1e-9)
        w_p = w[:, prune]
        clean = compensated(mean, second, w, keep, prune, lam / float(cov[keep][:, keep].diagonal().mean()))
        penalty = lam * float(w_p.square().sum() + (w_p @ b_ridge).square().sum())
        assert float(errors[t - 1]) == pytest.approx(clean + penalty, rel=1e-9)


@pytest.mark.parametrize("lazy", [1, 3, 128])
def test_every_step_is_the_brute_force_greedy_step(lazy: int) -> None:
    """Each step removes the channel whose removal (with a fresh fit of the rest) costs least, and its gain is that
    cost: the downdated inverse and Gram (applied every step with lazy=1, deferred otherwise) are the fresh ones."""
    _, w, mean, second = layer(2, n=10, out=6)
    kinv = obs.damped_inverse(second - torch.outer(mean, mean), 0.0)
    units = torch.arange(10)[:, None]
    order, gains = obs.greedy_removal(kinv, w.T @ w, units, torch.zeros(10, dtype=torch.long), lazy=lazy)
    removed: list[int] = []
    before = 0.0
    for q, gain in zip(order.tolist(), gains.tolist(), strict=True):
        costs = {
            j: compensated(mean, second, w, *split(10, [*removed, j])) if len(removed) < 9 else float("nan")
            for j in range(10)
            if j not in removed
        }
        if len(removed) < 9:
            assert min(costs, key=costs.get) == q
            assert before + gain == pytest.approx(costs[q], rel=1e-8)
            before = costs[q]
        removed.append(q)


def test_greedy_is_optimal_on_uncorrelated_channels() -> None:
    """Channels with zero sample covariance cannot predict each other: the error of a removed set is the sum of its
    channels' ``var_j ||W_j||^2``, so removing the cheapest ones one by one is the best subset."""
    g = torch.Generator().manual_seed(3)
    q, _ = torch.linalg.qr(torch.randn(40, 9, generator=g, dtype=F64))
    q = q[:, 1:] - q[:, 1:].mean(0)  # centred, orthogonal columns: exactly uncorrelated
    x = q * torch.rand(8, generator=g, dtype=F64) * 5 + torch.randn(8, generator=g, dtype=F64)
    w = torch.randn(5, 8, generator=g, dtype=F64)
    mean, second = x.mean(0), x.T @ x / len(x)
    order, errors = obs.removal_order(mean, second, w, 0.0)
    assert float(errors[2]) == pytest.approx(best_subset(mean, second, w, 3), rel=1e-9)


def test_beats_the_diagonal_ranker_on_random_layers() -> None:
    """On 50 random correlated layers (8 channels, remove 3) against the best of all 56 subsets. Greedy is not
    optimal (ratios up to 3.6 here) and loses to the paper's energy x magnitude on 4 of them, but it is optimal on
    29, no worse on 46, and its mean excess over the optimum is a quarter of the diagonal ranker's."""
    ratio_obs, ratio_diag, no_worse, optimal = [], [], 0, 0
    for seed in range(50):
        _, w, mean, second = layer(seed)
        best = best_subset(mean, second, w, 3)
        greedy = compensated(
            mean, second, w, *split_top(obs.rank_scores(obs.removal_order(mean, second, w, 0.0)[0]), 5)
        )
        diag_scores = channel_scores("combined", channel_sums(second.diagonal(), torch.ones(8, dtype=F64), mean), w)
        diagonal = compensated(mean, second, w, *split_top(diag_scores, 5))
        ratio_obs.append(greedy / best)
        ratio_diag.append(diagonal / best)
        no_worse += greedy <= diagonal * (1 + 1e-9)
        optimal += greedy <= best * (1 + 1e-9)
    assert max(ratio_obs) > 1.5  # greedy is a heuristic: the assertions below are not vacuous
    assert optimal >= 25 and no_worse >= 45
    mean_obs, mean_diag = sum(ratio_obs) / 50, sum(ratio_diag) / 50
    assert mean_obs - 1 < (mean_diag - 1) / 3, (mean_obs, mean_diag)


def test_value_units_keep_equal_counts_per_kv_head() -> None:
    """V: a unit is one channel of a K/V head in all its query heads; every K/V head loses one unit per round, so
    the top-k scores of every head are the kept set at width k, and query heads of a group keep the same channels."""
    heads, group, d = 4, 2, 3
    x, _, _, _ = layer(4, n=heads * d, tokens=200)
    s = MlpStats(heads * d)
    s.update(x)
    w = torch.randn(7, heads * d, generator=torch.Generator().manual_seed(5), dtype=F64)
    scores = value_scores("obs", s, w, heads, group, 1e-3)
    assert scores.shape == (heads // group, d)
    order = torch.sort(scores.flatten(), descending=True).indices
    # removal goes round by round: the last 2 units removed are one from each K/V head, and so on
    owner = order // d
    for r in range(d):
        assert sorted(owner[2 * r : 2 * r + 2].tolist()) == [0, 1]
    units, kv = obs.value_units(heads, group, d)
    assert units.tolist()[:4] == [[0, 3], [1, 4], [2, 5], [6, 9]]
    assert kv.tolist() == [0, 0, 0, 1, 1, 1]


def test_budget_curves_read_the_obs_sets_errors() -> None:
    """A budget's MLP curve is greedy OBS's own running error at every width, and its V curve the error the pruner
    reports when it keeps OBS's V channels at that width (ridge-free, as every curve:
    ``compensation.affine_errors``)."""
    model = tiny_vit()
    config = PruneConfig(target="mlp,v", ranker="obs", ridge=0.0)
    stats = calibrate(model, tiny_batches(), config, "cpu", progress=False)
    curves = error_curves(model, stats, config, frozenset({"mlp", "v"}))
    s, fc2 = stats.mlp[1], model.blocks[1].mlp.fc2
    w, b = fc2.weight.detach().double(), fc2.bias.detach().double()
    _, running = obs.removal_order(s.mean(), s.second_moment(), w, 0.0)
    energy = float(C.output_energy(s.mean(), s.second_moment(), w, b))
    widths, curve = curves[(1, "mlp")]
    for k, err in zip(widths[1:], curve[1:], strict=True):
        assert err == pytest.approx(float(running[w.shape[1] - k - 1]) / energy, rel=1e-6), k
    widths, curve = curves[(1, "v")]
    for k, err in zip(widths[1:], curve[1:], strict=True):
        report = prune_model(copy.deepcopy(model), stats, config, [Widths(), Widths(v=k)])
        assert err == pytest.approx(report[1]["v"]["rel_error"]["corp"], rel=1e-6), k


def test_obs_refuses_what_it_does_not_model() -> None:
    with pytest.raises(CorpError, match="--ranker obs"):
        PruneConfig(ranker="obs", compensation="mean")
    with pytest.raises(CorpError, match="--ranker obs"):
        PruneConfig(ranker="obs", selection="global", target="mlp")


def duplicate_channels(fc1: torch.nn.Linear, fc2: torch.nn.Linear) -> None:
    """The second half of the hidden channels copies the first (fc1 rows and bias; fc2 columns): the diagonal
    score ties every pair and keeps pairs whole, where a kept twin predicts its copy exactly."""
    half = fc1.out_features // 2
    with torch.no_grad():
        fc1.weight[half:] = fc1.weight[:half]
        fc1.bias[half:] = fc1.bias[:half]
        fc2.weight[:, half:] = fc2.weight[:, :half]


def duplicate_values(qkv: torch.nn.Linear, proj: torch.nn.Linear, heads: int) -> None:
    """``duplicate_channels`` for V in a timm attention: each head's second half of V channels copies its first."""
    dim = proj.in_features
    d = dim // heads
    with torch.no_grad():
        for h in range(heads):
            first, second = slice(h * d, h * d + d // 2), slice(h * d + d // 2, (h + 1) * d)
            qkv.weight[2 * dim + second.start : 2 * dim + second.stop] = qkv.weight[
                2 * dim + first.start : 2 * dim + first.stop
            ]
            qkv.bias[2 * dim + second.start : 2 * dim + second.stop] = qkv.bias[
                2 * dim + first.start : 2 * dim + first.stop
            ]
            proj.weight[:, second] = proj.weight[:, first]


def relative_error(model: torch.nn.Module, dense: torch.nn.Module, inputs) -> float:
    with torch.no_grad():
        a, b = model(inputs), dense(inputs)
    a, b = (t.last_hidden_state if hasattr(t, "last_hidden_state") else t for t in (a, b))
    return float((a - b).square().sum() / b.square().sum())


@torch.no_grad()
def test_vit_prunes_saves_and_reloads_with_obs(tmp_path) -> None:
    args = dict(TINY)
    dense = corp_deploy.create_model("deit_tiny", weights="random", model_args=args)
    for block in dense.blocks:
        duplicate_channels(block.mlp.fc1, block.mlp.fc2)
        duplicate_values(block.attn.qkv, block.attn.proj, TINY["num_heads"])
    held_out = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(9))
    errors = {}
    for ranker in ("combined", "obs"):
        config = PruneConfig(sparsity=0.5, round_to=4, target="mlp,v", ranker=ranker)
        result = corp_deploy.prune(copy.deepcopy(dense), tiny_batches(), config, device="cpu", progress=False)
        out = corp_deploy.save(result, tmp_path / ranker, "deit_tiny_patch16_224", args, weights="random")
        loaded = corp_deploy.load_pruned(out)
        torch.testing.assert_close(loaded(held_out), result.model(held_out), rtol=0, atol=0)
        errors[ranker] = relative_error(loaded, dense, held_out)
    assert errors["obs"] < errors["combined"] / 10, errors


@pytest.mark.e2e
def test_bert_prunes_and_reloads_with_obs_from_the_cli(tmp_path, capsys) -> None:
    import transformers

    folder = tiny_text_folder(tmp_path)
    dense = transformers.AutoModel.from_pretrained(folder).eval()
    for layer_ in dense.encoder.layer:
        duplicate_channels(layer_.intermediate.dense, layer_.output.dense)
    dense.save_pretrained(folder)
    g = torch.Generator().manual_seed(11)
    held_out = torch.randint(5, len(TEXT_VOCAB), (6, 20), generator=g)
    errors = {}
    for ranker in ("combined", "obs"):
        out = tmp_path / ranker
        argv = ["prune", str(folder), "--calib", "synthetic", "--target", "mlp", "--sparsity", "0.5", "--seq-len", "32"]
        argv += ["--round-to", "4", "--quiet", "--num-calib", "8", "--calib-batch-size", "4", "--ranker", ranker]
        code, _, stderr = run([*argv, "--out", str(out)], capsys)
        assert code == 0, stderr
        errors[ranker] = relative_error(corp_deploy.load_pruned(out).eval(), dense, held_out)
    assert errors["obs"] < errors["combined"] / 10, errors
