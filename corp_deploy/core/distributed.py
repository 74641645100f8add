"""Data-parallel calibration on torch.distributed: every rank sums its shard, one all-reduce merges.

CORP's statistics are plain float64 sums (``stats.CalibrationStats``), so calibrating on disjoint
shards and adding the sums gives the single-process result up to summation order. Under
``torchrun`` each rank takes every ``world``-th image of the same seeded sample (no overlap, no
padding, unlike ``DistributedSampler``, whose padding would count images twice), accumulates, and
joins an all-reduce (NCCL on GPUs, gloo on CPUs). Rank 0 then ranks, compensates and writes; the
other ranks stop. The reduction runs tensor by tensor in bounded chunks, so no rank ever holds a
second copy of the statistics.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from corp_deploy.base.errors import CorpError, first_line
from corp_deploy.core.stats import CalibrationStats

T = TypeVar("T")
CHUNK_BYTES = 64 * 2**20
"""All-reduce granularity: bounds the communication buffers, not the statistics themselves."""


@dataclass(frozen=True)
class World:
    """This process's place in the job; ``World()`` is the single-process default."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


SINGLE_PROCESS = World()


def launched() -> bool:
    """True under torchrun (or any launcher that sets RANK and WORLD_SIZE) with more than one process."""
    return processes() > 1


def processes() -> int:
    """How many processes the launcher started (1 outside one), known before the process group is joined."""
    return int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1


def init(device: torch.device, timeout_s: float) -> tuple[World, torch.device]:
    """Join the process group: NCCL for CUDA calibration, gloo for CPU. Returns the world and this rank's device."""
    world = World(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        if world.local_rank >= torch.cuda.device_count():
            raise CorpError(
                f"local rank {world.local_rank} has no GPU ({torch.cuda.device_count()} visible); "
                "use --nproc-per-node <= the GPU count"
            )
        device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    except Exception as e:  # rendezvous failures come as several exception types
        raise CorpError(f"rank {world.rank}: could not join the {backend} process group: {first_line(e)}") from None
    return world, device


def shard(items: Sequence[T], world: World) -> list[T]:
    """Every ``size``-th item from ``rank``: disjoint, together exactly ``items``, same order on every rank."""
    return list(items[world.rank :: world.size])


def all_reduce_stats(stats: CalibrationStats, world: World, timeout_s: float) -> CalibrationStats:
    """Sum ``stats`` over all ranks in place; every rank ends with the totals.

    A rank that died or hangs surfaces here as a timeout after ``timeout_s`` on every other rank.
    """
    if world.size == 1:
        return stats
    device = stats.tensors()[0].device if stats.tensors() else torch.device("cpu")
    counts = torch.tensor([stats.samples, stats.skipped], dtype=torch.float64, device=device)
    all_reduce_tensors([counts, *stats.tensors()], world, timeout_s)
    stats.samples, stats.skipped = int(counts[0]), int(counts[1])
    return stats


def all_reduce_tensors(tensors: Sequence[torch.Tensor], world: World, timeout_s: float) -> None:
    """Sum each (contiguous) tensor over all ranks in place, in ``CHUNK_BYTES`` pieces."""
    if world.size == 1:
        return
    sent = []
    try:
        for tensor in tensors:
            flat = tensor.view(-1)
            step = max(1, CHUNK_BYTES // flat.element_size())
            for start in range(0, flat.numel(), step):
                chunk = flat[start : start + step]
                dist.all_reduce(chunk)
                sent.append(weakref.ref(chunk))
                del chunk  # only the reducing thread may hold it now
        if dist.get_backend() == "gloo":
            _until_released(sent, timeout_s)
    except Exception as e:
        raise CorpError(
            f"rank {world.rank}: merging calibration statistics failed (another rank died or did not answer "
            f"within --dist-timeout {timeout_s:g} s): {first_line(e)}"
        ) from None


def _until_released(sent: list[weakref.ref], timeout_s: float) -> None:
    """Wait (GIL free) until gloo's worker threads have dropped the chunks they reduced (NCCL's are torch's own).

    ``all_reduce`` returns when the sum is in place, but the worker thread releases its work (and with it the
    chunk's Python object, which needs the GIL) a moment later. A rank that exits in that moment, as every rank
    but 0 does right after the merge, has its worker take the GIL during interpreter shutdown, and the process
    aborts ("terminate called without an active exception"; 4 runs in 20 on a loaded 2-core machine). A weak
    reference dies exactly when the last holder lets go.
    """
    deadline = time.monotonic() + timeout_s
    while any(ref() is not None for ref in sent):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the reduced chunks were not released within {timeout_s:g} s")
        time.sleep(0.001)


def finish() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
