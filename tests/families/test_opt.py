"""OPT decoders and the shared decoder plumbing: causal Q/K statistics, packed calibration text, document splits,
perplexity, surgery, compensation, the artifact, ``generate`` and the CLI.

Tiny random ``OPTConfig`` models and a word-level tokenizer built in the test: no hub, no downloads.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from helpers import SPECIAL, VOCAB, WORDS, documents, opt_folders, run, tiny_opt, token_batches, tokenizer

from corp_deploy.base.errors import CorpError

transformers = pytest.importorskip("transformers", reason="text models need transformers (pip install '.[text]')")

from transformers import OPTForCausalLM  # noqa: E402

from corp_deploy.core.config import PruneConfig  # noqa: E402
from corp_deploy.core.pruner import calibrate, prune_model  # noqa: E402
from corp_deploy.core.stats import QKStats  # noqa: E402
from corp_deploy.families import adapter_for, get  # noqa: E402
from corp_deploy.families.hf import hub  # noqa: E402
from corp_deploy.families.hf.modeling import PrunedOptAttention  # noqa: E402
from corp_deploy.formats.artifact import load_pruned, read_meta, save_pruned  # noqa: E402
from corp_deploy.formats.calibration import text_calibration_data  # noqa: E402
from corp_deploy.formats.evaluation import perplexity  # noqa: E402
from corp_deploy.formats.text import Document, packed_sequences, read_documents, shuffled, split_documents  # noqa: E402
from corp_deploy.plan.width_plan import check_parts, plan_widths  # noqa: E402

# ------------------------------------------------------------------------------------- causal Q/K moments


def _brute_moment(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    """``sum_b sum_(i, j counted) vec(q_i q_i^T)[p] vec(k_j k_j^T)[q]`` pair by pair, packed upper triangles."""
    batch, tokens, heads, d = q.shape
    rows, cols = torch.triu_indices(d, d)
    out = torch.zeros(heads, rows.numel(), rows.numel(), dtype=torch.float64)
    for b in range(batch):
        for i in range(tokens):
            for j in range(i + 1 if causal else tokens):
                for h in range(heads):
                    qi, kj = q[b, i, h].double(), k[b, j, h].double()
                    out[h] += torch.outer(torch.outer(qi, qi)[rows, cols], torch.outer(kj, kj)[rows, cols])
    return out


def test_causal_qk_moment_is_the_brute_force_sum_over_pairs_with_key_at_or_before_query() -> None:
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 7, 3, 4, generator=g), torch.randn(2, 7, 3, 4, generator=g)
    causal, full = QKStats(3, 4, causal=True), QKStats(3, 4)
    causal.update(q, k)
    full.update(q, k)
    expected = _brute_moment(q, k, causal=True)
    torch.testing.assert_close(causal.moment, expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(full.moment, _brute_moment(q, k, causal=False), rtol=1e-5, atol=1e-4)
    assert (full.moment - causal.moment).abs().max() > 0.1 * expected.abs().max()  # the pairs j > i matter
    assert int(causal.count) == 2


def test_causal_qk_moment_leaves_padded_tokens_out() -> None:
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 6, 2, 3, generator=g), torch.randn(2, 6, 2, 3, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]).bool()
    padded = QKStats(2, 3, causal=True)
    padded.update(q, k, mask)
    expected = _brute_moment(q[:1], k[:1], causal=True) + _brute_moment(q[1:, :4], k[1:, :4], causal=True)
    torch.testing.assert_close(padded.moment, expected, rtol=1e-5, atol=1e-4)


def test_an_opt_model_calibrates_causal_moments_from_its_own_q_and_k() -> None:
    """What the adapter hands the statistics is q_proj's and k_proj's output of every layer, over causal pairs."""
    model, batches = tiny_opt(), token_batches(n=2, seq=6)
    stats = calibrate(model, batches, PruneConfig(target="qk"), "cpu", progress=False)
    seen: dict[str, list[torch.Tensor]] = {"q": [], "k": []}
    attn = model.model.decoder.layers[1].self_attn
    hooks = [
        attn.q_proj.register_forward_hook(lambda _m, _a, o: seen["q"].append(o.unflatten(-1, (4, 8)))),
        attn.k_proj.register_forward_hook(lambda _m, _a, o: seen["k"].append(o.unflatten(-1, (4, 8)))),
    ]
    with torch.no_grad():
        for inputs, _ in batches:
            model(**inputs)
    for h in hooks:
        h.remove()
    expected = sum(_brute_moment(q, k, causal=True) for q, k in zip(seen["q"], seen["k"], strict=True))
    assert adapter_for(model) is get("hf-opt") and stats.qk[1].causal
    torch.testing.assert_close(stats.qk[1].moment, expected, rtol=1e-4, atol=1e-3)


# ------------------------------------------------------------------------------ calibration text, splits


def test_documents_split_into_disjoint_seeded_parts_across_the_whole_folder() -> None:
    docs = documents(40)
    split = split_documents(docs)
    parts = [split.calibration, split.heldout, split.evaluation]
    assert [len(p) for p in parts] == [32, 4, 4]
    ids = [{id(d) for d in p} for p in parts]
    assert not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2])
    assert set().union(*ids) == {id(d) for d in docs}
    assert split == split_documents(docs)  # fixed: every command draws the same split
    assert len({d.folder for d in split.evaluation}) > 1  # drawn across classes, not the last folder
    assert split_documents(docs[:1]).calibration == docs[:1]


def test_decoder_calibration_packs_documents_into_full_sequences_with_eos_between(tmp_path: Path) -> None:
    tok = tokenizer()
    docs = [Document("the news", "."), Document("a film game", "."), Document("vote", ".")]
    ids = packed_sequences(tok, docs, seq_len=4)
    stream = [1, 4, 6, 2, 5, 8, 9, 2, 10, 2]  # BOS, each document, EOS after each
    assert ids.tolist() == [stream[:4], stream[4:8]]  # the tail shorter than a window is dropped
    assert packed_sequences(tok, docs, seq_len=4, num=1).tolist() == [stream[:4]]
    with pytest.raises(CorpError, match="fewer than --seq-len 11 tokens"):
        packed_sequences(tok, docs, seq_len=11)

    text = tmp_path / "text"
    text.mkdir()
    for i, doc in enumerate(documents(30)):
        (text / f"{i:02d}.txt").write_text(doc.text)
    data = text_calibration_data(tiny_opt(), tok, text, num=5, batch_size=2, seq_len=16)
    batches = [b for b, _ in data.batches]
    assert data.total == 5 and [b["input_ids"].shape for b in batches] == [(2, 16), (2, 16), (1, 16)]
    assert all(bool(b["attention_mask"].all()) for b in batches)  # no padding: every token counts
    calibration = shuffled(split_documents(read_documents(text)).calibration, seed=0)  # never evaluation's
    assert torch.equal(torch.cat([b["input_ids"] for b in batches]), packed_sequences(tok, calibration, 16, 5))


# ------------------------------------------------------------------------------------------- perplexity


def test_perplexity_is_exp_of_the_mean_nll_over_non_overlapping_windows() -> None:
    model = tiny_opt()
    windows = torch.randint(len(SPECIAL), len(VOCAB), (5, 9), generator=torch.Generator().manual_seed(3))
    nll, count = 0.0, 0
    with torch.no_grad():
        for w in windows:  # one window, one token at a time: -log p(w_t | w_<t)
            for t in range(1, len(w)):
                logp = torch.log_softmax(model(input_ids=w[None, :t]).logits[0, -1].double(), -1)
                nll -= float(logp[w[t]])
                count += 1
    expected = math.exp(nll / count)
    assert perplexity(model, windows, batch_size=2) == pytest.approx(expected, rel=1e-5)
    assert perplexity(model, windows, batch_size=5) == pytest.approx(expected, rel=1e-5)


# ----------------------------------------------------------------------- pruning, artifact, generate


def test_pruned_opt_generates_the_same_tokens_after_the_artifact_round_trip(tmp_path: Path) -> None:
    model = tiny_opt()
    config = PruneConfig(sparsity=0.5, target="all", round_to=2)
    stats = calibrate(model, token_batches(), config, "cpu", progress=False)
    prune_model(model, stats, config, plan_widths(model, config, stats))
    save_pruned(model, tmp_path / "art", {"model": {"name": "tiny-opt", "args": {}}})
    assert read_meta(tmp_path / "art")["family"] == "hf-opt"
    assert json.loads((tmp_path / "art" / "config.json").read_text())["architectures"] == ["OPTForCausalLM"]
    loaded = load_pruned(tmp_path / "art")
    assert type(loaded) is OPTForCausalLM and not loaded.training
    assert isinstance(loaded.model.decoder.layers[0].self_attn, PrunedOptAttention)
    prompt = torch.tensor([[1, 4, 6, 7, 8]])
    with torch.no_grad():
        ids = torch.randint(len(SPECIAL), len(VOCAB), (2, 11), generator=torch.Generator().manual_seed(4))
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
        got = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False)
        again = loaded.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False)
        nocache = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False, use_cache=False
        )
    assert got.shape == (1, 11) and torch.equal(got, again)
    assert torch.equal(got, nocache)  # the key/value cache holds the pruned, unequal K and V widths correctly


def _output_error(dense: OPTForCausalLM, pruned: OPTForCausalLM, batches: list[tuple[dict, int]]) -> float:
    """Relative error of the decoder's last hidden states (every token is real)."""
    num = den = 0.0
    with torch.no_grad():
        for inputs, _ in batches:
            ref, out = dense.model(**inputs).last_hidden_state, pruned.model(**inputs).last_hidden_state
            num += float((out - ref).square().sum())
            den += float(ref.square().sum())
    return num / den


