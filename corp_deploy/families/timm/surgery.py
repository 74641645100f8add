"""The pruned timm modules: physically smaller, ordinary ``nn.Module`` trees.

The builders here only create modules of the pruned shapes; the pruner fills them with
compensated weights and ``load_pruned`` fills them from a checkpoint. Both go through the same
builders, so a saved artifact always reloads into exactly the structure that was pruned.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from corp_deploy.base.errors import CorpError
from corp_deploy.families.layers import AffineBranch

if TYPE_CHECKING:  # annotations only: only image models pay for importing timm (and torchvision: ~3 s)
    from timm.layers import Mlp
    from timm.models.vision_transformer import Attention


class PrunedAttention(nn.Module):
    """Multi-head self-attention with Q/K head width ``qk_dim`` and V head width ``v_dim``.

    One fused ``qkv`` Linear with ``2*H*qk_dim + H*v_dim`` outputs (one GEMM), laid out
    ``[q heads | k heads | v heads]``. ``scale`` stays that of the ORIGINAL head dim: CORP's
    compensation reproduces the original logits, so rescaling by ``qk_dim ** -0.5`` would be wrong.
    With ``qk_dim == v_dim`` this is ordinary multi-head attention, which SDPA's flash kernels take;
    with unequal widths they do not, and ``pad_qk`` (an export-time switch, not a weight) zero-pads
    Q and K up to ``v_dim`` after the projection: exact, since the extra dims add 0 to every logit,
    and the smaller qkv GEMM is kept. Reshapes use -1 so that no batch or sequence size is baked
    into exported graphs.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        qk_dim: int,
        v_dim: int,
        scale: float,
        qkv_bias: bool = True,
        proj_bias: bool = True,
        dim_out: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.qk_dim, self.v_dim, self.scale = num_heads, qk_dim, v_dim, scale
        self.pad_qk = False
        self.qkv = nn.Linear(dim, num_heads * (2 * qk_dim + v_dim), bias=qkv_bias)
        self.norm: nn.Module = nn.Identity()
        self.gate: nn.Linear | None = None
        self.proj = nn.Linear(num_heads * v_dim, dim_out or dim, bias=proj_bias)

    def forward(self, x: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        b, n, _ = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        qk_width = self.num_heads * self.qk_dim
        q, k, v = self.qkv(x).split([qk_width, qk_width, self.num_heads * self.v_dim], dim=-1)
        q = q.reshape(b, n, self.num_heads, -1).transpose(1, 2)
        k = k.reshape(b, n, self.num_heads, -1).transpose(1, 2)
        v = v.reshape(b, n, self.num_heads, -1).transpose(1, 2)
        if self.pad_qk and self.qk_dim < self.v_dim:
            q, k = (F.pad(t, (0, self.v_dim - self.qk_dim)) for t in (q, k))
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=self.scale)
        x = self.norm(x.transpose(1, 2).reshape(b, n, -1))
        if gate is not None:
            x = x * gate
        return self.proj(x)


BRANCHES = {"attn": ("norm1", "attn", "ls1"), "mlp": ("norm2", "mlp", "ls2")}
"""Per removable module of a timm Block: (its norm, the module, its LayerScale); the branch is ls(module(norm(x)))."""


def replace_branch(block: nn.Module, module: str, branch: AffineBranch) -> None:
    """Make ``block``'s ``module`` branch ``branch(x)``: the norm and LayerScale become identities, so timm's own
    ``x + drop_path(ls(module(norm(x))))`` computes ``x + branch(x)`` (drop_path is the identity in eval)."""
    norm, name, scale = BRANCHES[module]
    setattr(block, norm, nn.Identity())
    setattr(block, scale, nn.Identity())
    param = next(getattr(block, name).parameters())
    setattr(block, name, branch.to(param.device, param.dtype))


def removed(block: nn.Module, module: str) -> str | None:
    """The fit that replaced ``block``'s ``module`` (``AffineBranch.fit``), or None while the module is there."""
    m = getattr(block, BRANCHES[module][1])
    return m.fit if isinstance(m, AffineBranch) else None


def check_v_prunable(attn: nn.Module, block: int) -> None:
    """V pruning folds into proj's weight AND bias, and needs nothing else to act on the V channels."""
    problem = None
    if not isinstance(attn.norm, nn.Identity):
        problem = "a norm over the attention output (scale_norm), which removing V channels changes"
    elif getattr(attn, "gate", None) is not None:
        problem = "a gate on the attention output"
    elif attn.proj.bias is None:
        problem = "no proj bias to take the compensation's constant"
    if problem:
        raise CorpError(f"V pruning is not supported for block {block}: it has {problem}; use --target mlp,qk")


def head_widths(attn: Attention | PrunedAttention) -> tuple[int, int]:
    """(Q/K dims, V channels) per head of a dense or pruned attention."""
    if isinstance(attn, PrunedAttention):
        return attn.qk_dim, attn.v_dim
    return attn.head_dim, attn.head_dim


