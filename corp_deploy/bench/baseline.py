"""The quantize-only baseline in ``bench``: what a user gets without pruning, timed beside dense and pruned.

The dense graph quantized by onnxruntime's own one line (``int8_recipes.BASELINE_WHAT``) is the alternative pruning
has to beat. ``bench`` times it in the same interleaved loop as dense and pruned on every onnxruntime CPU backend
(so each precision's row shows it, measured in the same run), from the run folder's ``baseline.int8.onnx``
(``prune-export --int8``, ``quantize``) or, where the folder has none, quantized from its ``dense.onnx`` into a
temporary folder (seconds). ``bench --gate quantize-only`` holds pruned INT8 to it (``gate.against_quantize_only``).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from corp_deploy.base.timing import Step
from corp_deploy.bench.backends import Backend, RunFolder, cpu_step, inputs_for
from corp_deploy.exporters.int8_recipes import BASELINE_WHAT, dynamic_int8
from corp_deploy.exporters.onnx_export import onnx_files
from corp_deploy.formats.run_folder import BASELINE

Loader = Callable[[RunFolder, str, bool, "int | None"], Callable[[int], Step]]


def runs_beside(backend: Backend) -> bool:
    """Whether the baseline is timed in ``backend``'s loop: it is an onnxruntime CPU graph."""
    return backend.runtime == "onnxruntime" and backend.device == "cpu"


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


def loader(path: Path) -> Loader:
    """A backend loader for the baseline graph on onnxruntime's CPU provider, on ``run``'s inputs."""

    def load(run: RunFolder, which: str, include_copies: bool, threads: int | None) -> Callable[[int], Step]:
        from corp_deploy.exporters.runners import OrtRunner

        runner = OrtRunner(path, "cpu", threads)

        def at(batch: int) -> Step:
            x = inputs_for(run, batch)
            return cpu_step(lambda: runner(x))

        return at

    return load


def quantize_only_baseline(run: RunFolder, backends: list[Backend], tmp: Path, skipped: dict[str, str]) -> tuple | None:
    """(the quantize-only baseline's loader, where its graph came from) when an onnxruntime CPU backend runs and the
    run folder has dense.onnx; else None, the reason in ``skipped``."""
    if not any(runs_beside(b) for b in backends):
        return None
    if not run.onnx("dense").is_file():
        skipped["quantize-only baseline"] = f"no dense.onnx in {run.root} to quantize"
        return None
    graph, origin = baseline_graph(run, tmp)
    return loader(graph), origin
