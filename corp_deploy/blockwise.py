"""Block-by-block calibration: memory-bounded statistics, and sequential (error-correcting) CORP.

The one-pass default (``pruner.calibrate``) keeps every block's sums alive at once: 5.5 GiB for deit_base, about
40 GiB for deit3_huge. Here the images run ONCE through the stem (everything before ``model.blocks``) and the
block-0 input tokens are cached; then the walk visits groups of consecutive blocks: the cached tokens run through the
group with hooks (its statistics; the cache advances to the next group's input), the group is pruned and its sums
are freed. Groups are as large as ``max_stats_gib`` allows. On the dense stream this IS the one-pass method: every
block sees the same dense tokens, batch by batch in the same order, so the sums and the pruned weights are the same.

Sequential (``PruneConfig.sequential``): one block at a time, with two cached streams of the same images, the DENSE
model's and the model pruned so far. Per block i:

1. dense block i runs on ``[dense; pruned]`` tokens (one batch): the pruned stream's sums (ranking, ridge
   systems), the dense stream's (targets) and their cross moments (``stats.PairStats``);
2. with Q/K pruned, once the kept dims are ranked, a second pass through block i's ``norm1 -> qkv`` only gives
   the cross term of the logit regression (``compensation.sequential_logit_system``);
3. block i is pruned, regressing the dense targets from the pruned stream (so upstream error is undone too);
4. both streams advance: the dense one through a copy of the dense block, the pruned one through the pruned block.

That is about 4 block passes over the cache per block instead of 1 (plus the qkv-only pass), and 2 caches.

Cache placement: on a GPU, chunks (one per calibration batch) stay on the GPU while the cache fits in
``CACHE_FRACTION`` of the GPU memory free at the start minus the statistics the walk will hold; later chunks live in
host memory and are moved to the GPU one at a time. On the CPU everything is host memory.

Data-parallel: every rank caches its own shard; each block's (group's) sums are all-reduced before it is pruned, and
EVERY rank prunes it identically from the same sums, so its pruned stream can advance; rank 0 keeps the result.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from timm.models.vision_transformer import Block, VisionTransformer
from torch import Tensor, nn
from tqdm import tqdm

from corp_deploy.distributed import SINGLE_PROCESS, World, all_reduce_stats, all_reduce_tensors
from corp_deploy.errors import CorpError
from corp_deploy.family import TIMM_VIT
from corp_deploy.pruner import PruneConfig, Timer, Widths, plan_widths, prune_block
from corp_deploy.stats import CalibrationStats, empty_stats, recording

CACHE_FRACTION = 0.5
"""Share of the GPU memory free at the start that the token cache may take; the rest is for statistics, weights
and activations. Judgement: a deit_base block's activations at batch 64 are well under a GiB."""
GIB = 2**30


def check_supported(model: nn.Module) -> None:
    """The walk calls the stem and the blocks itself: only timm VisionTransformers with standard Blocks."""
    blocks = getattr(model, "blocks", None)
    if not (
        isinstance(model, VisionTransformer)
        and isinstance(blocks, nn.Sequential)
        and all(isinstance(b, Block) for b in blocks)
    ):
        raise CorpError(
            f"block-by-block calibration (--sequential, --max-stats-gib) supports timm VisionTransformer models with "
            f"standard blocks; {type(model).__name__} is not one: use the one-pass default"
        )


def stem(model: VisionTransformer, images: Tensor) -> Tensor:
    """Block 0's input tokens: ``forward_features`` up to ``model.blocks`` (timm 1.0)."""
    return model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(images))))


def block_stats(
    model: nn.Module, config: PruneConfig, blocks: Iterable[int], device: torch.device | str
) -> CalibrationStats:
    """Zeroed sums for ``blocks`` (``device="meta"`` to size them without allocating)."""
    return empty_stats(
        model, config.prunes("mlp"), config.prunes("qk"), device, config.prunes("v"), list(blocks), config.sequential
    )


def plan_groups(model: nn.Module, config: PruneConfig, max_stats_gib: float | None) -> list[list[int]]:
    """Consecutive blocks whose statistics together fit ``max_stats_gib`` (sequential: one block per group).

    Cheap and data-free (sizes from meta tensors): call it before calibrating so a bad bound fails at once.
    """
    sizes = [block_stats(model, config, [i], "meta").nbytes() for i in range(len(model.blocks))]
    if max_stats_gib is not None:
        if not max_stats_gib > 0:
            raise CorpError(f"--max-stats-gib must be > 0, got {max_stats_gib:g}")
        biggest = max(range(len(sizes)), key=sizes.__getitem__)
        if sizes[biggest] > max_stats_gib * GIB:
            need = math.ceil(sizes[biggest] / GIB * 1e4) / 1e4
            raise CorpError(
                f"--max-stats-gib {max_stats_gib:g} is below one block's statistics ({need:g} GiB for block "
                f"{biggest}{' in sequential mode' if config.sequential else ''}); pass at least {need:g}"
            )
    if config.sequential:
        return [[i] for i in range(len(sizes))]
    bound = math.inf if max_stats_gib is None else max_stats_gib * GIB
    groups: list[list[int]] = []
    used = 0
    for i, size in enumerate(sizes):
        if not groups or used + size > bound:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += size
    return groups


