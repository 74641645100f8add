"""RoBERTa (BERT's layout, positions offset past the padding index): prune, artifact round trip, verified ONNX.

A tiny random ``RobertaConfig`` model built in the test: no hub, no downloads.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="text models need transformers (pip install '.[text]')")

from transformers import RobertaConfig, RobertaModel  # noqa: E402

from corp_deploy.core.config import PruneConfig  # noqa: E402
from corp_deploy.core.pruner import calibrate, prune_model  # noqa: E402
from corp_deploy.families.hf.adapter import max_positions  # noqa: E402
from corp_deploy.families.hf.modeling import PrunedSelfAttention  # noqa: E402
from corp_deploy.formats import sources  # noqa: E402
from corp_deploy.formats.artifact import load_pruned, read_meta, save_pruned  # noqa: E402
from corp_deploy.plan.width_plan import plan_widths  # noqa: E402

VOCAB, PAD = 30, 1  # RoBERTa pads with id 1; its positions start at PAD + 1


def tiny_roberta() -> RobertaModel:
    torch.manual_seed(0)
    size = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
    config = RobertaConfig(vocab_size=VOCAB, max_position_embeddings=40, pad_token_id=PAD, **size)
    config._attn_implementation = "sdpa"
    return RobertaModel(config).eval()


def batches(n: int, seed: int) -> list[tuple[dict, int]]:
    """Real tokens (ids above the specials) of random lengths, padded to 24 with RoBERTa's pad id."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, VOCAB, (4, 24), generator=g)
        mask = (torch.arange(24)[None] < torch.randint(4, 25, (4, 1), generator=g)).long()
        out.append(({"input_ids": torch.where(mask.bool(), ids, PAD), "attention_mask": mask}, 0))
    return out


def test_roberta_prunes_reloads_and_exports_verified(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from corp_deploy.exporters.pipeline import export_verified

    dense = tiny_roberta()
    assert max_positions(dense.config) == 40 - PAD - 1
    model = copy.deepcopy(dense)
    config = PruneConfig(sparsity=0.5, target="all", round_to=4)
    stats = calibrate(model, batches(8, seed=1), config, "cpu", progress=False)
    prune_model(model, stats, config, plan_widths(model, config, stats))
    attn = model.encoder.layer[0].attention.self
    assert isinstance(attn, PrunedSelfAttention) and attn.query.out_features == attn.value.out_features == 32
    assert model.encoder.layer[1].intermediate.dense.out_features == 64

    save_pruned(model, tmp_path / "art", {"model": {"name": "tiny-roberta", "args": {}}})
    assert read_meta(tmp_path / "art")["family"] == "hf-bert"
    loaded = load_pruned(tmp_path / "art")
    assert type(loaded) is RobertaModel and not loaded.training
    inputs, _ = batches(1, seed=5)[0]
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).last_hidden_state, model(**inputs).last_hidden_state)

    description = sources.describe(loaded, "tiny-roberta", {}, "corp-pruned", seq_len=32)
    record = export_verified(loaded, tmp_path / "pruned.onnx", description)
    assert record["modality"] == "text" and record["max_positions"] == 38 and record["verify"]["cosine"] > 0.99999
