"""Blocks run by the core itself on ``transformers`` text models, from block 0's captured call: the block-by-block
walk (``blockwise``: bounded memory is the one-pass method bit for bit, sequential CORP corrects upstream error,
padding stays out of the paired sums, the causal logit cross-sums are the brute-force sums over (query, key <=
query) pairs) and the sensitivity pass (``--allocation sensitivity``: held-out sequences from the held-out
documents, features over real tokens only).

Tiny random OPT, Llama and BERT models of ``test_opt``, ``test_llama`` and ``test_text``; no hub, no downloads.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import launch, run, run_here

from corp_deploy import api
from corp_deploy.core import blockwise
from corp_deploy.core.config import PruneConfig
from corp_deploy.core.pruner import calibrate
from corp_deploy.core.stats import MlpStats, PairStats
from corp_deploy.formats import calibration
from corp_deploy.plan.sensitivity import measure

transformers = pytest.importorskip("transformers", reason="text models need transformers (pip install '.[text]')")

from helpers import opt_folders, padded_batches, tiny_bert, tiny_llama, tiny_opt, token_batches, tokenizer  # noqa: E402

from corp_deploy.families import adapter_for  # noqa: E402
from corp_deploy.formats.artifact import read_meta  # noqa: E402
from corp_deploy.formats.text import packed_sequences, read_documents, shuffled, split_documents  # noqa: E402

FAMILIES = {
    # name: (model, calibration batches, held-out batches, the stack whose last hidden state is compared, target)
    "opt": (tiny_opt, lambda: token_batches(n=12), lambda: token_batches(n=3, seed=9), lambda m: m.model.decoder),
    "llama": (tiny_llama, lambda: token_batches(n=12), lambda: token_batches(n=3, seed=9), lambda m: m.model),
    "bert": (tiny_bert, lambda: padded_batches(n=12), lambda: padded_batches(n=3, seed=9), lambda m: m),
}
TARGET = {"opt": "mlp,qk,v", "llama": "mlp,v", "bert": "mlp,qk,v"}  # Llama refuses Q/K (RoPE)


def _prune(name: str, **kw):
    make, calibration, _, _ = FAMILIES[name]
    config = PruneConfig(sparsity=0.5, target=TARGET[name], round_to=2, sequential=kw.pop("sequential", False))
    return api.prune(make(), calibration(), config, "cpu", progress=False, **kw)


def _hidden_error(name: str, pruned: torch.nn.Module) -> float:
    """Relative error of the last hidden states over the real (unpadded) tokens of held-out batches."""
    make, _, heldout, stack = FAMILIES[name]
    dense, num, den = make(), 0.0, 0.0
    with torch.no_grad():
        for inputs, _ in heldout():
            ref, out = (stack(m)(**inputs).last_hidden_state for m in (dense, pruned))
            real = inputs["attention_mask"].bool()
            num += float((out - ref)[real].square().sum())
            den += float(ref[real].square().sum())
    return num / den


@pytest.mark.parametrize("name", list(FAMILIES))
def test_bounded_memory_walk_is_the_one_pass_method_for_text_models(name: str) -> None:
    """One block per group: each block's statistics come from the cached stream advanced through the blocks before
    it with block 0's captured call (mask, positions), so any slip in the call changes the pruned weights."""
    make = FAMILIES[name][0]
    config = PruneConfig(sparsity=0.5, target=TARGET[name], round_to=2)
    bound = blockwise.block_stats(make(), config, [0], "meta").nbytes() / 2**30 * 1.01
    one_pass, grouped = _prune(name), _prune(name, max_stats_gib=bound)
    assert grouped.report["calibration"]["mode"] == "blockwise" and grouped.report["calibration"]["groups"] == 2
    want, got = one_pass.model.state_dict(), grouped.model.state_dict()
    assert want.keys() == got.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize(("name", "factor"), [("opt", 1.0), ("llama", 0.9)])
