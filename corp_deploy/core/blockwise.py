"""Block-by-block calibration: memory-bounded statistics, and sequential (error-correcting) CORP.

The one-pass default (``pruner.calibrate``) keeps every block's sums alive at once: 5.5 GiB for deit_base, about
40 GiB for deit3_huge. Here the inputs run ONCE through the model up to block 0 and block 0's input tokens are
cached with the rest of its call (``Adapter.block_call``: nothing for a timm ViT; the attention mask and rotary
position embeddings of a ``transformers`` model) and the batch's token mask (padding stays out of every sum); then
the walk visits groups of consecutive blocks: the cached tokens run through the group with hooks (its statistics;
the cache advances to the next group's input), the group is pruned and its sums are freed. Groups are as large as
``max_stats_gib`` allows. On the dense stream this IS the one-pass method: every block sees the same dense tokens,
batch by batch in the same order, so the sums and the pruned weights are the same.

Sequential (``PruneConfig.sequential``): one block at a time, with two cached streams of the same inputs, the DENSE
model's and the model pruned so far. Per block i:

1. dense block i runs on ``[dense; pruned]`` tokens (one batch): the pruned stream's sums (ranking, ridge
   systems), the dense stream's (targets) and their cross moments (``stats.PairStats``);
2. with Q/K pruned, once the kept dims are ranked, a second pass through the dense block i, stopped once its
   query and key projections ran, gives the cross term of the logit regression
   (``compensation.sequential_logit_system``) over the pairs the softmax sees (a decoder's: key <= query);
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
from torch import Tensor, nn
from tqdm import tqdm

from corp_deploy.base import memory
from corp_deploy.base.errors import CorpError
from corp_deploy.core.config import PruneConfig, Widths
from corp_deploy.core.distributed import SINGLE_PROCESS, World, all_reduce_stats, all_reduce_tensors
from corp_deploy.core.pruner import Timer, prune_block
from corp_deploy.core.stats import CalibrationStats, empty_stats, recording
from corp_deploy.families import adapter_for, onload
from corp_deploy.families.base import Adapter, BlockCall, StopForward, map_tensors, run_until_stopped

CACHE_FRACTION = 0.5
"""Share of the GPU memory free at the start that the token cache may take; the rest is for statistics, weights
and activations. Judgement: a deit_base block's activations at batch 64 are well under a GiB."""
GIB = 2**30


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
    sizes = [block_stats(model, config, [i], "meta").nbytes() for i in range(len(adapter_for(model).blocks(model)))]
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
    if config.sequential or onload.of(model) is not None:  # onloaded: a group's blocks are in memory together
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


GROUP_GIB = 1.0
"""The statistics bound picked by default when one pass does not fit: groups cost no extra work (every block is still
visited once, the cache re-read per group), so a small bound only lowers the peak. Judgement."""


