"""What every family's pruning shares: a removed module's closed-form stand-in and a Linear's weights in float64.

Here, not in one family's folder, so the algorithm (``core.pruner``) and the plan (``plan.width_plan``) read them
without importing the timm family; a family places the stand-in in its own blocks (``Adapter.replace_branch``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class AffineBranch(nn.Module):
    """A removed module's closed-form stand-in (``--depth``): ``y = x W^T + x_bar U^T + b`` per token.

    ``x`` is the block's residual stream where the branch reads it (before the branch's norm), ``x_bar`` its mean
    over the image's tokens, ``y`` what the branch added to the residual (after its LayerScale): the fit
    (``compensation.branch_fit``) replaces norm, module and LayerScale together, so nothing is folded through
    a LayerNorm. ``fit`` (``compensation.DEPTH_FITS``) says which terms exist: ``mean`` keeps only b,
    ``affine`` adds W, ``affine-mean`` adds U. Ordinary ops only (Linear, mean, add), so it exports to ONNX.
    """

    def __init__(self, dim: int, fit: str) -> None:
        super().__init__()
        self.fit = fit
        self.bias = nn.Parameter(torch.zeros(dim))
        self.linear = nn.Linear(dim, dim, bias=False) if fit != "mean" else None
        self.token_mean = nn.Linear(dim, dim, bias=False) if fit == "affine-mean" else None

    def forward(self, x: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        """timm's Block calls its attention with ``attn_mask``/``is_causal``; a fitted map has no use for them."""
        y = self.bias.expand_as(x) if self.linear is None else self.linear(x) + self.bias
        if self.token_mean is not None:
            y = y + self.token_mean(x.mean(1, keepdim=True))
        return y

    @torch.no_grad()
    def fill(self, w: Tensor, b: Tensor) -> AffineBranch:
        """Set the fitted ``y ~ W z + b`` with ``z = [x, x_bar]`` (W: dim x |features of the fit|)."""
        dim = self.bias.numel()
        self.bias.copy_(b)
        if self.linear is not None:
            self.linear.weight.copy_(w[:, :dim])
        if self.token_mean is not None:
            self.token_mean.weight.copy_(w[:, dim:])
        return self


def linear_float64(linear: nn.Linear, dev: torch.device) -> tuple[Tensor, Tensor]:
    """A Linear's weight and bias (zeros when it has none) in float64 on the statistics' device."""
    w = linear.weight.detach().to(dev, torch.float64)
    b = torch.zeros(w.shape[0], dtype=w.dtype, device=dev) if linear.bias is None else linear.bias.detach()
    return w, b.to(dev, torch.float64)
