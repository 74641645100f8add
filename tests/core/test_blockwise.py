"""Block-by-block calibration: bounded memory is the one-pass method; sequential CORP reduces to CORP and corrects.

The closed forms are checked against direct least squares on raw float64 tensors; the walk on tiny ViTs
(``helpers.tiny_vit``); data-parallel walks with 2 real gloo processes against one process.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest
import torch
from helpers import ROOT, attn_moment, correlated_activations, qk_images, split, tiny_batches, tiny_vit
from safetensors.torch import load_file

from corp_deploy import api
from corp_deploy.base.errors import CorpError
from corp_deploy.core import blockwise
from corp_deploy.core import compensation as C
from corp_deploy.core.config import PruneConfig, Widths
from corp_deploy.core.stats import MlpStats, PairStats
from corp_deploy.families import BlockCall, structure
from corp_deploy.plan import width_plan

F64 = torch.float64


def _prune(model, config: PruneConfig, batches=None, **kw):
    return api.prune(copy.deepcopy(model), batches or tiny_batches(), config, "cpu", progress=False, **kw)


# ------------------------------------------------------------------------------------- closed forms


def test_mlp_regression_reduces_to_corp_without_upstream_error() -> None:
    """x~ = x: D is 0 on the kept rows and CORP's B on the pruned ones, for a DAMPED fit (alpha > 0)."""
    x = correlated_activations(3000, 20, seed=0).to(F64)
    keep, prune = split(20, 8)
    s = MlpStats(20)
    s.update(x)
    mean, second = s.mean(), s.second_moment()
    d, c = C.regression_affine(mean, second, mean, second, keep, alpha=1e-2)
    b, c_corp = C.mlp_affine(mean, second, keep, prune, alpha=1e-2)
    assert torch.equal(d[keep], torch.zeros_like(d[keep])) and torch.equal(c[keep], torch.zeros_like(c[keep]))
    torch.testing.assert_close(d[prune], b, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(c[prune], c_corp, rtol=1e-10, atol=1e-12)

    g = torch.Generator().manual_seed(1)
    w, bias = torch.randn(5, 20, generator=g, dtype=F64), torch.randn(5, generator=g, dtype=F64)
    for got, want in zip(
        C.fold_regression(w, bias, keep, d, c), C.fold_mlp(w, bias, keep, prune, b, c_corp), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    got = C.regression_error(mean, second, mean, second, second, w, bias, keep, d, c)
    want = C.mlp_output_error(mean, second, w, bias, keep, prune, b, c_corp)
    torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-14)


def test_mlp_regression_is_least_squares_onto_dense_targets_and_its_error_is_exact() -> None:
    """With upstream error: the fit (alpha -> 0) is the direct least squares of x on [x~_S, 1]."""
    x = correlated_activations(3000, 16, seed=2).to(F64)
    g = torch.Generator().manual_seed(3)
    noisy = x + 0.3 * torch.randn(x.shape, generator=g, dtype=F64) @ torch.randn(16, 16, generator=g, dtype=F64) / 4
    keep, _ = split(16, 6)
    s = PairStats(16)
    s.update(torch.cat([x, noisy]))
    d, c = C.regression_affine(s.mean(), s.second_moment(), s.target.mean(), s.cross / s.count, keep, alpha=0.0)
    design = torch.cat([noisy[:, keep], torch.ones(len(x), 1, dtype=F64)], dim=1)
    direct = torch.linalg.lstsq(design, x).solution  # (|S| + 1, width)
    torch.testing.assert_close(C.embed_kept(torch.eye(6, dtype=F64), keep, 16) + d, direct[:-1].T, rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(c, direct[-1], rtol=1e-7, atol=1e-9)

    w, b = torch.randn(4, 16, generator=g, dtype=F64), torch.randn(4, generator=g, dtype=F64)
    new_w, new_b = C.fold_regression(w, b, keep, d, c)
    dense_out, pruned_out = x @ w.T + b, noisy[:, keep] @ new_w.T + new_b
    direct_err = ((dense_out - pruned_out) ** 2).sum() / (dense_out**2).sum()
    moments = (s.target.mean(), s.target.second_moment(), s.mean(), s.second_moment(), s.cross / s.count)
    torch.testing.assert_close(C.regression_error(*moments, w, b, keep, d, c), direct_err, rtol=1e-7, atol=1e-12)


def _logit_cross(q, k, qp, kp, keep) -> tuple[torch.Tensor, torch.Tensor]:
    """``sum_b (Q~_S^T Q)(K^T K~_S)`` and ``sum_b ||Q K^T||^2`` for head 0, directly."""
    cross = sum(qpb[:, keep].T @ qb @ kb.T @ kpb[:, keep] for qb, kb, qpb, kpb in zip(q, k, qp, kp, strict=True))
    energy = sum(((qb @ kb.T) ** 2).sum() for qb, kb in zip(q, k, strict=True))
    return cross, energy


def test_logit_regression_reduces_to_corp_without_upstream_error() -> None:
    q, k = qk_images(images=5, tokens=7, d=6, seed=0)
    q, k = q.to(F64), k.to(F64)
    keep, prune = split(6, 3)
    s = attn_moment(q, k)
    a, r = C.logit_system(s.moment[0], s.index, keep, prune)
    cross, energy = _logit_cross(q[:, :, 0], k[:, :, 0], q[:, :, 0], k[:, :, 0], keep)
    r_seq, removed = C.sequential_logit_system(a, cross, energy)
    torch.testing.assert_close(r_seq, r, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(removed, C.pair_energy(s.moment[0], s.index, prune), rtol=1e-9, atol=1e-9)


def test_logit_regression_is_least_squares_onto_dense_logits() -> None:
    """With upstream error: I + N minimises sum_b ||Q K^T - Q~_S (I + N) K~_S^T||^2 (alpha = 0), error exact."""
    q, k = qk_images(images=5, tokens=7, d=6, seed=1)
    q, k = q[:, :, 0].to(F64), k[:, :, 0].to(F64)
    g = torch.Generator().manual_seed(4)
    qp, kp = (t + 0.2 * torch.randn(t.shape, generator=g, dtype=F64) for t in (q, k))
    keep, prune = split(6, 3)
    s = attn_moment(qp[:, :, None], kp[:, :, None])  # the system comes from the PRUNED stream
    a, _ = C.logit_system(s.moment[0], s.index, keep, prune)
    r, target_energy = C.sequential_logit_system(a, *_logit_cross(q, k, qp, kp, keep))
    n = C.solve_logit_compensation(a, r, alpha=0.0)

    rows = torch.cat([torch.kron(qb[:, keep], kb[:, keep]) for qb, kb in zip(qp, kp, strict=True)])
    targets = torch.cat([(qb @ kb.T).reshape(-1) for qb, kb in zip(q, k, strict=True)])
    direct = torch.linalg.lstsq(rows, targets).solution.reshape(3, 3)
    torch.testing.assert_close(torch.eye(3, dtype=F64) + n, direct, rtol=1e-7, atol=1e-9)
    resid = sum(
        ((qb @ kb.T - qpb[:, keep] @ direct @ kpb[:, keep].T) ** 2).sum()
        for qb, kb, qpb, kpb in zip(q, k, qp, kp, strict=True)
    )
    torch.testing.assert_close(C.logit_error(a, r, target_energy, n), resid, rtol=1e-7, atol=1e-9)


# --------------------------------------------------------------------------------------------- walks


@pytest.mark.parametrize("target", ["both", "all"])
def test_bounded_memory_is_the_one_pass_method_bit_for_bit(target: str) -> None:
    """Every block sees the same dense tokens, batch by batch in the same order: the same float ops and sums."""
    model, config = tiny_vit(), PruneConfig(sparsity=0.5, target=target, round_to=4)
    one_block = blockwise.block_stats(model, config, [0], "meta").nbytes() / 2**30
    bounded = _prune(model, config, max_stats_gib=one_block)
    one_pass = _prune(model, config)
    assert bounded.report["calibration"]["groups"] == 2 and bounded.report["calibration"]["mode"] == "blockwise"
    assert bounded.report["memory"]["statistics_mib"] * 2 == pytest.approx(one_pass.report["memory"]["statistics_mib"])
    a, b = one_pass.model.state_dict(), bounded.model.state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert bounded.report["blocks"] == one_pass.report["blocks"]


def test_groups_fill_the_bound_and_bad_bounds_are_refused_before_calibration() -> None:
    model, config = tiny_vit(depth=5), PruneConfig(target="all", round_to=4)
    size = blockwise.block_stats(model, config, [0], "meta").nbytes() / 2**30
    assert blockwise.plan_groups(model, config, 2.5 * size) == [[0, 1], [2, 3], [4]]
    assert blockwise.plan_groups(model, config, None) == [[0, 1, 2, 3, 4]]
    sequential = PruneConfig(target="all", round_to=4, sequential=True)
    assert blockwise.plan_groups(model, sequential, None) == [[i] for i in range(5)]

    def never():
        raise AssertionError("calibration must not start")
        yield

    for bound, says in ((0.5 * size, "is below one block's statistics"), (0.0, "must be > 0"), (-1.0, "must be > 0")):
        with pytest.raises(CorpError, match=says) as err:
            api.prune(tiny_vit(), never(), config, "cpu", progress=False, max_stats_gib=bound)
        assert "\n" not in str(err.value)
    with pytest.raises(CorpError, match=r"in sequential mode\); pass at least") as err:
        api.prune(tiny_vit(), never(), sequential, "cpu", progress=False, max_stats_gib=size)
    need = float(str(err.value).rsplit(" ", 1)[1])
    assert need * 2**30 >= blockwise.block_stats(model, sequential, [0], "meta").nbytes()

    class NotAViT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = tiny_vit().blocks

    with pytest.raises(CorpError, match="NotAViT is not a supported model family") as err:
        api.prune(NotAViT(), never(), config, "cpu", progress=False, max_stats_gib=size)
    assert "\n" not in str(err.value)


def test_token_cache_keeps_chunks_on_the_device_while_they_fit_then_on_the_host() -> None:
    """The meta device stands in for a GPU: placement is decided per chunk against the budget, for both streams,
    and a chunk's block calls and token mask live where its tokens do."""
    chunk = torch.randn(4, 17, 64)
    call, mask = BlockCall((torch.zeros(4, 1, 17, 17),), {"rope": (torch.ones(1, 17, 8),)}), torch.ones(4, 17).bool()
    cache = blockwise.TokenCache(torch.device("meta"), streams=2, budget=2.5 * 2 * chunk.nbytes)
    for _ in range(4):
        cache.add(chunk, call, mask, paired=call)
    assert [[t.device.type for t in c.streams] for c in cache.chunks] == [["meta"] * 2] * 2 + [["cpu"] * 2] * 2
    homes = [
        [c.mask.device.type, c.call.kwargs["rope"][0].device.type, c.paired.args[0].device.type] for c in cache.chunks
    ]
    assert homes == [["meta"] * 3] * 2 + [["cpu"] * 3] * 2
    assert cache.nbytes(torch.device("meta")) == 4 * chunk.nbytes and cache.nbytes() == 8 * chunk.nbytes
    loaded = cache.load(3)  # moved over for the computation
    assert all(t.device.type == "meta" for t in [*loaded.streams, *loaded.call.args, *loaded.paired.args, loaded.mask])
    cache.store(0, 1, chunk)  # a result goes back to where its chunk lives
    assert cache.chunks[0].streams[1].device.type == "meta"
    assert cache.chunks[3].streams[0] is not cache.chunks[3].streams[1]


@pytest.mark.parametrize("target", ["both", "all"])
def test_sequential_at_sparsity_zero_reproduces_the_dense_model(target: str) -> None:
    model = tiny_vit()
    result = _prune(model, PruneConfig(sparsity=0.0, target=target, sequential=True))
    assert result.report["calibration"]["mode"] == "sequential"
    x = tiny_batches(n=8, seed=7)[0][0]
    with torch.inference_mode():
        torch.testing.assert_close(result.model.forward_features(x), model.forward_features(x), rtol=1e-6, atol=1e-6)


def test_sequential_reduces_the_final_feature_error(monkeypatch) -> None:
    """Known upstream error: block 0 keeps 16 of 128 MLP channels, block 1 keeps all 128 (per-block widths as a
    budgeted allocation would give). One-pass leaves block 1 as it is; sequential regresses its dense hidden
    activation from the pruned stream (``x ~ (I + D) x~ + c``), on the calibration images, scored on held-out ones.

    Only the part of block 0's error that reaches block 1's MLP is corrected (not the residual stream itself): ~5%.
    """
    model = tiny_vit()
    monkeypatch.setattr(width_plan, "data_free", lambda *_args: [Widths(16), Widths(128)])
    batches = tiny_batches(n=256, batch=64, seed=1)
    config = PruneConfig(sparsity=0.5, target="mlp", round_to=4)
    one_pass = _prune(model, config, batches, max_stats_gib=1.0)  # the one-pass method (bounded == one-pass)
    sequential = _prune(model, replace(config, sequential=True), batches)
    x = tiny_batches(n=64, batch=64, seed=9)[0][0]
    with torch.inference_mode():
        dense = model.forward_features(x)
        err = {
            k: float((r.model.forward_features(x) - dense).norm() / dense.norm())
            for k, r in (("one-pass", one_pass), ("sequential", sequential))
        }
    assert err["sequential"] < 0.97 * err["one-pass"], err
    first = (r.report["blocks"][0]["mlp"]["rel_error"] for r in (sequential, one_pass))
    assert next(first) == pytest.approx(next(first), rel=1e-9)  # no upstream error: the same fit (other sum order)
    block1 = sequential.report["blocks"][1]["mlp"]["rel_error"]  # against the DENSE targets, on the pruned stream
    assert block1["corp"] < 0.5 * block1["none"] and one_pass.report["blocks"][1]["mlp"]["rel_error"]["none"] == 0


def test_a_budget_with_sequential_prunes_to_the_budgets_widths() -> None:
    """Two passes: the dense statistics choose the widths (``allocation.plan_budget``), the walk prunes to them."""
    model = tiny_vit()
    config = PruneConfig(budget="macs=0.7", target="both", allocation="local", round_to=4)
    planned = _prune(model, config)
    walked = _prune(model, replace(config, sequential=True))
    assert walked.report["calibration"]["mode"] == "sequential"
    assert structure(walked.model) == structure(planned.model) != structure(model)
    assert walked.report["pruned"]["macs"] == planned.report["pruned"]["macs"] <= 0.7 * planned.report["dense"]["macs"]


def test_a_budget_is_refused_with_bounded_memory_before_calibration() -> None:
    def never():
        raise AssertionError("calibration started")
        yield

    with pytest.raises(CorpError, match="--budget compares every block's statistics at once; drop --max-stats-gib"):
        api.prune(tiny_vit(), never(), PruneConfig(budget="macs=0.7"), "cpu", progress=False, max_stats_gib=1.0)


WORKER = """
import sys
sys.path[:0] = [{root!r}, {tests!r}]
import torch
from safetensors.torch import save_file
from helpers import tiny_batches, tiny_vit
from corp_deploy import api
from corp_deploy.core import distributed
from corp_deploy.core.config import PruneConfig

world = distributed.SINGLE_PROCESS
if distributed.launched():
    world, _ = distributed.init(torch.device("cpu"), 300)
batches = distributed.shard(tiny_batches(n=40, batch=4), world)  # uneven: 10 batches over the ranks
for name, config, bound in (
    ("sequential", PruneConfig(sparsity=0.5, target="all", round_to=4, sequential=True), None),
    ("bounded", PruneConfig(sparsity=0.5, target="both", round_to=4), 1e-3),  # one block per group
):
    result = api.prune(tiny_vit(), batches, config, "cpu", progress=False, world=world, max_stats_gib=bound)
    assert (result is None) == (world.rank != 0)
    if result is not None:
        assert result.report["calibration"]["images"] == 40
        save_file(result.model.state_dict(), sys.argv[1] + "-" + name + ".safetensors")
distributed.finish()
"""


def test_two_gloo_processes_walk_like_one(tmp_path, monkeypatch) -> None:
    """Each rank caches its shard; per-block sums are all-reduced and every rank prunes each block the same way."""
    script = tmp_path / "worker.py"
    source = textwrap.dedent(WORKER.format(root=str(ROOT), tests=str(ROOT / "tests")))
    script.write_text(source)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    argv = [*torchrun, str(script), str(tmp_path / "two")]
    done = subprocess.run(
        argv, cwd=ROOT, env=env | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=420
    )
    assert done.returncode == 0, done.stderr
    # The same script as one process, here (no fresh process's imports): one thread, as OMP_NUM_THREADS=1 gives.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", [str(script), str(tmp_path / "one")])
    monkeypatch.setattr(sys, "path", list(sys.path))
    torch.set_num_threads(1)  # the autouse _torch_threads fixture restores the count
    exec(compile(source, str(script), "exec"), {"__name__": "__main__"})
    for name in ("sequential", "bounded"):
        a, b = (load_file(str(tmp_path / f"{run}-{name}.safetensors")) for run in ("one", "two"))
        assert sorted(a) == sorted(b)
        for key in a:  # shard sums added in another order: equal to float64 round-off, then cast to float32
            torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")
