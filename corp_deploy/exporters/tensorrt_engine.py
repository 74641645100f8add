"""TensorRT engines in two flavours, one code path: build from ONNX, describe, check, run.

Flavours: full TensorRT (``tensorrt``, NVIDIA's index only; builds on the GPU it targets) and
TensorRT for RTX (``tensorrt_rtx_bindings``, real wheels on PyPI; builds ahead of time on any
machine, GPU or not, for a list of target compute capabilities). Their Python APIs mirror each
other, so the builder and the runner below take the module as a parameter instead of being copied.

Precision lives in the ONNX graph (both build strongly typed: TensorRT 11 and TensorRT-RTX have no
FP16 builder flag; on TensorRT 10 the same path is used), so an FP16 engine is built from an
FP16-typed graph (``corp_deploy.exporters.fp16``). Every engine gets a JSON sidecar (``<engine>.json``)
recording what it is tied to: flavour and version, the building GPU (TensorRT) or the target
compute capabilities (TensorRT-RTX), the sha256 of the engine and of its ONNX, and whether it was
verified against onnxruntime or only built. Loading checks them before the engine is deserialized.
The runner uses torch CUDA tensors as I/O buffers; no pycuda.
"""

from __future__ import annotations

import json
import os
import re
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from corp_deploy.base import env
from corp_deploy.base.deps import install_hint, optional
from corp_deploy.base.errors import CorpError
from corp_deploy.base.fsio import atomic_file, cache_dir, check_writable, held_interrupt, sha256, staged
from corp_deploy.base.version import __version__
from corp_deploy.exporters.onnx_export import graph_precision, load_onnx, onnx_sha256, read_metadata

FORMAT = "corp-deploy/tensorrt-engine"
FORMAT_VERSION = 2
PRECISIONS = ("fp32", "fp16", "int8")
VERIFIED = "verified against onnxruntime"
TEXT_ENGINES = "text engines are built only: the engine runner takes one image input"
"""Why a text encoder's engine (``input_ids``, ``attention_mask``) is never run or timed here."""
MAKE_GRAPH = {
    "fp16": "convert with `corp-deploy export --precision fp32,fp16`",
    "int8": "an INT8 engine needs a Q/DQ graph: `corp-deploy quantize ONNX --calib-dir DIR` writes one",
}
"""How to make the graph a precision needs, for the one-line error when the graph has other types."""


@dataclass(frozen=True)
class Flavour:
    """One TensorRT distribution: its ``--runtime`` name, label and import name."""

    name: str
    label: str
    module: str
    builds_without_gpu: bool

    @property
    def install(self) -> str:
        """The pip command that brings it (from the dependency gate, ``corp_deploy.base.deps``)."""
        return install_hint(self.module)


FLAVOURS = {
    f.name: f
    for f in (
        Flavour("tensorrt", "TensorRT", "tensorrt", False),
        Flavour("tensorrt-rtx", "TensorRT-RTX", "tensorrt_rtx_bindings", True),
    )
}
RUNTIMES = ("auto", *FLAVOURS)
RTX_COMPUTE_CAPABILITIES = ("7.5", "8.0", "8.6", "8.9", "12.0", "12.1")
"""TensorRT-RTX 1.7's support matrix (its ``ComputeCapability`` enum): RTX-class GPUs, no Hopper (9.0)."""
RTX_DEFAULT_TARGETS = ("8.0", "8.6", "8.9", "12.0", "12.1")
"""What a TensorRT-RTX engine targets when none are set: Ampere and later; Turing (7.5) only on request."""
RTX_GPUS = "TensorRT-RTX engines run on RTX-class GPUs (compute capability 8.0-12.x, 7.5 on request)"


@dataclass(frozen=True)
class Profile:
    """One optimization profile over an axis (the batch, a text sequence): TensorRT tunes kernels for ``opt``."""

    min: int
    opt: int
    max: int

    def __post_init__(self) -> None:
        if not 1 <= self.min <= self.opt <= self.max:
            raise CorpError(f"a range must satisfy 1 <= min <= opt <= max, got {self.min}:{self.opt}:{self.max}")

    def __str__(self) -> str:
        return f"{self.min}:{self.opt}:{self.max}"

    def covers(self, batches: tuple[int, ...]) -> None:
        """Refuse verify batch sizes the engine cannot take, before anything is built."""
        outside = [b for b in batches if not self.min <= b <= self.max]
        if outside:
            raise CorpError(
                f"verify batch sizes {', '.join(map(str, outside))} are outside the engine batch range {self}: "
                "widen --batch-range or change --verify-batch-sizes"
            )


