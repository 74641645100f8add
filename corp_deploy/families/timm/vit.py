"""timm VisionTransformers as a CORP family (``models.check_supported`` says which variants)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from corp_deploy.base.errors import CorpError
from corp_deploy.families.base import Adapter, BranchHook, QKHook
from corp_deploy.families.layers import AffineBranch
from corp_deploy.families.registry import register
from corp_deploy.families.timm import surgery
from corp_deploy.families.timm.models import ALIASES


class TimmViT(Adapter):
    """timm VisionTransformers (``models.check_supported``): fused qkv, ``fc1 -> act -> fc2``, every token counts."""

    name = "timm-vit"
    summary = "timm VisionTransformers"
    block_keys = frozenset({"heads", "mlp_hidden", "qk_dim", "v_dim", "attn", "mlp"})
    """``attn`` / ``mlp``: the module was replaced by an ``AffineBranch`` of that fit (then its widths are absent)."""

    def matches(self, model: nn.Module) -> bool:
        """Without asking timm into the process: a timm model exists only once its module was imported (the
        family registry asks every family about every model, text models included; timm with torchvision: ~3 s)."""
        vit = sys.modules.get("timm.models.vision_transformer")
        return vit is not None and isinstance(model, vit.VisionTransformer)

    def build(self, meta: dict[str, Any], folder: Path) -> nn.Module:
        """The recorded timm name, or an alias of one (``corp_deploy.save(result, out, "deit_small")``)."""
        import timm

        name, args = meta["model"]["name"], meta["model"].get("args", {})
        return timm.create_model(ALIASES.get(name, name), pretrained=False, **args)

    def blocks(self, model: nn.Module) -> Sequence[nn.Module]:
        return model.blocks

    def mlp_out(self, block: nn.Module) -> nn.Linear:
        return block.mlp.fc2

    def set_mlp(self, block: nn.Module, keep: Tensor, w: Tensor, b: Tensor | None) -> None:
        surgery.fill_mlp(block.mlp, keep, w, b)

    def heads(self, block: nn.Module) -> int:
        return block.attn.num_heads

    def head_widths(self, block: nn.Module) -> tuple[int, int]:
        return surgery.head_widths(block.attn)

    def qk_weights(self, block: nn.Module) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
        qkv, heads, (qk, _) = block.attn.qkv, self.heads(block), self.head_widths(block)
        rows = 2 * heads * qk
        w = qkv.weight[:rows].unflatten(0, (2, heads, qk))
        b = None if qkv.bias is None else qkv.bias[:rows].unflatten(0, (2, heads, qk))
        return w[0], None if b is None else b[0], w[1], None if b is None else b[1]

    def on_qk(self, block: nn.Module, fn: QKHook) -> list[RemovableHandle]:
        heads, (qk, _) = self.heads(block), self.head_widths(block)

        def hook(_m: nn.Module, _args: tuple, out: Tensor) -> None:
            q, k = out[..., : 2 * heads * qk].unflatten(-1, (2, heads, qk)).unbind(-3)
            fn(q, k)

        return [block.attn.qkv.register_forward_hook(hook)]

    def set_qk(self, block: nn.Module, q_w: Tensor, q_b: Tensor | None, k_w: Tensor, k_b: Tensor | None) -> None:
        block.attn = surgery.fill_attention(block.attn, q_w, q_b, k_w, k_b)

    def proj(self, block: nn.Module) -> nn.Linear:
        return block.attn.proj

    def set_values(self, block: nn.Module, keep: Tensor, w: Tensor, b: Tensor) -> None:
        block.attn = surgery.fill_values(block.attn, keep, w, b)

    def check_parts(self, block: nn.Module, i: int, parts: Sequence[str], compensation: str | None) -> None:
        super().check_parts(block, i, parts, compensation)
        if "v" in parts:
            surgery.check_v_prunable(block.attn, i)

    def check_depth(self, block: nn.Module, i: int) -> None:
        """The branch must be timm's ``x + ls(module(norm(x)))`` (``Block``), which ``surgery.replace_branch`` keeps."""
        from timm.models.vision_transformer import Block

        if type(block) is not Block:
            raise CorpError(
                f"--depth replaces modules of timm's plain Block only; block {i} is a {type(block).__name__}"
            )

    def on_branch(self, block: nn.Module, module: str, fn: BranchHook) -> list[RemovableHandle]:
        """x is the input of the branch's norm, y the output of its LayerScale (``surgery.BRANCHES``)."""
        norm, _, scale = (getattr(block, name) for name in surgery.BRANCHES[module])
        seen: list[Tensor] = []
        return [
            norm.register_forward_pre_hook(lambda _m, args: seen.append(args[0])),
            scale.register_forward_hook(lambda _m, _args, out: fn(seen.pop(), out)),
        ]

    def replace_branch(self, block: nn.Module, module: str, branch: AffineBranch) -> None:
        surgery.replace_branch(block, module, branch)

    def structure(self, block: nn.Module) -> dict[str, int | str]:
        """A replaced module is recorded as its fit (``attn``/``mlp``) instead of its widths."""
        entry: dict[str, int | str] = {}
        if (fit := surgery.removed(block, "mlp")) is not None:
            entry["mlp"] = fit
        else:
            entry["mlp_hidden"] = self.mlp_out(block).in_features
        if (fit := surgery.removed(block, "attn")) is not None:
            entry["attn"] = fit
        else:
            qk, v = self.head_widths(block)
            entry |= {"qk_dim": qk, "v_dim": v, "heads": self.heads(block)}
        return entry

    def apply_structure(self, model: nn.Module, entries: list[dict[str, Any]]) -> None:
        surgery.apply_widths(model, entries)

    def run(self, model: nn.Module, inputs: Tensor, device: torch.device | str) -> None:
        model(inputs.to(device, non_blocking=True))

    def count(self, inputs: Tensor) -> int:
        return inputs.shape[0]

    def tokens(self, model: nn.Module) -> int:
        """Patches plus class/distillation/register tokens."""
        return model.patch_embed.num_patches + model.num_prefix_tokens

    def example(self, model: nn.Module) -> Tensor:
        param = next(model.parameters())
        return torch.zeros(1, *self.input_size(model), device=param.device, dtype=param.dtype)

    def input_size(self, model: nn.Module) -> tuple[int, int, int]:
        """Taken from the model itself: timm's data config reports the pretrained config's size (518 for DINOv2)
        even when the model was built with ``img_size=224``."""
        h, w = model.patch_embed.img_size
        return (model.patch_embed.proj.in_channels, h, w)

    def data_config(self, model: nn.Module) -> dict[str, Any]:
        """timm's own preprocessing config of ``model``, at the input size it was actually built for."""
        import timm.data

        return timm.data.resolve_model_data_config(model) | {"input_size": self.input_size(model)}

    def features(self, model: nn.Module, x: Tensor, inputs: Tensor) -> Tensor:
        """Pre-logit features: the final norm, the pooled head input."""
        return model.forward_head(model.norm(x), pre_logits=True)


register(TimmViT())
