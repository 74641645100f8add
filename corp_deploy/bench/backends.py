"""Backends: how one model runs and is timed on one runtime, device and precision.

Each backend turns a (run folder, model) pair into ``at(batch) -> Step``. Inputs are made on the
device before timing (unless ``include_copies``); GPU steps are timed with CUDA events on the
current stream, CPU steps with ``perf_counter``. ``missing`` says why a backend cannot run here.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from corp_deploy.base.deps import missing as uninstalled
from corp_deploy.base.errors import CorpError, first_line
from corp_deploy.base.timing import Step
from corp_deploy.exporters import targets as export_targets
from corp_deploy.exporters.compare import Feed
from corp_deploy.exporters.onnx_export import image_graph
from corp_deploy.exporters.rewrites import PATCH_LINEAR, rewritten
from corp_deploy.exporters.targets import TENSORRT, BenchSpec, Target
from corp_deploy.exporters.text_onnx import graph
from corp_deploy.formats.artifact import build, load_pruned
from corp_deploy.formats.run_folder import ARTIFACT, MODELS, RunFolder


def torch_model(run: RunFolder, which: str) -> nn.Module:
    """The pruned model from its artifact; the dense one as its family builds it (a timm name, a config.json);
    each as its graph was exported (``text_onnx.graph``: ``input_ids, attention_mask``; ``image_graph``).

    The dense weights are random: values do not change a dense model's latency. Models held in memory
    (``bench.meter``'s, for a latency table or the closed loop) come as they are, through their own ``torch_model``.
    """
    if not isinstance(run, RunFolder):
        return run.torch_model(which)
    model = load_pruned(run.root / ARTIFACT) if which == "pruned" else build(run.meta, run.root / ARTIFACT).eval()
    return graph(model)[0] if run.text is not None else image_graph(model)


def causal_lm(run: RunFolder, which: str) -> nn.Module:
    """The ``transformers`` causal LM itself (dense rebuilt with random weights, as ``torch_model``), for a
    decoder's own step loop with its key/value cache."""
    if not run.decoder:
        raise CorpError(f"{run.root} holds no causal LM (its pruned/config.json names none)")
    return torch_model(run, which).model


def inputs_for(run: RunFolder, batch: int) -> Feed:
    """A batch as ``run``'s models take it: full-length random token ids (mask all ones) for a text run,
    else random images. Anything else with an ``input_size`` and a ``text`` (``speed``'s models) reads alike."""
    rng = np.random.default_rng(batch)
    text = run.text
    if text is None:
        return rng.standard_normal((batch, *run.input_size), dtype=np.float32)
    ids = rng.integers(0, text.vocab, (batch, text.seq_len))
    return {"input_ids": ids, "attention_mask": np.ones_like(ids)}


def torch_inputs(feed: Feed, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """``feed`` as torch tensors on ``device``: images in ``dtype``, token ids and masks as they are."""
    if isinstance(feed, dict):
        return tuple(torch.from_numpy(a).to(device) for a in feed.values())
    return (torch.from_numpy(feed).to(device, dtype),)


def cpu_step(call: Callable[[], object]) -> Step:
    def step() -> float:
        start = time.perf_counter()
        call()
        return time.perf_counter() - start

    return step


def cuda_step(call: Callable[[], object]) -> Step:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def step() -> float:
        start.record()
        call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    return step


@dataclass(frozen=True)
class Backend:
    """One runtime on one device at one precision, and what the rest of the tool needs to know about it (so that
    nothing takes its name apart)."""

    name: str
    runtime: str
    """``torch``, ``onnxruntime`` or ``tensorrt``."""
    device: str
    precision: str
    load: Callable[[RunFolder, str, bool, int | None], Callable[[int], Step]]
    """(run, model, include_copies, CPU threads) -> (batch -> timed step)."""
    missing: Callable[[RunFolder], str | None]
    compiler: str | None = None
    """torch.compile's backend when the model is compiled (``inductor``); None: eager or not torch."""
    graphed: bool = False
    """Replayed as a CUDA graph."""
    equal_heads: bool = False
    """Its fast attention kernels need one head width for Q, K and V (SDPA flash, TensorRT MHA): a latency table
    measured here allocates equal Q/K and V widths (``latency.LatencyTable.tied``)."""
    default_rewrites: tuple[str, ...] = ()
    """The exact rewrites measured to pay here (``exporters.rewrites``; docs/BENCHMARKS.md "Exact fixed-cost
    rewrites": the patch embedding as one GEMM on CUDA; none paid on the CPU backends)."""
    opt_in: str | None = None
    """Why ``auto`` leaves this backend out (it runs only when named); None: ``auto`` includes it."""
    chosen_rewrites: tuple[str, ...] | None = None
    """The user's ``--rewrites`` where they replace the defaults: a latency budget times what is exported."""
    target: Target | None = None
    """The export target whose files it runs (``exporters.targets``); None: the PyTorch model itself."""
    ready: Callable[[Path], str | None] = lambda path: None
    """Why a file of its target that is there cannot run here (``BenchSpec.ready``)."""

    @property
    def rewrites(self) -> tuple[str, ...]:
        """The exact rewrites applied here (``exporters.rewrites``): those chosen, else those that pay. Its torch
        loader applies them to dense and pruned alike; the ONNX and engine backends run the graphs as exported (their
        sidecars say which)."""
        return self.default_rewrites if self.chosen_rewrites is None else self.chosen_rewrites


def compile_model(model: nn.Module, backend: str | Callable[..., Any] = "inductor") -> nn.Module:
    """``torch.compile`` with static shapes: one specialised graph per (model, batch), as a deployment
    serving fixed batch sizes compiles it, and as a CUDA graph (fixed addresses and shapes) needs."""
    return torch.compile(model, backend=backend, dynamic=False)


@contextmanager
def _every_recompile_allowed() -> Iterator[None]:
    """Lift dynamo's per-function recompile limit (8) to its global one while a forward compiles.

    Every model of a class shares one compile cache (``VisionTransformer.forward``), and each model x
    batch x precision is one more entry: past 8, dynamo silently runs the function eagerly and the
    "compiled" timing would be eager's.
    """
    import torch._dynamo

    config = torch._dynamo.config
    with config.patch(cache_size_limit=config.accumulated_cache_size_limit):
        yield


def torch_forward(
    model: nn.Module, x: torch.Tensor | tuple[torch.Tensor, ...], graph: bool = False
) -> Callable[[], torch.Tensor]:
    """``model(x)`` (``model(*x)`` for a tuple) under ``inference_mode``, run once here so a compiled model
    compiles now, not when timed.

    ``graph``: after warm-up iterations on a side stream (CUDA graphs capture no first-call work), the
    forward is captured once in a CUDA graph and the call replays it: no per-kernel launch cost. ``x``
    is then the static input buffer (write new inputs into it) and the call returns the static output.
    """
    args = x if isinstance(x, tuple) else (x,)

    def run() -> torch.Tensor:
        with torch.inference_mode():
            return model(*args)

    with _every_recompile_allowed():
        if not graph:
            run()
            return run
        device = args[0].device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(3):
                run()
        torch.cuda.current_stream(device).wait_stream(side)
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            out = run()
    return _Replay(captured, out, (model, args))


@dataclass(frozen=True)
class _Replay:
    """A captured forward: replaying it returns the static output."""

    graph: torch.cuda.CUDAGraph
    out: torch.Tensor
    reads: tuple
    """The model and the static inputs: the graph reads their memory at fixed addresses, so they must live as long
    as it does (freed, the allocator hands that memory to other tensors, or back to the driver)."""

    def __call__(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


def _torch(
    device: str,
    dtype: torch.dtype,
    defaults: tuple[str, ...] = (),
    compile_backend: str | None = None,
    graph: bool = False,
) -> Callable:
    """The loader of a torch backend on ``device``: the model with the rewrites that pay there (``defaults``)."""

    def load(run: RunFolder, which: str, include_copies: bool, threads: int | None) -> Callable[[int], Step]:
        names = defaults if run.rewrites is None else run.rewrites
        model = rewritten(torch_model(run, which), names)[0].to(device, dtype).eval()
        if compile_backend:
            model = compile_model(model, compile_backend)

        def at(batch: int) -> Step:
            x = torch_inputs(inputs_for(run, batch), device, dtype)
            try:
                forward = torch_forward(model, x, graph)
            except torch.cuda.OutOfMemoryError:
                raise
            except RuntimeError as e:  # a compiler or capture failure: this batch is skipped, the bench goes on
                raise CorpError(f"the warm-up forward (compile, graph capture) failed: {first_line(e)}") from e
            if include_copies and device == "cuda":
                hosts = [t.cpu().pin_memory() for t in x]

                def call() -> torch.Tensor:
                    for t, host in zip(x, hosts, strict=True):
                        t.copy_(host, non_blocking=True)
                    return forward().cpu()

                return cuda_step(call)
            return cuda_step(forward) if device == "cuda" else cpu_step(forward)

        return at

    return load


def _ort(target: Target, spec: BenchSpec) -> Callable:
    """onnxruntime's loader: on the GPU the inputs are copied to the device once, unless ``include_copies``."""
    device = "gpu" if spec.device == "cuda" else "cpu"

    def load(run: RunFolder, which: str, include_copies: bool, threads: int | None) -> Callable[[int], Step]:
        from corp_deploy.exporters.runners import OrtRunner

        runner = OrtRunner(run.root / target.file_name(which, spec.precision), device, threads)
        if device == "gpu" and runner.provider == "CPUExecutionProvider":
            raise CorpError("onnxruntime fell back to the CPU provider; its GPU provider did not load")

        def at(batch: int) -> Step:
            x = inputs_for(run, batch)
            if device == "cpu" or include_copies:
                return cpu_step(lambda: runner(x))  # session.run blocks until the result is on the host
            return cpu_step(runner.on_gpu(x))

        return at

    return load


def _tensorrt(target: Target, spec: BenchSpec) -> Callable:
    """TensorRT's loader: torch CUDA tensors in and out, timed with CUDA events."""

    def load(run: RunFolder, which: str, include_copies: bool, threads: int | None) -> Callable[[int], Step]:
        runner = target.runner(run.root / target.file_name(which, spec.precision), threads)
        shape = run.input_size

        def at(batch: int) -> Step:
            if include_copies:
                host = torch.randn(batch, *shape).pin_memory()
                return cuda_step(lambda: runner.run(host.to("cuda", non_blocking=True)).cpu())
            x = torch.randn(batch, *shape, device="cuda").to(runner.input_dtype)
            return cuda_step(lambda: runner.run(x))

        return at

    return load


def _no_gpu(_: RunFolder) -> str | None:
    return None if torch.cuda.is_available() else "no CUDA GPU visible"


def _compile_missing(run: RunFolder) -> str | None:
    if reason := _no_gpu(run):
        return reason
    absent = uninstalled("triton")
    return absent and f"not installed: {absent} (torch.compile's inductor writes its CUDA kernels in Triton)"


CUDA_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
COMPILE_OPT_IN = (
    "not in auto: torch.compile (inductor) compiles each model and batch size first, ~5-10 s each on an H200, "
    "minutes in all; name it in --backends"
)
TORCH_CUDA_MODES = {
    "": (None, False, _no_gpu, None),
    "-graph": (None, True, _no_gpu, None),
    "-compile": ("inductor", False, _compile_missing, COMPILE_OPT_IN),
    "-compile-graph": ("inductor", True, _compile_missing, COMPILE_OPT_IN),
}
"""Name suffix -> (torch.compile backend, CUDA graph, why it cannot run here, why ``auto`` leaves it out)."""
CUDA_REWRITES = (PATCH_LINEAR,)
"""What pays on the torch CUDA backends: 0.55 ms as a cuDNN conv vs 0.08 ms as reshape+GEMM for deit_base's patch
embedding at batch 64 in fp16 on an H200 (issue 23)."""

TORCH_BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend(
            "torch-cpu-fp32", "torch", "cpu", "fp32", _torch("cpu", torch.float32), lambda run: None, equal_heads=True
        ),
        *(
            Backend(
                f"torch-cuda-{p}{suffix}",
                "torch",
                "cuda",
                p,
                _torch("cuda", dtype, CUDA_REWRITES, compiler, graph),
                missing,
                compiler=compiler,
                graphed=graph,
                equal_heads=True,
                default_rewrites=CUDA_REWRITES,
                opt_in=opt_in,
            )
            for suffix, (compiler, graph, missing, opt_in) in TORCH_CUDA_MODES.items()
            for p, dtype in CUDA_DTYPES.items()
        ),
    )
}
"""The PyTorch backends, eager, graphed and compiled: not export targets, the model itself timed."""


def _runner(target: Target, spec: BenchSpec) -> Callable:
    """The loader of any other target's backend: its file of the spec's precision run by its runner on the CPU."""

    def load(run: RunFolder, which: str, include_copies: bool, threads: int | None) -> Callable[[int], Step]:
        runner = target.runner(run.root / target.file_name(which, spec.precision), threads)

        def at(batch: int) -> Step:
            x = inputs_for(run, batch)
            return cpu_step(lambda: runner(x))

        return at

    return load


LOADERS: dict[str, Callable[[Target, BenchSpec], Callable]] = {"onnxruntime": _ort, TENSORRT: _tensorrt}
"""Runtimes timed their own way (inputs on the GPU, CUDA events), by ``BenchSpec.runtime``; every other target's
files are timed through its runner on the CPU (``_runner``)."""


def _target_missing(target: Target, spec: BenchSpec) -> Callable[[RunFolder], str | None]:
    """Why a target's backend cannot time ``run`` here: its runtime not installed, a text run it does not time, its
    files absent (and the command that writes them), or a file it cannot run (``BenchSpec.ready``)."""

    def missing(run: RunFolder) -> str | None:
        if reason := target.missing():
            return f"not installed: {reason}"
        if run.text is not None and target.text:
            return target.text
        files = [run.root / target.file_name(m, spec.precision) for m in MODELS]
        if absent := [f.name for f in files if not f.is_file()]:
            return f"no {', '.join(absent)} in {run.root} ({target.how_to_make(run.root, spec.precision)})"
        return next(filter(None, map(spec.ready, files)), None)

    return missing


@functools.cache
def _backends_of(target: Target) -> tuple[Backend, ...]:
    """A registered export target's backends, built once (the same objects at every read)."""
    return tuple(
        Backend(
            s.name,
            s.runtime,
            s.device,
            s.precision,
            LOADERS.get(s.runtime, _runner)(target, s),
            _target_missing(target, s),
            equal_heads=s.equal_heads,
            target=target,
            ready=s.ready,
        )
        for s in target.backends
    )


BACKENDS: dict[str, Backend] = {}
"""Every backend by name, CPU first: the PyTorch ones and every registered export target's (``all_backends`` keeps
it current)."""


def all_backends() -> dict[str, Backend]:
    """``BACKENDS``, brought up to date with the registry: the PyTorch backends and every registered export target's
    (``exporters.targets``: ONNX's onnxruntime, TensorRT, OpenVINO...), CPU first; what ``bench``, ``eval`` and a
    latency budget choose from. Read at each call, so a target registered later is there too."""
    ordered = [*TORCH_BACKENDS.values(), *(b for t in export_targets.load().values() for b in _backends_of(t))]
    current = {b.name: b for device in ("cpu", "cuda") for b in ordered if b.device == device}
    if list(current) != list(BACKENDS):  # a target registered or removed: entries replaced (tests patch them)
        BACKENDS.clear()
        BACKENDS.update(current)
    return BACKENDS


all_backends()


def rewrites_on(name: str | None) -> tuple[str, ...]:
    """The rewrites that pay on backend ``name``; none for an unknown or absent one (refused where it is used)."""
    return TORCH_BACKENDS[name].default_rewrites if name in TORCH_BACKENDS else ()


def select_backends(
    names: str,
    run: RunFolder,
    registry: Mapping[str, Any] | None = None,
    kind: str = "backend",
    elsewhere: tuple[str, Mapping[str, Any]] = ("decoder runs", {}),
) -> tuple[list, dict[str, str]]:
    """``auto`` or a comma list of ``registry``'s names (image/encoder backends, or the decoder ones) -> (backends
    to run, {skipped backend: why}; ``registry`` by default: ``all_backends``, the export targets' too); ``auto``
    leaves out what cannot run here and what is opt-in. ``elsewhere``: the
    other kind of run and its registry, named when a backend of that kind is asked for here (a refusal lists every
    backend there is, by the runs it times)."""
    registry = all_backends() if registry is None else registry
    wanted = list(registry) if names == "auto" else [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in registry]
    if unknown or not wanted:
        runs, other = elsewhere
        here = [n for n in unknown if n in other]
        what = (
            f"{', '.join(here)} {'times' if len(here) == 1 else 'time'} {runs}, not this run"
            if here
            else (f"unknown {kind} {', '.join(unknown) or names!r}")
        )
        theirs = [n for n in other if n not in registry]
        also = f" ({runs} also: {', '.join(theirs)})" if theirs else ""
        raise CorpError(f"{what}; choose auto or from {', '.join(registry)}{also}")
    chosen, skipped = [], {}
    for name in wanted:
        opt_in = getattr(registry[name], "opt_in", None)
        reason = registry[name].missing(run) or (opt_in if names == "auto" else None)
        if reason is None:
            chosen.append(registry[name])
        elif names == "auto":
            skipped[name] = reason
        else:
            raise CorpError(f"backend {name} cannot run here: {reason}")
    return chosen, skipped
