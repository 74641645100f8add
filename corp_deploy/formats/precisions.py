"""The precisions a graph is written in, as data: one record each, so that commands, file names and targets read
what a precision is (does an engine build it, does it calibrate, is it for decoders only) instead of spelling it.

``--precision`` takes a comma list of these names on every command that writes graphs (``export``, ``quantize``,
``build-engine``, ``prune-export``); each target says which it writes (``exporters.targets``)."""

from __future__ import annotations

from dataclasses import dataclass

from corp_deploy.base.errors import CorpError


@dataclass(frozen=True)
class Precision:
    name: str
    what: str
    calibrated: bool = False
    """Its weights or activations are quantized from data: it needs a calibration source and a held-out gate."""
    decoders_only: bool = False
    """Gated on perplexity and written for decoders only (INT4 weight-only)."""


FP32 = Precision("fp32", "float32, the reference every other precision is gated against")
FP16 = Precision("fp16", "float16 inside, float32 inputs and outputs")
INT8 = Precision("int8", "8-bit integers, calibrated; gated on held-out inputs", calibrated=True)
INT4 = Precision(
    "int4", "4-bit weight-only (MatMulNBits), decoders; gated on perplexity", calibrated=True, decoders_only=True
)
PRECISIONS: dict[str, Precision] = {p.name: p for p in (FP32, FP16, INT8, INT4)}
"""Every precision by name, widest first."""


def parse(text: str, allowed: tuple[str, ...] = tuple(PRECISIONS), flag: str = "--precision") -> tuple[str, ...]:
    """``"fp32,int8"`` -> ("fp32", "int8"), each checked against ``allowed``; one line naming the choices otherwise."""
    values = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    bad = [p for p in values if p not in allowed]
    if bad or not values:
        raise CorpError(f"{flag} takes a comma-separated list of {', '.join(allowed)}, got {text!r}")
    return values


def calibrated(names: tuple[str, ...]) -> tuple[str, ...]:
    """The precisions of ``names`` that quantize from data."""
    return tuple(n for n in names if PRECISIONS[n].calibrated)
