"""Label-free recovery (``corp_deploy.core.recover``) on
tiny models built in the test: it lowers the error it optimizes,
never changes widths, trains on the calibration batches only (never the held-out ones), its record round-trips
through JSON, and bad budgets are one line. Through the CLI (``--recover-*`` on prune and prune-export): recorded in
corp.json and printed, the widths of CORP alone, the exported graphs hold the recovered weights, a ViT, a text
encoder and a decoder; a bad budget, torchrun or an interrupt leaves nothing written."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from helpers import PRUNE, pruned_copy, run, tiny_batches, tiny_llama_folder, tiny_text_folder, tiny_vit
from safetensors.torch import load_file

import corp_deploy
from corp_deploy.base.errors import CorpError
from corp_deploy.core.config import PruneConfig
from corp_deploy.core.recover import Kept, Objective, Recovery, RecoveryRecord, lr_factor, recover
from corp_deploy.families import adapter_for, structure
from corp_deploy.formats import calibration
from corp_deploy.formats.artifact import load_pruned, read_meta

HALF = PruneConfig(sparsity=0.5, target="mlp,qk,v", compensation="none")


def error(pruned, dense, batches, target: str) -> float:
    """The objective over every batch, measured independently of the recovery's own cache."""
    return Objective(pruned, dense, target).mean([b for b, _ in batches])


@pytest.mark.parametrize("target", ["features", "blocks", "hidden"])
def test_recovery_lowers_the_error_it_optimizes_and_keeps_the_widths(target: str) -> None:
    dense, batches = tiny_vit(), tiny_batches(n=32)
    pruned, _ = pruned_copy(dense, HALF, batches)
    widths, count = structure(pruned), sum(p.numel() for p in pruned.parameters())
    norms = {n: p.detach().clone() for n, p in pruned.named_parameters() if "norm" in n or "embed" in n}
    before = error(pruned, dense, batches, target)
    record = recover(pruned, dense, batches, steps=12, lr=5e-3, target=target)
    after = error(pruned, dense, batches, target)
    assert after < 0.7 * before, (before, after)
    assert record.steps == 12 and record.inputs == 32 and record.batches == 2
    assert record.loss_after < record.loss_before
    assert structure(pruned) == widths and sum(p.numel() for p in pruned.parameters()) == count
    for n, p in pruned.named_parameters():  # Linear weights only: norms and embeddings untouched
        if n in norms:
            assert torch.equal(p, norms[n]), n
        assert p.requires_grad  # handed back as found
    assert not any(p.grad is not None for p in dense.parameters())


def test_hidden_follows_the_pruned_path_where_blocks_feeds_the_dense_one() -> None:
    """With only the first block changed, ``blocks`` sees its error in the first term alone (every later block is
    fed the dense input and is dense), ``hidden`` sees it carried through every later block too."""
    dense = tiny_vit()
    pruned = copy.deepcopy(dense)
    first = adapter_for(pruned).blocks(pruned)[0]
    with torch.no_grad():
        for m in first.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.mul_(0.5)
    batches = tiny_batches(n=8)
    blocks, hidden = error(pruned, dense, batches, "blocks"), error(pruned, dense, batches, "hidden")
    assert blocks > 0 and len(adapter_for(pruned).blocks(pruned)) > 1
    assert hidden > 1.5 * blocks, (blocks, hidden)
    assert error(dense, copy.deepcopy(dense), batches, "hidden") == 0


def test_a_recovery_that_raises_the_held_out_objective_keeps_corps_weights() -> None:
    """``Recovery.run`` (what ``--recover-*`` runs) puts CORP's weights back when the objective on the held-out
    inputs rose: a learning rate far too large wrecks the model, and what ships is CORP's start, said in the record."""
    dense, batches, held = tiny_vit(), tiny_batches(n=32), tiny_batches(n=8, seed=5)
    pruned, _ = pruned_copy(dense, HALF, batches)
    start = {k: v.clone() for k, v in pruned.state_dict().items()}
    wrecked = Recovery(steps=4, lr=5.0).run(pruned, dense, batches, held)
    assert wrecked.check_after > wrecked.check_before and wrecked.kept == "corp"
    assert all(torch.equal(v, start[k]) for k, v in pruned.state_dict().items())
    helped = Recovery(steps=12, lr=5e-3).run(pruned, dense, batches, held)
    assert helped.check_after < helped.check_before and helped.kept == "recovered"
    assert any(not torch.equal(v, start[k]) for k, v in pruned.state_dict().items())


