"""The prune stage: build a model, calibrate, prune; ``prune`` writes the artifact, other stages reuse the rest."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import click
import torch
from torch import nn

from corp_deploy import api, calibration, distributed, hf, speed
from corp_deploy.artifact import read_meta
from corp_deploy.bench.backends import Backend
from corp_deploy.cli.options import (
    CALIB_IMAGES,
    SMOKE_IMAGES,
    TEXT_SEQUENCES,
    calibration_source,
    out_options,
    out_path,
    prune_config,
    prune_options,
    recovery_setup,
    typed,
)
from corp_deploy.data import SYNTHETIC
from corp_deploy.errors import CorpError
from corp_deploy.families import adapter_for
from corp_deploy.families.hf_text import count_macs_at
from corp_deploy.latency import LatencyTable, Timing, format_table, workload
from corp_deploy.models import create_model, parse_model_args, resolve_name
from corp_deploy.pruner import PruneConfig
from corp_deploy.recover import Kept
from corp_deploy.report import format_report
from corp_deploy.text import read_documents


class Pruned(NamedTuple):
    result: api.PruneResult
    name: str
    args: dict
    weights: str
    dense: nn.Module | None


@click.command()
@prune_options
@out_options("Artifact folder")
def prune(out: str | None, overwrite: bool, **kwargs: Any) -> None:
    """Prune MODEL (timm name or alias such as deit_base; a transformers folder or hf:NAME) with CORP into --out.

    With --speedup S (or --budget latency=F) the widths are allocated against a latency table measured on
    --latency-on at --latency-batch (cached); the speed is predicted, not checked (prune-export checks it).
    """
    config = prune_config(kwargs.pop("pruning"), kwargs["latency"])
    out = out_path(out, kwargs["model"], config, overwrite)
    run = pruned(config, **kwargs, transformers=True)
    if run is None:  # a data-parallel rank other than 0: its shard is merged, rank 0 writes
        return
    path = api.save(run.result, out, run.name, run.args, weights=run.weights, overwrite=overwrite)
    click.echo(format_report(run.result.report))
    click.echo(f"wrote {path}/ (model.safetensors, corp.json); load it with corp_deploy.load_pruned({str(path)!r})")
    say_folder(path)


def say_folder(path: str | Path) -> None:
    """A text artifact's one line on how it loads without corp-deploy (and why it needs remote code, if it does)."""
    folder = read_meta(path).get("folder")
    if folder:
        from corp_deploy.hf_folder import describe

        click.echo(f"{path}/ {describe(folder)}")


class Inputs(NamedTuple):
    """A built model and its calibration batches, everything cheap validated first."""

    net: nn.Module
    batches: Iterable
    total: int
    heldout: calibration.Heldout | None
    device: torch.device
    name: str
    args: dict
    weights: str
    source: str
    world: distributed.World


def inputs(
    model: str,
    weights: str,
    checkpoint: str | None,
    model_arg: tuple[str, ...],
    calib_dir: str | None,
    calib: str | None,
    num_calib: int | None,
    calib_batch_size: int,
    workers: int | None,
    seed: int,
    device: str,
    seq_len: int = 128,
    dist_timeout: float | None = None,
    hold_out: int = 0,
    transformers: bool = False,
) -> Inputs:
    """``dist_timeout`` marks a command that may run data-parallel under torchrun (prune, prune-export);
    ``hold_out`` calibration images are drawn across the sample for the width planning
    (``calibration.calibration_data``).
    ``transformers``: the command takes ``transformers`` models too (MODEL a folder with a config.json, or
    ``hf:NAME``): text encoders and decoders, and vision transformers."""
    reads = hf.modality(model)
    source = calibration_source(calib_dir, calib, reads == "text")
    if num_calib is None:
        num_calib = SMOKE_IMAGES if source == SYNTHETIC else TEXT_SEQUENCES if reads == "text" else CALIB_IMAGES
    if reads is not None and not transformers:
        raise CorpError(f"{model} is a transformers model; this command takes timm ViTs only (use prune)")
    if reads == "text":
        return _text_inputs(model, source, num_calib, calib_batch_size, seed, seq_len, device, hold_out, dist_timeout)
    world, device_ = _world(calibration.resolve_device(device), dist_timeout)
    torch.manual_seed(seed)  # --weights random: the same model on every run and every rank
    if reads == "image":
        if checkpoint is not None or model_arg:
            raise CorpError("--checkpoint and --model-arg are for timm models; a transformers folder holds its weights")
        net, name, args, provenance = hf.load(model)[0], model, {}, "pretrained"
    else:
        args = parse_model_args(model_arg)
        net = create_model(model, weights=weights, checkpoint=checkpoint, model_args=args)
        name, provenance = resolve_name(model), f"checkpoint:{checkpoint}" if checkpoint else weights
    data = calibration.calibration_data(net, source, num_calib, calib_batch_size, seed, workers, world, hold_out)
    return Inputs(net, data.batches, data.total, data.heldout, device_, name, args, provenance, str(source), world)