def _pruned(dense: OPTForCausalLM, target: str, compensation: str) -> OPTForCausalLM:
    model = copy.deepcopy(dense)
    config = PruneConfig(sparsity=0.5, target=target, round_to=2, compensation=compensation)
    stats = calibrate(model, token_batches(n=12), config, "cpu", progress=False)
    prune_model(model, stats, config, plan_widths(model, config, stats))
    return model


@pytest.mark.parametrize("target", ["mlp", "v", "mlp,qk", "all"])
@pytest.mark.parametrize("pre_ln", [True, False])
def test_pruned_opt_is_smaller_the_same_class_and_compensation_helps(target: str, pre_ln: bool) -> None:
    """Pre-LN (125m, 1.3b) and post-LN with project_in/out (350m's layout) alike: the fold is exact in both."""
    dense = tiny_opt(init_std=0.2, **({} if pre_ln else {"do_layer_norm_before": False, "word_embed_proj_dim": 16}))
    heldout = token_batches(n=3, seed=9)
    model = _pruned(dense, target, "corp")
    layer = model.model.decoder.layers[0]
    assert type(model) is OPTForCausalLM and not any(m.training for m in model.modules())
    assert get("hf-opt").structure(layer) == {
        "mlp_hidden": 32 if "mlp" in target or target == "all" else 64,
        "qk_dim": 4 if "qk" in target or target == "all" else 8,
        "v_dim": 4 if target in ("v", "all") else 8,
        "heads": 4,
    }
    assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in dense.parameters())
    assert _output_error(dense, model, heldout) < 0.75 * _output_error(dense, _pruned(dense, target, "none"), heldout)