def test_the_record_round_trips_through_json() -> None:
    dense, batches = tiny_vit(), tiny_batches(n=16)
    pruned, _ = pruned_copy(dense, HALF, batches)
    record = recover(pruned, dense, batches, steps=2, lr=1e-3, optimizer="sgd", check=tiny_batches(n=8, seed=5))
    again = RecoveryRecord.from_dict(json.loads(json.dumps(record.to_dict())))
    assert again == record and again.budget == {"steps": 2} and again.check_after is not None


def test_a_minutes_budget_stops_on_time() -> None:
    dense, batches = tiny_vit(), tiny_batches(n=16)
    pruned, _ = pruned_copy(dense, HALF, batches)
    record = recover(pruned, dense, batches, minutes=0.02, lr=1e-4)
    assert record.budget == {"minutes": 0.02} and record.steps >= 1 and record.seconds < 0.02 * 60 + 2


def test_the_schedule_warms_up_then_decays_to_zero() -> None:
    assert lr_factor(0.0, 0.1) < 0.02 and lr_factor(0.1, 0.1) == pytest.approx(1.0)
    assert lr_factor(0.55, 0.1) == pytest.approx(0.5) and lr_factor(1.0, 0.1) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize(
    "budget, lr",
    [
        ({}, 1e-4),
        ({"steps": 3, "minutes": 1.0}, 1e-4),
        ({"steps": 0}, 1e-4),
        ({"steps": 2.5}, 1e-4),
        ({"minutes": 0.0}, 1e-4),
        ({"minutes": -1.0}, 1e-4),
        ({"minutes": float("nan")}, 1e-4),
        ({"steps": 3}, 0.0),
    ],
)
def test_bad_budgets_are_one_line_before_any_work(budget, lr) -> None:
    dense = tiny_vit()
    pruned = copy.deepcopy(dense)
    before = copy.deepcopy(pruned.state_dict())
    with pytest.raises(CorpError) as e:
        recover(pruned, dense, tiny_batches(n=16), lr=lr, **budget)
    assert "\n" not in str(e.value) and str(e.value)
    assert all(torch.equal(before[k], v) for k, v in pruned.state_dict().items())


def test_unknown_choices_and_no_data_are_one_line() -> None:
    dense = tiny_vit()
    for kwargs in ({"target": "logits"}, {"optimizer": "lion"}, {"trained": "norms"}):
        with pytest.raises(CorpError, match="unknown recovery"):
            recover(copy.deepcopy(dense), dense, tiny_batches(n=16), steps=1, **kwargs)
    with pytest.raises(CorpError, match="at least one batch"):
        recover(copy.deepcopy(dense), dense, [], steps=1)


@pytest.mark.parametrize("target", ["features", "blocks", "hidden"])
def test_the_held_out_calibration_images_are_never_trained_on(image_dir, monkeypatch, target: str) -> None:
    dense = tiny_vit()
    data = calibration.calibration_data(dense, image_dir, num=11, batch_size=4, workers=0, hold_out=3)
    batches = list(data.batches)
    pruned, _ = pruned_copy(dense, HALF, batches)
    trained: list[torch.Tensor] = []
    loss = Objective.__call__

    def recorded(self, key, inputs):  # every input a loss with gradients is computed on
        if torch.is_grad_enabled():
            trained.append(inputs)
        return loss(self, key, inputs)

    monkeypatch.setattr(Objective, "__call__", recorded)
    record = recover(pruned, dense, batches, steps=4, lr=1e-3, target=target, check=[data.heldout.images])
    seen, held, calib = torch.cat(trained), data.heldout.images, torch.cat([b for b, _ in batches])
    assert record.inputs == 8 and record.check_before is not None and record.check_after is not None
    assert len(seen) == 16  # 4 steps over the 2 batches (4 images each)
    assert not any(torch.equal(s, h) for s in seen for h in held)
    assert all(any(torch.equal(s, c) for c in calib) for s in seen)


def test_a_text_encoder_recovers_through_its_adapter_with_padding_left_out() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=30,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=40,
    )
    config._attn_implementation = "sdpa"
    dense = transformers.BertModel(config).eval()
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(2):
        ids = torch.randint(5, 30, (4, 24), generator=g)
        mask = (torch.arange(24)[None] < torch.randint(4, 25, (4, 1), generator=g)).long()
        batches.append(({"input_ids": ids * mask, "attention_mask": mask}, 0))
    pruned, _ = pruned_copy(dense, PruneConfig(sparsity=0.5, target="mlp,qk", compensation="none"), batches)
    assert adapter_for(pruned).name != "timm-vit"
    widths = structure(pruned)
    before = error(pruned, dense, batches, "blocks")
    recover(pruned, dense, batches, steps=10, lr=1e-3, target="blocks")
    assert error(pruned, dense, batches, "blocks") < 0.8 * before and structure(pruned) == widths


