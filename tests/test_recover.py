"""Label-free recovery (``corp_deploy.recover``) on tiny models built in the test: it lowers the error it optimizes,
never changes widths, trains on the calibration batches only (never the held-out ones), its record round-trips
through JSON, and bad budgets are one line."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from corp_deploy import calibration
from corp_deploy.errors import CorpError
from corp_deploy.families import adapter_for, structure
from corp_deploy.pruner import PruneConfig
from corp_deploy.recover import Objective, RecoveryRecord, lr_factor, recover
from tests.conftest import pruned_copy, tiny_batches, tiny_vit

HALF = PruneConfig(sparsity=0.5, target="mlp,qk,v", compensation="none")


def error(pruned, dense, batches, target: str) -> float:
    """The objective over every batch, measured independently of the recovery's own cache."""
    return Objective(pruned, dense, target).mean([b for b, _ in batches])


@pytest.mark.parametrize("target", ["features", "blocks"])
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


@pytest.mark.parametrize("target", ["features", "blocks"])
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
