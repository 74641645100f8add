"""TensorRT engines: build from ONNX (strongly typed, TensorRT 10 and 11), describe, check, run.

Precision lives in the ONNX graph (TensorRT 11 has no FP16 builder flag; on 10.x the same strongly
typed path is used), so an FP16 engine is built from an FP16-typed graph (``exporters.fp16``).
Every engine gets a JSON sidecar (``<engine>.json``) recording what it is tied to: TensorRT
version, GPU model and compute capability, and the sha256 of the engine and of its ONNX. Loading
checks them, because a serialized engine is only valid for the GPU and TensorRT that built it.
The runner uses torch CUDA tensors as I/O buffers; no pycuda.
"""

from __future__ import annotations

import json
import os
import re
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import corp_deploy
from corp_deploy.artifact import atomic_file, cache_dir, check_writable, staged
from corp_deploy.errors import CorpError
from exporters.onnx_export import graph_precision, load_onnx, sha256

FORMAT = "corp-deploy/tensorrt-engine"
FORMAT_VERSION = 1
PRECISIONS = ("fp32", "fp16")
INSTALL_HINT = (
    "install the real libraries from NVIDIA's index: pip install tensorrt --extra-index-url https://pypi.nvidia.com "
    "(the PyPI package alone is a placeholder)"
)


@dataclass(frozen=True)
class Profile:
    """One optimization profile over the batch axis: TensorRT tunes kernels for ``opt``."""

    min: int
    opt: int
    max: int

    def __post_init__(self) -> None:
        if not 1 <= self.min <= self.opt <= self.max:
            raise CorpError(f"batch range must satisfy 1 <= min <= opt <= max, got {self.min}:{self.opt}:{self.max}")

    def __str__(self) -> str:
        return f"{self.min}:{self.opt}:{self.max}"


def parse_profile(text: str) -> Profile:
    """``"1:32:256"`` -> Profile(1, 32, 256); a single number means a fixed batch."""
    parts = text.split(":")
    if len(parts) not in (1, 3) or not all(p.strip().isdigit() for p in parts):
        raise CorpError(f"--batch expects MIN:OPT:MAX (e.g. 1:32:256) or one batch size, got {text!r}")
    values = [int(p) for p in parts]
    return Profile(*(values * 3 if len(values) == 1 else values))


@dataclass(frozen=True)
class BuildOptions:
    precision: str = "fp16"
    profile: Profile = Profile(1, 32, 256)
    workspace_gib: float = 8.0
    opt_level: int = 3
    tf32: bool = False
    timing_cache: Path | None = None

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise CorpError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if not 0 <= self.opt_level <= 5:
            raise CorpError(f"--opt-level must be 0..5 (TensorRT builder optimization level), got {self.opt_level}")
        if self.workspace_gib <= 0:
            raise CorpError(f"--workspace-gib must be > 0, got {self.workspace_gib}")


def tensorrt_missing() -> str | None:
    """Why engines cannot be built or run here, or None when they can."""
    if not torch.cuda.is_available():
        return "no CUDA GPU visible"
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return f"TensorRT is not installed ({INSTALL_HINT})"
    return None


def import_tensorrt():
    reason = tensorrt_missing()
    if reason:
        raise CorpError(f"TensorRT engines need a CUDA GPU and TensorRT: {reason}")
    import tensorrt as trt

    return trt


def platform_info(trt) -> dict[str, str]:
    """What a serialized engine is tied to, for this process's current GPU."""
    major, minor = torch.cuda.get_device_capability()
    return {
        "tensorrt": trt.__version__,
        "gpu": torch.cuda.get_device_name(),
        "compute_capability": f"{major}.{minor}",
        "cuda": torch.version.cuda or "unknown",
    }


def default_timing_cache(trt) -> Path:
    """One cache per TensorRT version and GPU model, shared by every build on this machine."""
    info = platform_info(trt)
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", f"trt{info['tensorrt']}-{info['gpu']}").strip("-")
    return cache_dir() / f"{slug}.timing-cache"


def sidecar(engine: str | Path) -> Path:
    return Path(f"{engine}.json")