def memory_plan(
    model: nn.Module,
    config: PruneConfig,
    inputs: int,
    tokens: int,
    batch: int,
    device: torch.device,
    max_stats_gib: float | None,
    one_pass: bool,
) -> tuple[memory.Plan, float | None]:
    """The predicted peak of calibrating and pruning ``model`` (already loaded) on ``inputs`` of ``tokens`` tokens in
    batches of ``batch``, and the statistics bound to run with: ``max_stats_gib`` when given, else None (one pass)
    when everything fits the machine, else ``GROUP_GIB`` or one block's statistics (grouped: the same result).
    ``one_pass``: the run needs every block's statistics at once (a budget or a scored selection).

    Parts: the weights (float32 as loaded; onloaded, ``families.onload``: what is resident and one block, the
    pruned blocks waiting on disk, unless ``one_pass`` reads the model whole first), the statistics held at once,
    the token cache between groups, one batch's activations through one block (its widest layer's outputs, SwiGLU's
    three, the softmax maps) with the fp32 product of its widest statistic, and the compensation's four float64
    copies of its widest covariance (the moments, the covariance, its kept rows and columns, the factor). Refuses in
    one line, naming what would make it fit, when even one block's statistics do not.

    The peak is the walk's (or the pass's): what comes after holds less. The report measures the pruned model
    streamed as the dense one was, and the save writes the weights one tensor at a time
    (``formats.safetensors_writer``), an onloaded model's pruned blocks read from their store as they are written:
    nothing reads the pruned model whole (the 1.7B shape's 5.0 GiB in float32 did, at 7.26 GiB against the walk's
    5.07)."""
    adapter = adapter_for(model)
    block = adapter.blocks(model)[0]
    widest = max(adapter.mlp_out(block).in_features, adapter.dim(block))
    resident = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
    loader = None if one_pass else onload.of(model)  # one pass over an onloaded model reads it whole first
    whole = sum(p.numel() * p.element_size() for p in model.parameters())  # the meta ones by their shapes
    weights = whole if loader is None else resident + loader.block_bytes()
    per_block = [block_stats(model, config, [i], "meta").nbytes() for i in range(len(adapter.blocks(model)))]
    streams = 2 if config.sequential else 1
    maps = batch * adapter.heads(block) * tokens * tokens * 4
    parts = {
        "weights": weights,
        "activations": batch * tokens * widest * 4 * (adapter.mlp_projections + 2) * streams + maps + widest**2 * 4,
        "compensation": 4 * widest**2 * 8,
    }
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        room = free + sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == "cuda")
        where = "GPU"
    else:
        room = memory.available()
        room = None if room is None else room + resident  # loaded already: MemAvailable no longer counts them
        where = "host"
    cache = inputs * tokens * adapter.dim(block) * 4 * streams
    one = memory.Plan({**parts, "statistics": sum(per_block)}, room, where)
    fixes = "calibrate on fewer inputs (--num-calib) or shorter ones (--seq-len)"
    if config.sequential or max_stats_gib is not None or loader is not None:
        bound = max_stats_gib
    elif one.fits() or one_pass:
        return one.check(f"{fixes}, or a machine with more memory"), None
    else:
        bound = max(GROUP_GIB, max(per_block) / GIB)
    held = max(block_stats(model, config, g, "meta").nbytes() for g in plan_groups(model, config, bound))
    grouped = memory.Plan({**parts, "statistics": held, "cache": cache}, room, where)
    return grouped.check(f"{fixes}, run on a machine with more memory or on a GPU that holds it"), bound


@dataclass
class Chunk:
    """One calibration batch in the walk: its token streams (the block input of each), the rest of the block call
    (``paired``: the call for both streams as one batch, captured from the doubled inputs; sequential only), and
    which token positions count (``Adapter.token_mask``; None = all). Lives on the device or the host."""

    streams: list[Tensor]
    call: BlockCall
    paired: BlockCall | None
    mask: Tensor | None

    def to(self, device: torch.device, streams: list[Tensor] | None = None) -> Chunk:
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        streams = [move(t) for t in self.streams] if streams is None else streams
        paired = None if self.paired is None else self.paired.to(device)
        return Chunk(streams, self.call.to(device), paired, move(self.mask))


