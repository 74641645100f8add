"""The GPU suite on the CPU: every section's code path on a tiny model (so it cannot rot between GPU
runs), its ingest into the docs, and its bad inputs (one line, exit 2)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from corp_deploy.families import structure
from corp_deploy.plan import speed
from tools.gpu_suite.core import Context, Plan
from tools.gpu_suite.record import BEGIN, END, ingest
from tools.gpu_suite.registry import SECTIONS
from tools.gpu_suite.sections import kernel_kind
from tools.gpu_suite.speedup import run_speedup, speedup_markdown
from tools.gpu_suite.suite import main


def _fake_s(model: torch.nn.Module) -> float:
    """Seconds made up from the block widths: a fixed cost plus a linear one per block."""
    blocks = structure(model)  # a replaced module (--depth) has no widths: 1e-5 for its stand-in
    return 1e-3 + sum(
        (1e-5 * b["mlp_hidden"] if "mlp_hidden" in b else 1e-5)
        + (3e-5 * b["qk_dim"] + 2e-5 * b["v_dim"] if "qk_dim" in b else 1e-5)
        for b in blocks
    )


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("suite") / "run"
    with pytest.MonkeyPatch.context() as mp:  # the speedup section's latency tables: cached, but not in ~/.cache
        mp.setenv("XDG_CACHE_HOME", str(out.parent / "cache"))
        # a tiny model's CPU timings are noise (a table may even show no gain): the speedup section times with a
        # cost made up from the widths, so its records are checked, never a speed
        mp.setattr(speed, "time_against", lambda _, models, *__: {n: _fake_s(m) for n, m in models.items()})
        mp.setattr(speed, "time_models", lambda models, *_: {n: [_fake_s(m)] * 6 for n, m in models.items()})
        assert main(["--out", str(out), "--smoke", "--device", "cpu", "--budget", "900"]) == 0
    return out


@pytest.mark.e2e
def test_smoke_runs_every_section_into_three_files(smoke) -> None:
    assert sorted(p.name for p in smoke.iterdir()) == ["suite.json", "suite.log", "summary.md"]
    suite = json.loads((smoke / "suite.json").read_text())
    assert [s["name"] for s in suite["sections"]] == list(SECTIONS)
    assert all(s["status"] == "ok" for s in suite["sections"]), suite["sections"]
    rec = suite["records"]
    assert rec["tests"]["skipped"] >= 5 and rec["tests"]["failed"] == 0  # every gpu test skips with its reason
    if not torch.cuda.is_available():
        assert all(c["message"] == "no CUDA GPU visible" for c in rec["tests"]["cases"])
    (row,) = rec["prune"]["rows"]
    assert row["images"] == 16 and row["params"][1] < row["params"][0] and row["macs"][1] < row["macs"][0]
    modes = {(r["mode"], r["precision"], r["batch"]) for r in rec["latency"]["rows"]}
    assert modes == {("eager", "fp32", 1), ("eager", "fp32", 2), ("eager", "bf16", 1), ("eager", "bf16", 2)} | {
        ("compile", "fp32", 1)
    }
    for r in rec["latency"]["rows"]:
        assert r["p50_ratio"] == pytest.approx(r["pruned"]["p50_ms"] / r["dense"]["p50_ms"])
        assert r["v_throughput_ratio"] == pytest.approx(r["pruned_v"]["throughput"] / r["dense"]["throughput"])
    sdpa = {r["variant"]: r for r in rec["sdpa"]["rows"]}
    assert sdpa["qk_pruned"]["accepted"]["flash"].startswith("no: Flash attention requires q,k,v")
    assert sdpa["dense"]["accepted"]["flash"] == sdpa["equal_width"]["accepted"]["flash"] == "yes"
    assert sdpa["qk_zero_padded"]["qk_dim"] == sdpa["qk_zero_padded"]["v_dim"]
    engines = rec["engines"]
    if "version" in engines["modules"]["tensorrt_rtx_bindings"]:  # CI installs it: real engines, built only
        rows = {p["model"]: p for p in engines["pipeline"]}
        assert rows["dense"]["attention"]["fused_mha_layers"] == 2  # one fused MHA per block...
        assert rows["pruned"]["attention"]["fused_mha_layers"] == 0  # ...lost when Q/K width != V width
        if not torch.cuda.is_available():
            assert rows["pruned"]["status"].startswith("built only (not executed") and rows["pruned"]["verify"] is None
    speedup = rec["speedup"]
    assert speedup["backend"] == "torch-cpu-fp32" and not speedup["skipped"]
    levers = [(r["lever"], r["batch"], r["goal"]) for r in speedup["rows"]]
    assert levers == [(lever, b, 1.2) for lever in ("width", "width+depth") for b in (2, 1)]
    for r in speedup["rows"]:  # the made-up cost is additive: the table predicts it, the loop meets it at once
        assert r["goal_met"] and r["loop_met"] and r["rounds"] == 1 and r["measured_speedup"] >= r["goal"]
        assert r["measured_speedup"] == pytest.approx(r["dense_p50_ms"] / r["pruned_p50_ms"])
        assert r["measured_speedup"] == pytest.approx(r["predicted_speedup"]) and r["macs"][1] < r["macs"][0]
    dense = rec["profile"]["models"]["dense"]
    assert {"gemm", "attention", "layer_norm"} <= set(dense["kinds"]) and "aten::addmm" in dense["top"]
    summary = (smoke / "summary.md").read_text()
    assert "SMOKE" in summary and "**Pruning time**" in summary and "| deit_tiny | eager | fp32 | 1 |" in summary
    assert "**Prune to a speed** (deit_tiny on torch-cpu-fp32" in summary and "| width | 2 | >= 1.20x |" in summary


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible here")
def test_the_speedup_section_skips_in_one_line_where_its_backend_cannot_run() -> None:
    """The full plan's backend (torch-cuda-fp16-graph) without a GPU: the section is skipped with the reason, and
    nothing is built or timed."""
    plan = replace(Plan.smoke(), speedup=("deit_tiny", Plan.full().speedup[1], ((64, 1.65),)))
    ctx = Context(torch.device("cpu"), plan, True, float("inf"), lambda line: None)
    record = run_speedup(ctx)
    assert record["rows"] == [] and "no CUDA GPU visible" in record["skipped"]
    assert speedup_markdown(record)[-1] == f"- not measured: {record['skipped']}"


@pytest.mark.e2e
def test_ingest_replaces_the_block_and_merges_split_runs(smoke, tmp_path) -> None:
    docs = tmp_path / "BENCHMARKS.md"
    docs.write_text(f"# Benchmarks\n\nbefore\n\n{BEGIN}\nold rows\n{END}\n\nafter\n")
    tests_only = tmp_path / "second"
    suite = json.loads((smoke / "suite.json").read_text())
    suite["sections"] = [s for s in suite["sections"] if s["name"] == "tests"]
    suite["records"] = {"tests": suite["records"]["tests"] | {"command": "pytest -m gpu (second run)"}}
    tests_only.mkdir()
    (tests_only / "suite.json").write_text(json.dumps(suite))
    ingest([smoke, tests_only], docs)
    text = docs.read_text()
    assert text.startswith("# Benchmarks\n\nbefore\n\n") and text.endswith("\n\nafter\n") and "old rows" not in text
    assert (
        text.count(BEGIN) == 1 and "second run" in text and "| tests | run 2 |" in text and "| prune | run 1 |" in text
    )
    assert "pytest -m gpu (second run)`**: 0 passed" in text and text.count("**Pruning time**") == 1
    ingest([smoke, tests_only], docs)
    assert docs.read_text() == text  # idempotent


def test_kernel_kinds_of_real_kernel_names() -> None:
    assert kernel_kind("sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert kernel_kind("nvjet_sm90_hsh_192x192_64x4_2x1_v_bz_coopB_bias_TNN") == "gemm"
    # names seen on an H200 (torch 2.11, cuDNN 9): cuDNN's attention kernel says fprop too
    assert kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64") == "attention"
    assert kernel_kind("void cutlass__5x_cudnn::Kernel<cutlass_tensorop_f16_s16816fprop_optimized_f16>") == "patch_conv"
    assert kernel_kind("void cudnn::engines_precompiled::nchwToNhwcKernel<__half, __half, float>") == "patch_conv"
    assert (
        kernel_kind("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::Half>") == "layer_norm"
    )
    assert kernel_kind("aten::gelu") == "gelu"
    assert kernel_kind("void at::native::elementwise_kernel<128, 2>") == "other"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--smoke", "--device", "cpu", "--only", "tests,nope"], "unknown section nope; choose from tests"),
        (["--device", "cpu"], "--device cpu measures nothing worth recording; add --smoke"),
        (["--smoke", "--device", "tpu"], "--device must be cuda or cpu"),
        ([], "pass --out DIR"),
    ],
)
@pytest.mark.e2e
def test_bad_input_is_one_line_and_exit_2(argv, message, tmp_path, capsys) -> None:
    out = ["--out", str(tmp_path / "out")] if argv else []
    assert main([*out, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible here")
@pytest.mark.e2e
def test_cuda_without_a_gpu_says_what_to_run(tmp_path, capsys) -> None:
    assert main(["--out", str(tmp_path / "out")]) == 2
    assert "no CUDA GPU is visible; on a CPU machine run --smoke --device cpu" in capsys.readouterr().err


@pytest.mark.e2e
def test_existing_output_and_foreign_ingest_folders_are_refused(smoke, tmp_path, capsys) -> None:
    assert main(["--out", str(smoke), "--smoke", "--device", "cpu"]) == 2
    assert "exists; choose another --out or pass --overwrite" in capsys.readouterr().err
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    assert main(["--ingest", str(foreign)]) == 2
    assert "is not a gpu-suite result" in capsys.readouterr().err
    (foreign / "suite.json").write_text(json.dumps({"schema": "corp-deploy/bench"}))
    assert main(["--ingest", str(foreign)]) == 2
    assert "is not a gpu-suite record (schema 'corp-deploy/bench'" in capsys.readouterr().err
    copy = tmp_path / "smoke"
    shutil.copytree(smoke, copy)
    assert main(["--ingest", str(copy)]) == 2  # into the real docs: a smoke run measures nothing
    assert "these are smoke runs" in capsys.readouterr().err
