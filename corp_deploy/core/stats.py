"""Calibration statistics: mergeable sums, and the one forward pass that fills them.

Every statistic is a plain sum (count, sum, sum of outer products, ...) kept in float64, so
statistics from disjoint image shards merge by addition (``+=``, or an all-reduce of
``tensors()``) and give the same result as one pass over all images. None of them depends on the
sparsity: a sweep collects once and prunes many times.

Per-batch products run in float32 (fast GEMMs) and are added into the float64 sums. The MLP outer
products are formed on batch-centred activations and the shift is added back in float64, which
avoids the cancellation of ``E[xx^T] - mu mu^T`` when means are large against variances.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from tqdm import tqdm

from corp_deploy.core.compensation import packed_index
from corp_deploy.families import adapter_for
from corp_deploy.families.base import StopForward, run_until_stopped

ACTIVE_EPS = 1e-3
"""Threshold of the ``active`` ranker: a hidden channel is active on a token when ``|x| > eps``."""


def _at_least_fp32(t: Tensor) -> Tensor:
    """Per-batch products run in fp32 (fp64 inputs stay fp64); half-precision activations are upcast."""
    return t if t.dtype == torch.float64 else t.float()


def _add_outer(into: Tensor, a: Tensor, b: Tensor, scale: float = 1.0) -> None:
    """``into += scale * sum_n a_n b_n^T`` (float64) of the rows of two fp32 matrices over the same tokens.

    The product runs on batch-centred rows and the shift is added back in float64:
    sum a b^T = sum ac bc^T + ma tb^T + ta mb^T - n ma mb^T holds for ANY shifts ma, mb. Adding n ma mb^T
    alone would let the float32 error e of a batch mean in as n (ma e^T + e mb^T): it swamps small variances.
    Everything lands in ``into`` in place (``addr_``; the fp32 product is cast as it is added), so the only
    temporary is that fp32 product: a float64 copy and three float64 outer products of an 8192-wide MLP input
    would be 1.6 GiB more at the peak.
    """
    n = a.shape[0]
    ma, mb = a.mean(0), b.mean(0)
    ac = a - ma
    bc = ac if b is a else b - mb
    ta, tb = a.sum(0, dtype=torch.float64), b.sum(0, dtype=torch.float64)
    ma, mb = ma.double(), mb.double()
    if bc is ac:
        _add_gram(into, ac, scale)
    else:
        into.add_(ac.T @ bc, alpha=scale)
    into.addr_(ma, tb, alpha=scale).addr_(ta, mb, alpha=scale).addr_(ma, mb, alpha=-n * scale)


GRAM_STRIP = 1024
"""Columns per strip of ``_add_gram``: 8 strips of an 8192-wide input do 56% of the full product's FLOPs."""


def _add_gram(into: Tensor, x: Tensor, scale: float) -> None:
    """``into += scale * x^T x`` from the lower triangle only, in column strips, each mirrored into the upper one.

    The Gram of a width-w input is half of its w x w product; strips of ``GRAM_STRIP`` columns skip the blocks above
    the diagonal (the MLP input's Gram costs as much as the block's whole forward); the mirrored product is symmetric.
    """
    width, s = x.shape[1], GRAM_STRIP
    for j in range(0, width, s):
        strip = x[:, j:].T @ x[:, j : j + s]  # rows j.., columns j..j+s
        into[j:, j : j + s].add_(strip, alpha=scale)
        into[j : j + s, j + s :].add_(strip[s:].T, alpha=scale)


class _Sums:
    """Merging is adding every sum: shards of the calibration set combine exactly."""

    def tensors(self) -> list[Tensor]:
        raise NotImplementedError

    def __iadd__(self, other: _Sums) -> _Sums:
        for mine, theirs in zip(self.tensors(), other.tensors(), strict=True):
            mine += theirs.to(mine.device)
        return self


class MlpStats(_Sums):
    """Token statistics of a Linear's input: an MLP's hidden activation (fc2), or the attention output (proj).

    V pruning is the MLP's compensation at proj's input, so both use the same sums.
    """

    def __init__(self, width: int, device: torch.device | str = "cpu") -> None:
        f64 = {"dtype": torch.float64, "device": device}
        self.count = torch.zeros((), **f64)
        self.sum = torch.zeros(width, **f64)
        self.outer = torch.zeros(width, width, **f64)
        self.active = torch.zeros(width, **f64)

    def update(self, x: Tensor, mask: Tensor | None = None) -> None:
        """x: (..., width) tokens; ``mask`` (bool, the same tokens in the same order): those that count (None: all).

        Both are flattened over tokens, so x may come flat (OPT runs its MLP on (batch * tokens, width))."""
        x = x.reshape(-1, x.shape[-1])
        x = _at_least_fp32(x if mask is None else x[mask.reshape(-1)])
        self.count += x.shape[0]
        self.sum += x.sum(0, dtype=torch.float64)
        _add_outer(self.outer, x, x)
        self.active += (x.abs() > ACTIVE_EPS).sum(0, dtype=torch.float64)

    def mean(self) -> Tensor:
        return self.sum / self.count

    def second_moment(self) -> Tensor:
        return self.outer / self.count

    def tensors(self) -> list[Tensor]:
        return [self.count, self.sum, self.outer, self.active]


