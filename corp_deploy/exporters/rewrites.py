"""Exact fixed-cost rewrites of a deployed model: the same function, computed with faster kernels.

Width pruning shrinks only the GEMMs; what stays (the patch embedding, attention, LayerNorm, launches) caps the
speedup. A rewrite here changes how one of those fixed parts is computed, never what it computes, and is applied
to the dense and the pruned model alike (so a measured speedup compares like with like). Whether one pays depends
on the backend: ``DEFAULTS`` keeps a rewrite only where it was measured to pay (docs/BENCHMARKS.md "Exact
fixed-cost rewrites"; ``studies/rewrite_study.py`` measures it).

- ``patch-linear``: the patch embedding, a Conv2d whose kernel equals its stride (no padding, no dilation, one
  group), as a reshape/permute into patches and one Linear: the same sums in the same order per output, as a GEMM
  instead of a convolution kernel (0.55 ms as a cuDNN conv vs 0.08 ms as reshape+GEMM for deit_base at batch 64
  in fp16 on an H200, issue 23).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from corp_deploy.base.errors import CorpError

PATCH_LINEAR = "patch-linear"
REWRITES = (PATCH_LINEAR,)


class LinearPatchEmbed(nn.Module):
    """timm's ``PatchEmbed`` (flattened NLC output) with its patch convolution computed as reshape + Linear.

    Patch (i, j)'s output is ``W . x[:, i*p:(i+1)*p, j*p:(j+1)*p] + b``: a conv whose kernel equals its stride
    is one GEMM of the (C, p, p)-flattened patches with the (out, C*p*p)-reshaped kernel.
    """

    def __init__(self, embed: nn.Module) -> None:
        super().__init__()
        conv = embed.proj
        self.patch_size = tuple(conv.kernel_size)
        self.proj = nn.Linear(conv.in_channels * self.patch_size[0] * self.patch_size[1], conv.out_channels)
        self.proj.bias = None if conv.bias is None else nn.Parameter(conv.bias.detach().clone())
        self.proj.weight = nn.Parameter(conv.weight.detach().reshape(conv.out_channels, -1).clone())
        self.norm = embed.norm
        for name in ("img_size", "grid_size", "num_patches", "flatten", "output_fmt", "dynamic_img_pad"):
            setattr(self, name, getattr(embed, name))
        self.strict_img_size = embed.strict_img_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        ph, pw = self.patch_size
        x = x.reshape(b, c, h // ph, ph, w // pw, pw).permute(0, 2, 4, 1, 3, 5)
        return self.norm(self.proj(x.reshape(b, (h // ph) * (w // pw), c * ph * pw)))


def _patch_linear_applies(model: nn.Module) -> bool:
    """Whether ``model.patch_embed`` is a timm PatchEmbed whose conv is exactly a per-patch GEMM."""
    embed = getattr(model, "patch_embed", None)
    conv = getattr(embed, "proj", None)
    return (
        isinstance(conv, nn.Conv2d)
        and tuple(conv.kernel_size) == tuple(conv.stride)
        and conv.padding in ((0, 0), "valid")
        and tuple(conv.dilation) == (1, 1)
        and conv.groups == 1
        and getattr(embed, "flatten", False) is True
        and not getattr(embed, "dynamic_img_pad", True)
    )


def parse_rewrites(text: str, defaults: tuple[str, ...] = ()) -> tuple[str, ...]:
    """``auto`` (``defaults``: what pays on the backend, ``bench.backends.Backend.default_rewrites``), ``none`` or a
    comma list of rewrite names."""
    if text == "auto":
        return defaults
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if names == ("none",):
        return ()
    if not names or any(n not in REWRITES for n in names):
        raise CorpError(f"--rewrites takes auto, none or a comma list of {', '.join(REWRITES)}; got {text!r}")
    return names


def rewritten(model: nn.Module, names: Sequence[str]) -> tuple[nn.Module, tuple[str, ...]]:
    """A copy of ``model`` with the named rewrites applied where they are exact; and those applied.

    ``model`` itself is returned when none applies, so nothing is copied for nothing.
    """
    applied = tuple(n for n in names if n == PATCH_LINEAR and _patch_linear_applies(model))
    if not applied:
        return model, ()
    model = copy.deepcopy(model)
    model.patch_embed = LinearPatchEmbed(model.patch_embed)
    return model, applied