def test_qk_compensation_recovers_logits_that_the_kept_dims_determine() -> None:
    """Rank-3 query and key heads of width 8: the 4 kept dims span them, so the fold reproduces the logits
    (up to the ridge damping) while plain removal loses half of every head."""
    dense = tiny_opt(init_std=0.2)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in dense.model.decoder.layers:
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                w = torch.randn(4, 8, 3, generator=g) @ torch.randn(4, 3, 32, generator=g)
                lin.weight.copy_(w.flatten(0, 1) * 0.5)
                lin.bias.zero_()
    heldout = token_batches(n=3, seed=9)
    corp, none = (_output_error(dense, _pruned(dense, "qk", c), heldout) for c in ("corp", "none"))
    assert none > 0.1 and corp < 0.05 * none
    assert _pruned(dense, "qk", "corp").model.decoder.layers[1].self_attn.scaling == pytest.approx(8**-0.5)


def test_opt_without_biases_refuses_v_pruning_before_calibration() -> None:
    model = tiny_opt(enable_bias=False)
    check_parts(model, PruneConfig(sparsity=0.5, target="mlp,qk", compensation="none"))
    with pytest.raises(CorpError, match="out_proj has no bias.*--target mlp,qk"):
        check_parts(model, PruneConfig(sparsity=0.5, target="v"))


