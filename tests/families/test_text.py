"""BERT-family encoders (``transformers``): masked statistics, surgery, compensation, the artifact and the CLI.

Tiny random ``BertConfig`` models built in the test: no hub, no downloads.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import BERT_VOCAB, BERT_WORDS, padded_batches, run, tiny_bert

from corp_deploy.base.errors import CorpError

transformers = pytest.importorskip("transformers", reason="text models need transformers (pip install '.[text]')")

from transformers import BertModel, BertTokenizerFast  # noqa: E402

from corp_deploy.core.config import PruneConfig  # noqa: E402
from corp_deploy.core.pruner import calibrate, prune_model  # noqa: E402
from corp_deploy.families import adapter_for, get  # noqa: E402
from corp_deploy.families.hf.modeling import PrunedSelfAttention  # noqa: E402
from corp_deploy.formats.artifact import load_pruned, read_meta, save_pruned  # noqa: E402
from corp_deploy.plan.width_plan import plan_widths  # noqa: E402


def _captured(model: BertModel, batches: list[tuple[dict, int]], block: int) -> dict[str, list[torch.Tensor]]:
    """The raw tensors the statistics read, captured by plain hooks: output.dense inputs, query/key outputs."""
    layer = model.encoder.layer[block]
    seen: dict[str, list[torch.Tensor]] = {"x": [], "q": [], "k": []}
    hooks = [
        layer.output.dense.register_forward_pre_hook(lambda _m, a: seen["x"].append(a[0])),
        layer.attention.self.query.register_forward_hook(lambda _m, _a, o: seen["q"].append(o)),
        layer.attention.self.key.register_forward_hook(lambda _m, _a, o: seen["k"].append(o)),
    ]
    with torch.no_grad():
        for inputs, _ in batches:
            model(**inputs)
    for h in hooks:
        h.remove()
    return seen


def test_statistics_are_brute_force_sums_over_real_tokens_and_pairs() -> None:
    model, batches = tiny_bert(), padded_batches()
    stats = calibrate(model, batches, PruneConfig(target="mlp,qk"), "cpu", progress=False)
    seen = _captured(model, batches, 1)
    heads, d = 4, 16
    count, total, outer = 0, torch.zeros(128, dtype=torch.float64), torch.zeros(128, 128, dtype=torch.float64)
    moment = torch.zeros(heads, d * (d + 1) // 2, d * (d + 1) // 2, dtype=torch.float64)
    rows, cols = torch.triu_indices(d, d)
    for (inputs, _), x, q, k in zip(batches, seen["x"], seen["q"], seen["k"], strict=True):
        for b, length in enumerate(inputs["attention_mask"].sum(1).tolist()):
            real = x[b, :length].double()
            count += length
            total += real.sum(0)
            outer += real.T @ real
            for h in range(heads):  # one sequence: Grams over its real (query, key) pairs only
                qh, kh = (t[b, :length, h * d : (h + 1) * d].double() for t in (q, k))
                gq, gk = (qh.T @ qh)[rows, cols], (kh.T @ kh)[rows, cols]
                moment[h] += torch.outer(gq, gk)
    mlp, attn = stats.mlp[1], stats.qk[1]
    assert int(mlp.count) == count < 6 * 4 * 24  # padding left out
    torch.testing.assert_close(mlp.sum, total, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(mlp.outer, outer, rtol=1e-5, atol=1e-3)
    assert int(attn.count) == 6 * 4
    torch.testing.assert_close(attn.moment, moment, rtol=1e-4, atol=1e-2)


def test_what_padding_holds_does_not_change_the_statistics() -> None:
    model, config = tiny_bert(), PruneConfig(target="all")
    a = calibrate(model, padded_batches(pad_with=0), config, "cpu", progress=False)
    b = calibrate(model, padded_batches(pad_with=7), config, "cpu", progress=False)
    for x, y in zip(a.tensors(), b.tensors(), strict=True):
        torch.testing.assert_close(x, y)


def test_attention_hook_sees_what_the_pruner_folds() -> None:
    """The adapter's per-head query/key weights and hooks agree with the Linear layout (heads contiguous)."""
    model = tiny_bert()
    layer = model.encoder.layer[0]
    q_w, q_b, k_w, _ = get("hf-bert").qk_weights(layer)
    x = torch.randn(2, 5, 64)
    got = []
    handles = get("hf-bert").on_qk(layer, lambda q, k: got.append((q, k)))
    with torch.no_grad():
        layer.attention.self(x)
    for h in handles:
        h.remove()
    q, _ = got[0]
    torch.testing.assert_close(q[:, :, 2], x @ q_w[2].T + q_b[2])
    assert adapter_for(model) is get("hf-bert")


@pytest.mark.parametrize("target", ["mlp,qk", "all"])
def test_pruned_bert_is_smaller_a_transformers_model_and_compensation_helps(target: str) -> None:
    dense = tiny_bert()
    heldout = padded_batches(n=2, seed=9)
    errors = {}
    for compensation in ("corp", "none"):
        model = copy.deepcopy(dense)
        config = PruneConfig(sparsity=0.5, target=target, round_to=4, compensation=compensation)
        stats = calibrate(model, padded_batches(n=12), config, "cpu", progress=False)
        prune_model(model, stats, config, plan_widths(model, config, stats))
        errors[compensation] = _feature_error(dense, model, heldout)
    assert isinstance(model, BertModel) and not any(m.training for m in model.modules())  # no dropout
    attn = model.encoder.layer[0].attention.self
    assert isinstance(attn, PrunedSelfAttention) and attn.query.out_features == 4 * 8
    assert attn.scaling == pytest.approx(16**-0.5)  # the dense head dim's scale: the fold keeps the logits
    assert model.encoder.layer[0].intermediate.dense.out_features == 64
    assert (attn.value.out_features == 4 * 8) == (target == "all")
    assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in dense.parameters())
    assert errors["corp"] < errors["none"]


