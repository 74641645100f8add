"""INT8 recipe choice, verified fusions and the quantize-only baseline (issue 43), on tiny models; no speed asserted
(a fake timer decides what is "fastest")."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import TINY_CLI_ARGS, bench_record, pruned_copy, run, tiny_vit

from corp_deploy.base.errors import CorpError
from corp_deploy.bench import gate
from corp_deploy.bench.report import format_table
from corp_deploy.core.config import PruneConfig
from corp_deploy.exporters import int8_recipes
from corp_deploy.exporters.compare import FP32, INT8, Tolerance
from corp_deploy.exporters.int8_quant import compare_on, quantize_verified
from corp_deploy.exporters.int8_recipes import (
    RECIPES,
    Job,
    Recipe,
    choose_int8,
    fused_graph,
    int8_speed,
    parse_recipes,
    quantize_graphs,
)
from corp_deploy.exporters.onnx_export import load_onnx, read_metadata
from corp_deploy.exporters.pipeline import export_verified, format_summary
from corp_deploy.exporters.runners import Memo, OrtRunner
from corp_deploy.formats.calibration import noise_arrays
from corp_deploy.formats.sources import describe
from corp_deploy.formats.text import int8_feeds

pytest.importorskip("onnxruntime", reason="onnxruntime not installed (pip install '.[onnx]')")
pytest.importorskip("onnxscript", reason="onnxscript not installed (pip install '.[onnx]')")

UNEQUAL = PruneConfig(target="mlp,qk,v", mlp_sparsity=0.5, qk_sparsity=0.5, v_sparsity=0.25, round_to=4)
"""Q/K and V pruned by different amounts: every block's Q/K heads narrower than its V heads."""


@pytest.fixture(scope="module")
def vits(tmp_path_factory) -> dict[str, Path]:
    """A tiny dense ViT and its copy pruned with unequal Q/K and V widths, exported (verified) once."""
    tmp = tmp_path_factory.mktemp("recipes")
    dense = tiny_vit()
    pruned, _ = pruned_copy(dense, UNEQUAL)
    graphs = {}
    for name, model in (("dense", dense), ("pruned", pruned)):
        graphs[name] = tmp / f"{name}.onnx"
        export_verified(model, graphs[name], describe(model, "tiny", {}, "random"))
    return graphs


def _job(tol: Tolerance = INT8) -> Job:
    calibration = noise_arrays(16, (3, 32, 32), seed=0)
    return Job(calibration, noise_arrays(8, (3, 32, 32), seed=1), tol, say=lambda line: None)


def _copy(graph: Path, folder: Path) -> Path:
    folder.mkdir(exist_ok=True)
    return Path(shutil.copy(graph, folder / graph.name))


def _broken(src: Path, out: Path, job: Job) -> None:
    """A recipe whose graph misses any gate: the FP32 graph with every weight matrix halved."""
    proto = load_onnx(src)
    for t in proto.graph.initializer:
        if len(t.dims) == 2:
            t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t) * 0.5, t.name))
    onnx.save(proto, str(out))


class FakeTimer:
    """p50 by candidate name (default 10 ms); remembers what it was asked to time."""

    def __init__(self, ms: dict[str, float]) -> None:
        self.ms, self.timed, self.batches = ms, [], []

    def __call__(self, graphs: dict[str, Path], feed) -> dict[str, float]:
        self.timed.append(sorted(graphs))
        self.batches.append(len(feed))
        return {name: self.ms.get(name, 10.0) for name in graphs}