def _world(device: torch.device, dist_timeout: float | None) -> tuple[distributed.World, torch.device]:
    """This process's rank under torchrun (after joining the group), else the single process; refused for a
    command that does not run data-parallel (``dist_timeout`` None)."""
    if not distributed.launched():
        return distributed.SINGLE_PROCESS, device
    if dist_timeout is None:
        raise CorpError("only prune and prune-export run data-parallel; launch this command without torchrun")
    return distributed.init(device, dist_timeout)


def _text_inputs(
    model: str,
    source: str,
    num: int,
    batch_size: int,
    seed: int,
    seq_len: int,
    device: str,
    hold_out: int,
    dist_timeout: float | None,
) -> Inputs:
    """``inputs`` for a transformers model: the model and its tokenizer, text calibration (packed for a decoder,
    ``calibration.text_calibration_data``; under torchrun, this rank's shard of an encoder's documents)."""
    device_ = calibration.resolve_device(device)
    hf.transformers_module("pruning a transformers model")  # the install line before any work
    if source != SYNTHETIC:
        read_documents(source)  # a folder without text fails before the model loads
    world, device_ = _world(device_, dist_timeout)
    net, tokenizer = hf.load(model)
    count_macs_at(net, seq_len)
    data = calibration.text_calibration_data(net, tokenizer, source, num, batch_size, seed, seq_len, hold_out, world)
    return Inputs(net, data.batches, data.total, data.heldout, device_, model, {}, "pretrained", source, world)


def latency_loop(
    backend: Backend, batch: int, rounds: int, say: Callable[[str], None], seq_len: int | None = None
) -> api.LatencyLoop:
    """The closed loop on ``backend`` at ``batch`` (x ``seq_len`` tokens for a text encoder): dense and pruned timed
    interleaved, each timing reported."""
    threads = torch.get_num_threads()
    at = workload({"batch": batch, "seq_len": seq_len})

    def timing(dense: nn.Module, pruned: nn.Module) -> Timing:
        say(f"latency check: timing dense and pruned on {backend.name} at {at}, interleaved")
        t = speed.measure_pair(dense, pruned, backend, batch, threads, speed.LOOP_METHOD, seq_len)
        say(f"  dense {t.dense_s * 1e3:.1f} ms, pruned {t.pruned_s * 1e3:.1f} ms: {t.speedup:.2f}x +-{t.band:.1%}")
        return t

    return api.LatencyLoop(timing, rounds)


def latency_table(
    got: Inputs,
    backend: Backend,
    latency: dict[str, Any],
    say: Callable[[str], None],
    depth: tuple[str, ...] = (),
    depth_fit: str = "affine-mean",
    seq_len: int | None = None,
) -> LatencyTable:
    """The latency table of the built model on ``backend`` at --latency-batch (x ``seq_len`` tokens for a text
    encoder): given, cached or measured now (with ``depth``, also each block's time with those modules replaced by
    their ``depth_fit`` stand-in)."""
    batch, threads = latency["latency_batch"], torch.get_num_threads()
    key = speed.key(got.name, got.args, backend, batch, threads, depth, depth_fit, seq_len)
    table = speed.table_for(got.net, key, backend, latency["latency_table"], say)
    say(format_table(table))
    return table


