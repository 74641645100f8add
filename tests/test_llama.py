"""Llama decoders (``corp_deploy.llama``): SwiGLU MLP and grouped-query V pruning, the compensation's constant
as a bias of its own, the artifact, ``generate``, the Q/K refusal, and the GGUF conversion.

Tiny random ``LlamaConfig`` models (hidden 32, 2 layers, 4 query heads over 2 K/V heads, intermediate 64,
vocab 100); the word-level tokenizer and token batches of ``test_opt``. No hub, no downloads.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
from helpers import run

from corp_deploy.errors import CorpError

transformers = pytest.importorskip("transformers", reason="text models need transformers (pip install '.[text]')")

from test_opt import SPECIAL, VOCAB, _documents, token_batches, tokenizer  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from corp_deploy import compensation as C  # noqa: E402
from corp_deploy.artifact import load_pruned, read_meta, save_pruned  # noqa: E402
from corp_deploy.llama import HF_LLAMA, PrunedLlamaAttention  # noqa: E402
from corp_deploy.pruner import PruneConfig, calibrate, check_parts, prune_model  # noqa: E402


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """hidden 32, 2 layers, 4 heads of 8 over 2 K/V heads, intermediate 64, vocab 100; SDPA as ``hf.load`` sets."""
    torch.manual_seed(seed)
    args = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    args |= {"intermediate_size": 64, "vocab_size": 100, "max_position_embeddings": 64} | overrides
    config = LlamaConfig(pad_token_id=0, bos_token_id=1, eos_token_id=2, **args)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


def _pruned(dense: LlamaForCausalLM, target: str, compensation: str, sparsity: float = 0.5) -> LlamaForCausalLM:
    model = copy.deepcopy(dense)
    config = PruneConfig(sparsity=sparsity, target=target, round_to=2, compensation=compensation)
    prune_model(model, calibrate(model, token_batches(n=12), config, "cpu", progress=False), config)
    return model


def _output_error(dense: LlamaForCausalLM, pruned: LlamaForCausalLM) -> float:
    """Relative error of the decoder's last hidden states on held-out batches (every token is real)."""
    num = den = 0.0
    with torch.no_grad():
        for inputs, _ in token_batches(n=3, seed=9):
            ref, out = dense.model(**inputs).last_hidden_state, pruned.model(**inputs).last_hidden_state
            num += float((out - ref).square().sum())
            den += float(ref.square().sum())
    return num / den
