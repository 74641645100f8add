"""TensorRT and TensorRT-RTX engines, one registered target: an engine per model and precision from its verified
ONNX graph, checked against onnxruntime on that graph where this machine can run it, else recorded as built only
(``pipeline.engine_verified``: nothing claims a verification that did not run). Automatic: built wherever a flavour
can build them, named in ``--targets`` or not; the reason recorded (``engines_skipped``) where none can.

Its option group is the engine builder's (``--batch-range`` ... ``--compute-capability``); its bench backends are
``tensorrt-fp32``, ``tensorrt-fp16`` and ``tensorrt-int8`` on the GPU.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from corp_deploy.base.errors import CorpError
from corp_deploy.exporters.onnx_export import load_onnx, read_metadata
from corp_deploy.exporters.targets import TENSORRT, BenchSpec, Job, Option, Target, register
from corp_deploy.exporters.tensorrt_engine import (
    PRECISIONS,
    RTX_DEFAULT_TARGETS,
    RUNTIMES,
    TEXT_ENGINES,
    BuildOptions,
    build_missing,
    run_missing,
)
from corp_deploy.formats.precisions import INT8
from corp_deploy.formats.run_folder import engine_name, onnx_name

OPTIONS = (
    Option("--batch-range", "Engine batch range MIN:OPT:MAX.", "1:32:256", key="batch"),
    Option(
        "--seq-range",
        "Text encoders: the engine's tokens-per-sequence range [1:SEQ:SEQ, SEQ the graph's sequence length: "
        "export --seq-len].",
        metavar="MIN:OPT:MAX",
    ),
    Option("--workspace-gib", "TensorRT workspace limit.", 8.0),
    Option("--opt-level", "TensorRT builder optimization level 0..5.", 3),
    Option("--tf32", "Allow TF32 in FP32 engines (off: exact FP32).", is_flag=True),
    Option("--timing-cache", "Timing cache file [per GPU, ~/.cache].", type=Path),
    Option(
        "--runtime",
        "Engine flavour; auto: TensorRT with a CUDA GPU, else TensorRT-RTX (builds without a GPU).",
        "auto",
        type=RUNTIMES,
    ),
    Option(
        "--compute-capability",
        "TensorRT-RTX target GPUs, e.g. 8.9 (RTX 4090) or 7.5 (Turing) [" + ",".join(RTX_DEFAULT_TARGETS) + "].",
        metavar="CC[,CC]",
    ),
)
"""The engine builder's flags, as data (``cli.export_options.engine_group`` makes them click options)."""


def write(job: Job) -> list[dict[str, Any]]:
    """An engine per model and precision of ``job`` (options: ``build``, the ``BuildOptions``; ``require``, fail
    where none can be built; ``skip``, a reason to build none, e.g. a decoder's), or the reason none is built."""
    from corp_deploy.exporters.pipeline import engine_verified

    build: BuildOptions = job.options.get("build") or BuildOptions()
    reason = job.options.get("skip") or build_missing(build)
    if reason:
        if job.options.get("require"):
            raise CorpError(f"--require-engines: cannot build TensorRT engines here: {reason}")
        job.skip(reason)
        return []
    precisions = [p for p in job.precisions if p in PRECISIONS]
    if INT8.name in precisions and (not_qdq := _not_qdq(job.out, job.stems)):
        precisions.remove(INT8.name)
        job.skip(
            f"int8: {not_qdq}; TensorRT builds INT8 from Q/DQ graphs only: `corp-deploy quantize {job.out} "
            "--int8-recipe static` writes them, then `corp-deploy build-engine GRAPH --precision int8`"
        )
    records = []
    with job.step("TensorRT engines"):
        for precision in precisions:
            for stem in job.stems:
                source, engine = job.out / onnx_name(stem, precision), job.out / engine_name(stem, precision)
                options = replace(build, precision=precision)
                records.append({"file": engine.name, **engine_verified(source, engine, options, job.opts)})
    return records


def _not_qdq(out: Path, stems: tuple[str, ...]) -> str:
    """Which INT8 graphs of ``out`` an engine cannot be built from (their recipe is not Q/DQ), and why; '' if none."""
    recipes = {stem: read_metadata(load_onnx(out / onnx_name(stem, INT8.name), weights=False)) for stem in stems}
    return ", ".join(
        f"{stem}.int8.onnx is {meta.get('int8_recipe', {}).get('chosen', 'not Q/DQ')} (the fastest passing recipe)"
        for stem, meta in recipes.items()
        if meta.get("int8_scheme", {}).get("format") != "QDQ"
    )


def _runner(path: Path, threads: int | None):
    from corp_deploy.exporters.tensorrt_engine import TrtRunner

    return TrtRunner(path)


register(
    Target(
        name=TENSORRT,
        what="TensorRT / TensorRT-RTX engines, verified against onnxruntime where this machine runs them",
        precisions=PRECISIONS,
        file_name=engine_name,
        write=write,
        runner=_runner,
        backends=tuple(
            BenchSpec(f"tensorrt-{p}", TENSORRT, "cuda", p, equal_heads=True, ready=run_missing) for p in PRECISIONS
        ),
        files=(
            (
                "*.plan",
                "TensorRT engine (its .json: the build and its check)",
                "corp-deploy bench <this folder> (TensorRT's runtime)",
            ),
        ),
        options=OPTIONS,
        automatic=True,
        record="engines",
        step=None,
        made_by=lambda root, precision: f"prune-export --precision {precision}",
        text=TEXT_ENGINES,
    )
)
