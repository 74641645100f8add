"""A finished prune is never lost: a step after it that stops (Ctrl-C as a real SIGINT to a child process, or a
failure) leaves the pruned artifact and every finished file whole, removes what was unfinished, says in one line
what stopped and the commands that finish the job (which are run here), and exits non-zero without a traceback.
Also: a Qwen2 config with null special token ids (``Qwen2Config()``'s defaults) still gets its genai folder."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import DECODER_VOCAB, PRUNE, decoder_tokenizer, run

from corp_deploy import load_pruned
from corp_deploy.exporters.compare import Tolerance
from corp_deploy.exporters.onnx_export import load_onnx, read_metadata
from corp_deploy.exporters.tensorrt_engine import build_missing

pytestmark = pytest.mark.e2e
pytest.importorskip("onnxruntime", reason="onnxruntime not installed (pip install '.[onnx]')")
pytest.importorskip("onnxscript", reason="onnxscript not installed (pip install '.[onnx]')")

TINY_EXPORT = [
    "prune-export",
    *PRUNE[1:],
    "--calib",
    "synthetic",
    "--batch-range",
    "1:4:8",
    "--verify-batch-sizes",
    "1,2",
]
INT8 = ["--int8-calib", "8", "--int8-verify", "4"]
ENGINES = build_missing()


def stopped_line(stderr: str) -> str:
    """The one ``error:`` line of a stopped run (and no traceback)."""
    assert "Traceback" not in stderr, stderr
    (line,) = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    return line


def whole(run_dir: Path) -> set[str]:
    """What a stopped run left: no staging leftovers, every graph and engine with its sidecar, no ``export.json``
    (the record of a whole run), and a pruned artifact that loads; its names."""
    names = {p.name for p in run_dir.iterdir()}
    assert not [n for n in names if n.startswith(".")], names
    assert all(f"{n}.json" in names for n in names if n.endswith((".onnx", ".plan"))), names
    assert "export.json" not in names
    load_pruned(run_dir / "pruned")
    return names


def finish(line: str, capsys, replace: dict[str, str] | None = None) -> None:
    """Run, in this process, the commands ``line`` says finish the job (with ``replace``'s arguments swapped)."""
    for command in line.split("to finish: ", 1)[1].split(" && "):
        argv = [(replace or {}).get(a, a) for a in shlex.split(command)]
        assert argv[0] == "corp-deploy", command
        code, _, err = run(argv[1:], capsys)
        assert code == 0, f"{command}: {err}"


STEPS = {
    "ONNX export and verification (dense, pruned)": ["--precision", "fp32"],
    "INT8 quantization": [*INT8, "--precision", "fp32,int8"],
    "TensorRT engines": ["--precision", "fp32"],
}


@pytest.mark.parametrize("step", STEPS)
def test_ctrl_c_at_the_start_of_each_step_after_the_prune(step, tmp_path, capsys) -> None:
    """A real SIGINT, sent when the child prints the step's first line; then the finishing commands make the rest."""
    if step == "TensorRT engines" and ENGINES:
        pytest.skip(f"no engine builds here: {ENGINES}")
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "corp_deploy", *TINY_EXPORT, *STEPS[step], "--out", str(out)]
    child = (
        subprocess.Popen(  # SIGINT as a terminal sends it, even where this run's shell ignores it (a background job)
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    )
    seen = []
    for printed in child.stdout:
        seen.append(printed)
        if printed.startswith(f"{step}..."):
            child.send_signal(signal.SIGINT)
            break
    _, stderr = child.communicate(timeout=300)
    assert seen[-1].startswith(f"{step}..."), "".join(seen) + stderr
    assert child.returncode == 130, stderr
    line = stopped_line(stderr)
    assert line.startswith(f"error: interrupted during {step}; {out}/ holds ") and "to finish: corp-deploy " in line
    names = whole(out)
    graphs = {"dense.onnx", "dense.fp16.onnx", "pruned.onnx", "pruned.fp16.onnx"}
    if step.startswith("ONNX"):
        assert "pruned.onnx" not in names  # dense was being exported, pruned not begun
    else:
        assert graphs & names == {"dense.onnx", "pruned.onnx"}
    finish(line, capsys)
    made = {p.name for p in out.iterdir()}
    assert {"dense.onnx", "pruned.onnx"} <= made
    assert "int8" not in step or {"dense.int8.onnx", "pruned.int8.onnx"} <= made
    assert step != "TensorRT engines" or {"dense.fp32.plan", "pruned.fp32.plan"} <= made


def test_a_failed_fp16_conversion_keeps_the_prune_and_the_fp32_graph(tmp_path, capsys, monkeypatch) -> None:
    from corp_deploy.base.errors import CorpError

    def broken(*args, **kwargs):
        raise CorpError("FP16 ONNX dense.fp16.onnx differs from its FP32 graph")

    monkeypatch.setattr("corp_deploy.exporters.pipeline.convert_verified", broken)
    out = tmp_path / "run"
    code, stdout, stderr = run([*TINY_EXPORT, "--precision", "fp32,fp16", "--out", str(out)], capsys)
    line = stopped_line(stderr)
    assert code == 1 and "ONNX export and verification (dense, pruned) failed: FP16 ONNX dense.fp16.onnx" in line
    assert whole(out) == {"pruned", "dense.onnx", "dense.onnx.json"}
    assert f"wrote {out}/pruned/" in stdout  # said as soon as it was there
    monkeypatch.undo()
    finish(line, capsys)  # dense again (--overwrite: its FP32 graph is there), pruned, and the engines if any
    assert {"dense.fp16.onnx", "pruned.fp16.onnx"} <= {p.name for p in out.iterdir()}


def test_an_int8_graph_that_misses_its_gate_keeps_the_fp32_graphs(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr("corp_deploy.cli.export_options.INT8", Tolerance(min_cosine=1.0, max_rel_error=0.0))
    out = tmp_path / "run"
    code, _, stderr = run([*TINY_EXPORT, *INT8, "--precision", "fp32,int8", "--out", str(out)], capsys)
    line = stopped_line(stderr)
    assert code == 1 and "INT8 quantization failed: INT8 ONNX dense.int8.onnx against dense.onnx" in line
    assert whole(out) == {"pruned", "dense.onnx", "dense.onnx.json", "pruned.onnx", "pruned.onnx.json"}
    assert f"to finish: corp-deploy quantize {out} --calib synthetic --int8-calib 8 --int8-verify 4" in line


@pytest.mark.skipif(ENGINES is not None, reason=f"no engine builds here: {ENGINES}")
def test_a_failed_engine_keeps_the_engines_built_before_it(tmp_path, capsys, monkeypatch) -> None:
    from corp_deploy.base.errors import CorpError
    from corp_deploy.exporters import pipeline

    real, built = pipeline.engine_verified, []

    def third_fails(source, engine, *args, **kwargs):
        if len(built) == 2:
            raise CorpError(f"TensorRT-RTX could not build an engine from {source.name}: out of workspace")
        built.append(engine.name)
        return real(source, engine, *args, **kwargs)

    monkeypatch.setattr(pipeline, "engine_verified", third_fails)
    out = tmp_path / "run"
    code, _, stderr = run([*TINY_EXPORT, "--out", str(out)], capsys)
    line = stopped_line(stderr)
    assert code == 1 and "TensorRT engines failed: TensorRT-RTX could not build" in line
    assert {"dense.fp32.plan", "pruned.fp32.plan"} <= whole(out) and "dense.fp16.plan" not in whole(out)
    monkeypatch.undo()
    finish(line, capsys)
    assert {"dense.fp16.plan", "pruned.fp16.plan"} <= {p.name for p in out.iterdir()}


def qwen2_folder(root: Path, tokenizer: bool) -> Path:
    """A tiny Qwen2 from ``Qwen2Config``'s defaults but its sizes: BOS, EOS and pad ids all null."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=DECODER_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (None, None, None)
    folder = root / "tiny-qwen2"
    transformers.Qwen2ForCausalLM(config).eval().save_pretrained(folder)
    if tokenizer:
        decoder_tokenizer().save_pretrained(folder)
    return folder


DECODER = ["--calib", "synthetic", "--seq-len", "16", "--round-to", "4", "--quiet", "--num-calib", "8"]
DECODER += ["--verify-batch-sizes", "1,2"]


def test_a_qwen2_with_null_special_ids_gets_them_from_its_tokenizer_and_an_int4_gate_miss_keeps_the_rest(
    tmp_path, capsys
) -> None:
    pytest.importorskip("onnxruntime_genai")
    out = tmp_path / "run"
    int4 = ["--int4-seq-len", "16", "--int4-windows", "2", "--int4-block-size", "16", "--tol-ppl-ratio", "0.5"]
    argv = ["prune-export", str(qwen2_folder(tmp_path, True)), *DECODER, "--precision", "fp32,int4", *int4]
    code, stdout, stderr = run([*argv, "--out", str(out)], capsys)
    line = stopped_line(stderr)
    assert code == 1 and "INT4 quantization failed: " in line and "gate" in line
    names = whole(out)
    assert {"dense.onnx", "pruned.onnx", "dense-genai", "pruned-genai"} <= names
    assert type(load_pruned(out / "pruned")).__name__ == "Qwen2ForCausalLM"
    for stem in ("dense", "pruned"):
        config = json.loads((out / f"{stem}-genai" / "genai_config.json").read_text())["model"]
        assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 0)  # the tokenizer's
        record = json.loads((out / f"{stem}-genai" / "model.onnx.json").read_text())
        assert all(p["genai_equal"] for p in record["genai"]["prompts"])
    assert "special token ids: the config leaves them null: eos_token_id 2 from the tokenizer" in stdout
    assert f"to finish: corp-deploy quantize {out} --precision int4 " in line and "--tol-ppl-ratio 0.5" in line
    finish(line, capsys, {"0.5": "1000"})  # the same command with a gate it can pass
    assert {"dense-genai-int4", "pruned-genai-int4"} <= {p.name for p in out.iterdir()}


def test_a_qwen2_with_no_eos_anywhere_keeps_its_prune_and_onnx(tmp_path, capsys) -> None:
    """The default precisions (FP32, FP16): a Qwen2's rotary embedding stays FP32 in the FP16 graph (the converter
    mistypes its int -> float Cast otherwise, and FP16 positions past 2048 are not whole numbers)."""
    pytest.importorskip("onnxruntime_genai")
    out = tmp_path / "run"
    argv = ["prune-export", str(qwen2_folder(tmp_path, False)), *DECODER]
    code, _, stderr = run([*argv, "--out", str(out)], capsys)
    line = stopped_line(stderr)
    assert code == 1 and "genai folders (dense, pruned) failed: the model names no eos_token_id" in line
    assert {"pruned", "dense.onnx", "pruned.onnx", "dense.fp16.onnx", "pruned.fp16.onnx"} <= whole(out)
    assert "dense-genai" not in whole(out)
    for stem in ("dense", "pruned"):
        record = read_metadata(load_onnx(out / f"{stem}.fp16.onnx", weights=False))
        kept = record["fp16_kept_fp32_nodes"]  # the TorchScript tracer names its rotary nodes and keeps the upcasts
        assert record["precision"] == "fp16" and re.fullmatch(r"[1-9]\d* rotary, 9 Cast to FP32", kept), record
    assert f"to finish: corp-deploy export {tmp_path / 'tiny-qwen2'} " in line and f"--out {out}/dense-genai" in line


def test_a_sweep_stopped_at_a_point_keeps_the_finished_ones_and_resumes(tmp_path, capsys, monkeypatch) -> None:
    from corp_deploy.apps import sweep

    real, benched = sweep.benchmark, []

    def second_interrupted(run_folder, *args, **kwargs):
        benched.append(run_folder.root.name)
        if len(benched) == 2:
            raise KeyboardInterrupt
        return real(run_folder, *args, **kwargs)

    monkeypatch.setattr(sweep, "benchmark", second_interrupted)
    out = tmp_path / "sw"
    argv = ["sweep", *PRUNE[1:], "--calib", "synthetic", "--sparsities", "0,0.5", "--backends", "ort-cpu-fp32"]
    argv += ["--batch-sizes", "1", "--min-seconds", "0", "--out", str(out)]
    code, _, stderr = run(argv, capsys)
    line = stopped_line(stderr)
    assert code == 130 and line.startswith("error: interrupted during sweep point s0.50; ")
    assert line.endswith(f"to finish: {shlex.join(['corp-deploy', *argv, '--resume'])}")
    assert (out / "s0.00" / "bench.json").is_file() and not (out / "s0.50" / "bench.json").exists()
    assert not (out / "sweep.json").exists() and not [p for p in out.iterdir() if p.name.startswith(".")]
    code, _, stderr = run(argv, capsys)
    assert code == 1 and "pass --resume to continue its sweep" in stderr
    before = (out / "s0.00" / "bench.json").read_text()
    code, _, stderr = run([*argv, "--min-seconds", "0.001", "--resume"], capsys)  # issue 50, item 1: no mixing
    assert code == 1 and stderr.strip().splitlines() == [
        f"error: --resume: {out / 's0.00'} was made with --min-seconds 0.0, this command has --min-seconds 0.001; "
        "resume with the options it was made with, or start again with --overwrite"
    ]
    assert len(benched) == 2 and (out / "s0.00" / "bench.json").read_text() == before
    code, stdout, stderr = run([*argv, "--resume"], capsys)
    assert code == 0, stderr
    assert len(benched) == 3 and "s0.00 finished, kept" in stdout  # only s0.50 was benched again
    assert (out / "s0.00" / "bench.json").read_text() == before
    rows = json.loads((out / "sweep.json").read_text())["rows"]
    assert [r["sparsity"] for r in rows] == [0.0, 0.5] and all(r["bench"] for r in rows)


def test_a_speed_target_inside_the_noise_band_but_below_it_is_not_called_met() -> None:
    from corp_deploy.plan.report import verdict

    check = {"target_speedup": 1.5, "measured_speedup": 1.41, "met": True}  # 6% short, inside a +-7% band
    assert verdict(check) == "within the noise band, not reached"
    assert verdict(check | {"measured_speedup": 1.52}) == "met"
    assert verdict(check | {"measured_speedup": 1.2, "met": False}) == "MISSED"


def test_a_model_given_by_a_path_gets_its_last_part_as_the_default_folder(tmp_path, monkeypatch) -> None:
    from corp_deploy.cli.options import out_path
    from corp_deploy.core.config import PruneConfig

    monkeypatch.chdir(tmp_path)
    path = "/home/me/venvs/x/lib/python3.11/site-packages/pkg/model/"
    assert out_path(None, path, PruneConfig(sparsity=0.3), False) == "runs/model-s30"
    assert out_path(None, "deit_small", PruneConfig(sparsity=0.5), False) == "runs/deit_small-s50"


def test_a_recovery_says_about_ten_lines_whatever_its_steps() -> None:
    from helpers import pruned_copy, tiny_batches, tiny_vit

    from corp_deploy.core.config import PruneConfig
    from corp_deploy.core.recover import recover

    dense = tiny_vit()
    pruned, _ = pruned_copy(dense, PruneConfig(sparsity=0.5, round_to=4))
    lines = []
    record = recover(pruned, dense, tiny_batches(n=16), steps=40, lr=1e-4, say=lines.append)
    assert record.steps == 40 and len(record.history) == 40  # the record keeps every step
    assert len(lines) == 10 and lines[-1].startswith("recovery step 40: loss ")


def test_third_party_info_logging_is_silenced_unless_verbose(capsys, monkeypatch) -> None:
    """onnxruntime's INT4 quantizer sets the root logger to INFO when imported; torch.export's ONNX passes then log
    54 INFO lines for a tiny ViT through onnxscript and onnx_ir, and onnx_ir warns about graphs it repairs as it
    reads them. The CLI sets those two to ERROR."""
    import logging

    from corp_deploy.cli import QUIET_LOGGERS

    assert QUIET_LOGGERS == ("onnxscript", "onnx_ir")
    for name in QUIET_LOGGERS:
        monkeypatch.setattr(logging.getLogger(name), "level", logging.NOTSET)
    assert run(["--verbose", "prune", "--help"], capsys)[0] == 0
    assert {logging.getLogger(n).level for n in QUIET_LOGGERS} == {logging.NOTSET}
    assert run(["prune", "--help"], capsys)[0] == 0
    assert {logging.getLogger(n).level for n in QUIET_LOGGERS} == {logging.ERROR}
    # issue 50, item 11: onnx_ir's "The model is invalid but we will still create a new input" despite the help
    assert not logging.getLogger("onnx_ir.serde").isEnabledFor(logging.WARNING)


def test_a_ctrl_c_inside_a_held_block_waits_for_its_end(tmp_path) -> None:
    """A real SIGINT, raised where ``check_writable`` makes and removes its probe folder (where a Ctrl-C once left
    ``.dense.onnx.check-*`` in a MiniLM run folder): the block finishes, then the interrupt arrives."""
    from corp_deploy.base.fsio import held_interrupt

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as Python starts, even in a background job
    probe, done = tmp_path / ".probe", []
    try:
        with pytest.raises(KeyboardInterrupt), held_interrupt():
            probe.mkdir()
            signal.raise_signal(signal.SIGINT)
            probe.rmdir()
            done.append(True)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
    assert done and list(tmp_path.iterdir()) == []