def pruned(
    config: PruneConfig,
    latency: dict[str, Any],
    recovery: dict[str, Any],
    quiet: bool,
    dist_timeout: float,
    max_stats_gib: float | None = None,
    keep_dense: bool = False,
    transformers: bool = False,
    latency_rounds: int | None = None,
    rewrites: tuple[str, ...] | None = None,
    **flags: Any,
) -> Pruned | None:
    """Validate everything cheap first, then build, calibrate, prune ``config`` (``options.prune_config``) and, with
    ``--recover-*``, recover.

    Under torchrun every rank calibrates its shard; rank 0 gets the result, the others ``None``. A latency
    budget's table is measured (or read) before calibration; ``latency_rounds`` closes the loop (``api.LatencyLoop``);
    both time the models with ``rewrites`` (None: the backend's defaults), as they will be exported.

    The dense model is kept (``keep_dense``, or for a recovery) as a copy made before pruning: one more model's
    weights in host memory (4 bytes a parameter in fp32: 88 MB for a ViT-S, 28 GB for a 7B decoder). A recovery
    (``api.recover_pruned``, after the closed loop: the widths are final) trains on the first ``recover.KEPT_INPUTS``
    calibration inputs, kept as the calibration pass reads them (``recover.Kept``), on the device pruning used,
    with the sensitivity pass's held-out inputs (if any) evaluated, never trained on.
    """
    recover = recovery_setup(recovery)
    if recover is not None and distributed.launched():
        raise CorpError("--recover-steps/--recover-minutes train in one process; run it without torchrun")
    api.calibration_mode(config, max_stats_gib, distributed.SINGLE_PROCESS)  # combinations refused before any data
    backend = None if latency["latency_on"] is None else speed.check_backend(latency["latency_on"], rewrites)
    seq_len = flags["seq_len"] if hf.modality(flags["model"]) == "text" else None  # a text encoder: at --seq-len
    say = (lambda line: None) if quiet else click.echo
    loop = None
    if backend is not None and latency_rounds is not None:
        loop = latency_loop(backend, latency["latency_batch"], latency_rounds, say, seq_len)
        api.check_loop(config, max_stats_gib, 2 if distributed.launched() else 1)
    got = inputs(**flags, dist_timeout=dist_timeout, hold_out=config.heldout_images, transformers=transformers)
    if not typed("target"):  # the default target names only what the family can prune (in the layout asked for)
        adapter = adapter_for(got.net)
        parts = adapter.standard_parts if config.layout == "standard" and adapter.standard_parts else adapter.parts
        config = replace(config, target=[p for p in config.target if p in parts])
    table = None
    if backend is not None:
        speed.text_inputs(got.net, seq_len)  # a decoder, or --seq-len past the positions: one line, before timing
        table = latency_table(got, backend, latency, say, config.depth, config.depth_fit, seq_len)
    dense = copy.deepcopy(got.net) if keep_dense or recover is not None else None  # pruning works in place
    progress = not quiet and got.world.is_main
    batches = got.batches if recover is None else Kept(got.batches, adapter_for(got.net).count)
    result = api.prune(
        got.net,
        batches,
        config,
        got.device,
        got.total,
        progress,
        got.world,
        dist_timeout,
        max_stats_gib,
        got.heldout,
        table,
        loop,
    )
    if result is None:
        return None
    if recover is not None:
        api.recover_pruned(result, dense, batches.batches, recover, got.heldout, say)
    result.report["calibration"] |= {"source": got.source, "seed": flags["seed"]}
    if seq_len is not None:
        result.report["calibration"]["seq_len"] = seq_len
    return Pruned(result, got.name, got.args, got.weights, dense)