class PairStats(MlpStats):
    """Sequential calibration at a Linear's input: two streams of the same tokens.

    ``self`` holds the PRUNED stream's sums (what ranking and the ridge system use, as ``MlpStats``),
    ``target`` the DENSE stream's, and ``cross`` sums ``x_dense x_pruned^T``: the compensation regresses
    the dense activation onto the pruned stream's kept channels (``compensation.regression_affine``).
    """

    def __init__(self, width: int, device: torch.device | str = "cpu") -> None:
        super().__init__(width, device)
        self.target = MlpStats(width, device)
        self.cross = torch.zeros(width, width, dtype=torch.float64, device=device)

    def update(self, x: Tensor, mask: Tensor | None = None) -> None:
        """x: ``[dense rows; pruned rows]`` along dim 0, the same inputs in the same order in both halves;
        ``mask``: the tokens that count, in the same order (the same in both halves)."""
        target, source = x.reshape(-1, x.shape[-1]).chunk(2)
        if mask is not None:
            counted_target, counted_source = mask.reshape(-1).chunk(2)
            target, source = target[counted_target], source[counted_source]
        super().update(source)
        self.target.update(target)
        _add_outer(self.cross, _at_least_fp32(target), _at_least_fp32(source))

    def tensors(self) -> list[Tensor]:
        return super().tensors() + self.target.tensors() + [self.cross]


class QKStats(_Sums):
    """Per-head packed 4th-order Q/K moment of one attention layer, summed over the counted (query, key) pairs.

    ``moment[h, p, q] = sum_b sum_(i, j) (q_i q_i^T)[p] (k_j k_j^T)[q]`` over the pairs the softmax sees in
    sequence b: every pair of real tokens for an encoder (then it is ``GQ_b[p] GK_b[q]`` with the Grams
    ``GQ_b = Q_b^T Q_b``), only ``j <= i`` for a causal decoder (``causal``). A d x d symmetric matrix is
    stored as its upper triangle of ``P = d (d + 1) / 2`` entries. Ranking (its diagonal), the Kronecker ridge
    system and its right-hand side for ANY kept set all follow from it, so one pass serves every sparsity.
    Size: ``heads * P^2`` float64, e.g. 415 MB per DeiT-Base layer.
    """

    def __init__(self, heads: int, head_dim: int, device: torch.device | str = "cpu", causal: bool = False) -> None:
        self.heads, self.head_dim, self.causal = heads, head_dim, causal
        self.index = packed_index(head_dim, device=device)
        self.rows, self.cols = torch.triu_indices(head_dim, head_dim, device=device)
        p = self.rows.numel()
        self.count = torch.zeros((), dtype=torch.float64, device=device)
        self.moment = torch.zeros(heads, p, p, dtype=torch.float64, device=device)

    def update(self, q: Tensor, k: Tensor, mask: Tensor | None = None) -> None:
        """q, k: (batch, tokens, heads, head_dim) for the same inputs; ``mask`` (batch, tokens): real tokens.

        Zeroing the padded rows of q and k leaves exactly the (real query, real key) pairs in every sum.
        """
        q, k = _at_least_fp32(q), _at_least_fp32(k)
        if mask is not None:
            keep = mask[:, :, None, None].to(q.dtype)
            q, k = q * keep, k * keep
        self.count += q.shape[0]
        if self.causal:
            self._update_causal(q, k)
            return
        gq = torch.einsum("bnhd,bnhe->bhde", q, q)[..., self.rows, self.cols]
        gk = torch.einsum("bnhd,bnhe->bhde", k, k)[..., self.rows, self.cols]
        self.moment += torch.einsum("bhp,bhq->hpq", gq, gk).double()

    def _update_causal(self, q: Tensor, k: Tensor) -> None:
        """``sum_i (q_i q_i^T) (x) sum_(j <= i) k_j k_j^T``: a running (prefix) sum of the keys' packed outer
        products over the tokens, paired with each query's: one GEMM over tokens per head.

        Costs ``tokens * P^2`` per head and sequence (the all-pairs moment ``P^2``); heads run one at a time to
        bound the memory of the per-token packed products."""
        for h in range(self.heads):
            qh, kh = q[:, :, h], k[:, :, h]
            qq = (qh[..., self.rows] * qh[..., self.cols]).flatten(0, 1)
            prefix = (kh[..., self.rows] * kh[..., self.cols]).cumsum(1).flatten(0, 1)
            self.moment[h] += (qq.T @ prefix).double()

    def tensors(self) -> list[Tensor]:
        return [self.count, self.moment]


