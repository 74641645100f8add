"""Faults at the edges: the regression gate at its threshold, atomic writers that fail half way, corrupt artifacts.

The gate: a change exactly at the threshold, a baseline that cannot be divided by, a run that
measured less than its baseline. The writers: an ``--overwrite`` that fails half way leaves the
old artifact as it was. The reader: corrupt, foreign, future and inconsistent ``corp.json`` files
are one-line errors that say what to do.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import PRUNE, RECORD, TINY, bench_record, pruned_copy, run, tiny_vit

import corp_deploy
from corp_deploy import api
from corp_deploy.base.errors import CorpError
from corp_deploy.base.fsio import atomic_file
from corp_deploy.bench import gate
from corp_deploy.core.config import PruneConfig
from corp_deploy.formats.artifact import FORMAT, FORMAT_VERSION, META_FILE, WEIGHTS_FILE, save_pruned

# ------------------------------------------------------------------------------------------ gate


@pytest.mark.parametrize(
    ("baseline", "current", "limit"),
    [
        (8.0, 10.0, 0.25),  # 10 / 8 - 1 is exactly 0.25 in binary
        (10.0, 10.5, gate.parse_fraction("5%")),  # 10.5 / 10 - 1 is 0.05000000000000004 in floating point
        (40.0, 44.0, gate.parse_fraction("10%")),
    ],
)
def test_absolute_gate_passes_a_change_equal_to_the_threshold_and_fails_just_beyond(baseline, current, limit) -> None:
    """The docs promise a failure for a slowdown *beyond* --max-regression: equal passes."""
    base = bench_record({("ort", "dense", 1): baseline, ("ort", "pruned", 1): baseline})
    now = bench_record({("ort", "dense", 1): current, ("ort", "pruned", 1): current * (1 + 1e-6)})
    dense, pruned = gate.compare(now, base, limit, "absolute")
    assert dense.change == pytest.approx(limit, abs=1e-12) and not dense.regressed
    assert pruned.regressed  # one part in a million beyond the threshold
    assert "1 of 2 regressed" in gate.format_checks([dense, pruned], limit, "absolute")


def test_ratio_gate_passes_a_speedup_loss_equal_to_the_threshold() -> None:
    base = bench_record({("ort", "dense", 1): 10.0, ("ort", "pruned", 1): 8.0})  # speedup 1.25
    even = bench_record({("ort", "dense", 1): 10.0, ("ort", "pruned", 1): 10.0})  # speedup 1.0: 25% lost
    (check,) = gate.compare(even, base, 0.25, "ratio")
    assert check.change == 0.25 and not check.regressed
    (check,) = gate.compare(even, base, 0.2499, "ratio")
    assert check.regressed


def _with_p50(index: int, p50: float) -> dict:
    record = copy.deepcopy(RECORD)
    record["results"][index]["p50_ms"] = p50
    return record


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ([1, 2], "not a corp-deploy bench record"),
        ({**RECORD, "results": []}, "holds no measurements"),
        ({**RECORD, "results": "none"}, "holds no measurements"),
        (_with_p50(0, 0.0), "measurement 0 lacks .* positive p50_ms"),
        (_with_p50(1, -1.0), "measurement 1 lacks"),
        (_with_p50(0, float("nan")), "measurement 0 lacks"),
        ({**RECORD, "results": [{"backend": "ort", "model": "dense", "p50_ms": 1.0}]}, "measurement 0 lacks"),
        ({**RECORD, "results": [{"backend": "ort", "model": "dense", "batch": 1, "p50_ms": "fast"}]}, "lacks"),
    ],
    ids=["a-list", "no-results", "results-not-a-list", "p50-zero", "p50-negative", "p50-nan", "no-batch", "p50-text"],
)
def test_a_bad_baseline_is_refused_when_loaded(tmp_path, record, message) -> None:
    """Checked before any measuring, so a p50 of 0 is a one-line error, not a ZeroDivisionError later."""
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps(record))
    with pytest.raises(CorpError, match=message):
        gate.load_baseline(path)


@pytest.mark.parametrize("mode", gate.BASELINE_MODES)
def test_a_run_missing_baseline_measurements_fails_the_gate(mode) -> None:
    """Fewer checks than the baseline has is not a pass: a skipped backend or batch must be noticed."""
    partial = copy.deepcopy(RECORD)
    partial["results"] = [r for r in partial["results"] if not (r["batch"] == 32 and r["model"] == "pruned")]
    missing = "ort pruned batch 32 p50 ms" if mode == "absolute" else "ort batch 32 pruned/dense p50 speedup"
    with pytest.raises(CorpError, match=f"this run lacks 1 of the baseline's \\d measurements \\({missing}\\)"):
        gate.compare(partial, RECORD, 0.05, mode)
    extra = copy.deepcopy(RECORD)  # measuring MORE than the baseline is fine: the extra is not gated
    extra["results"] += bench_record({("trt", "dense", 1): 1.0, ("trt", "pruned", 1): 0.5})["results"]
    assert len(gate.compare(extra, RECORD, 0.05, mode)) == (4 if mode == "absolute" else 2)


# --------------------------------------------------------------------------------------- writers


def _tiny_artifact(out: Path, overwrite: bool = False) -> Path:
    model, _ = pruned_copy(tiny_vit(), PruneConfig(sparsity=0.5, round_to=4))
    args = {**TINY, "num_classes": 10}
    return save_pruned(model, out, {"model": {"name": "vit_tiny_patch16_224", "args": args}}, overwrite=overwrite)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.e2e
def test_overwrite_whose_write_fails_leaves_the_old_artifact(tmp_path, capsys, monkeypatch) -> None:
    out = _tiny_artifact(tmp_path / "run")
    before = _snapshot(out)

    def disk_full(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("corp_deploy.formats.safetensors_writer.write", disk_full)
    code, _, stderr = run([*PRUNE, "--calib", "synthetic", "--out", str(out), "--overwrite"], capsys)
    assert code == 1 and "Traceback" not in stderr
    (line,) = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    assert "could not write" in line and "No space left on device" in line and "unchanged" in line
    assert _snapshot(out) == before
    assert corp_deploy.load_pruned(out).blocks[0].mlp.fc1.out_features == 64
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no staged or moved-aside folders left


def test_overwrite_whose_final_rename_fails_puts_the_old_artifact_back(tmp_path, monkeypatch) -> None:
    """The old folder is moved aside before the new one moves in; if that move fails, it must come back."""
    out = _tiny_artifact(tmp_path / "run")
    before = _snapshot(out)
    real_replace = os.replace

    def refuse_staged(src, dst):
        if ".run.tmp-" in str(src):
            raise OSError(18, "Invalid cross-device link")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", refuse_staged)
    with pytest.raises(CorpError, match="could not write .*Invalid cross-device link.*unchanged"):
        _tiny_artifact(out, overwrite=True)
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_atomic_file_that_fails_midway_keeps_the_old_file(tmp_path) -> None:
    target = tmp_path / "bench.json"
    target.write_text("old record")
    with pytest.raises(OSError, match="interrupted"), atomic_file(target, overwrite=True) as tmp:
        tmp.write_text("half a new rec")
        raise OSError("interrupted")
    assert target.read_text() == "old record"
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]


# -------------------------------------------------------------------------------------- artifact


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    return _tiny_artifact(tmp_path_factory.mktemp("artifact") / "run")


def _edit(meta: dict, case: str) -> dict | list | str:
    structure = meta["structure"]
    return {
        "foreign": {**meta, "format": "someone-else/model"},
        "future": {**meta, "format_version": FORMAT_VERSION + 1},
        "a-list": [meta],
        "no-structure": {k: v for k, v in meta.items() if k != "structure"},
        "no-model-name": {**meta, "model": {"args": {}}},
        "unknown-model": {**meta, "model": {"name": "no_such_vit", "args": {}}},
        "blocks-missing": {**meta, "structure": structure[:1]},
        "width-missing": {**meta, "structure": [{"heads": 4}] * len(structure)},
        "wrong-widths": {**meta, "structure": [{**b, "mlp_hidden": 96} for b in structure]},
        "unknown-family": {**meta, "family": "hf-someday"},
        "unknown-block-entry": {**meta, "structure": [{**b, "attn_removed": True} for b in structure]},
    }[case]


CORRUPT = {
    "foreign": "is not a prune artifact this corp-deploy version reads; upgrade or re-prune",
    "future": "is not a prune artifact this corp-deploy version reads; upgrade or re-prune",
    "a-list": "is not a prune artifact",
    "no-structure": "lacks the model name, arguments or structure",
    "no-model-name": "lacks the model name",
    "unknown-model": "describes a model this corp-deploy cannot build .*no_such_vit",
    "blocks-missing": "describes a model this corp-deploy cannot build",
    "width-missing": "describes a model this corp-deploy cannot build",
    "wrong-widths": "weights in .* do not match its corp.json",
    "unknown-family": "is a 'hf-someday' model, which this corp-deploy cannot build; upgrade it",
    "unknown-block-entry": "records block entries this corp-deploy does not know \\(attn_removed\\); upgrade it",
}
"""A family or block entry a later version adds is refused by name, never built as something else: that is
what lets the format grow without a version bump."""


@pytest.mark.parametrize("case", list(CORRUPT))
def test_a_bad_corp_json_is_a_one_line_error(artifact, tmp_path, case) -> None:
    copy_ = shutil.copytree(artifact, tmp_path / "run")
    meta = json.loads((copy_ / META_FILE).read_text())
    assert meta["format"] == FORMAT
    (copy_ / META_FILE).write_text(json.dumps(_edit(meta, case)))
    with pytest.raises(CorpError, match=CORRUPT[case]) as info:
        corp_deploy.load_pruned(copy_)
    assert "\n" not in str(info.value)


def test_a_truncated_corp_json_or_missing_weights_are_refused(artifact, tmp_path) -> None:
    copy_ = shutil.copytree(artifact, tmp_path / "run")
    text = (copy_ / META_FILE).read_text()
    (copy_ / META_FILE).write_text(text[: len(text) // 2])
    with pytest.raises(CorpError, match="is corrupt .*re-run `corp-deploy prune`"):
        corp_deploy.load_pruned(copy_)
    (copy_ / META_FILE).write_text(text)
    (copy_ / WEIGHTS_FILE).write_bytes(b"\0" * 100)
    with pytest.raises(CorpError, match="do not match"):
        corp_deploy.load_pruned(copy_)


@pytest.mark.e2e
def test_a_future_artifact_through_the_cli_is_one_line(artifact, tmp_path, capsys) -> None:
    copy_ = shutil.copytree(artifact, tmp_path / "run")
    meta = json.loads((copy_ / META_FILE).read_text())
    (copy_ / META_FILE).write_text(json.dumps(_edit(meta, "future")))
    code, _, stderr = run(["export", str(copy_), "--out", str(tmp_path / "m.onnx")], capsys)
    assert code == 1 and "Traceback" not in stderr
    assert stderr.strip().splitlines() == [f"error: {copy_ / META_FILE} {CORRUPT['future']}"]
    assert not (tmp_path / "m.onnx").exists()


def test_the_untouched_artifact_loads(artifact) -> None:
    """The fixture itself is sound, so the failures above are caused by the edits alone."""
    model = corp_deploy.load_pruned(artifact)
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 10)


def test_a_bias_free_mlp_is_refused_for_compensation_and_pruned_without_it() -> None:
    """fc2 without a bias cannot take the constant ``W2_P c``: refuse before calibrating, not drop it silently."""
    model = tiny_vit(proj_bias=False)  # timm: proj_bias is also the MLP's bias
    assert model.blocks[0].mlp.fc2.bias is None
    for compensation in ("corp", "mean"):
        with pytest.raises(CorpError, match=f"--compensation {compensation} is not supported for block 0: its fc2 "):
            api.check(model, PruneConfig(sparsity=0.5, target="mlp", compensation=compensation), 0)
    pruned, blocks = pruned_copy(model, PruneConfig(sparsity=0.5, target="mlp", compensation="none"))
    assert [b["mlp"]["kept"] for b in blocks] == [64, 64] and pruned.blocks[0].mlp.fc2.bias is None
    assert pruned(torch.zeros(1, 3, 32, 32)).shape == (1, 10)


def test_offline_hub_setting_is_put_back_after_the_load(monkeypatch) -> None:
    import huggingface_hub.constants as hub

    from corp_deploy.families.timm import models

    seen = []
    monkeypatch.setattr(models, "_resolves", lambda host: False)
    monkeypatch.setattr(models, "_build", lambda name, args, pretrained: seen.append(hub.HF_HUB_OFFLINE) or "built")
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    assert models._pretrained("deit_tiny_patch16_224", {}) == "built"
    assert seen == [True] and hub.HF_HUB_OFFLINE is False
