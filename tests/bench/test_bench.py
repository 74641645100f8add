"""Bench: statistics and the gate on synthetic timings; one short real run on a tiny model (CPU)."""

from __future__ import annotations

import copy
import itertools
import json
import shutil
import sys

import numpy as np
import pytest
import torch
from helpers import RECORD, TINY_CLI_ARGS, bench_record, pruned_copy, run, tiny_vit

from corp_deploy.base.errors import CorpError
from corp_deploy.base.timing import Method, Race, interleaved, median_of_repeats, race, summarize
from corp_deploy.bench import backends, gate
from corp_deploy.bench.backends import (
    BACKENDS,
    COMPILE_OPT_IN,
    Backend,
    RunFolder,
    _torch,
    compile_model,
    select_backends,
    torch_forward,
)
from corp_deploy.bench.report import skipped_lines
from corp_deploy.bench.run import SCHEMA, benchmark, pairs, parse_batch_sizes
from corp_deploy.cli import main
from corp_deploy.core.config import PruneConfig


def test_summarize_percentiles_and_throughput() -> None:
    stats = summarize([i / 1000 for i in range(1, 101)], batch=8)  # 1..100 ms
    assert stats.p50_ms == pytest.approx(50.5) and stats.p90_ms == pytest.approx(90.1)
    assert stats.p99_ms == pytest.approx(99.01) and stats.mean_ms == pytest.approx(50.5)
    assert stats.throughput == pytest.approx(8 / 0.0505) and stats.iters == 100


def test_median_of_repeats_ignores_one_disturbed_repeat() -> None:
    calm, noisy = summarize([0.010] * 20, 1), summarize([0.030] * 20, 1)
    combined = median_of_repeats([calm, noisy, calm])
    assert combined.p50_ms == pytest.approx(10.0) and combined.iters == 60


def test_interleaved_alternates_and_meets_both_minimums() -> None:
    calls: list[str] = []

    def fake(name: str, seconds: float):
        return lambda: calls.append(name) or seconds

    method = Method(warmup_iters=3, warmup_seconds=0.0, min_iters=10, min_seconds=0.5, round_iters=2)
    times = interleaved({"dense": fake("dense", 0.02), "pruned": fake("pruned", 0.01)}, method)
    assert calls[:6] == ["dense"] * 3 + ["pruned"] * 3  # warm-up, not timed
    assert len(times["dense"]) >= 10 and sum(times["pruned"]) >= 0.5  # pruned needs 50 iterations for 0.5 s
    timed = calls[6:]
    assert timed[:8] == ["dense", "dense", "pruned", "pruned", "pruned", "pruned", "dense", "dense"]
    assert len(times["dense"]) == len(times["pruned"])  # same rounds: drift hits both


def test_the_race_drops_the_clearly_slower_early_and_times_the_close_ones_longest() -> None:
    """Successive elimination: a candidate whose best call is slower than the leader's median leaves after the first
    ``min_rounds``; two within reach of each other but not tied run to ``max_rounds``; a tie ends the race."""

    def fake(*calls: float):
        cycle = itertools.cycle(calls)
        return lambda: next(cycle)

    rule = Race(min_rounds=3, max_rounds=8, tie=0.01)
    times = race({"slow": fake(1.2, 1.25, 1.22), "fast": fake(1.0, 1.03, 0.99), "close": fake(0.998, 1.05, 1.04)}, rule)
    assert len(times["slow"]) == 3 and len(times["fast"]) == len(times["close"]) == 8
    assert np.median(times["fast"]) < np.median(times["close"])
    tied = race({"a": fake(1.0, 1.01, 1.0), "b": fake(1.005, 1.0, 1.0)}, rule)
    assert len(tied["a"]) == len(tied["b"]) == 3  # within the tie after the first rounds: as fast, stop


def test_pairs_give_pruned_over_dense_ratios() -> None:
    (one, big) = sorted(pairs(RECORD), key=lambda p: p["batch"])
    assert one["p50_speedup"] == pytest.approx(10 / 6) and big["throughput_ratio"] == pytest.approx(200 / 110)