def parse_profile(text: str, flag: str = "--batch-range") -> Profile:
    """``"1:32:256"`` -> Profile(1, 32, 256); a single number means a fixed size."""
    parts = text.split(":")
    if len(parts) not in (1, 3) or not all(p.strip().isdigit() for p in parts):
        raise CorpError(f"{flag} expects MIN:OPT:MAX (e.g. 1:32:256) or one size, got {text!r}")
    values = [int(p) for p in parts]
    try:
        return Profile(*(values * 3 if len(values) == 1 else values))
    except CorpError as e:
        raise CorpError(f"{flag}: {e}") from None


def parse_compute_capabilities(text: str | None) -> tuple[str, ...]:
    """``"8.9"`` or ``"7.5,8.6"`` -> ("7.5", "8.6"): TensorRT-RTX targets, from its support matrix."""
    values = {v.strip() for v in (text or "").split(",") if v.strip()}
    if text is not None and (not values or not values <= set(RTX_COMPUTE_CAPABILITIES)):
        raise CorpError(
            f"--compute-capability takes TensorRT-RTX targets from {', '.join(RTX_COMPUTE_CAPABILITIES)} "
            f"(comma-separated), got {text!r}"
        )
    return tuple(cc for cc in RTX_COMPUTE_CAPABILITIES if cc in values)


@dataclass(frozen=True)
class BuildOptions:
    precision: str = "fp16"
    profile: Profile = Profile(1, 32, 256)
    workspace_gib: float = 8.0
    opt_level: int = 3
    tf32: bool = False
    timing_cache: Path | None = None
    runtime: str = "auto"
    compute_capabilities: tuple[str, ...] = ()
    sequence: Profile | None = None
    """The range of a graph's other dynamic axis (a text encoder's tokens per sequence); None for images."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise CorpError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if not 0 <= self.opt_level <= 5:
            raise CorpError(f"--opt-level must be 0..5 (TensorRT builder optimization level), got {self.opt_level}")
        if self.workspace_gib <= 0:
            raise CorpError(f"--workspace-gib must be > 0, got {self.workspace_gib}")
        if self.runtime not in RUNTIMES:
            raise CorpError(f"--runtime must be one of {', '.join(RUNTIMES)}, got {self.runtime!r}")
        if self.runtime == "tensorrt" and self.compute_capabilities:
            raise CorpError(
                "--compute-capability is for --runtime tensorrt-rtx: TensorRT builds for the GPU it runs on"
            )
        if self.runtime == "tensorrt-rtx" and self.timing_cache:
            raise CorpError("--timing-cache is for --runtime tensorrt: TensorRT-RTX has no timing cache")

    @property
    def candidates(self) -> list[Flavour]:
        """Flavours to try, in order: auto prefers TensorRT, unless only TensorRT-RTX fits the options."""
        if self.runtime != "auto":
            return [FLAVOURS[self.runtime]]
        if self.compute_capabilities:
            return [FLAVOURS["tensorrt-rtx"]]
        return list(FLAVOURS.values())


def for_graph(options: BuildOptions, seq_len: int | None) -> BuildOptions:
    """``options`` for a text encoder of ``seq_len`` tokens (sequence range 1:seq_len:seq_len unless --seq-range
    gave one), or for an image model (``seq_len`` None), which has no sequence axis to give a range."""
    if seq_len is None:
        if options.sequence is not None:
            raise CorpError("--seq-range is for text encoders' engines; an image graph has no sequence axis")
        return options
    return replace(options, sequence=options.sequence or Profile(1, seq_len, seq_len))


def flavour_missing(flavour: Flavour) -> str | None:
    """Why ``flavour`` cannot build engines here, or None when it can."""
    if optional(flavour.module) is None:
        return f"{flavour.label} is not installed ({flavour.install})"
    if not flavour.builds_without_gpu and not torch.cuda.is_available():
        return f"{flavour.label} needs a CUDA GPU to build (none visible)"
    return None


def build_missing(options: BuildOptions = BuildOptions()) -> str | None:
    """Why no engine can be built here with ``options``: every candidate flavour's reason, or None."""
    reasons = [flavour_missing(f) for f in options.candidates]
    return None if None in reasons else "; ".join(reasons)  # type: ignore[arg-type]