# ------------------------------------------------------------------------------------------------- CLI


def test_cli_prunes_an_opt_folder_and_evaluates_its_perplexity(tmp_path: Path, capsys) -> None:
    model, text = opt_folders(tmp_path)
    common = ["--seq-len", "16", "--calib-batch-size", "4", "--round-to", "2", "--quiet"]
    code, out, err = run(
        ["prune", str(model), "--calib", "synthetic", "--target", "mlp,qk", *common, "--out", str(tmp_path / "syn")],
        capsys,
    )
    assert code == 0, err
    assert "64 calibration sequences" in out
    code, out, err = run(
        [
            "prune",
            str(model),
            "--calib-dir",
            str(text),
            "--num-calib",
            "6",
            "--target",
            "all",
            *common,
            "--out",
            str(tmp_path / "txt"),
        ],
        capsys,
    )
    assert code == 0, err
    meta = read_meta(tmp_path / "txt")
    assert meta["family"] == "hf-opt" and meta["report"]["calibration"]["sequences"] == 6
    assert "6 calibration sequences" in out and (tmp_path / "txt" / "tokenizer.json").is_file()
    assert type(load_pruned(tmp_path / "txt")) is OPTForCausalLM

    code, out, err = run(["eval", str(tmp_path / "txt"), "--text", str(text), "--seq-len", "16"], capsys)
    assert code == 0, err
    pruned, dense = (float(line.split()[2]) for line in out.splitlines()[:2])
    assert out.startswith("pruned: perplexity") and "dense: perplexity" in out and "evaluation: 3 of 30" in out
    loaded, tok = load_pruned(tmp_path / "txt"), tokenizer()
    windows = packed_sequences(tok, split_documents(read_documents(text)).evaluation, 16)
    assert pruned == pytest.approx(perplexity(loaded, windows), rel=1e-3)
    assert dense == pytest.approx(perplexity(tiny_opt(), windows), rel=1e-3)
    record = json.loads((tmp_path / "txt" / "eval.json").read_text())[-1]  # issue 50, item 6: as the help says
    assert record["metric"] == "perplexity" and f"appended to {tmp_path / 'txt' / 'eval.json'}" in out
    assert [round(record["results"][k]["perplexity"], 3) for k in ("pruned", "dense")] == [pruned, dense]

    assert windows.shape[0] > 1  # --num caps the windows, first ones first
    argv = ["eval", str(tmp_path / "txt"), "--text", str(text), "--seq-len", "16", "--num", "1"]
    code, out, err = run(argv, capsys)
    assert code == 0 and f"on 1 of {windows.shape[0]} windows" in out, err
    assert float(out.split()[2]) == pytest.approx(perplexity(loaded, windows[:1]), rel=1e-3)

    shutil.rmtree(model)  # the dense folder moved: the pruned model is still evaluated, the dense skipped
    code, out, err = run(["eval", str(tmp_path / "txt"), "--text", str(text), "--seq-len", "16"], capsys)
    assert code == 0 and out.startswith("pruned: perplexity") and "dense: skipped (cannot load" in out, err
    records = json.loads((tmp_path / "txt" / "eval.json").read_text())
    assert len(records) == 3 and "cannot load" in records[-1]["results"]["dense"]["skipped"]