class BranchStats(_Sums):
    """Moments to fit a block's branch output y (what it adds to the residual) from the branch input x (depth).

    The fit's input is ``z = [x, x_bar]`` with ``x_bar`` the image's token mean (``compensation.branch_fit``).
    Only ``x x^T`` and ``y x^T`` need token-level products: ``x_bar`` is constant over an image's N tokens, so
    ``sum_tokens x x_bar^T = sum_tokens x_bar x_bar^T = sum_images N x_bar x_bar^T`` and ``sum_tokens y x_bar^T =
    sum_images N y_bar x_bar^T``, and ``sum_tokens x_bar = sum_tokens x``. Every token counts (timm ViTs).
    """

    def __init__(self, width: int, device: torch.device | str = "cpu") -> None:
        f64 = {"dtype": torch.float64, "device": device}
        self.count = torch.zeros((), **f64)
        self.sum_x = torch.zeros(width, **f64)
        self.sum_y = torch.zeros(width, **f64)
        self.xx = torch.zeros(width, width, **f64)
        self.bb = torch.zeros(width, width, **f64)
        self.yx = torch.zeros(width, width, **f64)
        self.yb = torch.zeros(width, width, **f64)
        self.energy = torch.zeros((), **f64)

    def update(self, x: Tensor, y: Tensor) -> None:
        """x, y: (batch, tokens, width), the branch's input and output for the same tokens."""
        x, y = _at_least_fp32(x), _at_least_fp32(y)
        n = x.shape[1]
        xbar, ybar = x.mean(1), y.mean(1)
        xt, yt = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
        self.count += xt.shape[0]
        self.sum_x += xt.sum(0, dtype=torch.float64)
        self.sum_y += yt.sum(0, dtype=torch.float64)
        _add_outer(self.xx, xt, xt)
        _add_outer(self.yx, yt, xt)
        _add_outer(self.bb, xbar, xbar, n)
        _add_outer(self.yb, ybar, xbar, n)
        self.energy += yt.double().square().sum()

    def moments(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """``E[z]``, ``E[z z^T]``, ``E[y]``, ``E[y z^T]``, ``E||y||^2`` over the tokens, z = [x, x_bar]."""
        mean_x = self.sum_x / self.count
        bb = self.bb / self.count
        second = torch.cat([torch.cat([self.xx / self.count, bb], 1), torch.cat([bb, bb], 1)])
        cross = torch.cat([self.yx, self.yb], 1) / self.count
        return torch.cat([mean_x, mean_x]), second, self.sum_y / self.count, cross, self.energy / self.count

    def tensors(self) -> list[Tensor]:
        return [self.count, self.sum_x, self.sum_y, self.xx, self.bb, self.yx, self.yb, self.energy]


@dataclass
class CalibrationStats:
    """Everything CORP needs from the calibration data, per transformer block."""

    mlp: dict[int, MlpStats] = field(default_factory=dict)
    qk: dict[int, QKStats] = field(default_factory=dict)
    proj: dict[int, MlpStats] = field(default_factory=dict)
    samples: int = 0
    """Inputs summed: images, or a text model's sequences (``Adapter.unit``)."""
    skipped: int = 0
    depth: dict[tuple[int, str], BranchStats] = field(default_factory=dict)
    """(block, module) -> its branch's moments, for replacing the module (``--depth``)."""
    paired: bool = False
    """Sequential calibration: hooked tensors are ``[dense; pruned]`` halves (``PairStats``; Q/K read the pruned)."""

    def tensors(self) -> list[Tensor]:
        """All sums in a fixed order, for an all-reduce across processes."""
        out: list[Tensor] = []
        for i in sorted(self.mlp):
            out += self.mlp[i].tensors()
        for i in sorted(self.qk):
            out += self.qk[i].tensors()
        for i in sorted(self.proj):
            out += self.proj[i].tensors()
        for k in sorted(self.depth):
            out += self.depth[k].tensors()
        return out

    def __iadd__(self, other: CalibrationStats) -> CalibrationStats:
        for i, s in other.mlp.items():
            self.mlp[i] += s
        for i, s in other.qk.items():
            self.qk[i] += s
        for i, s in other.proj.items():
            self.proj[i] += s
        for k, s in other.depth.items():
            self.depth[k] += s
        self.samples += other.samples
        self.skipped += other.skipped
        return self

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def empty_stats(
    model: nn.Module,
    mlp: bool,
    qk: bool,
    device: torch.device | str,
    proj: bool = False,
    blocks: Iterable[int] | None = None,
    paired: bool = False,
    depth: Iterable[str] = (),
) -> CalibrationStats:
    """Zeroed accumulators for ``blocks`` (default: all) of a supported model (``proj``: attention outputs, for V;
    ``depth``: the modules, ``attn`` and/or ``mlp``, whose branches may be replaced).

    ``paired``: sequential calibration (``PairStats``). ``device="meta"`` sizes them without allocating.
    """
    stats = CalibrationStats(paired=paired)
    linear = PairStats if paired else MlpStats
    adapter = adapter_for(model)
    all_blocks = adapter.blocks(model)
    for i in range(len(all_blocks)) if blocks is None else blocks:
        block = all_blocks[i]
        if mlp:
            stats.mlp[i] = linear(adapter.mlp_out(block).in_features, device)
        if qk:
            stats.qk[i] = QKStats(adapter.heads(block), adapter.head_widths(block)[0], device, adapter.causal)
        if proj:
            stats.proj[i] = linear(adapter.proj(block).in_features, device)
        for module in depth:
            stats.depth[(i, module)] = BranchStats(adapter.dim(block), device)
    return stats


def _stop(*_: Any) -> None:
    raise StopForward


@dataclass
class TokenMask:
    """The token mask of the batch being recorded (``Adapter.token_mask``): None while every token counts."""

    value: Tensor | None = None


@contextmanager
def recording(model: nn.Module, stats: CalibrationStats) -> Iterator[TokenMask]:
    """Hooks feeding ``stats`` from forward passes of ``model``'s blocks; removed however the pass ends.

    They read the input of each block's ``mlp_out`` and ``proj``, each attention's (q, k) (``Adapter.on_qk``) and
    each recorded branch's input and output (``Adapter.on_branch``),
    keeping the tokens of the yielded ``TokenMask``: set its ``value`` before each forward of a padded batch.
    """
    adapter = adapter_for(model)
    blocks = adapter.blocks(model)
    mask = TokenMask()
    handles = []
    inputs = [(adapter.mlp_out(blocks[i]), s) for i, s in stats.mlp.items()]
    inputs += [(adapter.proj(blocks[i]), s) for i, s in stats.proj.items()]
    for linear, s in inputs:
        handles.append(linear.register_forward_pre_hook(lambda _m, args, s=s: s.update(args[0], mask.value)))
    for i, s in stats.qk.items():

        def on_qk(q: Tensor, k: Tensor, s: QKStats = s) -> None:
            counted = mask.value
            if stats.paired:  # Q/K statistics read the pruned half
                half = q.shape[0] // 2
                q, k, counted = q[half:], k[half:], None if counted is None else counted[half:]
            s.update(q, k, counted)

        handles += adapter.on_qk(blocks[i], on_qk)
    for (i, module), s in stats.depth.items():
        handles += adapter.on_branch(blocks[i], module, s.update)
    try:
        yield mask
    finally:
        for h in handles:
            h.remove()


def collect(
    model: nn.Module,
    batches: Iterable[tuple[Any, int]],
    stats: CalibrationStats,
    device: torch.device | str,
    total: int | None = None,
    progress: bool = True,
) -> CalibrationStats:
    """Run the model once over ``batches`` of (inputs, skipped-count), accumulating into ``stats``.

    Inputs are what the model's family takes (images; token ids with an attention mask): ``Adapter.run``. The
    forward stops after the last block with statistics: what follows (a decoder's LM head, 1.6 TFLOP over 8k tokens
    for a 49k vocabulary at width 2048) feeds no sum.
    """
    model.eval()
    adapter = adapter_for(model)
    last = max([*stats.mlp, *stats.qk, *stats.proj, *(i for i, _ in stats.depth)], default=-1)
    blocks = adapter.blocks(model)
    with (
        recording(model, stats) as mask,
        torch.inference_mode(),
        tqdm(total=total, unit="input", desc="calibration", disable=not progress) as bar,
    ):
        for inputs, skipped in batches:
            stats.skipped += skipped
            n = adapter.count(inputs)
            if n:
                mask.value = adapter.token_mask(inputs, device)
                stop = [] if last < 0 else [blocks[last].register_forward_hook(_stop)]
                run_until_stopped(stop, functools.partial(adapter.run, model, inputs, device))
                stats.samples += n
            bar.update(n + skipped)
    return stats