@dataclass
class TokenCache:
    """Token chunks (one per calibration batch) of one or two streams; each chunk lives on the device or the host."""

    device: torch.device
    streams: int
    budget: float
    """Bytes of the calibration device the cache may take; chunks beyond it live in host memory."""
    chunks: list[list[Tensor]] = field(default_factory=list)

    def add(self, x: Tensor) -> None:
        """A new chunk of block-0 tokens, the same in every stream."""
        need = x.numel() * x.element_size() * self.streams
        home = self.device if self.nbytes(self.device) + need <= self.budget else torch.device("cpu")
        self.chunks.append([x.to(home, copy=s > 0) for s in range(self.streams)])

    def load(self, k: int) -> list[Tensor]:
        return [t.to(self.device, non_blocking=True) for t in self.chunks[k]]

    def store(self, k: int, stream: int, x: Tensor) -> None:
        self.chunks[k][stream] = x.to(self.chunks[k][stream].device)

    def nbytes(self, on: torch.device | None = None) -> int:
        """Bytes held, on ``on`` only when given."""
        return sum(t.numel() * t.element_size() for chunk in self.chunks for t in chunk if on is None or t.device == on)


def device_budget(device: torch.device, statistics: int) -> float:
    """Bytes of ``device`` the cache may use: none to spare on the CPU (the host IS the device there)."""
    if device.type != "cuda":
        return math.inf
    free, _ = torch.cuda.mem_get_info(device)
    return max(0, int(CACHE_FRACTION * free) - statistics)


def walk(
    model: nn.Module,
    batches: Iterable[tuple[Tensor, int]],
    config: PruneConfig,
    device: torch.device,
    max_stats_gib: float | None = None,
    total: int | None = None,
    progress: bool = True,
    world: World = SINGLE_PROCESS,
    dist_timeout: float = 1800.0,
    timer: Timer | None = None,
    plan: list[Widths] | None = None,
) -> tuple[list[dict], dict[str, Any]]:
    """Calibrate and prune ``model`` (on ``device``, eval mode) in place, block by block.

    ``plan`` (a budget's widths, ``allocation.plan_budget``) replaces the uniform ``plan_widths``.
    Returns the per-block report (as ``pruner.prune_model``'s) and what the walk did: images, groups, passes,
    peak statistics bytes and cache size.
    """
    check_supported(model)
    if device.type == "cuda" and device.index is None:  # tensors report cuda:N: compare like with like
        device = torch.device("cuda", torch.cuda.current_device())
    timer = timer or Timer()
    plan = plan_widths(model, config) if plan is None else plan
    groups = plan_groups(model, config, max_stats_gib)
    peak = max(block_stats(model, config, g, "meta").nbytes() for g in groups)
    cache = TokenCache(device, 2 if config.sequential else 1, device_budget(device, peak))
    start = time.perf_counter()
    images, skipped = _cache_stem(model, batches, cache, total, progress)
    counts = torch.tensor([images, skipped], dtype=torch.float64, device=device)
    all_reduce_tensors([counts], world, dist_timeout)
    images, skipped = int(counts[0]), int(counts[1])
    if images == 0:
        raise CorpError(f"none of the {skipped} calibration images could be read; check the files")
    timer.add("calibration", start)
    report = []
    step = _sequential_block if config.sequential else _dense_group
    for group in tqdm(groups, unit="group", desc="blocks", disable=not progress):
        report += step(model, group, plan, cache, config, world, dist_timeout, timer)
    passes = len(plan) * (4 if config.sequential else 1)
    return report, {
        "images": images,
        "skipped": skipped,
        "mode": "sequential" if config.sequential else "blockwise",
        "groups": len(groups),
        "block_passes": passes,
        "qkv_passes": 2 * len(plan) if config.sequential and config.prunes("qk") else 0,
        "statistics_bytes": peak,
        "cache_mib": cache.nbytes() / 2**20,
        "cache_on_device_mib": cache.nbytes(device) / 2**20 if device.type == "cuda" else 0.0,
    }


