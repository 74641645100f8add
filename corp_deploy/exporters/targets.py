"""Export targets as data: one registered record per format (as optimum's exporter configs and onnxruntime's
execution providers are), so that the command line, the pipeline, the run folder and the bench loop iterate over
the registry instead of naming formats.

A ``Target`` holds everything about one format: its name and file naming, the writer that converts, verifies and
gates (``write``), the runner that executes a file, what it needs installed (``modules``, checked through
``base.deps``), its option group (``options``: the command line builds its flags from them), its bench backends and
its quantize-only baseline. A new format is one module that calls ``register``; ``load`` imports the built-in ones:
ONNX (every run writes it first: the others convert from its verified FP32 graphs), OpenVINO IR, TensorRT engines
(built wherever a flavour can build them, named in ``--targets`` or not) and a decoder's onnxruntime-genai folders.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corp_deploy.base.deps import missing as uninstalled
from corp_deploy.base.errors import CorpError
from corp_deploy.exporters.compare import Feed

BUILT_IN = (
    "corp_deploy.exporters.onnx_target",
    "corp_deploy.exporters.openvino",
    "corp_deploy.exporters.tensorrt_target",
    "corp_deploy.exporters.genai_target",
)
"""The modules that register the built-in targets, in the order a run writes them (each imported by ``load``)."""
ONNX = "onnx"
TENSORRT = "tensorrt"
"""The two names the pipeline hands its own options to (``export_run``'s ONNX export and engine arguments)."""


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
    """The target's own option values (its option group, and what the pipeline hands it), by option name."""
    say: Callable[[str], None] = print
    models: Mapping[str, tuple[Any, dict[str, Any]]] = field(default_factory=dict)
    """Stem -> (PyTorch model, its description): what the ONNX target exports; the others read its files."""
    step: Callable[[str], AbstractContextManager] = lambda what: nullcontext()
    """Wraps each phase (``base.steps.Steps``: announced, timed, a stop said in one line)."""
    skip: Callable[[str], None] = lambda reason: None
    """Records why the target wrote nothing, or less than asked (TensorRT without a flavour that can build)."""

    def free(self) -> None:
        """Let go of the model ``models`` holds, where it holds one at a time (``pipeline.OneAtATime``); a plain
        mapping keeps its models. A writer calls it once it has what it needs of the PyTorch model (the file written,
        the reference outputs computed), so that what checks the file (onnxruntime, genai) runs without the model
        beside it; the next ``models[stem]`` reads a model again."""
        if callable(free := getattr(self.models, "free", None)):
            free()


@dataclass(frozen=True)
class Option:
    """One flag of a target's option group, as data: the command line builds a click option from it
    (``cli.export_options.target_group``), and the target reads its value from ``Job.options`` by ``name``."""

    flag: str
    help: str
    default: Any = None
    type: Any = None
    """A Python type, a tuple of choices, or a click type; None: taken from the default."""
    is_flag: bool = False
    metavar: str | None = None
    key: str = ""
    """The name its value is read by ("": the flag's, ``--batch-range`` -> ``batch_range``)."""

    @property
    def name(self) -> str:
        return self.key or self.flag.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class BenchSpec:
    """A bench backend a target brings: its files of ``precision`` run on ``device`` by the target's runner."""

    name: str
    runtime: str
    device: str
    """``cpu`` or ``cuda``."""
    precision: str
    equal_heads: bool = False
    """Its fast attention kernels need one head width for Q, K and V (``bench.backends.Backend.equal_heads``)."""
    ready: Callable[[Path], str | None] = lambda path: None
    """Why a file that is there cannot run here (no GPU, no provider, an engine built for another GPU), or None."""


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
    options: tuple[Option, ...] = ()
    """Its option group: ``prune-export`` takes these flags and hands their values to ``write`` in ``Job.options``."""
    automatic: bool = False
    """Written on every run where it can be, named in ``--targets`` or not (TensorRT: where a flavour builds)."""
    record: str | None = None
    """Where ``export.json`` keeps its records: this key (``onnx``, ``engines``), else ``targets[name]``."""
    by_file: bool = False
    """Its records kept by file name (``{"dense-genai": ...}``) rather than as a list."""
    step: str | None = ""
    """The phase its writing is announced as ("": ``name: what``); None: ``write`` announces its own phases."""
    made_by: Callable[[Path, str], str] | None = None
    """(run folder, precision) -> the command that writes a missing file, for ``bench``'s skip line."""
    text: str | None = None
    """Why ``bench`` does not time a text model's files here, or None (it does)."""

    def missing(self) -> str | None:
        """Why it cannot run here (what to install), or None."""
        return uninstalled(*self.modules)

    def require(self) -> None:
        if reason := self.missing():
            raise CorpError(f"--targets {self.name} needs {reason}")

    def how_to_make(self, root: Path, precision: str) -> str:
        """The command that writes this target's file of ``precision`` into run folder ``root``."""
        if self.made_by is not None:
            return self.made_by(root, precision)
        return f"prune-export --targets {ONNX},{self.name} --precision {precision}"


TARGETS: dict[str, Target] = {}


def register(target: Target) -> Target:
    """Add ``target`` (a module's registration at import); a second one of the same name is a bug."""
    if target.name in TARGETS and TARGETS[target.name] is not target:
        raise ValueError(f"target {target.name} is registered twice")
    TARGETS[target.name] = target
    return target


def load() -> dict[str, Target]:
    """Every registered target, the built-in modules imported first; ONNX first, then in the order registered."""
    for module in BUILT_IN:
        importlib.import_module(module)
    return {t.name: t for t in sorted(TARGETS.values(), key=lambda t: t.name != ONNX)}  # ONNX first: the rest read it


def parse(text: str) -> tuple[Target, ...]:
    """``--targets onnx,openvino`` -> the targets a run writes, in the registry's order: ONNX (every run writes it:
    the others convert from it), those named, each checked to be installed, and the automatic ones (TensorRT);
    one line naming the choices otherwise."""
    targets = load()
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in targets]
    if unknown or not names:
        raise CorpError(f"--targets takes a comma list of {', '.join(targets)}, got {text!r}")
    for name in names:
        if not targets[name].automatic:
            targets[name].require()
    return tuple(t for t in targets.values() if t.name == ONNX or t.name in names or t.automatic)


def file_kinds() -> list[tuple[str, str, str]]:
    """(name pattern, what it is, how to load it) of every registered target's files: the run folder's README."""
    return [kind for target in load().values() for kind in target.files]


def option_values(values: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """A command's parsed flags -> each registered target's option values, by target name (``Job.options``)."""
    return {t.name: {o.name: values[o.name] for o in t.options if o.name in values} for t in load().values()}