@pytest.mark.parametrize("fastest", ["static", "dynamic (fused)"])
def test_the_choice_keeps_the_fastest_passing_candidate_never_a_failing_one(vits, tmp_path, monkeypatch, fastest):
    monkeypatch.setitem(RECIPES, "broken", Recipe("broken", _broken, fusable=False))
    src = _copy(vits["pruned"], tmp_path)
    timer = FakeTimer({"broken": 0.1, fastest: 1.0})  # the broken graph "runs fastest" but must never be chosen
    record = choose_int8(src, tmp_path / "pruned.int8.onnx", _job(), ("static", "dynamic", "broken"), 4, timer)
    choice = record["int8_recipe"]
    by_name = {(c["recipe"], c["graph"]): c for c in choice["candidates"]}
    assert set(by_name) == {("static", "plain"), ("dynamic", "plain"), ("dynamic", "fused"), ("broken", "plain")}
    assert by_name["broken", "plain"]["passed"] is False and by_name["broken", "plain"]["p50_ms"] == 0.1
    assert timer.timed == [["broken", "dynamic", "dynamic (fused)", "static"]]  # one race, then gated fastest first
    recipe, graph = fastest.split(" (")[0], "fused" if "fused" in fastest else "plain"
    assert (choice["chosen"], choice["graph"]) == (recipe, graph) and by_name[recipe, graph]["passed"]
    slower = [c for key, c in by_name.items() if key not in {("broken", "plain"), (recipe, graph)}]
    assert [c["passed"] for c in slower] == [None, None] and all("cosine" not in c for c in slower)  # never gated
    assert "broken (cosine" in choice["why"] and "the fastest that passes of 4 raced" in choice["why"]
    assert record["verify"]["cosine"] >= INT8.min_cosine  # the shipped graph's own check, on held-out images
    out = OrtRunner(tmp_path / "pruned.int8.onnx", "cpu")(noise_arrays(4, (3, 32, 32), seed=5)[0])
    assert out.shape == (4, 10)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pruned.int8.onnx", "pruned.int8.onnx.json", "pruned.onnx"]