@dataclass
class TokenCache:
    """Token chunks (one per calibration batch) of one or two streams; each chunk lives on the device or the host."""

    device: torch.device
    streams: int
    budget: float
    """Bytes of the calibration device the cache may take; chunks beyond it live in host memory."""
    chunks: list[Chunk] = field(default_factory=list)

    def add(self, x: Tensor, call: BlockCall, mask: Tensor | None, paired: BlockCall | None = None) -> None:
        """A new chunk of block-0 tokens (the same in every stream), with the rest of its block call."""
        need = x.numel() * x.element_size() * self.streams
        home = self.device if self.nbytes(self.device) + need <= self.budget else torch.device("cpu")
        streams = [x.to(home, copy=s > 0) for s in range(self.streams)]
        self.chunks.append(Chunk([], call, paired, mask).to(home, streams))

    def load(self, k: int) -> Chunk:
        """Chunk ``k`` on the device."""
        return self.chunks[k].to(self.device)

    def store(self, k: int, stream: int, x: Tensor) -> None:
        self.chunks[k].streams[stream] = x.to(self.chunks[k].streams[stream].device)

    def nbytes(self, on: torch.device | None = None) -> int:
        """Bytes held by the token streams, on ``on`` only when given."""
        return sum(
            t.numel() * t.element_size() for chunk in self.chunks for t in chunk.streams if on is None or t.device == on
        )


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
    plan: list[Widths],
    device: torch.device,
    max_stats_gib: float | None = None,
    total: int | None = None,
    progress: bool = True,
    world: World = SINGLE_PROCESS,
    dist_timeout: float = 1800.0,
    timer: Timer | None = None,
) -> tuple[list[dict], dict[str, Any]]:
    """Calibrate and prune ``model`` (on ``device``, eval mode) in place, block by block, to ``plan``'s widths
    (``corp_deploy.plan.width_plan``).

    Returns the per-block report (as ``pruner.prune_model``'s) and what the walk did: samples, groups, passes,
    peak statistics bytes and cache size. An onloaded model (``families.onload``) has one block in memory at a
    time, read before its group and written to the onloader's store once pruned; it stays so when the walk returns
    (the report streams it, the save writes it from the store: ``formats.artifact``).
    """
    adapter = adapter_for(model)
    if device.type == "cuda" and device.index is None:  # tensors report cuda:N: compare like with like
        device = torch.device("cuda", torch.cuda.current_device())
    timer = timer or Timer()
    groups = plan_groups(model, config, max_stats_gib)
    peak = max(block_stats(model, config, g, "meta").nbytes() for g in groups)
    cache = TokenCache(device, 2 if config.sequential else 1, device_budget(device, peak))
    start = time.perf_counter()
    samples, skipped = _cache_stem(model, adapter, batches, cache, total, progress)
    counts = torch.tensor([samples, skipped], dtype=torch.float64, device=device)
    all_reduce_tensors([counts], world, dist_timeout)
    samples, skipped = int(counts[0]), int(counts[1])
    if samples == 0:
        raise CorpError(f"none of the {skipped} calibration {adapter.unit} could be read; check the files")
    timer.add("calibration", start)
    report = []
    step = _sequential_block if config.sequential else _dense_group
    loader = onload.of(model)
    for group in tqdm(groups, unit="group", desc="calibration and compensation", disable=not progress):
        for i in group if loader else ():
            loader.load(i)
        report += step(model, adapter, group, plan, cache, config, world, dist_timeout, timer)
        for i in group if loader else ():
            loader.drop(i, pruned=True)
    passes = len(plan) * (4 if config.sequential else 1)
    return report, {
        "samples": samples,
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
    model: nn.Module,
    adapter: Adapter,
    batches: Iterable[tuple[Any, int]],
    cache: TokenCache,
    total: int | None,
    progress: bool,
) -> tuple[int, int]:
    """Every batch once through the model up to block 0 (``Adapter.block_call``): the cache's chunks."""
    samples = skipped = 0
    with torch.inference_mode(), tqdm(total=total, unit="input", desc="stem", disable=not progress) as bar:
        for inputs, bad in batches:
            skipped += bad
            n = adapter.count(inputs)
            if n:
                x, call = adapter.block_call(model, inputs, cache.device)
                paired = None
                if cache.streams == 2:  # sequential: both streams run as one batch, whose call is captured too
                    doubled = map_tensors(inputs, lambda t: torch.cat([t, t]))
                    paired = adapter.block_call(model, doubled, cache.device)[1]
                cache.add(x, call, adapter.token_mask(inputs, cache.device), paired)
                samples += n
            bar.update(n + bad)
    return samples, skipped