def test_cli_refuses_bad_decoder_input_in_one_line_and_writes_nothing(tmp_path: Path, capsys) -> None:
    model, text = opt_folders(tmp_path / "a")
    no_bias, _ = opt_folders(tmp_path / "b", enable_bias=False)
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)
    ).save_pretrained(gpt2)
    empty, short = tmp_path / "empty", tmp_path / "short"
    empty.mkdir()
    short.mkdir()
    (short / "one.txt").write_text("the news said")
    bad = tmp_path / "bad"
    for argv, message in (
        ([str(model), "--calib-dir", str(empty)], "no text"),
        ([str(model)], "no calibration text: pass --calib-dir DIR (.txt/.jsonl"),
        ([str(model), "--calib", "synthetic", "--seq-len", "65"], "--seq-len must be between 1 and 64"),
        ([str(model), "--calib-dir", str(short), "--seq-len", "8"], "fewer than --seq-len 8 tokens"),
        ([str(gpt2), "--calib", "synthetic", "--seq-len", "16"], "model_type 'gpt2'"),
        ([str(no_bias), "--calib", "synthetic", "--seq-len", "16", "--target", "v"], "out_proj has no bias"),
    ):
        code, _, err = run(["prune", *argv, "--quiet", "--out", str(bad)], capsys)
        lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert len(lines) == 1, (argv, code, err)
        line = lines[0]
        assert code == 1 and message in line and "Traceback" not in err, (argv, err)
        assert not bad.exists()
    for argv, message in (
        ([str(model), "--text", str(text), "--seq-len", "16", "--all-text", "--batch-size", "2"], None),
        ([str(model), "--text", str(empty)], "no text"),
        ([str(model), "--text", str(short), "--seq-len", "2"], "--all-text"),
        ([str(tmp_path / "nothing"), "--text", str(text)], "neither a prune artifact"),
        ([str(model), "--text", str(text), "--images", str(text)], "--images and --probe-train are image sets"),
    ):
        code, out, err = run(["eval", *argv], capsys)
        if message is None:
            assert code == 0 and "all: 30 of 30 documents" in out, err
        else:
            assert code == 1 and message in err and "Traceback" not in err, (argv, err)


# ----------------------------------------------------------------------------------------------- ONNX


def test_pruned_decoder_exports_its_logits_to_onnx_with_dynamic_batch_and_sequence(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    import onnx

    from corp_deploy.exporters.text_onnx import export_text_onnx, verify_text_onnx

    model = tiny_opt()
    config = PruneConfig(sparsity=0.5, target="all", round_to=2)
    stats = calibrate(model, token_batches(), config, "cpu", progress=False)
    prune_model(model, stats, config, plan_widths(model, config, stats))
    path = export_text_onnx(model, tmp_path / "pruned.onnx")
    (logits,) = onnx.load(str(path)).graph.output
    assert logits.name == "logits"
    assert [d.dim_param or d.dim_value for d in logits.type.tensor_type.shape.dim] == ["batch", "sequence", 100]
    assert verify_text_onnx(model, path, shapes=((1, 5), (3, 19), (4, 33))) < 1e-5  # none of them traced, padded


def test_a_float16_checkpoint_loads_in_float32_and_a_folder_without_tokenizer_files_has_none(tmp_path: Path) -> None:
    """OPT's published checkpoints are float16: calibration and perplexity must not run in it on a CPU. Without
    tokenizer files transformers builds an EMPTY tokenizer of the config's class, which would tokenize to nothing."""
    tiny_opt().half().save_pretrained(tmp_path / "half")
    model, tok = hub.load(str(tmp_path / "half"))
    assert model.dtype == torch.float32 and tok is None and not model.training


def test_a_document_longer_than_the_positions_is_packed_without_a_warning(caplog) -> None:
    """Packing cuts long documents into windows: transformers' "longer than the maximum" warning would mislead."""
    tok = tokenizer()
    tok.model_max_length = 4
    ids = packed_sequences(tok, [Document(" ".join(WORDS), ".")], seq_len=4)
    assert ids.shape == (3, 4) and "longer than" not in caplog.text