def _feature_error(dense: BertModel, pruned: BertModel, batches: list[tuple[dict, int]]) -> float:
    """Relative error of the last hidden states over real tokens."""
    num = den = 0.0
    with torch.no_grad():
        for inputs, _ in batches:
            mask = inputs["attention_mask"].bool()
            ref, out = dense(**inputs).last_hidden_state[mask], pruned(**inputs).last_hidden_state[mask]
            num += float((out - ref).square().sum())
            den += float(ref.square().sum())
    return num / den


def test_artifact_round_trip_keeps_the_class_config_and_outputs(tmp_path: Path) -> None:
    dense = tiny_bert()
    model = copy.deepcopy(dense)
    config = PruneConfig(sparsity=0.5, target="all", round_to=4)
    stats = calibrate(model, padded_batches(), config, "cpu", progress=False)
    prune_model(model, stats, config, plan_widths(model, config, stats))
    save_pruned(model, tmp_path / "art", {"model": {"name": "tiny-bert", "args": {}}})
    assert read_meta(tmp_path / "art")["family"] == "hf-bert"
    assert json.loads((tmp_path / "art" / "config.json").read_text())["architectures"] == ["BertModel"]
    loaded = load_pruned(tmp_path / "art")
    assert type(loaded) is BertModel and not loaded.training
    inputs, _ = padded_batches(n=1, seed=5)[0]
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).last_hidden_state, model(**inputs).last_hidden_state)


def test_a_hub_name_without_network_is_one_line_at_once(tmp_path: Path, monkeypatch) -> None:
    """No host resolves: the hub is never asked (huggingface_hub would retry for ~25 s), the cache is."""
    import socket

    from corp_deploy.families.hf import hub

    def unresolved(*_args, **_kwargs):
        raise socket.gaierror("Name or service not known")

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty cache
    monkeypatch.setattr(socket, "getaddrinfo", unresolved)
    with pytest.raises(CorpError, match="not reachable from here and org/tiny is not in the local cache") as info:
        hub.load("hf:org/tiny")
    assert "\n" not in str(info.value)


def _model_folder(root: Path) -> Path:
    folder = root / "tiny-bert"
    tiny_bert().save_pretrained(folder)
    BertTokenizerFast(vocab={w: i for i, w in enumerate(BERT_VOCAB)}).save_pretrained(folder)
    return folder


@pytest.mark.e2e
def test_cli_prunes_a_transformers_folder_on_text_and_refuses_bad_text_input(tmp_path: Path, capsys) -> None:
    """The command line in this process (``helpers.run``: an uncaught exception fails the test, as a traceback
    would); a fresh process per command only re-imports torch and transformers."""
    folder = _model_folder(tmp_path)
    text = tmp_path / "text"
    for label, words in (("a", BERT_WORDS[:8]), ("b", BERT_WORDS[8:])):
        (text / label).mkdir(parents=True)
        for i in range(5):
            (text / label / f"{i}.txt").write_text(" ".join(words[i:] + words[:i]))
    (text / "more.jsonl").write_text(json.dumps({"text": "the news said"}) + "\n")
    out = tmp_path / "out"
    common = ["--num-calib", "8", "--calib-batch-size", "4", "--round-to", "4", "--quiet"]
    argv = ["prune", str(folder), "--calib-dir", str(text), "--seq-len", "16", "--target", "all", *common]
    code, _, err = run([*argv, "--out", str(out)], capsys)
    assert code == 0, err
    meta = read_meta(out)
    assert meta["family"] == "hf-bert" and meta["report"]["calibration"]["sequences"] == 8
    assert (out / "tokenizer_config.json").is_file()
    assert type(load_pruned(out)) is BertModel

    empty = tmp_path / "empty"
    empty.mkdir()
    for args, message in (
        (["--calib-dir", str(empty)], "no text"),
        (["--calib", "synthetic", "--seq-len", "41"], "--seq-len must be between 1 and 40"),
    ):
        code, _, err = run(["prune", str(folder), *args, *common, "--out", str(tmp_path / "bad")], capsys)
        assert code == 1 and message in err and "Traceback" not in err
        assert not (tmp_path / "bad").exists()


def test_a_text_models_prune_never_imports_timm(tmp_path: Path) -> None:
    """timm and torchvision under it cost ~3 s of a process start (`--help` took twice as long); a text model's
    command never needs timm (the family registry asks the timm family about every model without importing it).
    torchvision is not asserted: transformers' own BERT module imports it."""
    folder, out = _model_folder(tmp_path), tmp_path / "out"
    code = (
        "import sys\nfrom corp_deploy.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
        "    assert not e.code, e.code\nprint(sorted(m for m in ('timm',) if m in sys.modules))"
    )
    argv = ["prune", str(folder), "--calib", "synthetic", "--seq-len", "16", "--num-calib", "8", "--quiet"]
    done = subprocess.run([sys.executable, "-c", code, *argv, "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]" and read_meta(out)["family"] == "hf-bert"


def test_pruned_encoder_exports_to_onnx_with_dynamic_batch_and_sequence(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    from corp_deploy.exporters.text_onnx import export_text_onnx, verify_text_onnx

    model = tiny_bert()
    config = PruneConfig(sparsity=0.5, target="all", round_to=4)
    stats = calibrate(model, padded_batches(), config, "cpu", progress=False)
    prune_model(model, stats, config, plan_widths(model, config, stats))
    path = export_text_onnx(model, tmp_path / "pruned.onnx")
    assert verify_text_onnx(model, path, shapes=((1, 5), (3, 19), (4, 33))) < 1e-5  # none of them traced
