"""``transformers`` OPT decoders (OPTForCausalLM, OPTModel) as a CORP family: the paper's OPT-1.3B layout.

Per layer (``model.decoder.layers[i]``): MLP ``fc1 -> ReLU -> fc2``; attention ``self_attn.{q,k,v}_proj`` and
``self_attn.out_proj``, all with biases (``enable_bias``). Positions are learned and absolute (added to the
input embedding), so the Q/K logit compensation holds as for BERT; the attention is causal, so the Q/K
statistics count the (query, key) pairs with key <= query (``Adapter.causal``). OPT scales q right after
``q_proj`` by the DENSE head dim's ``scaling``; the pruned attention keeps that scale (the fold reproduces the
dense logits). Pre-LN (``do_layer_norm_before``, 125m and >= 1.3b) and post-LN (350m) layers alike: the
compensation folds into ``fc2`` and ``out_proj``, whose outputs go to the residual sum either way, so the fold
is exact in both; 350m's ``project_in``/``project_out`` lie outside the layers and are untouched.

A pruned layer stays an ``OPTAttention`` (``PrunedOptAttention``) with the same parameter names, the same
call and the same key/value cache use, so the model keeps ``forward`` and ``generate``; its K cache is
``heads * qk_dim`` wide and its V cache ``heads * v_dim``, per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle
from transformers.models.opt.modeling_opt import OPTAttention, eager_attention_forward

from corp_deploy.errors import CorpError
from corp_deploy.family import QKHook
from corp_deploy.hf import HfText, layer_cache, linear_like, qk_hooks


class PrunedOptAttention(OPTAttention):
    """OPT attention with Q/K head width ``qk_dim``, V head width ``v_dim`` and the dense ``scaling``.

    Reshapes use -1 so that no batch or sequence size is baked into exported graphs. Built without
    ``OPTAttention.__init__`` (which makes dense-size Linears); it stays an ``OPTAttention`` so that
    ``transformers``' output capture (``output_attentions``) still finds it."""

    def __init__(self, config: Any, layer_idx: int | None, heads: int, qk_dim: int, v_dim: int, scaling: float) -> None:
        nn.Module.__init__(self)
        dim, bias = config.hidden_size, config.enable_bias
        self.config, self.layer_idx, self.embed_dim = config, layer_idx, dim
        self.num_heads, self.qk_dim, self.v_dim, self.scaling = heads, qk_dim, v_dim, scaling
        self.dropout, self.enable_bias, self.is_causal = config.attention_dropout, bias, True
        self.q_proj = nn.Linear(dim, heads * qk_dim, bias=bias)
        self.k_proj = nn.Linear(dim, heads * qk_dim, bias=bias)
        self.v_proj = nn.Linear(dim, heads * v_dim, bias=bias)
        self.out_proj = nn.Linear(heads * v_dim, dim, bias=bias)

    def forward(
        self,
        hidden_states: Tensor,
        past_key_values: Any = None,
        attention_mask: Tensor | None = None,
        output_attentions: bool = False,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor | None]:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        shape = (*hidden_states.shape[:-1], self.num_heads, -1)
        q = (self.q_proj(hidden_states) * self.scaling).view(shape).transpose(1, 2)
        k, v = (lin(hidden_states).view(shape).transpose(1, 2) for lin in (self.k_proj, self.v_proj))
        cache = layer_cache(past_key_values, kwargs)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        dropout = self.dropout if self.training else 0.0
        out, weights = attend(self, q, k, v, attention_mask, dropout=dropout, scaling=1.0, **kwargs)
        return self.out_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