def pruned_attention_like(attn: Attention | PrunedAttention, qk_dim: int, v_dim: int | None = None) -> PrunedAttention:
    """An (unfilled) PrunedAttention with ``attn``'s shapes but ``qk_dim``/``v_dim`` per head.

    With the V width unchanged, ``norm`` (scale_norm), ``gate`` and ``proj`` act on the same channels
    and are carried over as they are; a new V width gets a new (unfilled) ``proj`` (V pruning is only
    planned for blocks without norm or gate).
    """
    old_v = head_widths(attn)[1]
    v_dim = old_v if v_dim is None else v_dim
    new = PrunedAttention(
        dim=attn.qkv.in_features,
        num_heads=attn.num_heads,
        qk_dim=qk_dim,
        v_dim=v_dim,
        scale=float(attn.scale),
        qkv_bias=attn.qkv.bias is not None,
        proj_bias=attn.proj.bias is not None,
        dim_out=attn.proj.out_features,
    )
    if v_dim == old_v:
        new.norm, new.gate, new.proj = attn.norm, getattr(attn, "gate", None), attn.proj  # gate: timm >= 1.0.28
    return new.to(attn.qkv.weight.device, attn.qkv.weight.dtype).train(attn.training)  # an eval model stays in eval


def pad_qk(model: nn.Module, enable: bool = True) -> int:
    """Switch zero-padding of Q/K to the V width on every pruned attention; returns how many changed.

    For export: the padded graph computes the same function with one head size for Q, K and V,
    which fused attention kernels (TensorRT MHA, flash SDPA) require.
    """
    changed = 0
    for m in model.modules():
        if isinstance(m, PrunedAttention) and m.qk_dim < m.v_dim:
            m.pad_qk = enable
            changed += 1
    return changed


def shrink_mlp(mlp: Mlp, hidden: int) -> None:
    """Replace ``fc1``/``fc2`` in place by (unfilled) Linears with ``hidden`` channels."""
    fc1, fc2 = mlp.fc1, mlp.fc2
    kw = {"device": fc1.weight.device, "dtype": fc1.weight.dtype}
    mlp.fc1 = nn.Linear(fc1.in_features, hidden, bias=fc1.bias is not None, **kw).train(fc1.training)
    mlp.fc2 = nn.Linear(hidden, fc2.out_features, bias=fc2.bias is not None, **kw).train(fc2.training)


def apply_widths(model: nn.Module, blocks: list[dict[str, int | str]]) -> None:
    """Give every block the recorded widths (``mlp_hidden``, ``qk_dim``, ``v_dim``) or replaced modules (``attn``,
    ``mlp``: the ``AffineBranch`` fit); weights are left unfilled.

    Artifacts written before V pruning have no ``v_dim``: their V width is the dense head dim.
    """
    for block, widths in zip(model.blocks, blocks, strict=True):
        dim = block.attn.qkv.in_features
        if "mlp" in widths:
            replace_branch(block, "mlp", AffineBranch(dim, widths["mlp"]))
        elif widths["mlp_hidden"] != block.mlp.fc1.out_features:
            shrink_mlp(block.mlp, widths["mlp_hidden"])
        if "attn" in widths:
            replace_branch(block, "attn", AffineBranch(dim, widths["attn"]))
            continue
        d = block.attn.head_dim
        qk, v = widths["qk_dim"], widths.get("v_dim", d)
        if (qk, v) != (d, d):
            block.attn = pruned_attention_like(block.attn, qk, v)


@torch.no_grad()
def fill_mlp(mlp: Mlp, keep: Tensor, w2: Tensor, b2: Tensor | None) -> None:
    """Shrink ``mlp`` to the kept channels: fc1 keeps rows ``keep``, fc2 gets the folded weights."""
    fc1_w = mlp.fc1.weight[keep].clone()
    fc1_b = None if mlp.fc1.bias is None else mlp.fc1.bias[keep].clone()
    shrink_mlp(mlp, keep.numel())
    mlp.fc1.weight.copy_(fc1_w)
    mlp.fc2.weight.copy_(w2)
    if fc1_b is not None:
        mlp.fc1.bias.copy_(fc1_b)
    if b2 is not None:
        mlp.fc2.bias.copy_(b2)


@torch.no_grad()
def fill_attention(
    attn: Attention, q_w: Tensor, q_b: Tensor | None, k_w: Tensor, k_b: Tensor | None
) -> PrunedAttention:
    """A PrunedAttention with the given per-head query/key projections and ``attn``'s values.

    ``q_w``/``k_w``: (heads, qk_dim, in_features); biases (heads, qk_dim) or None.
    """
    new = pruned_attention_like(attn, q_w.shape[1])
    attn_dim = attn.num_heads * attn.head_dim  # timm's ``attn.attn_dim``, which timm < 1.0.23 lacks
    v_rows = slice(2 * attn_dim, 3 * attn_dim)
    new.qkv.weight.copy_(torch.cat([q_w.flatten(0, 1), k_w.flatten(0, 1), attn.qkv.weight[v_rows]]))
    if new.qkv.bias is not None:
        new.qkv.bias.copy_(torch.cat([q_b.flatten(), k_b.flatten(), attn.qkv.bias[v_rows]]))
    return new


@torch.no_grad()
def fill_values(attn: Attention | PrunedAttention, keep: Tensor, proj_w: Tensor, proj_b: Tensor) -> PrunedAttention:
    """A PrunedAttention keeping V channels ``keep`` (indices into ``[v_1 | ... | v_H]``, the same
    number per head) with proj (``proj_w``, ``proj_b``). Q/K rows of qkv are copied as they are.
    """
    qk, _ = head_widths(attn)
    qk_rows = 2 * attn.num_heads * qk
    new = pruned_attention_like(attn, qk, keep.numel() // attn.num_heads)
    rows = torch.cat([torch.arange(qk_rows, device=keep.device), qk_rows + keep])
    new.qkv.weight.copy_(attn.qkv.weight[rows])
    if new.qkv.bias is not None:
        new.qkv.bias.copy_(attn.qkv.bias[rows])
    new.proj.weight.copy_(proj_w)
    new.proj.bias.copy_(proj_b)
    return new
