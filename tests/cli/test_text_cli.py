"""Text encoders through the CLI: `export`, `prune-export` and `build-engine` (dynamic batch and sequence, verified
graphs, engines with a (batch, sequence) profile), `bench` (sentences/s, tokens/s), MACs counted at `--seq-len`,
and one-line refusals. Tiny random encoders built in the test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import launch, run, run_here, tiny_text_folder

from corp_deploy.base.errors import CorpError
from corp_deploy.bench.run import pairs
from corp_deploy.cli import main
from corp_deploy.exporters.compare import FP32, compare
from corp_deploy.exporters.runners import OrtRunner, TorchRunner
from corp_deploy.exporters.tensorrt_engine import build_missing

pytest.importorskip("transformers", reason="text models need transformers (pip install '.[text]')")
pytest.importorskip("onnxruntime", reason="onnxruntime not installed (pip install '.[onnx]')")
pytest.importorskip("onnxscript", reason="onnxscript not installed (pip install '.[onnx]')")

from corp_deploy.exporters.text_onnx import Encoder, example_inputs  # noqa: E402

ENGINES_MISSING = build_missing()
TEXT_ARGS = ["--seq-len", "32", "--round-to", "4", "--quiet", "--num-calib", "8", "--calib-batch-size", "4"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tiny_text_folder(tmp_path_factory.mktemp("hf"))


@pytest.mark.e2e
def test_export_a_transformers_folder_fp32_and_fp16_self_describing(folder, tmp_path, capsys) -> None:
    out = tmp_path / "m.onnx"
    code, stdout, stderr = run(
        ["export", str(folder), "--precision", "fp32,fp16", "--seq-len", "24", "--out", str(out)], capsys
    )
    assert code == 0, stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.fp16.onnx", "m.fp16.onnx.json", "m.onnx", "m.onnx.json"]
    fp32, fp16 = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("m.onnx", "m.fp16.onnx"))
    for record in (fp32, fp16):
        assert record["modality"] == "text" and record["inputs"] == ["input_ids", "attention_mask"]
        assert record["seq_len"] == 24 and record["max_positions"] == 40 and record["verify"]["batches"] == [1, 4]
    assert fp16["verify"]["tolerance"]["min_cosine"] == 0.999 and fp16["precision"] == "fp16"
    # Both axes are dynamic: a shape and padding never traced (batch 3, 37 tokens) runs and matches PyTorch.
    from corp_deploy.families.hf.hub import load

    model, _ = load(str(folder))
    ids, mask = example_inputs(model.config.vocab_size, 3, 37, seed=5)
    x = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
    assert mask.min() == 0  # padded
    assert compare(TorchRunner(Encoder(model))(x), OrtRunner(out, "cpu")(x)).within(FP32)
    assert "m.fp16.onnx" in stdout


@pytest.fixture(scope="module")
def text_run(folder, tmp_path_factory) -> tuple[Path, str]:
    """A prune-export run folder of the tiny encoder, and what the command printed."""
    out = tmp_path_factory.mktemp("run") / "run"
    argv = [
        "prune-export",
        str(folder),
        "--calib",
        "synthetic",
        *TEXT_ARGS,
        "--batch-range",
        "1:4:8",
        "--out",
        str(out),
    ]
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    return out


@pytest.mark.e2e
def test_prune_export_a_text_encoder_writes_graphs_engines_and_records(text_run) -> None:
    out = text_run
    record = json.loads((out / "export.json").read_text())
    assert [r["file"] for r in record["onnx"]] == ["dense.onnx", "dense.fp16.onnx", "pruned.onnx", "pruned.fp16.onnx"]
    assert all(r["seq_len"] == 32 and r["modality"] == "text" for r in record["onnx"])
    assert record["size"]["pruned"]["params"] < record["size"]["dense"]["params"]
    assert (out / "pruned" / "config.json").is_file() and (out / "pruned" / "tokenizer_config.json").is_file()
    if ENGINES_MISSING:
        assert record["engines_skipped"] == ENGINES_MISSING
        return
    assert {e["file"] for e in record["engines"]} == {
        f"{m}.{p}.plan" for m in ("dense", "pruned") for p in ("fp32", "fp16")
    }
    for e in record["engines"]:
        assert [i["name"] for i in e["inputs"]] == ["input_ids", "attention_mask"]
        assert e["profile"] == {"min": 1, "opt": 4, "max": 8}
        assert e["sequence_profile"] == {"min": 1, "opt": 32, "max": 32}
        assert e["verify"] is None and "text engines are built only" in e["status"]  # never claimed as run


FAST = ["--warmup-iters", "1", "--warmup-seconds", "0", "--min-iters", "2", "--min-seconds", "0"]


@pytest.mark.e2e
def test_bench_times_dense_and_pruned_text_in_sentences_and_tokens(text_run, tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    argv = ["bench", str(text_run), "--backends", "ort-cpu-fp32,torch-cpu-fp32", "--batch-sizes", "1,3", *FAST]
    argv += ["--no-quantize-only"]  # dense and pruned only (the baseline beside them: test_int8_recipes.py)
    code, stdout, stderr = run([*argv, "--seq-len", "20", "--json", str(out)], capsys)
    assert code == 0, stderr
    record = json.loads(out.read_text())
    assert {(r["backend"], r["model"], r["batch"]) for r in record["results"]} == {
        (b, m, n) for b in ("ort-cpu-fp32", "torch-cpu-fp32") for m in ("dense", "pruned") for n in (1, 3)
    }
    assert all(r["seq_len"] == 20 for r in record["results"])  # --seq-len replaces the recorded 32
    assert all(p["dense_tokens_per_s"] == pytest.approx(20 * p["dense_throughput"]) for p in pairs(record))
    assert "seq-len" in stdout and "dense tok/s" in stdout and "batch    3 x 20 tokens" in stdout
    assert "img/s" not in stdout


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--seq-len", "41"], "--seq-len must be between 1 and 40"),
        (["--backends", "tensorrt-fp16"], "text engines are built only"),
    ],
)
def test_bad_text_bench_input_is_one_line(text_run, tmp_path, capsys, args, expected) -> None:
    out = tmp_path / "bench.json"
    code, _, stderr = run(["bench", str(text_run), *args, "--json", str(out), *FAST], capsys)
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert code == 1 and len(lines) == 1 and expected in lines[0] and "Traceback" not in stderr
    assert not out.exists()


@pytest.mark.e2e
def test_a_bench_where_every_backend_was_skipped_fails_and_writes_nothing(text_run, tmp_path, capsys, monkeypatch):
    """Issue 50, item 7: it exited 0 with an empty table, as if something had been measured."""
    import dataclasses

    from corp_deploy.bench.backends import BACKENDS

    def cannot(*args):
        raise CorpError("out of memory (simulated)")

    monkeypatch.setitem(BACKENDS, "ort-cpu-fp32", dataclasses.replace(BACKENDS["ort-cpu-fp32"], load=cannot))
    out = tmp_path / "bench.json"
    argv = ["bench", str(text_run), "--backends", "ort-cpu-fp32", "--no-quantize-only", "--json", str(out), *FAST]
    code, _, stderr = run(argv, capsys)
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert code == 1 and lines == [
        "error: nothing measured: every backend was skipped (ort-cpu-fp32: out of memory (simulated)); pass "
        "--backends with one that runs here"
    ]
    assert not out.exists()


@pytest.fixture(scope="module")
def graph16(folder, tmp_path_factory) -> Path:
    """``export FOLDER --seq-len 16 --out m.onnx``, once for the two tests below that read the graph."""
    onnx = tmp_path_factory.mktemp("graph16") / "m.onnx"
    with pytest.raises(SystemExit) as done:
        main(["export", str(folder), "--seq-len", "16", "--out", str(onnx)])
    assert done.value.code == 0
    return onnx


@pytest.mark.skipif(bool(ENGINES_MISSING), reason=f"no engine library: {ENGINES_MISSING}")
def test_build_engine_takes_the_sequence_range(graph16, capsys) -> None:
    onnx = graph16
    code, _, stderr = run(
        ["build-engine", str(onnx), "--precision", "fp32", "--batch-range", "1:2:4", "--seq-range", "4:8:40"], capsys
    )
    assert code == 0, stderr
    meta = json.loads((onnx.parent / "m.fp32.plan.json").read_text())
    assert meta["sequence_profile"] == {"min": 4, "opt": 8, "max": 40} and meta["profile"]["max"] == 4


BAD = {
    "prune-export int8 without text": (["prune-export", "{folder}", "--precision", "fp32,int8"], "no calibration text"),
    "prune-export int8 engines without text": (
        ["prune-export", "{folder}", "--precision", "fp32,int8"],
        "no calibration text",
    ),
    "prune-export pad-qk": (
        ["prune-export", "{folder}", "--pad-qk", "--calib", "synthetic"],
        "--pad-qk and --simplify",
    ),
    "prune-export seq-len": (
        ["prune-export", "{folder}", "--calib", "synthetic", "--seq-len", "41"],
        "--seq-len must be between 1 and 40",
    ),
    "prune-export seq range": (
        ["prune-export", "{folder}", "--calib", "synthetic", "--seq-range", "8:4:2"],
        "1 <= min <= opt <= max",
    ),
    "export seq-len": (["export", "{folder}", "--seq-len", "41"], "--seq-len must be between 1 and 40"),
    "export simplify": (["export", "{folder}", "--simplify"], "--pad-qk and --simplify"),
    "export checkpoint": (["export", "{folder}", "--checkpoint", "{folder}/model.safetensors"], "--checkpoint"),
    "export verify fails": (["export", "{folder}", "--tol-cosine", "1.0000001"], "does not match at batch 1"),
}


@pytest.mark.e2e
@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_text_export_input_is_one_line_and_writes_nothing(case, folder, tmp_path, capsys) -> None:
    argv, expected = BAD[case]
    argv = [a.format(folder=folder) for a in argv]
    argv += [*TEXT_ARGS[2:], "--out", str(tmp_path / "run")] if argv[0] == "prune-export" else []
    argv += ["--seq-len", "32"] if "--seq-len" not in argv else []
    argv += ["--out", str(tmp_path / "m.onnx")] if argv[0] == "export" else []
    code, _, stderr = run(argv, capsys)
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert code != 0 and len(lines) == 1 and expected in lines[0], stderr
    assert "Traceback" not in stderr and list(tmp_path.iterdir()) == []


def test_text_int8_without_text_and_an_image_graph_with_a_sequence_range_are_refused(graph16, capsys) -> None:
    onnx = graph16
    before = sorted(p.name for p in onnx.parent.iterdir())
    code, _, stderr = run(["quantize", str(onnx)], capsys)
    assert code == 1 and "no calibration text" in stderr and "Traceback" not in stderr
    from corp_deploy.base.errors import CorpError
    from corp_deploy.exporters.tensorrt_engine import BuildOptions, Profile, for_graph

    ranged = BuildOptions(sequence=Profile(1, 8, 16))
    with pytest.raises(CorpError, match="--seq-range is for text encoders"):
        for_graph(ranged, None)
    assert for_graph(ranged, 64).sequence == Profile(1, 8, 16)  # --seq-range wins over the graph's length
    assert for_graph(BuildOptions(), 64).sequence == Profile(1, 64, 64)
    assert sorted(p.name for p in onnx.parent.iterdir()) == before


@pytest.mark.e2e
def test_macs_are_counted_at_the_runs_seq_len_and_recorded(folder, tmp_path, capsys) -> None:
    from corp_deploy import load_pruned
    from corp_deploy.families.hf.adapter import count_macs_at
    from corp_deploy.families.hf.hub import load
    from corp_deploy.formats.artifact import read_meta
    from corp_deploy.plan.report import model_size

    reports = {}
    for seq_len in (16, 32):
        out = tmp_path / f"s{seq_len}"
        argv = ["prune", str(folder), "--calib", "synthetic", *TEXT_ARGS[2:], "--seq-len", str(seq_len)]
        code, _, stderr = run([*argv, "--budget", "macs=0.7", "--allocation", "local", "--out", str(out)], capsys)
        assert code == 0, stderr
        reports[seq_len] = report = read_meta(out)["report"]
        assert report["calibration"]["seq_len"] == seq_len
        assert report["dense"]["tokens"] == report["pruned"]["tokens"] == seq_len
        assert report["pruned"]["macs"] <= 0.7 * report["dense"]["macs"]  # the budget at the run's length
        # The artifact counts at the length it was pruned for, as does a fresh dense model told it.
        assert model_size(load_pruned(out))["macs"] == report["pruned"]["macs"]
        dense, _ = load(str(folder))
        count_macs_at(dense, seq_len)
        assert model_size(dense)["macs"] == report["dense"]["macs"]
    assert reports[32]["dense"]["macs"] > 2 * reports[16]["dense"]["macs"]  # linear layers double, attention x4


@pytest.mark.e2e
def test_two_gloo_processes_calibrate_text_to_the_single_process_model(folder, tmp_path, capsys) -> None:
    """torchrun data-parallel: each rank tokenizes its shard of the documents; the merged sums give the same model."""
    import torch
    from safetensors.torch import load_file

    text = tmp_path / "text"
    text.mkdir()
    words = ["the", "news", "market", "film", "vote", "team", "bank"]
    for i in range(11):  # uneven shards; documents of different lengths, so every batch is padded
        (text / f"{i:02d}.txt").write_text(" ".join(words[j % 7] for j in range(i, 3 * i + 4)))
    argv = ["-m", "corp_deploy", "prune", str(folder), "--calib-dir", str(text), *TEXT_ARGS[:4]]
    argv += ["--calib-batch-size", "3", "--num-calib", "11", "--device", "cpu", "--target", "all"]
    run_here(argv, tmp_path / "one", capsys)  # the single-process reference needs no fresh process
    launch(argv, tmp_path / "two", processes=2)
    a, b = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("one", "two"))
    assert sorted(a) == sorted(b)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-4, msg=key)  # summation order differs
    one, two = (json.loads((tmp_path / n / "corp.json").read_text())["report"]["calibration"] for n in ("one", "two"))
    assert two["sequences"] == one["sequences"] > 5 and (one["processes"], two["processes"]) == (1, 2)


@pytest.mark.e2e
def test_a_decoder_exports_logits_and_genai_folders_no_engines_and_benches_by_phase(tmp_path, capsys) -> None:
    """OPT through prune-export (the full-sequence forward, with the same records; the genai folders beside it)
    and bench (prefill and decode in onnxruntime-genai)."""
    import onnx
    import torch
    import transformers

    torch.manual_seed(0)
    # One layer: the run exports two logits and two decode-step graphs, each about twice as long with two layers.
    size = {"hidden_size": 32, "num_hidden_layers": 1, "ffn_dim": 64, "num_attention_heads": 4}
    config = transformers.OPTConfig(vocab_size=50, max_position_embeddings=64, word_embed_proj_dim=32, **size)
    transformers.OPTForCausalLM(config).eval().save_pretrained(tmp_path / "tiny-opt")
    out = tmp_path / "run"
    argv = ["prune-export", str(tmp_path / "tiny-opt"), "--calib", "synthetic", *TEXT_ARGS, "--precision", "fp32"]
    code, _, stderr = run([*argv, "--batch-range", "1:4:8", "--out", str(out)], capsys)
    assert code == 0, stderr
    assert [o.name for o in onnx.load(str(out / "pruned.onnx")).graph.output] == ["logits"]
    assert json.loads((out / "pruned.onnx.json").read_text())["seq_len"] == 32
    for stem in ("dense", "pruned"):  # and the key/value-cache graphs onnxruntime-genai generates with
        record = json.loads((out / f"{stem}-genai" / "model.onnx.json").read_text())
        assert all(p["genai_equal"] for p in record["genai"]["prompts"]) and record["tokenizer"] is None
    exported = json.loads((out / "export.json").read_text())
    assert exported["genai"]["pruned-genai"]["genai"]["tokens_equal"]
    assert exported["engines"] == [] and exported["engines_skipped"].startswith("decoders get none")  # no 1 GB plans
    assert not list(out.glob("*.plan"))
    code, _, stderr = run([*argv, "--require-engines", "--out", str(tmp_path / "required")], capsys)
    assert code == 1 and "decoders get none" in stderr and not (tmp_path / "required").exists(), stderr
    argv = ["bench", str(out), "--backends", "genai-cpu-fp32", "--batch-sizes", "2", "--prompt-lens", "8"]
    code, stdout, stderr = run([*argv, "--new-tokens", "4", *FAST], capsys)  # a decoder is timed by phase
    assert code == 0 and stdout.count("genai-cpu-fp32  cpu     fp32") == 2, stderr  # prefill and decode rows