def test_sequential_walk_lowers_a_decoders_hidden_state_error(name: str, factor: float, monkeypatch) -> None:
    """Four layers: blocks 1-3 regress the dense targets from the stream pruned so far (measured: OPT 0.041 ->
    0.039 with Q/K and V too, Llama 0.038 -> 0.032)."""
    make = FAMILIES[name][0]
    monkeypatch.setitem(FAMILIES, name, (lambda: make(num_hidden_layers=4), *FAMILIES[name][1:]))
    one_pass, sequential = _prune(name), _prune(name, sequential=True)
    assert sequential.report["calibration"]["mode"] == "sequential"
    assert _hidden_error(name, sequential.model) < factor * _hidden_error(name, one_pass.model)


@pytest.mark.parametrize("name", ["opt", "bert"])
def test_sequential_qk_of_the_first_block_is_one_pass_corp(name: str) -> None:
    """At block 0 both streams are the dense input, so the sequential logit regression reduces to CORP's
    (``compensation.sequential_logit_system``) only if its cross-sums count the pairs the moment counts: a decoder's
    causal pairs (with the all-pairs sums OPT's block-0 query weights move by 0.11, of 0.065 at most), an encoder's
    real tokens (BERT's padded batches run as one doubled batch with the mask captured for it)."""
    one_pass, sequential = _prune(name), _prune(name, sequential=True)
    adapter = adapter_for(one_pass.model)
    a, b = (adapter.qk_weights(adapter.blocks(r.model)[0]) for r in (one_pass, sequential))
    assert sequential.report["blocks"][0]["qk"]["kept"] < sequential.report["blocks"][0]["qk"]["head_dim"]
    for got, want in zip(b, a, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_sequential_block_zero_sees_the_one_pass_sums_of_real_tokens_only(monkeypatch) -> None:
    """At block 0 both streams are the dense input: the paired sums of a padded batch are the one-pass sums twice
    over (target = source, cross = outer), which fails if padding leaks into either half."""
    seen = {}
    real = blockwise.prune_block

    def spy(adapter, block, i, stats, *args, **kw):
        seen.setdefault(i, stats.mlp[i])
        return real(adapter, block, i, stats, *args, **kw)

    monkeypatch.setattr(blockwise, "prune_block", spy)
    config = PruneConfig(sparsity=0.5, target="mlp", round_to=2)
    one_pass = calibrate(tiny_bert(), padded_batches(n=12), config, "cpu", progress=False).mlp[0]
    api.prune(tiny_bert(), padded_batches(n=12), replace(config, sequential=True), "cpu")
    paired = seen[0]
    assert isinstance(paired, PairStats) and paired.count == one_pass.count
    for got in (paired, paired.target):
        torch.testing.assert_close(got.sum, one_pass.sum)
        torch.testing.assert_close(got.outer, one_pass.outer)
    torch.testing.assert_close(paired.cross, one_pass.outer)


def test_paired_sums_with_a_mask_are_the_sums_of_each_halfs_real_tokens() -> None:
    g = torch.Generator().manual_seed(0)
    dense, pruned = torch.randn(3, 7, 5, generator=g), torch.randn(3, 7, 5, generator=g)
    mask = torch.rand(3, 7, generator=g) > 0.4
    paired = PairStats(5)
    paired.update(torch.cat([dense, pruned]), torch.cat([mask, mask]))
    for got, x in ((paired, pruned), (paired.target, dense)):
        want = MlpStats(5)
        want.update(x[mask])
        torch.testing.assert_close(got.outer, want.outer)
        assert got.count == want.count == int(mask.sum())
    torch.testing.assert_close(paired.cross, dense[mask].double().T @ pruned[mask].double(), rtol=1e-5, atol=1e-6)


def _brute_logit_sums(q, k, qs, ks, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair by pair: ``sum (q~_i q_i^T)(k_j k~_j^T)`` and ``sum (q_i . k_j)^2`` over the counted (i, j)."""
    batch, tokens, heads, _ = q.shape
    cross = torch.zeros(heads, qs.shape[-1], ks.shape[-1], dtype=torch.float64)
    energy = torch.zeros(heads, dtype=torch.float64)
    for b in range(batch):
        for i in range(tokens):
            for j in range(i + 1 if causal else tokens):
                for h in range(heads):
                    logit = q[b, i, h].double() @ k[b, j, h].double()
                    cross[h] += logit * torch.outer(qs[b, i, h].double(), ks[b, j, h].double())
                    energy[h] += logit**2
    return cross, energy


@pytest.mark.parametrize("causal", [False, True])
def test_logit_cross_sums_are_the_brute_force_sums_over_the_counted_pairs(causal: bool) -> None:
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 6, 3, 4, generator=g), torch.randn(2, 6, 3, 4, generator=g)
    qs, ks = torch.randn(2, 6, 3, 2, generator=g), torch.randn(2, 6, 3, 2, generator=g)
    got = (blockwise.causal_logit_sums if causal else blockwise.logit_sums)(q, k, qs, ks)
    for g_, w in zip(got, _brute_logit_sums(q, k, qs, ks, causal), strict=True):
        torch.testing.assert_close(g_.double(), w, rtol=1e-4, atol=1e-4)
    if causal:  # and they differ from the all-pairs sums (a check that cannot pass by accident)
        assert not torch.allclose(got[0], blockwise.logit_sums(q, k, qs, ks)[0], rtol=1e-2)


def test_cli_prunes_a_decoder_sequentially_and_in_bounded_memory(tmp_path: Path, capsys) -> None:
    model, _ = opt_folders(tmp_path)
    common = ["--calib", "synthetic", "--num-calib", "8", "--seq-len", "16", "--target", "all", "--quiet"]
    for flag, mode in ((["--sequential"], "sequential"), (["--max-stats-gib", "0.001"], "blockwise")):
        out = tmp_path / mode
        code, _, err = run(["prune", str(model), *common, "--round-to", "2", *flag, "--out", str(out)], capsys)
        assert code == 0, err
        assert read_meta(out)["report"]["calibration"]["mode"] == mode
    assert copy.deepcopy(read_meta(tmp_path / "sequential")["family"]) == "hf-opt"


# ------------------------------------------------------------------------------------- sensitivity pass


@pytest.mark.parametrize("name", list(FAMILIES))
def test_sensitivity_allocation_beats_local_allocation_at_the_same_macs(name: str) -> None:
    """Measured: OPT 0.070 -> 0.015, Llama 0.123 -> 0.051, BERT 3.6e-5 -> 7.5e-6 hidden-state error at macs=0.6
    (held-out: 8 random-token sequences, disjoint from the 32 calibration ones)."""
    make, errors = FAMILIES[name][0], {}
    for allocation in ("local", "sensitivity"):
        config = PruneConfig(target=TARGET[name], budget="macs=0.6", allocation=allocation, round_to=2)
        config = replace(config, sensitivity_images=8)
        held = config.heldout_images
        data = calibration.text_calibration_data(make(), None, "synthetic", 32, 8, seq_len=24, hold_out=held)
        result = api.prune(make(), data.batches, config, "cpu", total=data.total, progress=False, heldout=data.heldout)
        report = result.report  # the closed-form MACs the allocator spends are the counted ones (SwiGLU, GQA)
        assert report["allocation"]["planned_macs"] == report["pruned"]["macs"] <= 0.6 * report["dense"]["macs"]
        errors[allocation] = _hidden_error(name, result.model)
    assert result.report["allocation"]["heldout"] == {"images": 8, "folders": {"synthetic": 8}}
    assert errors["sensitivity"] < 0.5 * errors["local"]


def test_sensitivities_do_not_depend_on_what_padding_holds() -> None:
    """The features the pass compares are the real tokens' (``HfText.features``): padded positions' outputs change
    with the pad token, and would change every weight if they were compared too."""
    model, config = tiny_bert(), PruneConfig(target="mlp,qk,v", round_to=2)
    stats = calibrate(model, padded_batches(n=4), config, "cpu", progress=False)
    zeros, sevens = (padded_batches(n=1, batch=6, seed=5, pad_with=p)[0][0] for p in (0, 7))
    assert not torch.equal(zeros["input_ids"], sevens["input_ids"])
    want, got = measure(model, stats, config, zeros), measure(model, stats, config, sevens)
    assert want.keys() == got.keys() and all(got[k] == pytest.approx(want[k], rel=1e-4) for k in want)


def test_held_out_sequences_come_from_the_held_out_documents(tmp_path: Path) -> None:
    """A decoder's held-out batch packs the split's held-out documents: calibration is the same with or without it."""
    model_dir, text = opt_folders(tmp_path)
    model, tok = tiny_opt(), tokenizer()
    plain = calibration.text_calibration_data(model, tok, text, 6, 4, seq_len=8)
    held = calibration.text_calibration_data(model, tok, text, 6, 4, seq_len=8, hold_out=2)
    assert plain.heldout is None and held.total == plain.total == 6
    for (a, _), (b, _) in zip(plain.batches, held.batches, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"])
    parts = split_documents(read_documents(text))
    want = packed_sequences(tok, shuffled(parts.heldout, 0), 8, 2)
    assert torch.equal(held.heldout.images["input_ids"], want)
    assert held.heldout.folders == {"held-out documents": 2}


def test_cli_allocates_a_decoder_by_sensitivity_and_refuses_a_folder_with_nothing_to_hold_out(
    tmp_path: Path, capsys
) -> None:
    model, text = opt_folders(tmp_path)
    common = ["--seq-len", "8", "--num-calib", "6", "--round-to", "2", "--target", "mlp,v", "--quiet"]
    budget = ["--budget", "macs=0.8", "--allocation", "sensitivity", "--sensitivity-images", "2"]
    out = tmp_path / "run"
    code, _, err = run(["prune", str(model), "--calib-dir", str(text), *common, *budget, "--out", str(out)], capsys)
    assert code == 0, err
    assert read_meta(out)["report"]["allocation"]["heldout"] == {"images": 2, "folders": {"held-out documents": 2}}

    few = tmp_path / "few"
    few.mkdir()
    for i in range(3):  # a tenth of 3 documents rounds to none
        (few / f"{i}.txt").write_text("the news market film game vote phone price team music court bank " * 4)
    code, _, err = run(
        ["prune", str(model), "--calib-dir", str(few), *common, *budget, "--out", str(tmp_path / "x")], capsys
    )
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code != 0 and len(lines) == 1 and "too few documents to hold any out" in lines[0], err
    assert not (tmp_path / "x").exists() and "Traceback" not in err

    long = [*common[:1], "48", *common[2:]]  # 48-token windows: the 3 held-out documents (43 tokens) fill none
    code, _, err = run(
        ["prune", str(model), "--calib-dir", str(text), *long, *budget, "--out", str(tmp_path / "y")], capsys
    )
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code != 0 and len(lines) == 1 and "the held-out documents hold fewer than --seq-len 48" in lines[0], err
    assert not (tmp_path / "y").exists() and "Traceback" not in err


@pytest.mark.e2e
def test_two_gloo_processes_calibrate_a_decoder_to_the_single_process_model(tmp_path: Path, capsys) -> None:
    """torchrun data-parallel for a decoder: each rank takes every other packed window; the merged sums give the
    same model as one process (the sequential walk too: every rank prunes each block from the merged sums)."""
    from safetensors.torch import load_file

    model, text = opt_folders(tmp_path)
    argv = ["-m", "corp_deploy", "prune", str(model), "--calib-dir", str(text), "--seq-len", "8", "--num-calib", "7"]
    argv += ["--calib-batch-size", "2", "--device", "cpu", "--target", "all", "--round-to", "2", "--quiet"]
    run_here(argv, tmp_path / "one", capsys)  # the single-process reference needs no fresh process
    launch(argv, tmp_path / "two", processes=2)
    launch([*argv, "--sequential"], tmp_path / "two-seq", processes=2)
    a, b = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("one", "two"))
    assert sorted(a) == sorted(b)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-4, msg=key)  # summation order differs
    reports = {n: read_meta(tmp_path / n)["report"]["calibration"] for n in ("one", "two", "two-seq")}
    assert reports["one"]["sequences"] == reports["two"]["sequences"] == reports["two-seq"]["sequences"] == 7
    assert (reports["two"]["processes"], reports["two-seq"]["mode"]) == (2, "sequential")
