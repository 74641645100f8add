"""The quantize-only baseline in ``bench``: what a user gets without pruning, timed beside dense and pruned.

The dense graph quantized by onnxruntime's own one line (``int8_recipes.BASELINE_WHAT``) is the alternative pruning
has to beat. ``bench`` times it in the same interleaved loop as dense and pruned on every onnxruntime CPU backend
(so each precision's row shows it, measured in the same run), from the run folder's ``baseline.int8.onnx``
(``prune-export --precision ...,int8``, ``quantize``) or, where the folder has none, quantized from its
``dense.onnx`` into a temporary folder (seconds). ``bench --gate quantize-only`` holds pruned INT8 to it
(``gate.against_quantize_only``).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

from corp_deploy.base.timing import Step
from corp_deploy.bench.backends import Backend, RunFolder, cpu_step, inputs_for
from corp_deploy.exporters import targets as export_targets
from corp_deploy.exporters.int8_recipes import BASELINE_WHAT, dynamic_int8
from corp_deploy.exporters.onnx_export import onnx_files
from corp_deploy.formats.run_folder import BASELINE

Loader = Callable[[RunFolder, str, bool, "int | None"], Callable[[int], Step]]


ORT = "onnxruntime"


def runs_beside(backend: Backend, baselines: Mapping[str, Loader]) -> bool:
    """Whether a baseline is timed in ``backend``'s loop: one of its runtime's, on the CPU."""
    return backend.runtime in baselines and backend.device == "cpu"


def baseline_graph(run: RunFolder, tmp: Path) -> tuple[Path, str]:
    """(the baseline graph, where it came from): the run folder's, else made now from its dense.onnx in ``tmp``."""
    kept = run.onnx(BASELINE, "int8")
    if kept.is_file():
        return kept, f"{kept.name} of the run folder ({BASELINE_WHAT})"
    for f in onnx_files(run.onnx("dense")):  # a copy: onnxruntime's quantizer writes beside the graph it reads
        shutil.copy(f, tmp / f.name)
    made = tmp / kept.name
    dynamic_int8(tmp / run.onnx("dense").name, made, per_channel=True)
    return made, f"made by bench from dense.onnx: {BASELINE_WHAT}"


def loader(path: Path, runner: Callable[[Path, int | None], Callable] | None = None) -> Loader:
    """A backend loader for a baseline file on ``run``'s inputs: ``runner`` (a target's), else onnxruntime's CPU
    provider."""

    def load(run: RunFolder, which: str, include_copies: bool, threads: int | None) -> Callable[[int], Step]:
        from corp_deploy.exporters.runners import OrtRunner

        run_ = OrtRunner(path, "cpu", threads) if runner is None else runner(path, threads)

        def at(batch: int) -> Step:
            x = inputs_for(run, batch)
            return cpu_step(lambda: run_(x))

        return at

    return load


def quantize_only_baseline(
    run: RunFolder, backends: list[Backend], tmp: Path, skipped: dict[str, str]
) -> tuple[dict[str, Loader], str] | None:
    """({runtime: the quantize-only baseline's loader}, where each came from) for the CPU runtimes among
    ``backends`` that have one: onnxruntime's from dense.onnx, each export target's (``exporters.targets``) from its
    own file; None when none does, the reasons in ``skipped``."""
    runtimes = {b.runtime for b in backends if b.device == "cpu"}
    loaders: dict[str, Loader] = {}
    origins: list[str] = []
    if ORT in runtimes:
        if run.onnx("dense").is_file():
            graph, origin = baseline_graph(run, tmp)
            loaders[ORT], origins = loader(graph), [origin]
        else:
            skipped["quantize-only baseline"] = f"no dense.onnx in {run.root} to quantize"
    for target in export_targets.load().values():
        runtime = {s.runtime for s in target.backends} & runtimes
        if target.baseline is None or not runtime:
            continue
        path, origin = target.baseline(run.root)
        if not path.is_file():
            skipped[f"{target.name} quantize-only baseline"] = f"no {path.name} in {run.root}"
            continue
        loaders |= {r: loader(path, target.runner) for r in runtime}
        origins.append(f"{target.name}: {origin}")
    return (loaders, "; ".join(origins)) if loaders else None
