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
from typing import Any, NoReturn

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle
from transformers.models.llama.modeling_llama import LlamaAttention, apply_rotary_pos_emb, eager_attention_forward

from corp_deploy.errors import CorpError
from corp_deploy.family import QKHook
from corp_deploy.hf import HfText, layer_cache, linear_like


class PrunedLlamaAttention(LlamaAttention):
    """Llama attention whose heads carry ``v_dim`` V channels (Q/K keep the dense ``head_dim`` and scale) and
    whose o_proj may have a bias (the compensation's constant).

    Built without ``LlamaAttention.__init__`` (which makes dense-size Linears); it stays a ``LlamaAttention``
    so that ``transformers``' output capture still finds it, with the same parameter names, call and
    key/value cache use (the V cache is ``kv_heads * v_dim`` wide)."""

    def __init__(self, config: Any, layer_idx: int | None, v_dim: int, proj_bias: bool) -> None:
        nn.Module.__init__(self)
        dim, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.config, self.layer_idx, self.v_dim = config, layer_idx, v_dim
        self.head_dim = getattr(config, "head_dim", None) or dim // heads
        self.num_key_value_groups, self.scaling = heads // kv, self.head_dim**-0.5
        self.attention_dropout, self.is_causal = config.attention_dropout, True
        bias = config.attention_bias
        self.q_proj = nn.Linear(dim, heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, kv * v_dim, bias=bias)
        self.o_proj = nn.Linear(heads * v_dim, dim, bias=bias or proj_bias)

    def forward(
        self,
        hidden_states: Tensor,
        position_embeddings: tuple[Tensor, Tensor] | None = None,
        attention_mask: Tensor | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor | None]:
        """``LlamaAttention.forward`` with the V heads reshaped at their own width (-1: no size baked in)."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        shape = (*hidden_states.shape[:-1], -1)
        q = self.q_proj(hidden_states).view(*shape, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(*shape, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(*shape, self.v_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        cache = layer_cache(past_key_values, kwargs)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        dropout = self.attention_dropout if self.training else 0.0
        out, weights = attend(self, q, k, v, attention_mask, dropout=dropout, scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(*shape).contiguous()), weights


def _reader(old: nn.Linear, in_features: int, w: Tensor, b: Tensor | None) -> nn.Linear:
    """A folded reader (down_proj, o_proj) of ``in_features`` inputs: weight ``w``; a bias when ``old`` had one
    or the compensation's constant ``b`` is non-zero (plain removal adds none)."""
    bias = old.bias is not None or (b is not None and bool(b.any()))
    new = nn.Linear(in_features, w.shape[0], bias=bias, device=old.weight.device, dtype=old.weight.dtype)
    new.train(old.training)
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
        return attn.head_dim, attn.v_dim if isinstance(attn, PrunedLlamaAttention) else attn.head_dim

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
        attn = block.self_attn
        new = PrunedLlamaAttention(attn.config, attn.layer_idx, v_dim, proj_bias)
        new.train(attn.training)
        return new.to(attn.q_proj.weight.device, attn.q_proj.weight.dtype)

    @torch.no_grad()
    def set_values(self, block: nn.Module, keep: Tensor, w: Tensor, b: Tensor) -> None:
        """``keep`` indexes o_proj's input (all query heads); v_proj keeps one query head's rows per K/V head."""
        old, heads, group = block.self_attn, self.heads(block), self.value_groups(block)
        d, kept = old.head_dim if not isinstance(old, PrunedLlamaAttention) else old.v_dim, keep.numel() // heads
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

    def apply_structure(self, model: nn.Module, entries: list[dict[str, Any]]) -> None:
        """Unfilled layers of the recorded widths and biases (``load_pruned``; weights load next)."""
        for block, widths in zip(self.blocks(model), entries, strict=True):
            mlp, hidden, mlp_bias = block.mlp, widths["mlp_hidden"], bool(widths.get("mlp_bias"))
            if hidden != mlp.down_proj.in_features or mlp_bias != (mlp.down_proj.bias is not None):
                mlp.gate_proj = linear_like(mlp.gate_proj, mlp.gate_proj.in_features, hidden)
                mlp.up_proj = linear_like(mlp.up_proj, mlp.up_proj.in_features, hidden)
                kw = {"device": mlp.down_proj.weight.device, "dtype": mlp.down_proj.weight.dtype}
                mlp.down_proj = nn.Linear(hidden, mlp.down_proj.out_features, bias=mlp_bias, **kw)
            proj_bias = bool(widths.get("proj_bias"))
            if widths["v_dim"] != self.head_widths(block)[1] or proj_bias != (self.proj(block).bias is not None):
                block.self_attn = self._rebuilt(block, widths["v_dim"], proj_bias)


HF_LLAMA = HfLlama()
