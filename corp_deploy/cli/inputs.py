"""What a command's MODEL and calibration flags name, built: the model and its calibration data (``inputs``). Every
command that prunes or times starts here."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import nn

from corp_deploy.base.errors import CorpError
from corp_deploy.cli.options import CALIB_IMAGES, SMOKE_IMAGES, TEXT_SEQUENCES, calibration_source
from corp_deploy.core import distributed
from corp_deploy.families.hf import hub
from corp_deploy.families.hf.adapter import count_macs_at
from corp_deploy.families.timm.models import create_model, parse_model_args, resolve_name
from corp_deploy.formats import calibration
from corp_deploy.formats.data import SYNTHETIC
from corp_deploy.formats.text import read_documents


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
    onload: bool = False,
) -> Inputs:
    """``dist_timeout`` marks a command that may run data-parallel under torchrun (prune, prune-export);
    ``hold_out`` calibration images are drawn across the sample for the width planning
    (``calibration.calibration_data``).
    ``transformers``: the command takes ``transformers`` models too (MODEL a folder with a config.json, or
    ``hf:NAME``): text encoders and decoders, and vision transformers. ``onload``: a transformers folder keeps its
    blocks' weights on disk until the prune's walk reads them (``hub.load``)."""
    reads = hub.modality(model)
    source = calibration_source(calib_dir, calib, reads == "text")
    if num_calib is None:
        num_calib = SMOKE_IMAGES if source == SYNTHETIC else TEXT_SEQUENCES if reads == "text" else CALIB_IMAGES
    if reads is not None and not transformers:
        raise CorpError(f"{model} is a transformers model; this command takes timm ViTs only (use prune)")
    if reads == "text":
        return _text_inputs(
            model, source, num_calib, calib_batch_size, seed, seq_len, device, hold_out, dist_timeout, onload
        )
    world, device_ = _world(calibration.resolve_device(device), dist_timeout)
    torch.manual_seed(seed)  # --weights random: the same model on every run and every rank
    if reads == "image":
        if checkpoint is not None or model_arg:
            raise CorpError("--checkpoint and --model-arg are for timm models; a transformers folder holds its weights")
        net, name, args, provenance = hub.load(model, onload)[0], model, {}, "pretrained"
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
    onload: bool,
) -> Inputs:
    """``inputs`` for a transformers model: the model and its tokenizer, text calibration (packed for a decoder,
    ``calibration.text_calibration_data``; under torchrun, this rank's shard of an encoder's documents)."""
    device_ = calibration.resolve_device(device)
    hub.transformers_module("pruning a transformers model")  # the install line before any work
    if source != SYNTHETIC:
        read_documents(source)  # a folder without text fails before the model loads
    world, device_ = _world(device_, dist_timeout)
    net, tokenizer = hub.load(model, onload)
    count_macs_at(net, seq_len)
    data = calibration.text_calibration_data(net, tokenizer, source, num, batch_size, seed, seq_len, hold_out, world)
    return Inputs(net, data.batches, data.total, data.heldout, device_, model, {}, "pretrained", source, world)
