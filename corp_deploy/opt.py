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

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from corp_deploy.errors import CorpError
from corp_deploy.family import QKHook
from corp_deploy.hf import HfText, qk_hooks
from corp_deploy.hf_modeling import PrunedOptAttention, linear_like, opt_attention_at, opt_head_widths


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
        return opt_head_widths(block.self_attn)

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
        return opt_attention_at(block.self_attn, qk_dim, v_dim)

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


HF_OPT = HfOpt()