def _dense_group(
    model: nn.Module,
    adapter: Adapter,
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
    blocks = adapter.blocks(model)
    stats = block_stats(model, config, group, cache.device)
    with recording(model, stats) as token_mask, torch.inference_mode():
        for k in range(len(cache.chunks)):
            chunk = cache.load(k)
            (x,), token_mask.value = chunk.streams, chunk.mask
            for i in group:
                x = chunk.call.run(blocks[i], x)
            cache.store(k, 0, x)
    all_reduce_stats(stats, world, dist_timeout)
    timer.add("calibration", t)
    return [prune_block(adapter, blocks[i], i, stats, plan[i], config, timer) for i in group]


def _sequential_block(
    model: nn.Module,
    adapter: Adapter,
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
    block = adapter.blocks(model)[i]
    t = time.perf_counter()
    dense = copy.deepcopy(block)
    stats = block_stats(model, config, group, cache.device)
    with recording(model, stats) as token_mask, torch.inference_mode():
        for k in range(len(cache.chunks)):
            chunk = cache.load(k)
            token_mask.value = None if chunk.mask is None else torch.cat([chunk.mask, chunk.mask])
            chunk.paired.run(block, torch.cat(chunk.streams))
    all_reduce_stats(stats, world, dist_timeout)
    timer.add("calibration", t)

    def logit_targets(keep: Tensor) -> tuple[Tensor, Tensor]:
        return _logit_targets(adapter, dense, cache, keep, world, dist_timeout)

    entry = prune_block(adapter, block, i, stats, plan[i], config, timer, logit_targets)
    t = time.perf_counter()
    with torch.inference_mode():
        for k in range(len(cache.chunks)):
            chunk = cache.load(k)
            x_dense, x_pruned = chunk.streams
            cache.store(k, 0, chunk.call.run(dense, x_dense))
            cache.store(k, 1, chunk.call.run(block, x_pruned))
    timer.add("calibration", t)
    return [entry]


def _dense_qk(adapter: Adapter, block: nn.Module, x: Tensor, call: BlockCall) -> tuple[Tensor, Tensor]:
    """(q, k) of ``block`` for the tokens ``x``, as (batch, tokens, heads, d); the block stops after them."""
    seen: list[Tensor] = []

    def grab(q: Tensor, k: Tensor) -> None:
        seen[:] = [q, k]
        raise StopForward

    run_until_stopped(adapter.on_qk(block, grab), lambda: call.run(block, x))
    return seen[0], seen[1]


def _logit_targets(
    adapter: Adapter, block: nn.Module, cache: TokenCache, keep: Tensor, world: World, dist_timeout: float
) -> tuple[Tensor, Tensor]:
    """Per head ``sum (Q~_S^T Q)(K^T K~_S)`` (heads, d', d') and ``sum ||Q K^T||^2`` (heads), over the (query, key)
    pairs the softmax sees (``causal_logit_sums``), padding excluded.

    Q, K from the dense stream, Q~, K~ from the pruned one, both through the DENSE ``block``'s Q/K projections.
    Per-batch products in fp32 added into float64 sums, as in ``stats.QKStats``.
    """
    heads = keep.shape[0]
    f64 = {"dtype": torch.float64, "device": keep.device}
    cross = torch.zeros(heads, keep.shape[1], keep.shape[1], **f64)
    energy = torch.zeros(heads, **f64)
    with torch.inference_mode():
        for k in range(len(cache.chunks)):
            chunk = cache.load(k)
            q2, k2 = _dense_qk(adapter, block, torch.cat(chunk.streams), chunk.paired)
            if chunk.mask is not None:
                keep_rows = torch.cat([chunk.mask, chunk.mask])[:, :, None, None].to(q2.dtype)
                q2, k2 = q2 * keep_rows, k2 * keep_rows
            (q, qp), (kk, kp) = (t.float().chunk(2) for t in (q2, k2))
            index = keep.to(qp.device).expand(*qp.shape[:2], -1, -1)
            qs, ks = qp.gather(-1, index), kp.gather(-1, index)
            c, e = (causal_logit_sums if adapter.causal else logit_sums)(q, kk, qs, ks)
            cross += c.double()
            energy += e.double()
    all_reduce_tensors([cross, energy], world, dist_timeout)
    return cross, energy


def logit_sums(q: Tensor, k: Tensor, qs: Tensor, ks: Tensor) -> tuple[Tensor, Tensor]:
    """Over every (query, key) pair of each sequence: ``sum_b (Q~_S,b^T Q_b)(K_b^T K~_S,b)`` and
    ``sum_b ||Q_b K_b^T||^2`` per head. q, k: (batch, tokens, heads, d); qs, ks: (batch, tokens, heads, d')."""
    gq = torch.einsum("bnhs,bnhd->bhsd", qs, q)
    gk = torch.einsum("bnhd,bnht->bhdt", k, ks)
    grams = [torch.einsum("bnhd,bnhe->bhde", t, t) for t in (q, k)]
    return torch.einsum("bhsd,bhdt->hst", gq, gk), torch.einsum("bhde,bhde->h", *grams)


def causal_logit_sums(q: Tensor, k: Tensor, qs: Tensor, ks: Tensor) -> tuple[Tensor, Tensor]:
    """``logit_sums`` over the pairs (query i, key j <= i) only: ``sum_i q~_i (q_i^T P_i)`` with the running
    sum ``P_i = sum_(j <= i) k_j k~_j^T``, and ``sum_i q_i^T (sum_(j <= i) k_j k_j^T) q_i``. Heads one at a time
    bound the per-token (d x d') prefix products."""
    cross, energy = [], []
    for h in range(q.shape[2]):
        qh, kh, qsh, ksh = (t[:, :, h] for t in (q, k, qs, ks))
        prefix = torch.einsum("bnd,bnt->bndt", kh, ksh).cumsum(1)
        cross.append(torch.einsum("bns,bnd,bndt->st", qsh, qh, prefix))
        grams = torch.einsum("bnd,bne->bnde", kh, kh).cumsum(1)
        energy.append(torch.einsum("bnd,bnde,bne->", qh, grams, qh))
    return torch.stack(cross), torch.stack(energy)