def test_absolute_gate_passes_equal_and_fails_slower() -> None:
    assert not any(c.regressed for c in gate.compare(copy.deepcopy(RECORD), RECORD, 0.05, "absolute"))
    slower = copy.deepcopy(RECORD)
    slower["results"][1]["p50_ms"] *= 1.10  # pruned batch 1: 10% slower
    checks = gate.compare(slower, RECORD, 0.05, "absolute")
    assert [c.key for c in checks if c.regressed] == ["ort pruned batch 1 p50 ms"]
    assert gate.compare(slower, RECORD, 0.15, "absolute")[1].regressed is False
    assert "1 of 4 regressed" in gate.format_checks(checks, 0.05, "absolute")


def test_ratio_gate_ignores_a_uniformly_slower_machine_but_catches_a_lost_speedup() -> None:
    busy = copy.deepcopy(RECORD)
    for r in busy["results"]:
        r["p50_ms"] *= 1.5  # shared runner: everything 50% slower
    assert not any(c.regressed for c in gate.compare(busy, RECORD, 0.05, "ratio"))
    assert any(c.regressed for c in gate.compare(busy, RECORD, 0.05, "absolute"))
    lost = copy.deepcopy(RECORD)
    lost["results"][3]["p50_ms"] = 150.0  # pruned batch 32 lost part of its advantage
    assert [c.key for c in gate.compare(lost, RECORD, 0.05, "ratio") if c.regressed] == [
        "ort batch 32 pruned/dense p50 speedup"
    ]


@pytest.mark.parametrize(("text", "value"), [("5%", 0.05), ("0.05", 0.05), ("0%", 0.0), ("12.5%", 0.125)])
def test_parse_fraction(text, value) -> None:
    assert gate.parse_fraction(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["five", "-5%", "%"])
def test_parse_fraction_rejects(text) -> None:
    with pytest.raises(CorpError, match="--max-regression"):
        gate.parse_fraction(text)