def build_engine(
    onnx_path: str | Path,
    out: str | Path,
    options: BuildOptions,
    overwrite: bool = False,
    check: Callable[[Path], dict] | None = None,
) -> dict:
    """Build ``out`` from ``onnx_path``; write the engine and its sidecar; return the sidecar's record.

    The graph's own types decide the precision: ``options.precision`` must match them. ``check``
    runs on the finished engine before it is moved into place (its result goes into the record
    under ``verify``); if it raises, nothing is written.
    """
    trt = import_tensorrt()
    onnx_path, out = Path(onnx_path), Path(out)
    check_writable(out, overwrite)
    proto = load_onnx(onnx_path, weights=False)
    if graph_precision(proto) != options.precision:
        raise CorpError(
            f"{onnx_path} is an {graph_precision(proto)} graph but a {options.precision} engine was asked for; "
            "strongly typed TensorRT builds the graph's own types (convert with `corp-deploy export --fp16`)"
        )
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(_strongly_typed_flag(trt))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i).desc()) for i in range(parser.num_errors))
        raise CorpError(f"TensorRT cannot parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(options.workspace_gib * 2**30))
    config.builder_optimization_level = options.opt_level
    tf32_flag = getattr(trt.BuilderFlag, "TF32", None)
    if tf32_flag is not None:
        (config.set_flag if options.tf32 else config.clear_flag)(tf32_flag)
    image = network.get_input(0)
    shape = tuple(image.shape)[1:]
    profile = builder.create_optimization_profile()
    p = options.profile
    profile.set_shape(image.name, (p.min, *shape), (p.opt, *shape), (p.max, *shape))
    config.add_optimization_profile(profile)
    cache_path = options.timing_cache or default_timing_cache(trt)
    _use_timing_cache(config, cache_path)

    start = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    seconds = time.perf_counter() - start
    if serialized is None:
        raise CorpError(
            f"TensorRT could not build an engine from {onnx_path} (its log is above); "
            "try a larger --workspace-gib or a smaller max batch"
        )
    record = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        **platform_info(trt),
        "precision": options.precision,
        "tf32": bool(options.tf32 and tf32_flag is not None),
        "profile": asdict(p),
        "input": {"name": image.name, "shape": list(shape)},
        "workspace_gib": options.workspace_gib,
        "opt_level": options.opt_level,
        "build_seconds": round(seconds, 2),
        # Relative to the engine, so that a run folder can move as a whole.
        "onnx": {"path": os.path.relpath(onnx_path.resolve(), out.parent.resolve()), "sha256": sha256(onnx_path)},
        "corp_deploy": corp_deploy.__version__,
    }
    with staged(out, overwrite) as stage:
        engine = stage / out.name
        engine.write_bytes(memoryview(serialized))
        record["engine_sha256"] = sha256(engine)
        sidecar(engine).write_text(json.dumps(record, indent=2) + "\n")
        if check is not None:
            record["verify"] = check(engine)
            sidecar(engine).write_text(json.dumps(record, indent=2) + "\n")
    _save_timing_cache(config, cache_path)
    return record


def _strongly_typed_flag(trt) -> int:
    """Strong typing: opt-in on TensorRT 10.x, always on (flag ignored) on 11.x."""
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return 0 if flag is None else 1 << int(flag)


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
    if meta.get("format") != FORMAT or meta.get("format_version", 0) > FORMAT_VERSION:
        raise CorpError(f"{sidecar(engine)} is not engine metadata this corp-deploy reads; rebuild the engine")
    if meta.get("engine_sha256") != sha256(engine):
        raise CorpError(f"{engine} is not the file its {sidecar(engine).name} describes; rebuild the engine")
    return meta


def check_compatible(meta: dict[str, Any], here: dict[str, str], engine: str | Path) -> None:
    """Refuse an engine built for another GPU model or TensorRT version, or from an ONNX since changed."""
    for key, label in (("tensorrt", "TensorRT"), ("gpu", "GPU"), ("compute_capability", "compute capability")):
        if meta.get(key) != here[key]:
            raise CorpError(
                f"{engine} was built for {label} {meta.get(key)} but this machine has {here[key]}; "
                "engines are tied to the GPU and TensorRT that built them: rebuild with `corp-deploy build-engine`"
            )
    source = Path(engine).parent / meta["onnx"]["path"]
    if source.is_file() and sha256(source) != meta["onnx"]["sha256"]:
        raise CorpError(f"{engine} is stale: {source} changed after it was built; rebuild the engine")


class TrtRunner:
    """A deserialized engine with one execution context; I/O through torch CUDA tensors."""

    def __init__(self, engine: str | Path):
        trt = import_tensorrt()
        self.meta = read_engine_meta(engine)
        check_compatible(self.meta, platform_info(trt), engine)
        self._logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self._logger)
        self.engine = self.runtime.deserialize_cuda_engine(Path(engine).read_bytes())
        if self.engine is None:
            raise CorpError(f"TensorRT could not deserialize {engine}; rebuild it with `corp-deploy build-engine`")
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
        self.name = f"tensorrt-{self.meta['precision']}"

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """Enqueue one inference on the current torch stream; ``x`` must already be on the GPU."""
        if not self.profile.min <= len(x) <= self.profile.max:
            raise CorpError(f"batch {len(x)} is outside this engine's profile {self.profile}; rebuild with --batch")
        x = x.to(self.input_dtype).contiguous()
        self.context.set_input_shape(self.input, tuple(x.shape))
        self.context.set_tensor_address(self.input, x.data_ptr())
        out = torch.empty(tuple(self.context.get_tensor_shape(self.output)), dtype=self.output_dtype, device=x.device)
        self.context.set_tensor_address(self.output, out.data_ptr())
        if not self.context.execute_async_v3(torch.cuda.current_stream().cuda_stream):
            raise CorpError("TensorRT execution failed (see its log above)")
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