def select_flavour(options: BuildOptions = BuildOptions()) -> tuple[Flavour, Any]:
    """The flavour that builds here and its module; one line naming every install command if none."""
    for flavour in options.candidates:
        if flavour_missing(flavour) is None:
            return flavour, optional(flavour.module)
    raise CorpError(f"cannot build TensorRT engines here: {build_missing(options)}")


def default_timing_cache(trt) -> Path:
    """One cache per TensorRT version and GPU model, shared by every build on this machine."""
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", f"trt{trt.__version__}-{env.gpu()['gpu']}").strip("-")
    return cache_dir() / f"{slug}.timing-cache"


def source_record(onnx_path: Path, engine: Path) -> dict[str, str]:
    """The sidecar's record of the graph an engine is built from: its path relative to the engine (a run folder
    moves as a whole) and the hash of the whole model (graph and external weights: ``check_compatible``)."""
    return {"path": os.path.relpath(onnx_path.resolve(), engine.parent.resolve()), "sha256": onnx_sha256(onnx_path)}


def sidecar(engine: str | Path) -> Path:
    return Path(f"{engine}.json")


def require_precision(proto, path: str | Path, precision: str) -> None:
    """Strongly typed builds take the graph's own types: refuse a graph of another precision, saying how to make one."""
    if graph_precision(proto) != precision:
        how = MAKE_GRAPH.get(precision, "build from the FP32 graph")
        raise CorpError(
            f"{path} is an {graph_precision(proto)} graph but a {precision} engine was asked for; "
            f"strongly typed TensorRT builds the graph's own types ({how})"
        )


def build_engine(
    onnx_path: str | Path,
    out: str | Path,
    options: BuildOptions,
    overwrite: bool = False,
    check: Callable[[Path], dict] | None = None,
    unchecked: str = "no check asked for",
) -> dict:
    """Build ``out`` from ``onnx_path``; write the engine and its sidecar; return the sidecar's record.

    The graph's own types decide the precision: ``options.precision`` must match them. ``check``
    runs on the finished engine before it is moved into place, when this machine can run the
    engine (its result goes into the record under ``verify``); if it raises, nothing is written.
    Otherwise the record says the engine was built only, and why it was not executed (``unchecked``
    when there is no ``check``).
    """
    onnx_path, out = Path(onnx_path), Path(out)
    check_writable(out, overwrite)
    proto = load_onnx(onnx_path, weights=False)
    require_precision(proto, onnx_path, options.precision)
    flavour, trt = select_flavour(options)
    log = _build_log(trt, flavour)
    # A Ctrl-C raised inside TensorRT's logger callback is caught by its C++ caller ("Exception caught in log()") and
    # the build goes on: during TensorRT's calls SIGINT is held and delivered when they return.
    with held_interrupt():
        builder = trt.Builder(log)
        network = builder.create_network(_strongly_typed_flag(trt))
        parser = trt.OnnxParser(network, log)
        parsed = parser.parse_from_file(str(onnx_path))
    if not parsed:
        errors = "; ".join(str(parser.get_error(i).desc()) for i in range(parser.num_errors))
        raise CorpError(f"{flavour.label} cannot parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(options.workspace_gib * 2**30))
    config.builder_optimization_level = options.opt_level
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED  # the log then lists the built layers
    tf32_flag = getattr(trt.BuilderFlag, "TF32", None)
    if tf32_flag is not None:
        (config.set_flag if options.tf32 else config.clear_flag)(tf32_flag)
    inputs = _add_profile(builder, network, config, options, onnx_path)
    if flavour.builds_without_gpu:
        target = _set_targets(trt, config, options.compute_capabilities)
        cache_path = None
    else:
        target = {**env.gpu(), "targets": [env.gpu()["compute_capability"]]}
        cache_path = options.timing_cache or default_timing_cache(trt)
        _use_timing_cache(config, cache_path)

    start = time.perf_counter()
    with held_interrupt():
        serialized = builder.build_serialized_network(network, config)
    seconds = time.perf_counter() - start
    if serialized is None:
        why = log.last_error or "no error logged; try a larger --workspace-gib or a smaller max batch"
        raise CorpError(f"{flavour.label} could not build an engine from {onnx_path}: {why}")
    record = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "flavour": flavour.name,
        "version": trt.__version__,
        **target,
        "precision": options.precision,
        "tf32": bool(options.tf32 and tf32_flag is not None),
        "profile": asdict(options.profile),
        "sequence_profile": None if options.sequence is None else asdict(options.sequence),
        "input": inputs[0],
        "inputs": inputs,
        "workspace_gib": options.workspace_gib,
        "opt_level": options.opt_level,
        "build_seconds": round(seconds, 2),
        "engine_bytes": serialized.nbytes,
        "attention": {"blocks": len(read_metadata(proto).get("structure", [])) or None, **log.attention()},
        "onnx": source_record(onnx_path, out),
        "corp_deploy": __version__,
    }
    with staged(out, overwrite) as stage:
        engine = stage / out.name
        engine.write_bytes(memoryview(serialized))
        record["engine_sha256"] = sha256(engine)
        why = unchecked if check is None else run_missing(engine, meta=record, onnx=onnx_path)
        record |= {"verify": None, "status": f"built only (not executed: {why})" if why else VERIFIED}
        sidecar(engine).write_text(json.dumps(record, indent=2) + "\n")
        if not why:
            record["verify"] = check(engine)
            sidecar(engine).write_text(json.dumps(record, indent=2) + "\n")
    if cache_path is not None:
        _save_timing_cache(config, cache_path)
    return record