class HfOpt(HfText):
    """OPT decoders; calibration inputs are packed ``{"input_ids", "attention_mask"}`` sequences."""

    name = "hf-opt"
    block_keys = frozenset({"heads", "mlp_hidden", "qk_dim", "v_dim"})
    causal = True

    def blocks(self, model: nn.Module) -> Sequence[nn.Module]:
        return model.base_model.decoder.layers

    def final(self, model: nn.Module, x: Tensor) -> Tensor:
        """The decoder's final LayerNorm (pre-LN models) and ``project_out`` (when the embedding is narrower)."""
        decoder = model.base_model.decoder
        for layer in (decoder.final_layer_norm, decoder.project_out):
            x = x if layer is None else layer(x)
        return x

    def mlp_out(self, block: nn.Module) -> nn.Linear:
        return block.fc2

    @torch.no_grad()
    def set_mlp(self, block: nn.Module, keep: Tensor, w: Tensor, b: Tensor | None) -> None:
        up, down = block.fc1, block.fc2
        new_up, new_down = linear_like(up, up.in_features, keep.numel()), linear_like(down, keep.numel(), w.shape[0])
        new_up.weight.copy_(up.weight[keep])
        if up.bias is not None:
            new_up.bias.copy_(up.bias[keep])
        new_down.weight.copy_(w)
        if b is not None:
            new_down.bias.copy_(b)
        block.fc1, block.fc2 = new_up, new_down

    def heads(self, block: nn.Module) -> int:
        return block.self_attn.num_heads

    def head_widths(self, block: nn.Module) -> tuple[int, int]:
        attn = block.self_attn
        if isinstance(attn, PrunedOptAttention):
            return attn.qk_dim, attn.v_dim
        return attn.head_dim, attn.head_dim

    def qk_weights(self, block: nn.Module) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
        heads, q, k = self.heads(block), block.self_attn.q_proj, block.self_attn.k_proj
        per_head = lambda t: None if t is None else t.unflatten(0, (heads, -1))  # noqa: E731
        return per_head(q.weight), per_head(q.bias), per_head(k.weight), per_head(k.bias)

    def on_qk(self, block: nn.Module, fn: QKHook) -> list[RemovableHandle]:
        """q as ``q_proj`` outputs it, before OPT's scaling: the scale stays the dense one, outside the fold."""
        attn = block.self_attn
        return qk_hooks(attn.q_proj, attn.k_proj, self.heads(block), fn)

    def _rebuilt(self, block: nn.Module, qk_dim: int, v_dim: int) -> PrunedOptAttention:
        """An unfilled ``PrunedOptAttention`` with ``block``'s heads, layer index and dense scale at the widths."""
        attn = block.self_attn
        new = PrunedOptAttention(attn.config, attn.layer_idx, self.heads(block), qk_dim, v_dim, float(attn.scaling))
        new.train(attn.training)
        return new.to(attn.q_proj.weight.device, attn.q_proj.weight.dtype)

    @torch.no_grad()
    def set_qk(self, block: nn.Module, q_w: Tensor, q_b: Tensor | None, k_w: Tensor, k_b: Tensor | None) -> None:
        old = block.self_attn
        new = self._rebuilt(block, q_w.shape[1], self.head_widths(block)[1])
        for lin, w, b in ((new.q_proj, q_w, q_b), (new.k_proj, k_w, k_b)):
            lin.weight.copy_(w.flatten(0, 1))
            if b is not None:
                lin.bias.copy_(b.flatten())
        new.v_proj.load_state_dict(old.v_proj.state_dict())
        new.out_proj.load_state_dict(old.out_proj.state_dict())
        block.self_attn = new

    def proj(self, block: nn.Module) -> nn.Linear:
        return block.self_attn.out_proj

    @torch.no_grad()
    def set_values(self, block: nn.Module, keep: Tensor, w: Tensor, b: Tensor) -> None:
        old = block.self_attn
        new = self._rebuilt(block, self.head_widths(block)[0], keep.numel() // self.heads(block))
        new.q_proj.load_state_dict(old.q_proj.state_dict())
        new.k_proj.load_state_dict(old.k_proj.state_dict())
        new.v_proj.weight.copy_(old.v_proj.weight[keep])
        new.v_proj.bias.copy_(old.v_proj.bias[keep])
        new.out_proj.weight.copy_(w)
        new.out_proj.bias.copy_(b)
        block.self_attn = new

    def check_parts(self, block: nn.Module, i: int, parts: Sequence[str], compensation: str) -> None:
        """V pruning folds into ``out_proj``'s bias: a model built without biases (``enable_bias=False``) has none."""
        super().check_parts(block, i, parts, compensation)
        if "v" in parts and self.proj(block).bias is None:
            raise CorpError(
                f"V pruning is not supported for layer {i}: its out_proj has no bias to take the compensation's "
                "constant; use --target mlp,qk"
            )

    def apply_structure(self, model: nn.Module, entries: list[dict[str, Any]]) -> None:
        """Unfilled layers of the recorded widths (``load_pruned``; weights load next)."""
        for block, widths in zip(self.blocks(model), entries, strict=True):
            if widths["mlp_hidden"] != block.fc1.out_features:
                block.fc1 = linear_like(block.fc1, block.fc1.in_features, widths["mlp_hidden"])
                block.fc2 = linear_like(block.fc2, widths["mlp_hidden"], block.fc2.out_features)
            if (widths["qk_dim"], widths["v_dim"]) != self.head_widths(block):
                block.self_attn = self._rebuilt(block, widths["qk_dim"], widths["v_dim"])


HF_OPT = HfOpt()
