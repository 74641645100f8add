"""``transformers`` vision transformers: ViT (``ViTModel``, ``ViTForImageClassification``) and DINOv2
(``Dinov2Model``, ``Dinov2ForImageClassification``).

Per layer (ViT's ``layers[i]``, DINOv2's ``encoder.layer[i]``): attention ``attention.{q,k,v}_proj`` (separate
Linears) and ``attention.o_proj`` reading the head outputs; MLP ``mlp.fc1 -> act -> mlp.fc2``. Pre-LN, and DINOv2's
LayerScale multiplies the branch AFTER ``o_proj``/``fc2``, so folding the compensation into them is exact, as for
timm's ViTs: the same math on the same weights (``tests/families/test_families.py`` checks that a converted timm model
prunes to the same features). A pruned attention is ``modeling.PrunedPlainAttention`` (kind ``plain``) as a
subclass of the layer's own class.

Inputs are ``pixel_values`` batches, preprocessed as the source's ``preprocessor_config.json`` says (copied into
the artifact folder); the statistics count every token, the sensitivity pass compares the final LayerNorm's [CLS]
token (what the pooler, the classifier and timm's ``pre_logits`` read); exported graphs output the logits or the
last hidden state (``exporters.onnx_export.ImageGraph``). DINOv2's SwiGLU variant (``use_swiglu_ffn``: ViT-g)
has another MLP layout and is not this family's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from corp_deploy.base.errors import CorpError
from corp_deploy.families.hf.adapter import HfText, Names
from corp_deploy.families.registry import register


def names(layers: str, mlp_field: str) -> Names:
    """The layout both families share; ``layers``: where the base model keeps them, ``mlp_field``: the config
    field that gives the MLP width."""
    return Names(
        layers=layers,
        attention="attention",
        kind="plain",
        q="q_proj",
        k="k_proj",
        v="v_proj",
        proj="attention.o_proj",
        mlp_in=("mlp.fc1",),
        mlp_out="mlp.fc2",
        mlp_field=mlp_field,
    )


class HfVision(HfText):
    """A ``transformers`` vision transformer: ``HfText``'s layout by names, images as inputs."""

    modality = "image"
    causal = False

    def matches(self, model: nn.Module) -> bool:
        return super().matches(model) and not getattr(model.config, "use_swiglu_ffn", False)

    def run(self, model: nn.Module, inputs: Tensor, device: torch.device | str) -> None:
        model(pixel_values=inputs.to(device, non_blocking=True))

    def count(self, inputs: Tensor) -> int:
        return inputs.shape[0]

    def token_mask(self, inputs: Any, device: torch.device | str) -> None:
        return None

    def features(self, model: nn.Module, x: Tensor, inputs: Any) -> Tensor:
        """The final LayerNorm's [CLS] token."""
        return self.final(model, x)[:, 0]

    def input_size(self, model: nn.Module) -> tuple[int, int, int]:
        """(C, H, W) the model's image processor produces (its crop, else its resize), else the config's
        ``image_size`` (DINOv2's 518: its processor crops 224 and the model interpolates its positions)."""
        processor = preprocessor(model)
        size = processor.get("crop_size") if processor.get("do_center_crop") else processor.get("size")
        if isinstance(size, dict) and {"height", "width"} <= size.keys():
            return model.config.num_channels, size["height"], size["width"]
        size = model.config.image_size
        h, w = (size, size) if isinstance(size, int) else size
        return model.config.num_channels, h, w

    def data_config(self, model: nn.Module) -> dict[str, Any]:
        """The source's ``preprocessor_config.json`` in timm's terms: resize (the crop's share of the shortest
        edge) with its resampling, center crop, rescale to [0, 1] and normalize with its mean and std."""
        processor = preprocessor(model)
        if not processor:
            raise CorpError(
                f"{model.config._name_or_path or 'this model'} has no preprocessor_config.json: its image size, "
                "mean and std are unknown; put the source's file beside its config.json"
            )
        _, h, w = self.input_size(model)
        edge = (processor.get("size") or {}).get("shortest_edge")
        crop = processor.get("do_center_crop") and edge
        return {
            "input_size": (model.config.num_channels, h, w),
            "interpolation": RESAMPLING.get(processor.get("resample", 2), "bilinear"),
            "mean": tuple(processor.get("image_mean", (0.5, 0.5, 0.5))),
            "std": tuple(processor.get("image_std", (0.5, 0.5, 0.5))),
            "crop_pct": min(h, w) / edge if crop else 1.0,
            "crop_mode": "center",
        }

    def tokens(self, model: nn.Module) -> int:
        """Patches plus the [CLS] token at ``input_size``."""
        _, h, w = self.input_size(model)
        p = model.config.patch_size
        p = (p, p) if isinstance(p, int) else p
        return (h // p[0]) * (w // p[1]) + 1

    def example(self, model: nn.Module) -> Tensor:
        weight = next(model.parameters())
        return torch.zeros(1, *self.input_size(model), device=weight.device, dtype=weight.dtype)


RESAMPLING = {0: "nearest", 2: "bilinear", 3: "bicubic"}
"""PIL's resampling codes (an image processor's ``resample``) -> timm's interpolation names."""


def preprocessor(model: nn.Module) -> dict[str, Any]:
    """The image processor's settings saved beside the model (``preprocessor_config.json`` of the folder it was
    loaded from, which a pruned artifact copies), or {} when there is none."""
    path = Path(getattr(model.config, "_name_or_path", "") or "", "preprocessor_config.json")
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        raise CorpError(f"{path} is not valid JSON; restore the source's file") from None


class HfDinov2(HfVision):
    """DINOv2's config gives the MLP width as a whole multiple of the hidden size (``mlp_ratio``, an int)."""

    def mlp_config(self, config: Any, width: int) -> dict[str, Any] | None:
        """``mlp_ratio`` when ``width`` is a whole multiple of the hidden size, else None (remote-code folder)."""
        ratio, rest = divmod(width, config.hidden_size)
        return {"mlp_ratio": ratio} if rest == 0 and ratio > 0 else None


register(
    HfVision(
        "hf-vit",
        "transformers ViT (model_type vit)",
        ("vit",),
        names("layers", "intermediate_size"),
        final=("layernorm",),
    )
)
register(
    HfDinov2(
        "hf-dinov2",
        "transformers DINOv2 (model_type dinov2)",
        ("dinov2",),
        names("encoder.layer", "mlp_ratio"),
        final=("layernorm",),
    )
)