def test_a_graph_no_recipe_passes_is_refused_in_one_line_and_writes_nothing(vits, tmp_path) -> None:
    src = _copy(vits["dense"], tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    impossible = Tolerance(min_cosine=0.9999999999, max_rel_error=1e-9)
    with pytest.raises(CorpError) as e:
        quantize_graphs(
            [(src, tmp_path / "dense.int8.onnx")],
            "synthetic",
            impossible,
            num_calib=16,
            num_verify=8,
            recipes=("dynamic", "dynamic-per-tensor"),
            timer=FakeTimer({}),
            baseline=True,
            say=lambda line: None,
        )
    message = str(e.value)
    assert len(message.splitlines()) == 1 and "no INT8 recipe passes the gate" in message
    assert "INT8 ONNX dense.int8.onnx" in message and "dynamic: cosine 0.9" in message
    assert "dynamic (fused): cosine" in message and "dynamic-per-tensor: cosine" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no INT8 graph, baseline, sidecar or stage


def test_the_recorded_choice_round_trips_through_the_graph_and_its_sidecar(vits, tmp_path) -> None:
    src = _copy(vits["dense"], tmp_path)
    out = tmp_path / "dense.int8.onnx"
    record = choose_int8(src, out, _job(), ("static", "dynamic-per-tensor"), 32, FakeTimer({"static": 2.0}))
    meta = read_metadata(load_onnx(out, weights=False))
    sidecar = json.loads(Path(f"{out}.json").read_text())
    assert meta["int8_recipe"] == sidecar["int8_recipe"] == record["int8_recipe"]
    choice = meta["int8_recipe"]
    assert choice["chosen"] == "static" and meta["int8_scheme"]["format"] == "QDQ"
    assert choice["asked"] == ["static", "dynamic-per-tensor"] and choice["timing"]["shape"] == "batch 32"
    assert isinstance(choice["cpu"]["model"], str) and isinstance(choice["cpu"]["flags"], list | None)
    static, *dynamic = choice["candidates"]
    assert static["passed"] and static["cosine"] >= INT8.min_cosine and static["rel_error"] <= INT8.max_rel_error
    assert static["p50_ms"] == 2.0 and [(c["p50_ms"], c["passed"]) for c in dynamic] == [(10.0, None)] * 2  # slower
    assert choice["fusion"]["fused"]["SkipLayerNormalization"] > 0
    assert choice["fusion"]["checked"].startswith("no: no candidate on the fused graph")  # static passed first
    assert "cosine" not in choice["fusion"]


def test_the_fused_graph_is_checked_only_where_a_candidate_on_it_comes_up_and_dropped_where_it_misses(
    vits, tmp_path, monkeypatch
):
    """Issue 49: the fused FP32 graph ran over every held-out sample for its check before the race, also where no
    fused candidate could ship. Now it is checked when one comes up to be gated; one that misses drops them all."""
    fuse = int8_recipes.fuse

    def broken_fuse(src: Path, dst: Path) -> dict[str, int]:
        counts = fuse(src, dst)
        _broken(dst, dst, _job())
        return counts

    src = _copy(vits["pruned"], tmp_path)
    timer = FakeTimer({"dynamic (fused)": 1.0, "dynamic": 2.0})
    record = choose_int8(src, tmp_path / "good.int8.onnx", _job(), ("dynamic",), 4, timer)
    assert record["int8_recipe"]["graph"] == "fused" and record["int8_recipe"]["fusion"]["cosine"] >= FP32.min_cosine
    monkeypatch.setattr(int8_recipes, "fuse", broken_fuse)
    record = choose_int8(src, tmp_path / "pruned.int8.onnx", _job(), ("dynamic",), 4, timer)
    choice = record["int8_recipe"]
    assert timer.timed[-1] == ["dynamic", "dynamic (fused)"]  # raced before its check
    assert (choice["chosen"], choice["graph"]) == ("dynamic", "plain")
    fused = next(c for c in choice["candidates"] if c["graph"] == "fused")
    assert fused["passed"] is False and fused["error"].startswith("the fused graph does not match the FP32 graph")
    assert choice["fusion"]["cosine"] < FP32.min_cosine and "does not match" in choice["fusion"]["skipped"]


def test_the_choice_races_once_and_gates_only_until_one_passes(vits, tmp_path) -> None:
    """Issue 49: seven recipes timed at batch 32 and every one gated took 608 s of a deit_small export. Now: one race
    of a few calls each, one gate where the fastest passes, the FP32 reference run once
    per held-out input for the fused graph's check and every gate."""
    src = _copy(vits["pruned"], tmp_path)
    job = replace(_job(), reference=Memo(OrtRunner(src, "cpu")))
    timer = FakeTimer({"dynamic (fused)": 1.0})
    lines = []
    record = choose_int8(src, tmp_path / "pruned.int8.onnx", replace(job, say=lines.append), ("auto",), 32, timer)
    candidates = record["int8_recipe"]["candidates"]
    assert len(timer.timed) == 1 and len(timer.timed[0]) == len(candidates) == 5 and timer.batches == [32]
    assert "smooth-dynamic" not in {c["recipe"] for c in candidates}  # dynamic passed: nothing to rescue
    assert [c["recipe"] for c in candidates if "cosine" in c] == ["dynamic"]  # the fastest, passing: the only gate
    assert record["int8_recipe"]["timing"]["race"] == int8_recipes.RACE.as_dict()
    assert job.reference.runs == 2  # one sample and all held-out: the fused check and the gate read the same outputs
    progress = [line for line in lines if "INT8 candidate" in line]
    assert len(progress) == 5 and progress[0].startswith("  INT8 candidate 1/5: static (")
    assert "s left)" in progress[-1]


class CountingRunner(OrtRunner):
    """onnxruntime's CPU runner that counts its calls by batch size, per graph file."""

    calls: dict[tuple[Path, int], int] = {}

    def __init__(self, path: Path, *args) -> None:
        super().__init__(path, *args)
        self.path = Path(path)

    def __call__(self, feed):
        key = (self.path, len(feed))
        CountingRunner.calls[key] = CountingRunner.calls.get(key, 0) + 1
        return super().__call__(feed)


def test_the_race_and_the_speed_table_make_few_calls_a_graph_at_the_timing_batch(vits, tmp_path, monkeypatch):
    """Issue 49: a deit_small run's INT8 step was batch-32 calls (1.3 s each, quiet): 4 a candidate in the race and 21
    a graph in the speed table (5 graphs). Now the race makes three to eight a candidate (``RACE``) and the table
    three an INT8 graph (the FP32 graphs are bench's), each after one untimed call of one sample."""
    monkeypatch.setattr(int8_recipes, "OrtRunner", CountingRunner)
    monkeypatch.setattr(CountingRunner, "calls", {})
    src = _copy(vits["pruned"], tmp_path)
    choose_int8(src, tmp_path / "pruned.int8.onnx", _job(), ("dynamic", "dynamic-per-tensor"), 32)
    raced = {name: n for (name, batch), n in CountingRunner.calls.items() if batch == 32 and name.name != src.name}
    assert len(raced) == 4 and all(CountingRunner.calls[name, 1] >= 1 for name in raced)
    assert all(int8_recipes.RACE.min_rounds <= n <= int8_recipes.RACE.max_rounds for n in raced.values()), raced
    monkeypatch.setattr(CountingRunner, "calls", {})
    records = [{"file": "pruned.int8.onnx"}]
    timing = int8_speed([tmp_path / "pruned.int8.onnx"], records, 32, say=lambda line: None)
    timed = {path.name: n for (path, batch), n in CountingRunner.calls.items() if batch == 32}
    assert timed == {"pruned.int8.onnx": 3}
    assert timing["method"]["min_iters"] == 3 and records[0]["speed"]["p50_ms"] > 0


def test_a_rescuing_recipe_is_written_only_where_the_one_it_rescues_missed(vits, tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(RECIPES, "broken", Recipe("broken", _broken, fusable=False))
    monkeypatch.setitem(RECIPES, "fixed", Recipe("fixed", RECIPES["dynamic"].write, fusable=False, rescues="broken"))
    src = _copy(vits["pruned"], tmp_path)
    timer = FakeTimer({"broken": 1.0})
    record = choose_int8(src, tmp_path / "pruned.int8.onnx", _job(), ("static", "broken", "fixed"), 4, timer)
    choice = record["int8_recipe"]
    assert timer.timed == [["broken", "static"]] and choice["chosen"] == "fixed"  # never raced: written after the miss
    assert [(c["recipe"], c["passed"]) for c in choice["candidates"]] == [
        ("static", None),
        ("broken", False),
        ("fixed", True),
    ]


def test_fused_graphs_match_the_fp32_graph_on_a_tiny_bert(bert_graph, tmp_path) -> None:
    src = bert_graph["onnx"]
    meta = read_metadata(load_onnx(src, weights=False))
    _, held, _ = int8_feeds(None, "synthetic", meta["vocab_size"], 8, 12, 24, seed=0)
    fused, record = fused_graph(src, tmp_path / "fused.onnx", OrtRunner(src, "cpu"), held)
    assert fused is not None, record
    ops = {n.op_type for n in load_onnx(fused, weights=False).graph.node}
    assert {"SkipLayerNormalization", "BiasGelu"} <= ops and "Gelu" not in ops
    assert record["fused"]["SkipLayerNormalization"] == 4  # two blocks, two residual adds each
    assert record["fused"]["MultiHeadAttention"] == 2 and "Softmax" not in ops  # attention.fuse_attention
    comparisons = compare_on(OrtRunner(src, "cpu"), OrtRunner(fused, "cpu"), held)
    assert all(c.within(FP32) for c in comparisons)


def test_fused_graphs_match_the_fp32_graph_on_a_vit_with_unequal_qk_and_v_widths(vits, tmp_path) -> None:
    src = vits["pruned"]
    structure = read_metadata(load_onnx(src, weights=False))["structure"]
    assert all(b["qk_dim"] < b["v_dim"] < 16 for b in structure)  # tiny ViT heads are 16 wide: both pruned, unequally
    held = noise_arrays(8, (3, 32, 32), seed=3)
    fused, record = fused_graph(src, tmp_path / "fused.onnx", OrtRunner(src, "cpu"), held)
    assert fused is not None and record["fused"]["SkipLayerNormalization"] > 0, record
    assert record["fused"]["MultiHeadAttention"] == len(structure)  # timm's packed qkv, split unequally
    assert all(c.within(FP32) for c in compare_on(OrtRunner(src, "cpu"), OrtRunner(fused, "cpu"), held))
    x = np.random.default_rng(0).standard_normal((3, 3, 32, 32), dtype=np.float32)
    assert OrtRunner(fused, "cpu")(x).shape == (3, 10)  # the dynamic batch survives the optimizer


def test_auto_tries_every_recipe_and_a_list_names_known_ones() -> None:
    assert set(parse_recipes("auto")) == set(RECIPES)
    assert parse_recipes("static, dynamic") == ("static", "dynamic")
    with pytest.raises(CorpError, match="--int8-recipe takes auto or a comma list"):
        parse_recipes("fastest")


def test_the_baseline_row_appears_in_the_summary_beside_dense_and_pruned(vits, tmp_path) -> None:
    pairs = [(_copy(vits[m], tmp_path), tmp_path / f"{m}.int8.onnx") for m in ("dense", "pruned")]
    timer = FakeTimer({"dense.onnx": 40.0, "pruned.onnx": 30.0, "baseline.int8.onnx": 20.0, "pruned.int8.onnx": 10.0})
    records = quantize_graphs(
        pairs, "synthetic", INT8, 16, 8, recipes=("dynamic",), timer=timer, baseline=True, say=lambda line: None
    )
    assert [r["file"] for r in records] == ["dense.int8.onnx", "pruned.int8.onnx", "baseline.int8.onnx"]
    baseline = records[-1]
    assert baseline["int8_baseline"]["what"].startswith("onnxruntime.quantization.quantize_dynamic(dense.onnx")
    assert baseline["speed"]["vs_baseline"] == 1.0 and records[1]["speed"]["vs_baseline"] == 2.0
    assert "vs_dense_fp32" not in records[1]["speed"]  # FP32 graphs are bench's to time
    summary = format_summary({"onnx": records, "engines": [], "engines_skipped": None})
    assert "baseline.int8.onnx (quantize-only baseline)" in summary and "vs quantize-only" in summary
    pruned_row = next(line for line in summary.splitlines() if line.startswith("pruned.int8.onnx"))
    assert pruned_row.split()[-2:] == ["10.0", "2.00x"]
    assert "baseline.int8.onnx 20.0 ms" in summary.splitlines()[-1] and "dense.onnx" not in summary.splitlines()[-1]
    flipped = [r | {"verify": r["verify"] | {"top1": 0.0}} if r["file"] == "pruned.int8.onnx" else r for r in records]
    summary = format_summary({"onnx": flipped, "engines": [], "engines_skipped": None})  # issue 50, item 11
    assert "top-1 below 1.00 (pruned.int8.onnx): " in summary and "reported, never gated" in summary


def test_the_baseline_is_the_dense_graphs_dynamic_candidate_made_once(vits, tmp_path, monkeypatch) -> None:
    """Issue 49: the quantize-only baseline is ``quantize_dynamic(dense.onnx, per_channel=True)``, the very call of
    dense's ``dynamic`` candidate, and was made a second time after the choice."""
    made = []
    dynamic_int8 = int8_recipes.dynamic_int8
    monkeypatch.setattr(
        int8_recipes, "dynamic_int8", lambda src, *a, **k: made.append((src.name, a, k)) or dynamic_int8(src, *a, **k)
    )
    pairs = [(_copy(vits[m], tmp_path), tmp_path / f"{m}.int8.onnx") for m in ("dense", "pruned")]
    timer = FakeTimer({"dynamic-per-tensor": 1.0})
    records = quantize_graphs(
        pairs,
        "synthetic",
        INT8,
        16,
        8,
        recipes=("dynamic", "dynamic-per-tensor"),
        timer=timer,
        baseline=True,
        say=lambda line: None,
    )
    assert [k["per_channel"] for name, _, k in made if name == "dense.onnx"] == [True, False]  # plain: once each
    baseline = records[-1]
    assert baseline["file"] == "baseline.int8.onnx" and baseline["int8_baseline"]["what"] == int8_recipes.BASELINE_WHAT
    assert baseline["verify"]["images"] == 8 and "passes_gate" in baseline["int8_baseline"]
    meta = read_metadata(load_onnx(tmp_path / "baseline.int8.onnx", weights=False))
    assert meta["int8_scheme"]["weights"] == "int8 symmetric, per channel" and "int8_recipe" not in meta
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no stage or hold left


def test_the_quantize_only_gate_reads_the_baseline_beside_pruned_int8() -> None:
    record = bench_record(
        {
            ("ort-cpu-int8", "dense", 8): 10.0,
            ("ort-cpu-int8", "pruned", 8): 6.0,
            ("ort-cpu-int8", "baseline", 8): 5.0,
            ("ort-cpu-fp32", "dense", 8): 20.0,
            ("ort-cpu-fp32", "pruned", 8): 12.0,
        }
    )
    for r in record["results"]:
        r["precision"] = r["backend"].rsplit("-", 1)[1]
    checks = gate.against_quantize_only(record, 0.05)
    assert len(checks) == 1 and checks[0].regressed and checks[0].change == pytest.approx(0.2)
    assert not gate.against_quantize_only(record, 0.25)[0].regressed
    assert "quantize-only p50 ms" in format_table(record) and "0.83x" in format_table(record)
    del record["results"][2]
    with pytest.raises(CorpError, match="needs pruned INT8 or INT4 timed beside the quantize-only baseline"):
        gate.against_quantize_only(record, 0.05)


@pytest.mark.e2e
def test_prune_export_int8_then_bench_show_and_gate_the_quantize_only_baseline(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    argv = ["prune-export", "deit_tiny", "--weights", "random", *TINY_CLI_ARGS, "--round-to", "4", "--quiet"]
    argv += ["--calib", "synthetic", "--num-calib", "32", "--precision", "fp32,int8", "--int8-calib", "16"]
    code, stdout, err = run([*argv, "--int8-verify", "8", "--int8-batch-size", "4", "--out", str(out)], capsys)
    assert code == 0, err
    assert "pruned.int8.onnx: INT8 recipe " in stdout and "baseline.int8.onnx (quantize-only baseline)" in stdout
    p50 = [line for line in stdout.splitlines() if "baseline.int8.onnx" in line and " ms" in line and "p50" in line]
    assert len(p50) == 1, p50  # issue 50, item 11: the p50 line was printed twice (the step, then the summary)
    record = json.loads((out / "export.json").read_text())
    assert [r["file"] for r in record["onnx"] if r["precision"] == "int8"][-1] == "baseline.int8.onnx"
    fast = ["--min-iters", "2", "--min-seconds", "0", "--warmup-iters", "1", "--warmup-seconds", "0"]
    bench = ["bench", str(out), "--batch-sizes", "2", "--backends", "ort-cpu-fp32,ort-cpu-int8", *fast]
    code, stdout, err = run(
        [*bench, "--gate", "quantize-only", "--max-regression", "900%", "--json", str(tmp_path / "b")], capsys
    )
    assert code == 0, err
    assert "quantize-only p50 ms" in stdout and "regression gate (quantize-only" in stdout
    results = json.loads((tmp_path / "b").read_text())
    assert {(r["backend"], r["model"]) for r in results["results"]} == {
        (b, m) for b in ("ort-cpu-fp32", "ort-cpu-int8") for m in ("dense", "pruned", "baseline")
    }
    assert "of the run folder" in results["quantize_only_baseline"]
    (out / "baseline.int8.onnx").unlink()  # bench then quantizes dense.onnx itself
    code, stdout, err = run([*bench, "--json", str(tmp_path / "c")], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "c").read_text())["quantize_only_baseline"].startswith("made by bench")
    code, _, err = run([*bench, "--gate", "quantize-only", "--baseline", str(tmp_path / "b")], capsys)
    assert code == 1 and "without --baseline" in err and len(err.strip().splitlines()) == 1


def test_an_int8_engine_is_refused_from_a_graph_of_another_recipe(vits, tmp_path, capsys) -> None:
    src = _copy(vits["pruned"], tmp_path)
    out = tmp_path / "pruned.int8.onnx"
    choose_int8(src, out, _job(), ("dynamic",), 4, FakeTimer({}))
    before = sorted(p.name for p in tmp_path.iterdir())
    code, _, err = run(["build-engine", str(out), "--precision", "int8", "--out", str(tmp_path / "e.plan")], capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert "is not a Q/DQ graph (INT8 recipe dynamic)" in err and "--int8-recipe static" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_int8_engines_are_skipped_saying_how_where_the_fastest_recipe_is_not_qdq(tmp_path) -> None:
    """The INT8 ONNX keeps onnxruntime's fastest recipe; the engine step does not narrow it, it skips INT8 engines."""
    from corp_deploy.exporters.pipeline import export_run
    from corp_deploy.exporters.tensorrt_engine import FLAVOURS, BuildOptions, Profile, flavour_missing

    if missing := flavour_missing(FLAVOURS["tensorrt-rtx"]):
        pytest.skip(f"TensorRT-RTX engines: {missing}")
    dense = tiny_vit()
    pruned, _ = pruned_copy(dense, UNEQUAL)
    models = {m: (net, describe(net, "tiny", {}, "random")) for m, net in (("dense", dense), ("pruned", pruned))}

    def quantize(pairs):
        return [choose_int8(src, dst, _job(), ("dynamic",), 4, FakeTimer({})) for src, dst in pairs]

    build = BuildOptions(profile=Profile(1, 4, 8), workspace_gib=1, runtime="tensorrt-rtx")
    record = export_run(models, tmp_path, precisions=("fp32", "int8"), quantize=quantize, build=build)
    assert sorted(e["file"] for e in record["engines"]) == ["dense.fp32.plan", "pruned.fp32.plan"]
    assert record["engines_skipped"].startswith("int8: dense.int8.onnx is dynamic")
    assert "--int8-recipe static" in record["engines_skipped"]
    assert not list(tmp_path.glob("*.int8.plan"))


def _rss() -> int:
    """This process's resident bytes (Linux)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads resident memory from /proc")
def test_onnxruntime_sessions_share_one_arena_so_live_sessions_hold_one_calls_buffers(tmp_path) -> None:
    """Issue 49: a session's own arena keeps its largest call's buffers while it lives (deit_small FP32: 0.7 GB at
    batch 32), and the INT8 choice holds a reference and five raced candidates at once: a 9.3 GB peak. Four sessions
    of a graph with 32 MB intermediates, each run once and kept alive, now hold one call's buffers between them."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2**20])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1])
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    nodes = [
        helper.make_node("Mul", ["x", "two"], ["a"]),
        helper.make_node("Add", ["a", "x"], ["b"]),
        helper.make_node("Mul", ["b", "two"], ["c"]),
        helper.make_node("ReduceSum", ["c"], ["y"], keepdims=1),
    ]
    graph = helper.make_graph(nodes, "wide", [x], [y], [two])
    path = tmp_path / "wide.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    feed = np.ones((8, 2**20), dtype=np.float32)  # every intermediate 32 MB
    OrtRunner(path, "cpu")(feed)  # the arena has grown to one call's size (or was already larger)
    before = _rss()
    sessions = [OrtRunner(path, "cpu") for _ in range(4)]
    for session in sessions:
        assert session(feed)[0, 0] == 6.0 * feed.size
    assert _rss() - before < 48 * 2**20, (_rss() - before) / 2**20  # own arenas: at least 2 x 32 MB each


@pytest.mark.parametrize("static_ms", [1.0, 20.0])
def test_static_races_as_its_stand_in_and_calibrates_on_everything_only_when_gated(
    vits, tmp_path, monkeypatch, static_ms
):
    """Issue 49: static's calibration over every calibration image was the INT8 step's longest part, also where
    static then lost the race. Its stand-in (the same nodes, calibrated on a few images) races; the full calibration
    runs only where static comes up to be gated."""
    full = []
    monkeypatch.setattr(
        int8_recipes, "quantize_verified", lambda *a, **k: full.append(a[2]) or quantize_verified(*a, **k)
    )
    src = _copy(vits["pruned"], tmp_path)
    timer = FakeTimer({"static": static_ms})
    record = choose_int8(src, tmp_path / "pruned.int8.onnx", _job(), ("static", "dynamic"), 4, timer)
    choice = record["int8_recipe"]
    static = next(c for c in choice["candidates"] if c["recipe"] == "static")
    assert static["raced"].startswith("a stand-in") and len(timer.timed) == 1  # the same nodes: raced once
    if static_ms < 10.0:
        assert choice["chosen"] == "static" and static["passed"] and len(full) == 1 and len(full[0]) == 1
        meta = read_metadata(load_onnx(tmp_path / "pruned.int8.onnx", weights=False))
        assert (
            meta["int8_calibration"]["images"] == 16
        )  # the shipped graph: every calibration image, not the stand-in's
    else:
        assert choice["chosen"] == "dynamic" and static["passed"] is None and full == []  # never calibrated in full


def test_a_stand_in_that_leads_the_race_by_any_margin_is_calibrated_in_full_and_chosen(vits, tmp_path, monkeypatch):
    """A stand-in 2% ahead is calibrated and gated first: the race (``RACE``) resolves what three calls could not,
    and holding static to a 3% lead (the old ``STAND_IN_MARGIN``) picked deit_small's pruned INT8 4.5% slower than
    the exhaustive choice on the quiet Intel machine."""
    full = []
    monkeypatch.setattr(
        int8_recipes, "quantize_verified", lambda *a, **k: full.append(a[2]) or quantize_verified(*a, **k)
    )
    src = _copy(vits["pruned"], tmp_path)
    timer = FakeTimer({"static": 9.8, "dynamic": 10.0, "dynamic (fused)": 20.0})
    record = choose_int8(src, tmp_path / "pruned.int8.onnx", _job(), ("static", "dynamic"), 4, timer)
    choice = record["int8_recipe"]
    static = next(c for c in choice["candidates"] if c["recipe"] == "static")
    assert choice["chosen"] == "static" and static["passed"] and len(full) == 1
    assert "stand_in_margin" not in choice["timing"] and "as its stand-in" not in choice["why"]


def test_a_stand_in_whose_real_graph_differs_is_raced_again_with_the_candidates_left(vits, tmp_path, monkeypatch):
    def fp32_copy(src: Path, out: Path, job: Job) -> None:
        shutil.copy(src, out)

    monkeypatch.setitem(RECIPES, "odd", Recipe("odd", RECIPES["dynamic"].write, fusable=False, stand_in=fp32_copy))
    src = _copy(vits["pruned"], tmp_path)
    timer = FakeTimer({"odd": 1.0, "dynamic-per-tensor": 5.0})
    record = choose_int8(src, tmp_path / "pruned.int8.onnx", _job(), ("odd", "dynamic-per-tensor", "static"), 4, timer)
    raced = ["dynamic-per-tensor", "dynamic-per-tensor (fused)", "odd", "static"]
    assert timer.timed == [raced, raced]  # the real graph of odd, raced with every candidate left
    assert record["int8_recipe"]["chosen"] == "odd"


def test_the_pick_study_times_every_raced_candidate_beside_the_pick(vits, tmp_path) -> None:
    """``studies.int8_pick``: the race's pick and every candidate it raced, written for real, gated and timed
    exhaustively in one process; the pick's ratio to the fastest passing one (no speed asserted: tiny graphs)."""
    from studies import int8_pick

    result = int8_pick.study(_copy(vits["pruned"], tmp_path), "synthetic", 16, 8, batch=4, repeats=1)
    rows = {r["candidate"]: r for r in result["rows"]}
    assert set(rows) == {"static", "dynamic", "dynamic (fused)", "dynamic-per-tensor", "dynamic-per-tensor (fused)"}
    assert all(r["race_p50_ms"] > 0 and r["exhaustive_p50_ms"] > 0 for r in rows.values())
    assert rows[result["pick"]]["passes"] and rows[result["exhaustive_choice"]]["passes"]
    assert result["ratio"] == rows[result["pick"]]["exhaustive_p50_ms"] / result["exhaustive_p50_ms"] >= 1.0
    assert "ratio" in int8_pick.markdown([result], {"date": "d", "cpu": "c", "method": {}, "repeats": 1})