def test_gate_refuses_bad_baselines(tmp_path) -> None:
    with pytest.raises(CorpError, match="does not exist"):
        gate.load_baseline(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(CorpError, match="not JSON"):
        gate.load_baseline(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text('{"schema": "something else"}')
    with pytest.raises(CorpError, match="not a corp-deploy bench record"):
        gate.load_baseline(tmp_path / "other.json")
    disjoint = bench_record({("trt", "dense", 4): 1.0, ("trt", "pruned", 4): 1.0})
    with pytest.raises(CorpError, match="this run lacks 2 of the baseline's 2 measurements"):
        gate.compare(disjoint, RECORD, 0.05, "ratio")


def test_parse_batch_sizes() -> None:
    assert parse_batch_sizes("32,1,8,8") == [1, 8, 32]
    for bad in ("", "0,1", "a"):
        with pytest.raises(CorpError, match="--batch-sizes"):
            parse_batch_sizes(bad)


PRECISIONS = ("fp32", "fp16", "bf16")
GRAPHED = [f"torch-cuda-{p}-graph" for p in PRECISIONS]
COMPILED = [f"torch-cuda-{p}-compile{g}" for p in PRECISIONS for g in ("", "-graph")]


def test_the_registry_has_graph_and_compile_variants_of_every_torch_cuda_precision() -> None:
    for name in GRAPHED + COMPILED:
        backend = BACKENDS[name]
        assert (backend.device, backend.precision) == ("cuda", name.split("-")[2])
        assert (backend.opt_in == COMPILE_OPT_IN) == ("compile" in name)
    assert {"torch-cuda-fp32", "torch-cuda-fp16", "torch-cuda-bf16", "tensorrt-fp16"} <= set(BACKENDS)


def test_without_cuda_auto_lists_the_new_variants_as_skipped_and_naming_one_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run = RunFolder(tmp_path)  # an empty folder: no ONNX, no engines
    chosen, skipped = select_backends("auto", run)
    assert [b.name for b in chosen] == ["torch-cpu-fp32"]
    assert {n: skipped[n] for n in GRAPHED + COMPILED} == dict.fromkeys(GRAPHED + COMPILED, "no CUDA GPU visible")
    with pytest.raises(CorpError) as refused:
        select_backends("torch-cpu-fp32,torch-cuda-fp16-compile-graph", run)
    assert str(refused.value) == "backend torch-cuda-fp16-compile-graph cannot run here: no CUDA GPU visible"


def test_skipped_backends_are_one_line_per_reason(tmp_path, monkeypatch) -> None:
    """Without a GPU, every CUDA variant is skipped for the same reason: one line names them all."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _, skipped = select_backends("auto", RunFolder(tmp_path))
    lines = skipped_lines(skipped)
    assert len(lines) == len(set(skipped.values())) < len(skipped)
    (cuda,) = [line for line in lines if line.endswith(": no CUDA GPU visible")]
    assert all(name in cuda for name in GRAPHED)


def test_with_cuda_auto_runs_the_graphs_and_leaves_compile_to_be_named(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # only what select asks: nothing runs here
    monkeypatch.setattr(backends, "uninstalled", lambda module: None)
    run = RunFolder(tmp_path)
    chosen, skipped = select_backends("auto", run)
    assert set(GRAPHED) <= {b.name for b in chosen} and set(COMPILED).isdisjoint(b.name for b in chosen)
    assert {n: skipped[n] for n in COMPILED} == dict.fromkeys(COMPILED, COMPILE_OPT_IN)
    named, none = select_backends("torch-cuda-bf16-compile,torch-cuda-fp16-compile-graph", run)
    assert [b.name for b in named] == ["torch-cuda-bf16-compile", "torch-cuda-fp16-compile-graph"] and none == {}
    monkeypatch.setattr(backends, "uninstalled", lambda module: f"{module} (pip install {module})")
    assert select_backends("auto", run)[1]["torch-cuda-fp16-compile"] == (
        "not installed: triton (pip install triton) (torch.compile's inductor writes its CUDA kernels in Triton)"
    )


def test_a_misspelt_backend_is_refused_in_one_line_naming_the_choices(tmp_path) -> None:
    with pytest.raises(CorpError) as refused:
        select_backends("torch-cuda-fp16-graphs", RunFolder(tmp_path))
    message = str(refused.value)
    assert message.startswith("unknown backend 'torch-cuda-fp16-graphs'; choose auto or from torch-cpu-fp32, ")
    assert "torch-cuda-fp16-compile-graph" in message and "\n" not in message


def test_a_decoder_backend_named_for_an_image_run_is_said_to_be_one_and_every_backend_listed(tmp_path) -> None:
    """Issue 50, item 13: the unknown-backend list left out genai-cpu-*, as if they did not exist."""
    from corp_deploy.bench.decode import DECODE_BACKENDS

    decoders = ("decoder runs", DECODE_BACKENDS)
    with pytest.raises(CorpError) as refused:
        select_backends("genai-cpu-fp32", RunFolder(tmp_path), elsewhere=decoders)
    message = str(refused.value)
    assert message.startswith("genai-cpu-fp32 times decoder runs, not this run; choose auto or from torch-cpu-fp32")
    assert message.endswith("(decoder runs also: genai-cpu-fp32, genai-cpu-int4)"), message
    with pytest.raises(CorpError, match=r"unknown backend 'onnx-magic'; .*\(decoder runs also: genai-cpu-fp32"):
        select_backends("onnx-magic", RunFolder(tmp_path), elsewhere=decoders)


def test_without_onnxruntime_its_backends_are_skipped_saying_what_to_install(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import fails as if it were not installed
    _, skipped = select_backends("auto", RunFolder(tmp_path))
    assert skipped["ort-cpu-fp32"] == "not installed: onnxruntime (pip install 'corp-deploy[onnx]')"


def _dense_and_pruned() -> dict[str, torch.nn.Module]:
    dense = tiny_vit()
    return {"dense": dense, "pruned": pruned_copy(dense, PruneConfig(sparsity=0.5, round_to=4))[0]}


def test_a_compiled_forward_gives_eager_outputs_on_the_cpu() -> None:
    """The compile path of the CUDA backends, run on the CPU with dynamo's eager backend (no C++ toolchain)."""
    for model in _dense_and_pruned().values():
        x = torch.randn(3, 3, 32, 32)
        eager = torch_forward(model, x)()
        assert torch.equal(torch_forward(compile_model(model, "eager"), x)(), eager)


def test_compiled_forwards_past_dynamos_recompile_limit_still_compile_and_run_compiled() -> None:
    """Dense and pruned share ``VisionTransformer.forward``'s compile cache: 10 (model, batch) entries > dynamo's 8."""
    torch.compiler.reset()
    compiled: list[tuple[int, ...]] = []
    runs: list[tuple[int, ...]] = []

    def counting(gm, inputs):
        shape = next(tuple(t.shape) for t in inputs if t.dim() == 4)
        compiled.append(shape)
        return lambda *args: runs.append(shape) or gm.forward(*args)

    forwards = [
        torch_forward(compile_model(model, counting), torch.randn(batch, 3, 32, 32))
        for model in _dense_and_pruned().values()
        for batch in range(1, 6)
    ]
    every = sorted((b, 3, 32, 32) for b in range(1, 6) for _ in range(2))
    assert sorted(compiled) == every
    runs.clear()
    for forward in forwards:  # as when timed: outside the warm-up
        forward()
    assert sorted(runs) == every


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    pytest.importorskip("onnxruntime", reason="onnxruntime not installed (pip install '.[onnx]')")
    out = tmp_path_factory.mktemp("bench") / "run"
    argv = ["prune-export", "deit_tiny", "--weights", "random", *TINY_CLI_ARGS, "--round-to", "4", "--quiet"]
    with pytest.raises(SystemExit) as done:
        main([*argv, "--num-calib", "16", "--calib", "synthetic", "--precision", "fp32", "--out", str(out)])
    assert done.value.code == 0
    return out


@pytest.mark.e2e
def test_backend_selection_explains_what_it_skips(run_dir) -> None:
    chosen, skipped = select_backends("auto", RunFolder.open(run_dir))
    assert [b.name for b in chosen][:2] == ["torch-cpu-fp32", "ort-cpu-fp32"]
    assert all(skipped.values()) and set(skipped).isdisjoint(b.name for b in chosen)
    with pytest.raises(CorpError, match="unknown backend"):
        select_backends("torch-tpu", RunFolder.open(run_dir))
    with pytest.raises(CorpError, match="not a prune-export folder"):
        RunFolder.open(run_dir / "nothing")
    with pytest.raises(CorpError, match="is a prune artifact"):
        RunFolder.open(run_dir / "pruned")


def test_run_folder_reads_the_recorded_input_size_without_building_a_model(run_dir, tmp_path, monkeypatch) -> None:
    def no_model(run, which):
        raise AssertionError("a model was built to learn the input size")

    monkeypatch.setattr(backends, "torch_model", no_model)
    assert RunFolder.open(run_dir).input_size == (3, 32, 32)
    bare = tmp_path / "bare"
    shutil.copytree(run_dir / "pruned", bare / "pruned")
    with pytest.raises(CorpError, match="pruned.onnx.json is missing or records no input_size; re-run"):
        RunFolder.open(bare).input_size  # noqa: B018 (the property is the call under test)


def test_a_backend_that_cannot_load_is_skipped_and_the_others_still_run(run_dir) -> None:
    def broken(run, which, include_copies, threads):
        raise CorpError("the engine library failed to load\nits second line")

    backends = [Backend("broken", "torch", "cpu", "fp32", broken, lambda run: None), BACKENDS["torch-cpu-fp32"]]
    method = Method(warmup_iters=1, warmup_seconds=0, min_iters=3, min_seconds=0, round_iters=1)
    record = benchmark(RunFolder.open(run_dir), backends, [1], method)
    assert record["skipped"] == {"broken": "the engine library failed to load"}
    assert {(r["backend"], r["model"]) for r in record["results"]} == {
        ("torch-cpu-fp32", "dense"),
        ("torch-cpu-fp32", "pruned"),
    }


def test_the_torch_loader_compiles_while_it_prepares_a_batch_never_when_timed(run_dir) -> None:
    """The CUDA backends' loader with a CPU device and a counting dynamo backend: compile time is warm-up."""
    compiled = []

    def counting(gm, inputs):
        compiled.append(gm)
        return gm.forward

    at = _torch("cpu", torch.float32, compile_backend=counting)(RunFolder.open(run_dir), "pruned", False, None)
    step = at(2)
    assert len(compiled) == 1
    assert step() > 0 and step() > 0 and len(compiled) == 1


FAST = ["--min-iters", "3", "--min-seconds", "0", "--warmup-iters", "1", "--warmup-seconds", "0"]


@pytest.mark.e2e
def test_real_bench_run_writes_every_output_and_gates(run_dir, tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib not installed (pip install '.[bench]')")
    outputs = {k: tmp_path / f"b.{k}" for k in ("json", "csv", "md", "png")}
    argv = ["bench", str(run_dir), "--batch-sizes", "1,2", "--backends", "torch-cpu-fp32,ort-cpu-fp32", *FAST]
    argv += ["--no-quantize-only"]  # dense and pruned only (the baseline beside them: test_int8_recipes.py)
    argv += ["--json", str(outputs["json"]), "--csv", str(outputs["csv"]), "--markdown", str(outputs["md"])]
    code, stdout, stderr = run([*argv, "--plot", str(outputs["png"])], capsys)
    assert code == 0, stderr
    record = json.loads(outputs["json"].read_text())
    assert record["schema"] == SCHEMA and record["method"]["min_iters"] == 3
    assert {(r["backend"], r["model"], r["batch"]) for r in record["results"]} == {
        (b, m, n) for b in ("torch-cpu-fp32", "ort-cpu-fp32") for m in ("dense", "pruned") for n in (1, 2)
    }
    assert all(r["p50_ms"] > 0 and r["iters"] >= 3 for r in record["results"])
    assert outputs["csv"].read_text().count("\n") == 9 and "p50 speedup" in outputs["md"].read_text()
    assert outputs["png"].read_bytes()[:4] == b"\x89PNG"
    assert "method: warm-up" in stdout and "throughput ratio" in stdout

    # The gate against a baseline whose p50s are 1e4x longer passes; 1e4x shorter fails with exit 1
    # (a margin no scheduling hiccup on a loaded CI runner can cross).
    for factor, expected in ((1e4, 0), (1e-4, 1)):
        baseline = copy.deepcopy(record)
        for r in baseline["results"]:
            r["p50_ms"] *= factor
        path = tmp_path / f"baseline-{factor}.json"
        path.write_text(json.dumps(baseline))
        code, stdout, stderr = run([*argv[:6], *FAST, "--baseline", str(path), "--max-regression", "5%"], capsys)
        assert code == expected, stderr
        assert ("REGRESSED" in stdout) == bool(expected)
        if expected:
            assert stderr.strip().startswith("error: latency regression: 8 of 8")

    # Measuring less than the baseline (batch 1 only) fails, naming what is missing.
    path = tmp_path / f"baseline-{1e4}.json"
    code, _, stderr = run([*argv[:3], "1", *argv[4:6], *FAST, "--baseline", str(path)], capsys)
    assert code == 1 and "Traceback" not in stderr
    assert stderr.strip().splitlines() == [
        "error: this run lacks 4 of the baseline's 8 measurements (torch-cpu-fp32 dense batch 2 p50 ms, "
        "torch-cpu-fp32 pruned batch 2 p50 ms, ort-cpu-fp32 dense batch 2 p50 ms, ...); "
        "measure the same backends and batch sizes, or re-record the baseline"
    ]


@pytest.mark.e2e
def test_a_baseline_with_a_zero_p50_is_refused_before_measuring(run_dir, tmp_path, capsys) -> None:
    zero = copy.deepcopy(RECORD)
    zero["results"][0]["p50_ms"] = 0.0
    path = tmp_path / "zero.json"
    path.write_text(json.dumps(zero))
    code, stdout, stderr = run(["bench", str(run_dir), "--backends", "ort-cpu-fp32", "--baseline", str(path)], capsys)
    assert code == 1 and stdout == ""
    assert stderr.strip().splitlines() == [
        f"error: baseline {path}: measurement 0 lacks backend, model, batch or a positive p50_ms; "
        "re-record it with `corp-deploy bench --json`"
    ]


@pytest.mark.e2e
def test_sweep_calibrates_once_and_each_sparsity_equals_a_direct_prune(tmp_path) -> None:
    """Statistics reused across sparsities must give exactly what a fresh prune at that sparsity gives."""
    pytest.importorskip("onnxruntime", reason="onnxruntime not installed (pip install '.[onnx]')")
    import torch
    from helpers import TINY, pruned_copy, tiny_batches, tiny_vit

    import corp_deploy
    from corp_deploy.apps.sweep import format_sweep, parse_sparsities, sweep
    from corp_deploy.core.config import PruneConfig
    from corp_deploy.formats.sources import describe

    model = tiny_vit()
    description = describe(model, "deit_tiny_patch16_224", {**TINY, "num_classes": 10}, "random")
    fast = Method(warmup_iters=1, warmup_seconds=0, min_iters=2, min_seconds=0)
    config = PruneConfig(round_to=4)
    out = tmp_path / "sweep"
    result = sweep(model, description, tiny_batches(), [0.0, 0.25, 0.5], config, out, "ort-cpu-fp32", (1, 2), fast)
    assert [r["sparsity"] for r in result["rows"]] == [0.0, 0.25, 0.5]
    assert result["rows"][0]["flop_ideal_speedup"] == pytest.approx(1.0)
    assert result["rows"][0]["params"] > result["rows"][1]["params"] > result["rows"][2]["params"]
    assert all(len(r["bench"]) == 2 for r in result["rows"])  # batch 1 and 2, dense vs pruned each
    expected, _ = pruned_copy(tiny_vit(), PruneConfig(sparsity=0.5, round_to=4))
    got = corp_deploy.load_pruned(out / "s0.50" / "pruned")
    for key, value in expected.state_dict().items():
        torch.testing.assert_close(got.state_dict()[key], value, rtol=1e-6, atol=1e-6)
    assert (out / "s0.50" / "bench.json").is_file() and (out / "sweep.json").is_file()
    assert "FLOP ideal" in format_sweep(result)
    assert parse_sparsities("0.5,0,0.5") == [0.0, 0.5]
    with pytest.raises(CorpError, match="--sparsities"):
        parse_sparsities("0.5,1.0")


@pytest.mark.e2e
def test_sweep_recovers_every_point_as_prune_does(tmp_path) -> None:
    """With a recovery, each point's artifact is what ``prune`` + ``recover_pruned`` make of the same data (the
    command ``prune --recover-steps`` runs), not CORP alone, and the records say what the recovery did."""
    pytest.importorskip("onnxruntime", reason="onnxruntime not installed (pip install '.[onnx]')")
    import copy

    import torch
    from helpers import TINY, pruned_copy, tiny_batches, tiny_vit

    import corp_deploy
    from corp_deploy import api
    from corp_deploy.apps.sweep import sweep
    from corp_deploy.core.config import PruneConfig
    from corp_deploy.core.recover import Kept, Recovery
    from corp_deploy.families import adapter_for
    from corp_deploy.formats.sources import describe

    recovery, config = Recovery(steps=4, lr=1e-3), PruneConfig(sparsity=0.5, round_to=4)
    model = tiny_vit()
    description = describe(model, "deit_tiny_patch16_224", {**TINY, "num_classes": 10}, "random")
    fast = Method(warmup_iters=1, warmup_seconds=0, min_iters=2, min_seconds=0)
    out, batches = tmp_path / "sw", tiny_batches()
    result = sweep(model, description, batches, [0.5], config, out, "ort-cpu-fp32", (1,), fast, recovery=recovery)
    assert result["recovery"] == {"steps": 4, "minutes": None, "lr": 1e-3, "target": "blocks"}
    row = result["rows"][0]["recovery"]
    assert row["steps"] == 4 and row["kept"] == "recovered" and "history" not in row
    assert row["loss_after"] < row["loss_before"]

    dense, kept = tiny_vit(), Kept(tiny_batches(), adapter_for(model).count)
    direct = api.prune(copy.deepcopy(dense), kept, config, "cpu", progress=False)
    api.recover_pruned(direct, dense, kept.batches, recovery)
    got = corp_deploy.load_pruned(out / "s0.50" / "pruned").state_dict()
    for key, value in direct.model.state_dict().items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6)
    alone = pruned_copy(tiny_vit(), config)[0].state_dict()
    assert max((got[k] - v).abs().max().item() for k, v in alone.items()) > 1e-4  # recovered, not CORP alone


@pytest.mark.e2e
def test_sweep_command_line(tmp_path, capsys) -> None:
    pytest.importorskip("onnxruntime", reason="onnxruntime not installed (pip install '.[onnx]')")
    argv = ["sweep", "deit_tiny", "--weights", "random", *TINY_CLI_ARGS, "--round-to", "4", "--quiet"]
    argv += ["--calib", "synthetic", "--num-calib", "16", "--sparsities", "0,0.5", "--backends", "ort-cpu-fp32"]
    code, stdout, stderr = run(
        [*argv, "--batch-sizes", "1,2", "--min-seconds", "0", "--out", str(tmp_path / "sw")], capsys
    )
    assert code == 0, stderr
    assert "FLOP ideal" in stdout and (tmp_path / "sw" / "s0.50" / "bench.json").is_file()


@pytest.mark.e2e
def test_sweep_refuses_an_existing_folder_without_overwrite_before_calibrating(tmp_path, capsys, monkeypatch) -> None:
    out = tmp_path / "sw"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    argv = ["sweep", "deit_tiny", "--weights", "random", *TINY_CLI_ARGS, "--calib", "synthetic", "--out", str(out)]
    monkeypatch.setattr("corp_deploy.cli.inputs.create_model", _never)
    code, _, stderr = run(argv, capsys)
    assert code == 1 and f"output {out} already exists" in stderr and "--overwrite" in stderr
    assert [p.name for p in out.iterdir()] == ["mine.txt"]


def _never(*args, **kwargs):
    raise AssertionError("the model was built: the check came too late")


@pytest.mark.e2e
def test_sweep_copies_the_dense_graph_with_its_external_weights_and_sidecar(tmp_path, monkeypatch) -> None:
    """A dense graph stored with external data (models over 2 GB) must reach every sparsity's folder whole, and
    stay loadable: onnx (1.23) refuses an external data file with several hard links ("hardlink attack")."""
    pytest.importorskip("onnxruntime", reason="onnxruntime not installed (pip install '.[onnx]')")
    from helpers import TINY, tiny_batches, tiny_vit

    from corp_deploy.apps.sweep import sweep
    from corp_deploy.core.config import PruneConfig
    from corp_deploy.exporters.onnx_export import check_onnx, load_onnx
    from corp_deploy.formats.sources import describe

    monkeypatch.setattr(
        "corp_deploy.exporters.onnx_export.MAX_SINGLE_FILE", 0
    )  # every graph keeps its weights beside it
    model = tiny_vit()
    description = describe(model, "deit_tiny_patch16_224", {**TINY, "num_classes": 10}, "random")
    fast = Method(warmup_iters=1, warmup_seconds=0, min_iters=2, min_seconds=0)
    out = tmp_path / "sw"
    result = sweep(model, description, tiny_batches(), [0.5], PruneConfig(round_to=4), out, "ort-cpu-fp32", (1,), fast)
    assert len(result["rows"][0]["bench"]) == 1  # dense and pruned both ran from s0.50/
    for name in ("dense.onnx", "dense.onnx.data", "dense.onnx.json"):
        assert (out / "s0.50" / name).read_bytes() == (out / name).read_bytes()
    for graph in (out / "dense.onnx", out / "s0.50" / "dense.onnx"):
        check_onnx(graph)
        assert load_onnx(graph).graph.initializer  # the weights load from the graph's own data file


def test_sweep_plot_with_a_backend_skipped_at_one_sparsity(tmp_path) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib not installed (pip install '.[bench]')")
    from corp_deploy.apps.sweep import plot_sweep

    def row(sparsity: float, backends: list[str]) -> dict:
        bench = [{"backend": b, "batch": 32, "throughput_ratio": 1 + sparsity} for b in backends]
        return {"sparsity": sparsity, "flop_ideal_speedup": 1 / (1 - sparsity), "bench": bench}

    result = {"model": "m", "rows": [row(0.0, ["ort", "torch"]), row(0.5, ["ort"])]}
    plot_sweep(result, tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").stat().st_size > 0


@pytest.mark.parametrize("field", ["min_iters", "round_iters", "warmup_seconds"])
def test_timing_method_validates_itself_naming_the_field(field) -> None:
    with pytest.raises(CorpError, match=f"timing method {field} must be >= "):
        Method(**{field: -1})