def _cache_stem(
    model: nn.Module, batches: Iterable[tuple[Tensor, int]], cache: TokenCache, total: int | None, progress: bool
) -> tuple[int, int]:
    images = skipped = 0
    with torch.inference_mode(), tqdm(total=total, unit="img", desc="stem", disable=not progress) as bar:
        for x, bad in batches:
            skipped += bad
            if x.shape[0]:
                cache.add(stem(model, x.to(cache.device, non_blocking=True)))
                images += x.shape[0]
            bar.update(x.shape[0] + bad)
    return images, skipped


def _dense_group(
    model: nn.Module,
    group: list[int],
    plan: list,
    cache: TokenCache,
    config: PruneConfig,
    world: World,
    dist_timeout: float,
    timer: Timer,
) -> list[dict]:
    """One pass of the dense tokens through the group (statistics; the cache advances), then prune it."""
    t = time.perf_counter()
    stats = block_stats(model, config, group, cache.device)
    with recording(model, stats), torch.inference_mode():
        for k in range(len(cache.chunks)):
            (x,) = cache.load(k)
            for i in group:
                x = model.blocks[i](x)
            cache.store(k, 0, x)
    all_reduce_stats(stats, world, dist_timeout)
    timer.add("calibration", t)
    return [prune_block(TIMM_VIT, model.blocks[i], i, stats, plan[i], config, timer) for i in group]


def _sequential_block(
    model: nn.Module,
    group: list[int],
    plan: list,
    cache: TokenCache,
    config: PruneConfig,
    world: World,
    dist_timeout: float,
    timer: Timer,
) -> list[dict]:
    """Steps 1-4 of the module docstring for the group's one block."""
    (i,) = group
    t = time.perf_counter()
    dense = copy.deepcopy(model.blocks[i])
    stats = block_stats(model, config, group, cache.device)
    with recording(model, stats), torch.inference_mode():
        for k in range(len(cache.chunks)):
            model.blocks[i](torch.cat(cache.load(k)))
    all_reduce_stats(stats, world, dist_timeout)
    timer.add("calibration", t)

    def logit_targets(keep: Tensor) -> tuple[Tensor, Tensor]:
        return _logit_targets(dense, cache, keep, world, dist_timeout)

    entry = prune_block(TIMM_VIT, model.blocks[i], i, stats, plan[i], config, timer, logit_targets)
    t = time.perf_counter()
    with torch.inference_mode():
        for k in range(len(cache.chunks)):
            x_dense, x_pruned = cache.load(k)
            cache.store(k, 0, dense(x_dense))
            cache.store(k, 1, model.blocks[i](x_pruned))
    timer.add("calibration", t)
    return [entry]


def _split_qk(out: Tensor, heads: int, head_dim: int) -> tuple[Tensor, Tensor]:
    """timm's fused qkv output (B, N, 3*H*d) -> q, k as (B, N, H, d)."""
    qkv = out.unflatten(-1, (3, heads, head_dim))
    return qkv[..., 0, :, :], qkv[..., 1, :, :]


def _logit_targets(
    block: Block, cache: TokenCache, keep: Tensor, world: World, dist_timeout: float
) -> tuple[Tensor, Tensor]:
    """Per head ``sum_b (Q~_S,b^T Q_b)(K_b^T K~_S,b)`` (heads, d', d') and ``sum_b ||Q_b K_b^T||^2`` (heads).

    Q, K from the dense stream, Q~, K~ from the pruned one, both through the DENSE block's ``norm1 -> qkv``.
    Per-batch products in fp32 added into float64 sums, as in ``stats.QKStats``.
    """
    attn = block.attn
    heads, d = attn.num_heads, attn.head_dim
    f64 = {"dtype": torch.float64, "device": keep.device}
    cross = torch.zeros(heads, keep.shape[1], keep.shape[1], **f64)
    energy = torch.zeros(heads, **f64)
    with torch.inference_mode():
        for k in range(len(cache.chunks)):
            x_dense, x_pruned = cache.load(k)
            q, kk = (t.float() for t in _split_qk(attn.qkv(block.norm1(x_dense)), heads, d))
            qp, kp = (t.float() for t in _split_qk(attn.qkv(block.norm1(x_pruned)), heads, d))
            index = keep.to(qp.device).expand(*qp.shape[:2], -1, -1)
            qs, ks = qp.gather(-1, index), kp.gather(-1, index)
            gq = torch.einsum("bnhs,bnhd->bhsd", qs, q)
            gk = torch.einsum("bnhd,bnht->bhdt", kk, ks)
            cross += torch.einsum("bhsd,bhdt->hst", gq, gk).double()
            grams = [torch.einsum("bnhd,bnhe->bhde", t, t) for t in (q, kk)]
            energy += torch.einsum("bhde,bhde->h", *grams).double()
    all_reduce_tensors([cross, energy], world, dist_timeout)
    return cross, energy