def _add_profile(builder, network, config, options: BuildOptions, onnx_path: Path) -> list[dict[str, Any]]:
    """One optimization profile for every input: the batch axis over ``options.profile``, another dynamic
    axis (a text graph's sequence) over ``options.sequence``; returns each input's name and non-batch shape."""
    profile, inputs = builder.create_optimization_profile(), []
    for tensor in (network.get_input(i) for i in range(network.num_inputs)):
        shape = tuple(tensor.shape)[1:]
        dynamic = sum(d < 0 for d in shape)
        if dynamic > 1 or (dynamic and options.sequence is None):
            raise CorpError(
                f"{onnx_path} input {tensor.name} has {dynamic} dynamic axes besides the batch {list(shape)}; "
                "an engine takes one more (a sequence, with --seq-range MIN:OPT:MAX): re-export it"
            )

        def at(batch: int, seq: int, shape: tuple[int, ...] = shape) -> tuple[int, ...]:
            return (batch, *(seq if d < 0 else d for d in shape))

        b, q = options.profile, options.sequence or options.profile  # q unused without a dynamic axis
        profile.set_shape(tensor.name, at(b.min, q.min), at(b.opt, q.opt), at(b.max, q.max))
        inputs.append({"name": tensor.name, "shape": list(shape)})
    config.add_optimization_profile(profile)
    return inputs


FUSED_ATTENTION = re.compile(r"Name: ([^,\s]*_mha[^,\s]*), LayerType")
"""A fused multi-head-attention kernel in the builder's layer list (e.g. ``_gemm_mha_v2_myl0_6``)."""