def test_kept_passes_every_batch_through_once_and_keeps_whole_batches_up_to_its_limit() -> None:
    batches = tiny_batches(n=48, batch=16)
    kept = Kept(iter(batches), adapter_for(tiny_vit()).count, limit=20)
    assert list(kept) == batches  # the calibration pass sees the whole stream
    assert kept.batches == batches[:2] and kept.inputs == 32  # the batch that crosses 20 is kept whole, no more


BUDGETED = [*PRUNE, "--calib", "synthetic", "--budget", "macs=0.7", "--sensitivity-images", "8"]
"""16 noise images, 8 of them held out for the sensitivity pass: recovery trains on the other 8."""


def artifact(out: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((out / "corp.json").read_text()), load_file(out / "model.safetensors")


@pytest.mark.e2e
def test_prune_recovers_after_corp_with_its_widths_and_records_it(tmp_path, capsys) -> None:
    """Through the CLI with held-out inputs: the record, the widths of CORP alone, the printed line; a recovery that
    raises the held-out objective (a learning rate far too large) ships CORP's weights and says so."""
    corp, recovered = tmp_path / "corp", tmp_path / "recovered"
    assert run([*BUDGETED, "--out", str(corp)], capsys)[0] == 0
    flags = ["--recover-steps", "3", "--recover-lr", "1", "--out", str(recovered)]
    code, stdout, stderr = run([*BUDGETED, *flags], capsys)
    assert code == 0, stderr
    (meta, weights), (alone, corp_weights) = artifact(recovered), artifact(corp)
    rec = meta["report"]["recovery"]
    assert rec["budget"] == {"steps": 3} and rec["steps"] == 3 and rec["target"] == "blocks" and rec["lr"] == 1
    assert rec["inputs"] == 8 and rec["check_inputs"] == 8  # the sensitivity pass's 8 are only evaluated
    assert rec["check_after"] > rec["check_before"] and rec["kept"] == "corp"
    assert "recovery" not in alone["report"] and "recovery" in meta["report"]["seconds"]
    assert meta["structure"] == alone["structure"]  # widths planned before recovery, kept by it
    assert all(torch.equal(weights[k], corp_weights[k]) for k in weights)
    assert "recovery (blocks target, adamw lr 1, budget 3 steps): 3 steps" in stdout
    assert "held-out" in stdout and "CORP's weights were kept" in stdout


@pytest.mark.e2e
def test_prune_export_exports_the_recovered_weights(tmp_path, capsys) -> None:
    pytest.importorskip("onnxruntime")
    from corp_deploy.exporters.compare import FP32, compare, random_inputs
    from corp_deploy.exporters.runners import OrtRunner, TorchRunner

    out = tmp_path / "run"
    argv = ["prune-export", *PRUNE[1:], "--calib", "synthetic", "--precision", "fp32", "--recover-steps", "2"]
    code, _, stderr = run([*argv, "--out", str(out)], capsys)
    assert code == 0, stderr
    record = json.loads((out / "export.json").read_text())
    assert record["recovery"] == json.loads((out / "pruned" / "corp.json").read_text())["report"]["recovery"]
    assert record["recovery"]["steps"] == 2
    x = random_inputs(3, (3, 32, 32))
    recovered = TorchRunner(corp_deploy.load_pruned(out / "pruned"))(x)
    assert compare(recovered, OrtRunner(out / "pruned.onnx", "cpu")(x)).within(FP32)


BAD_RECOVERY = {
    "zero steps": (["--recover-steps", "0"], "--recover-steps must be a whole number >= 1"),
    "negative minutes": (["--recover-minutes", "-1"], "--recover-minutes must be > 0"),
    "minutes not a number": (["--recover-minutes", "nan"], "--recover-minutes must be > 0"),
    "both budgets": (["--recover-steps", "3", "--recover-minutes", "1"], "exactly one budget"),
    "zero learning rate": (["--recover-steps", "3", "--recover-lr", "0"], "--recover-lr (the recovery"),
    "a learning rate without a budget": (["--recover-lr", "1e-3"], "add --recover-steps N or --recover-minutes M"),
    "a target without a budget": (["--recover-target", "features"], "add --recover-steps N"),
    "an unknown target": (["--recover-steps", "3", "--recover-target", "logits"], "'logits' is not one of"),
}


@pytest.mark.e2e
@pytest.mark.parametrize("command", ["prune", "prune-export"])
@pytest.mark.parametrize("case", list(BAD_RECOVERY), ids=list(BAD_RECOVERY))
def test_a_bad_recovery_is_one_line_before_any_model_and_writes_nothing(case, command, tmp_path, capsys, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr("corp_deploy.cli.inputs.create_model", never)
    flags, expected = BAD_RECOVERY[case]
    out = tmp_path / "out"
    code, _, stderr = run([command, *PRUNE[1:], "--calib", "synthetic", *flags, "--out", str(out)], capsys)
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert code != 0 and len(lines) == 1 and expected in lines[0], stderr
    assert "Traceback" not in stderr and list(tmp_path.iterdir()) == []


@pytest.mark.e2e
def test_recovery_under_torchrun_is_refused_before_any_work(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, _, stderr = run(
        [*PRUNE, "--calib", "synthetic", "--recover-steps", "3", "--out", str(tmp_path / "o")], capsys
    )
    assert code != 0 and "train in one process; run it without torchrun" in stderr and list(tmp_path.iterdir()) == []


@pytest.mark.e2e
@pytest.mark.parametrize("command", ["prune", "prune-export"])
def test_an_interrupt_during_recovery_keeps_the_corp_result_and_says_so(command, tmp_path, capsys, monkeypatch) -> None:
    loss, calls = Objective.__call__, []

    def interrupted(self, key, inputs):  # the second training step is interrupted
        if torch.is_grad_enabled():
            calls.append(key)
            if len(calls) == 2:
                raise KeyboardInterrupt
        return loss(self, key, inputs)

    monkeypatch.setattr(Objective, "__call__", interrupted)
    out = tmp_path / "out"
    code, _, stderr = run(
        [command, *PRUNE[1:], "--calib", "synthetic", "--recover-steps", "5", "--out", str(out)], capsys
    )
    assert code == 130 and "Traceback" not in stderr and len(calls) == 2
    (line,) = stderr.splitlines()
    artifact = out if command == "prune" else out / "pruned"
    assert line.startswith(f"error: recovery interrupted after 1 of 5 steps; wrote {artifact}/ with CORP's weights")
    assert f"to recover, run corp-deploy {command} " in line and line.endswith("--overwrite")
    assert command == "prune" or f"to export it: corp-deploy export {PRUNE[1]} " in line
    report = read_meta(artifact)["report"]
    assert report["recovery_interrupted"] == {"steps": 1, "budget": {"steps": 5}, "kept": "corp"}
    assert "recovery" not in report
    assert command == "prune" or sorted(p.name for p in out.iterdir()) == ["pruned"]
    monkeypatch.undo()
    code, _, stderr = run([*PRUNE, "--calib", "synthetic", "--out", str(tmp_path / "corp")], capsys)
    assert code == 0, stderr
    corp, kept = load_pruned(tmp_path / "corp").state_dict(), load_pruned(artifact).state_dict()
    assert all(torch.equal(corp[k], kept[k]) for k in corp)  # CORP's weights, not half-trained ones


@pytest.mark.e2e
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_text_models_recover_through_the_cli(family, tmp_path, capsys) -> None:
    """An encoder on random tokens (a MACs budget: 4 held-out sequences, evaluated only), a decoder on documents."""
    pytest.importorskip("transformers")
    if family == "bert":
        model, held = tiny_text_folder(tmp_path), 4
        data = ["--calib", "synthetic", "--budget", "macs=0.8", "--sensitivity-images", str(held)]
    else:
        (model, text), held = tiny_llama_folder(tmp_path), 0
        data = ["--calib-dir", str(text)]
    out = tmp_path / "run"
    argv = ["prune", str(model), *data, "--seq-len", "32", "--num-calib", "8", "--calib-batch-size", "4"]
    code, stdout, stderr = run([*argv, "--round-to", "4", "--recover-steps", "2", "--out", str(out)], capsys)
    assert code == 0, stderr
    meta = json.loads((out / "corp.json").read_text())
    rec = meta["report"]["recovery"]
    assert rec["steps"] == 2 and rec["inputs"] == 8 and rec["batches"] == 2 and rec["check_inputs"] == held
    assert rec["loss_after"] != rec["loss_before"]  # the weights moved (a closely fitted random model's loss may rise)
    assert "on 8 calibration sequences (2 batches)" in stdout
    assert structure(corp_deploy.load_pruned(out)) == meta["structure"]
