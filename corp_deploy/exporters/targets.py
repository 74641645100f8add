"""Export targets as data: one registered record per format (as optimum's exporter configs and onnxruntime's
execution providers are), so that the command line, the pipeline, the run folder and the bench loop iterate over
the registry instead of naming formats.

A ``Target`` holds everything about one format: its name and file naming, the writer that converts, verifies and
gates (``write``), the runner that executes a file, what it needs installed (``modules``, checked through
``base.deps``), its bench backends and its quantize-only baseline. A new format is one module that calls
``register``; ``load`` imports the built-in ones.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corp_deploy.base.deps import missing as uninstalled
from corp_deploy.base.errors import CorpError
from corp_deploy.exporters.compare import Feed

BUILT_IN = ("corp_deploy.exporters.openvino",)
"""The modules that register the built-in targets beyond ONNX itself (each imported by ``load``)."""


@dataclass(frozen=True)
class Job:
    """What the pipeline hands a target's writer: the run folder, whose verified FP32 ONNX graphs (``dense.onnx``,
    ``pruned.onnx``) are written first, and how to verify and calibrate."""

    out: Path
    stems: tuple[str, ...]
    precisions: tuple[str, ...]
    opts: Any
    """``pipeline.VerifyOptions``: batches, the tolerances of each precision's gate, the seed."""
    data: Callable[[Any], Any] | None = None
    """ONNX graph -> (calibration batches, held-out inputs, counts): the data INT8 reads (``int8_quant.Data``)."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """The target's own option values (its option group), by option name."""
    say: Callable[[str], None] = print


@dataclass(frozen=True)
class BenchSpec:
    """A bench backend a target brings: its files of ``precision`` run on ``device`` by the target's runner."""

    name: str
    runtime: str
    device: str
    precision: str


@dataclass(frozen=True)
class Target:
    name: str
    what: str
    precisions: tuple[str, ...]
    """The precisions it writes; the others of ``--precision`` are not its."""
    file_name: Callable[[str, str], str]
    """(model stem, precision) -> the file's name in the run folder."""
    write: Callable[[Job], list[dict[str, Any]]]
    """Convert, verify against the reference, gate; each file staged with its ``.json`` record. Returns the records,
    each with ``file``, ``precision``, ``bytes``, ``seconds`` and ``verify`` (``reference``, ``runtime``, ``max_abs``,
    ``cosine``, ``top1``), as ``pipeline.format_summary`` prints them beside the ONNX files."""
    runner: Callable[[Path, int | None], Callable[[Feed], Any]]
    """(file, CPU threads) -> a call that runs a batch (numpy in, FP32 numpy out)."""
    modules: tuple[str, ...] = ()
    """What it imports (``base.deps``): absent, one line says what to install."""
    backends: tuple[BenchSpec, ...] = ()
    files: tuple[tuple[str, str, str], ...] = ()
    """(name pattern, what it is, how to load it) of each file it writes: the run folder's README reads them."""
    baseline: Callable[[Path], tuple[Path, str]] | None = None
    """Run folder -> (the quantize-only baseline's file, where it came from): the dense model quantized the
    runtime's own way, timed beside dense and pruned on this target's backends."""

    def missing(self) -> str | None:
        """Why it cannot run here (what to install), or None."""
        return uninstalled(*self.modules)

    def require(self) -> None:
        if reason := self.missing():
            raise CorpError(f"--targets {self.name} needs {reason}")


TARGETS: dict[str, Target] = {}


def register(target: Target) -> Target:
    """Add ``target`` (a module's registration at import); a second one of the same name is a bug."""
    if target.name in TARGETS and TARGETS[target.name] is not target:
        raise ValueError(f"target {target.name} is registered twice")
    TARGETS[target.name] = target
    return target


def load() -> dict[str, Target]:
    """Every registered target, the built-in modules imported first."""
    for module in BUILT_IN:
        importlib.import_module(module)
    return TARGETS


def parse(text: str) -> tuple[Target, ...]:
    """``--targets onnx,openvino`` -> the targets beyond ONNX (which every run writes: the others convert from it),
    each checked to be installed; one line naming the choices otherwise."""
    targets = load()
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in (ONNX, *targets)]
    if unknown or not names:
        raise CorpError(f"--targets takes a comma list of {', '.join((ONNX, *targets))}, got {text!r}")
    chosen = tuple(targets[n] for n in dict.fromkeys(names) if n != ONNX)
    for target in chosen:
        target.require()
    return chosen


ONNX = "onnx"
