"""``transformers`` Llama decoders (LlamaForCausalLM, LlamaModel; SmolLM2, TinyLlama, Llama 2/3) as a CORP family.

Per layer (``model.layers[i]``): SwiGLU MLP ``down_proj(act(gate_proj x) * up_proj x)``: hidden channel j is
``act(gate_j) * up_j``, so gate_proj's and up_proj's row j and down_proj's column j go together, and the MLP
statistics are down_proj's input. Attention ``self_attn.{q,k,v,o}_proj`` with grouped-query attention (GQA):
``num_key_value_heads`` K/V heads, each shared by ``num_key_value_groups`` query heads. RMSNorm before each
sub-layer needs nothing: every fold is at a reader's input (down_proj, o_proj), after the norm.

Biases: Llama's Linears have none (``mlp_bias``/``attention_bias`` false), but the compensation has a constant
(``x_P ~ B x_S + c``). A folded reader gets a bias of its own (``Adapter.adds_bias``) when its constant is
non-zero; the config's flags stay as they are (they would add zero biases to gate/up/q/k/v too), and
``corp.json`` records per layer which readers carry one (``mlp_bias``, ``proj_bias``) for ``load_pruned``.
Measured against fitting without the constant (``compensation.mlp_linear``): see docs/BENCHMARKS.md.

V under GQA: V channel c of K/V head g is column c of the o_proj input of EVERY query head of group g, so the
channels are ranked and kept per K/V head (``value_groups``) and the same columns of all the group's heads go;
the fit predicts the removed columns from the kept columns of all heads, as for every family.

Q/K: RoPE rotates q and k by the position, so ``q_S M k_S^T ~ q_P k_P^T`` with one M for all positions (the
logit compensation) does not hold; Q/K pruning is refused before any data is read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from corp_deploy.errors import CorpError
from corp_deploy.family import QKHook
from corp_deploy.hf import HfText
from corp_deploy.hf_modeling import PrunedLlamaAttention, linear_like, llama_attention_at, llama_v_dim


def _reader(old: nn.Linear, in_features: int, w: Tensor, b: Tensor | None) -> nn.Linear:
    """A folded reader (down_proj, o_proj) of ``in_features`` inputs: weight ``w``; a bias when ``old`` had one
    or the compensation's constant ``b`` is non-zero (plain removal adds none)."""
    bias = old.bias is not None or (b is not None and bool(b.any()))
    new = linear_like(old, in_features, w.shape[0], bias)
    new.weight.copy_(w)
    if bias:
        new.bias.copy_(b if b is not None else old.bias)
    return new


class HfLlama(HfText):
    """Llama decoders; calibration inputs are packed ``{"input_ids", "attention_mask"}`` sequences."""

    name = "hf-llama"
    block_keys = frozenset({"heads", "mlp_hidden", "qk_dim", "v_dim", "mlp_bias", "proj_bias"})
    causal = True
    parts = ("mlp", "v")
    adds_bias = True
    mlp_out_name = "down_proj"
    mlp_projections = 3  # SwiGLU: gate, up and down

    def blocks(self, model: nn.Module) -> Sequence[nn.Module]:
        return model.base_model.layers

    def final(self, model: nn.Module, x: Tensor) -> Tensor:
        return model.base_model.norm(x)

    def mlp_out(self, block: nn.Module) -> nn.Linear:
        return block.mlp.down_proj

    @torch.no_grad()
    def set_mlp(self, block: nn.Module, keep: Tensor, w: Tensor, b: Tensor | None) -> None:
        mlp = block.mlp
        for name in ("gate_proj", "up_proj"):
            old = getattr(mlp, name)
            new = linear_like(old, old.in_features, keep.numel())
            new.weight.copy_(old.weight[keep])
            if old.bias is not None:
                new.bias.copy_(old.bias[keep])
            setattr(mlp, name, new)
        mlp.down_proj = _reader(mlp.down_proj, keep.numel(), w, b)

    def heads(self, block: nn.Module) -> int:
        return block.self_attn.config.num_attention_heads

    def value_groups(self, block: nn.Module) -> int:
        return block.self_attn.num_key_value_groups

    def head_widths(self, block: nn.Module) -> tuple[int, int]:
        attn = block.self_attn
        return attn.head_dim, llama_v_dim(attn)

    def _no_qk(self) -> NoReturn:
        raise CorpError(
            "Q/K pruning is not supported for hf-llama models: rotary positions (RoPE) break the logit "
            "compensation; prune mlp and v (--target mlp,v)"
        )

    def qk_weights(self, block: nn.Module) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
        self._no_qk()

    def on_qk(self, block: nn.Module, fn: QKHook) -> list[RemovableHandle]:
        self._no_qk()

    def set_qk(self, block: nn.Module, q_w: Tensor, q_b: Tensor | None, k_w: Tensor, k_b: Tensor | None) -> None:
        self._no_qk()

    def proj(self, block: nn.Module) -> nn.Linear:
        return block.self_attn.o_proj

    def _rebuilt(self, block: nn.Module, v_dim: int, proj_bias: bool) -> PrunedLlamaAttention:
        """An unfilled ``PrunedLlamaAttention`` with ``block``'s config and layer index at the V width."""
        return llama_attention_at(block.self_attn, v_dim, proj_bias)

    @torch.no_grad()
    def set_values(self, block: nn.Module, keep: Tensor, w: Tensor, b: Tensor) -> None:
        """``keep`` indexes o_proj's input (all query heads); v_proj keeps one query head's rows per K/V head."""
        old, heads, group = block.self_attn, self.heads(block), self.value_groups(block)
        d, kept = llama_v_dim(old), keep.numel() // heads
        per_head = keep.view(heads, kept)[::group]
        rows = (per_head % d + d * torch.arange(per_head.shape[0], device=keep.device)[:, None]).flatten()
        new = self._rebuilt(block, kept, False)
        new.q_proj.load_state_dict(old.q_proj.state_dict())
        new.k_proj.load_state_dict(old.k_proj.state_dict())
        new.v_proj.weight.copy_(old.v_proj.weight[rows])
        if old.v_proj.bias is not None:
            new.v_proj.bias.copy_(old.v_proj.bias[rows])
        new.o_proj = _reader(old.o_proj, keep.numel(), w, b)
        block.self_attn = new

    def check_parts(self, block: nn.Module, i: int, parts: Sequence[str], compensation: str) -> None:
        if "qk" in parts:
            self._no_qk()
        super().check_parts(block, i, parts, compensation)

    def structure(self, block: nn.Module) -> dict[str, int]:
        biases = {
            "mlp_bias": int(block.mlp.down_proj.bias is not None),
            "proj_bias": int(self.proj(block).bias is not None),
        }
        return {**super().structure(block), **biases}


HF_LLAMA = HfLlama()
