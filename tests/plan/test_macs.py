"""MACs count attention the same way for every model, kernel and torch version: an analytic check."""

from __future__ import annotations

import pytest
import torch.utils.flop_counter as flop_counter
from helpers import TINY, pruned_copy, tiny_vit

from corp_deploy.core.config import PruneConfig
from corp_deploy.plan.report import model_size

CLASSES = 10


def analytic_macs(hidden: int, qk_dim: int) -> tuple[int, int]:
    """(total, per block) MACs of one image through the TINY ViT with the given MLP and Q/K widths.

    Written out from the architecture, not from the modules: patch embedding, then per block the fused
    qkv GEMM (Q and K at ``qk_dim``, V at the full head dim), the two attention matmuls Q K^T and A V,
    proj and the MLP; the head sees the class token only. LayerNorm, softmax and GELU are not MACs.
    """
    dim, heads = TINY["embed_dim"], TINY["num_heads"]
    head_dim, patch = dim // heads, TINY["patch_size"]
    patches = (TINY["img_size"] // patch) ** 2
    tokens = patches + 1  # + class token
    embed = patches * dim * 3 * patch * patch
    qkv = tokens * dim * heads * (2 * qk_dim + head_dim)
    attention = heads * tokens * tokens * (qk_dim + head_dim)  # Q K^T, then A V
    block = qkv + attention + tokens * dim * dim + 2 * tokens * dim * hidden
    return embed + TINY["depth"] * block + dim * CLASSES, block


def _blind_to_fused_attention(monkeypatch) -> None:
    """A counter with no formula for any fused attention kernel, as torch 2.11's has none for the CPU flash one."""
    known = {k: v for k, v in flop_counter.flop_registry.items() if "attention" not in str(k)}
    monkeypatch.setattr(flop_counter, "flop_registry", known)


@pytest.mark.parametrize("counter", ["this torch", "blind to fused attention"])
def test_macs_include_both_attention_matmuls_dense_and_pruned(counter, monkeypatch) -> None:
    if counter != "this torch":
        _blind_to_fused_attention(monkeypatch)
    dense = tiny_vit()
    hidden, head_dim = int(TINY["embed_dim"] * TINY["mlp_ratio"]), TINY["embed_dim"] // TINY["num_heads"]
    pruned, _ = pruned_copy(dense, PruneConfig(sparsity=0.5))  # dense has equal Q/K/V widths: a fused kernel
    for model, widths in ((dense, (hidden, head_dim)), (pruned, (hidden // 2, head_dim // 2))):
        total, block = analytic_macs(*widths)
        size = model_size(model)
        assert size["macs"] == total, widths
        assert [b["macs"] for b in size["blocks"]] == [block] * TINY["depth"]