def _build_log(trt, flavour: Flavour):
    """A logger that keeps what the builder says about the layers it built and the last error.

    The layer list (needs ``ProfilingVerbosity.DETAILED`` and verbose logging) is the one place an
    ahead-of-time build shows whether attention became one fused kernel: the engine inspector
    needs a deserialized engine, hence a GPU. Warnings go to Python's warnings, one line each.
    """

    class BuildLog(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.layer_lists: list[str] = []
            self.last_error: str | None = None

        def log(self, severity, msg: str) -> None:
            if "LayerType:" in msg:
                self.layer_lists.append(msg)
            elif severity <= trt.ILogger.ERROR:
                self.last_error = " ".join(msg.split())
            elif severity == trt.ILogger.WARNING:
                warnings.warn(f"{flavour.label}: {' '.join(msg.split())}", stacklevel=2)

        def attention(self) -> dict[str, Any]:
            if not self.layer_lists:
                return {"fused_mha_layers": None, "seen_in": "nothing: the builder listed no layers"}
            names = {m for text in self.layer_lists for m in FUSED_ATTENTION.findall(text)}
            return {"fused_mha_layers": len(names), "seen_in": "the builder's layer list (verbose log)"}

    return BuildLog()


def _strongly_typed_flag(trt) -> int:
    """Strong typing: opt-in on TensorRT 10.x, always on (flag ignored) on 11.x and TensorRT-RTX."""
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return 0 if flag is None else 1 << int(flag)


def _set_targets(trt, config, targets: tuple[str, ...]) -> dict[str, Any]:
    """TensorRT-RTX's target compute capabilities (its default when none): recorded instead of a GPU."""
    if targets:
        config.num_compute_capabilities = len(targets)
        for i, cc in enumerate(targets):
            config.set_compute_capability(getattr(trt.ComputeCapability, "SM" + cc.replace(".", "")), i)
    return {"targets": list(targets or RTX_DEFAULT_TARGETS), "targets_default": not targets}


def _use_timing_cache(config, path: Path) -> None:
    blob = path.read_bytes() if path.is_file() else b""
    cache = config.create_timing_cache(blob)
    if not config.set_timing_cache(cache, ignore_mismatch=False):
        warnings.warn(f"timing cache {path} is from another GPU or TensorRT; starting a fresh one", stacklevel=3)
        config.set_timing_cache(config.create_timing_cache(b""), ignore_mismatch=False)


def _save_timing_cache(config, path: Path) -> None:
    with atomic_file(path, overwrite=True) as tmp:
        tmp.write_bytes(memoryview(config.get_timing_cache().serialize()))


def read_engine_meta(engine: str | Path) -> dict[str, Any]:
    """The sidecar of ``engine``, checked to belong to that exact file."""
    engine = Path(engine)
    if not engine.is_file():
        raise CorpError(f"engine {engine} does not exist; build it with `corp-deploy build-engine`")
    try:
        meta = json.loads(sidecar(engine).read_text())
    except FileNotFoundError:
        raise CorpError(
            f"{engine} has no {sidecar(engine).name}: not built by corp-deploy, so its GPU and TensorRT "
            "version are unknown; rebuild it with `corp-deploy build-engine`"
        ) from None
    except json.JSONDecodeError:
        raise CorpError(f"{sidecar(engine)} is corrupt; rebuild the engine with `corp-deploy build-engine`") from None
    if (
        meta.get("format") != FORMAT
        or meta.get("format_version") != FORMAT_VERSION
        or meta.get("flavour") not in FLAVOURS
    ):
        raise CorpError(f"{sidecar(engine)} is not engine metadata this corp-deploy reads; rebuild the engine")
    if meta.get("engine_sha256") != sha256(engine):
        raise CorpError(f"{engine} is not the file its {sidecar(engine).name} describes; rebuild the engine")
    return meta


def check_compatible(
    meta: dict[str, Any], here: dict[str, str], engine: str | Path, onnx: str | Path | None = None
) -> None:
    """Refuse an engine this GPU and library cannot run, or built from an ONNX since changed.

    ``onnx`` is the graph it was built from where the caller knows it: during the build the engine
    is still in its staging folder, from which the sidecar's path (relative to the engine's final
    folder) leads nowhere. Otherwise that path is followed; a missing ONNX is not staleness.

    ``here`` holds the running library's ``version`` and the GPU (``corp_deploy.base.env.gpu``). A TensorRT
    engine is tied to the GPU model that built it; a TensorRT-RTX engine to its target compute
    capabilities, which must be in TensorRT-RTX's support matrix (RTX-class GPUs, not Hopper).
    """
    label, name = FLAVOURS[meta["flavour"]].label, Path(engine).name
    if meta["version"] != here["version"]:
        raise CorpError(
            f"{name} was built with {label} {meta['version']} but this machine has {here['version']}; "
            "engines are tied to the library that built them: rebuild it with `corp-deploy build-engine`"
        )
    cc, gpu = here["compute_capability"], f"{here['gpu']}, {here['compute_capability']}"
    if meta["flavour"] == "tensorrt-rtx" and cc not in RTX_COMPUTE_CAPABILITIES:
        raise CorpError(f"{RTX_GPUS}; this GPU is {gpu}")
    if meta["flavour"] == "tensorrt-rtx" and cc not in meta["targets"]:
        raise CorpError(
            f"{name} targets compute capability {', '.join(meta['targets'])}; this GPU is {gpu}: "
            f"rebuild it with --compute-capability {cc}"
        )
    if meta["flavour"] == "tensorrt" and (meta["gpu"], meta["compute_capability"]) != (here["gpu"], cc):
        raise CorpError(
            f"{name} was built on {meta['gpu']} ({meta['compute_capability']}) but this GPU is {gpu}; "
            "TensorRT engines are tied to the GPU that built them: rebuild it with `corp-deploy build-engine`"
        )
    source = Path(onnx) if onnx is not None else Path(engine).parent / meta["onnx"]["path"]
    if source.is_file() and onnx_sha256(source) != meta["onnx"]["sha256"]:
        raise CorpError(f"{engine} is stale: {source} changed after it was built; rebuild the engine")


def load_runtime(meta: dict[str, Any], engine: str | Path, runtime: str = "auto", onnx: str | Path | None = None):
    """The module that runs ``engine`` here (auto: its own flavour), after every check short of deserializing."""
    flavour, asked = FLAVOURS[meta["flavour"]], FLAVOURS.get(runtime, FLAVOURS[meta["flavour"]])
    if asked != flavour:
        raise CorpError(
            f"{Path(engine).name} is a {flavour.label} engine, not a {asked.label} one: "
            f"run it with --runtime {flavour.name} or rebuild it with --runtime {asked.name}"
        )
    trt = optional(flavour.module)
    if trt is None:
        raise CorpError(f"{Path(engine).name} is a {flavour.label} engine: {flavour_missing(flavour)}")
    if not torch.cuda.is_available():
        raise CorpError("no supported GPU here: no CUDA GPU is visible")
    check_compatible(meta, {"version": trt.__version__, **env.gpu()}, engine, onnx)
    return trt


def run_missing(
    engine: str | Path, runtime: str = "auto", meta: dict[str, Any] | None = None, onnx: str | Path | None = None
) -> str | None:
    """Why ``engine`` cannot run here (its sidecar, the library, the GPU, a changed ``onnx``), or None."""
    try:
        load_runtime(meta or read_engine_meta(engine), engine, runtime, onnx)
    except CorpError as e:
        return str(e)
    return None


class TrtRunner:
    """A deserialized engine with one execution context; I/O through torch CUDA tensors."""

    def __init__(self, engine: str | Path, runtime: str = "auto", onnx: str | Path | None = None):
        self.meta = read_engine_meta(engine)
        trt = load_runtime(self.meta, engine, runtime, onnx)
        self.label = FLAVOURS[self.meta["flavour"]].label
        self._logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self._logger)
        self.engine = self.runtime.deserialize_cuda_engine(Path(engine).read_bytes())
        if self.engine is None:
            raise CorpError(f"{self.label} could not deserialize {engine}; rebuild it with `corp-deploy build-engine`")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        outputs = [n for n in names if n not in inputs]
        if len(inputs) != 1 or len(outputs) != 1:
            raise CorpError(f"{engine} has {len(inputs)} inputs and {len(outputs)} outputs; expected one of each")
        (self.input,), (self.output,) = inputs, outputs
        self.input_dtype = _torch_dtype(trt, self.engine.get_tensor_dtype(self.input))
        self.output_dtype = _torch_dtype(trt, self.engine.get_tensor_dtype(self.output))
        self.profile = Profile(**self.meta["profile"])
        self.name = f"{self.meta['flavour']}-{self.meta['precision']}"

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """Enqueue one inference on the current torch stream; ``x`` must already be on the GPU.

        A shape the engine cannot take is refused in one line: outside the profile recorded beside
        the engine, TensorRT is never asked (it would log its own error); a shape TensorRT refuses
        anyway (``set_input_shape`` returns False) would otherwise run on the previous shape.
        """
        shape, image = tuple(x.shape), tuple(self.meta["input"]["shape"])
        low, high = (self.profile.min, *image), (self.profile.max, *image)
        inside = len(shape) == len(low) and all(a <= n <= b for a, n, b in zip(low, shape, high, strict=True))
        if not (inside and self.context.set_input_shape(self.input, shape)):
            raise CorpError(
                f"input shape {shape} is outside {self.label} engine {self.name}'s profile (min {low}, max {high}): "
                "pass images of the size it was built for, or rebuild it with --batch-range"
            )
        x = x.to(self.input_dtype).contiguous()
        self.context.set_tensor_address(self.input, x.data_ptr())
        out = torch.empty(tuple(self.context.get_tensor_shape(self.output)), dtype=self.output_dtype, device=x.device)
        self.context.set_tensor_address(self.output, out.data_ptr())
        if not self.context.execute_async_v3(torch.cuda.current_stream().cuda_stream):
            raise CorpError(f"{self.label} execution failed (see its log above)")
        return out

    def __call__(self, x: np.ndarray) -> np.ndarray:
        out = self.run(torch.from_numpy(x).cuda())
        torch.cuda.current_stream().synchronize()
        return out.float().cpu().numpy()


def _torch_dtype(trt, dtype) -> torch.dtype:
    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.int32: torch.int32}
    if getattr(trt, "bfloat16", None) is not None:
        table[trt.bfloat16] = torch.bfloat16
    if dtype not in table:
        raise CorpError(f"engine I/O type {dtype} is not supported by the runner")
    return table[dtype]
