"""onnxruntime-genai folders, one registered target: a decoder's dense and pruned models as genai folders
(``dense-genai/``, ``pruned-genai/``: the decode-step graph with its key/value cache, its genai_config.json and the
tokenizer), each verified by generating with it against ``transformers`` (``genai.write_genai_folder``). Automatic:
written for every decoder, never for an image model or an encoder.

A decoder's runtime is its genai folder, timed token by token by ``bench.decode``'s own backends (``genai-cpu-fp32``,
``genai-cpu-int4``), not by the image and encoder loop: this target brings no ``BenchSpec``. Its INT4 folders
(``--precision int4``) are ``exporters.int4``'s.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from corp_deploy.base.fsio import atomic_dir
from corp_deploy.base.steps import each
from corp_deploy.exporters.targets import Job, Target, register
from corp_deploy.formats.precisions import FP32, INT4
from corp_deploy.formats.run_folder import ARTIFACT, GENAI_SUFFIX, INT4_SUFFIX, genai_name

GENAI = "genai"
LOAD = "onnxruntime_genai.Model({p})"


def write(job: Job) -> list[dict[str, Any]]:
    """Every model's verified genai folder, for a decoder (options: ``decoder``, ``opset``, ``graph``, and
    ``folders``: each stem's ``transformers`` folder on disk, which genai's builder reads instead of a copy); each
    folder appears whole or not at all. The model is let go (``Job.free``) once its references are computed, so the
    builder, onnxruntime and genai run without it. Returns each folder's brief for ``export.json``
    (``pipeline.genai_brief``, its ``file`` the folder's name); the folder's ``model.onnx.json`` holds the whole
    record."""
    from corp_deploy.exporters.genai import write_genai_folder
    from corp_deploy.exporters.pipeline import genai_brief

    o = job.options
    if not o.get("decoder"):
        return []
    briefs = []
    with job.step(f"genai folders ({', '.join(job.stems)})"):
        for stem in each("genai folder", [(genai_name(s), s) for s in job.models], job.say):
            model, description = job.models[stem]  # read now: ``pipeline.OneAtATime`` holds one at a time
            with atomic_dir(job.out / genai_name(stem)) as folder:
                record = write_genai_folder(
                    model,
                    folder,
                    description,
                    job.out / ARTIFACT,
                    o["opset"],
                    None,
                    job.opts.fp32,
                    graph=o["graph"],
                    source=o.get("folders", {}).get(stem),
                    free=job.free,
                    again=functools.partial(_model, job, stem),
                    say=job.say,
                )
            briefs.append({"file": genai_name(stem), **genai_brief(record)})
            if line := filled(record, genai_name(stem)):
                job.say(line)
    return briefs


def _model(job: Job, stem: str) -> Any:
    return job.models[stem][0]


def filled(record: dict[str, Any], name: str) -> str:
    """The line, said as it happens, on the special token ids a genai folder took from elsewhere than its model's
    config ("" when none)."""
    return f"{name}: special token ids: {record['special_ids_filled']}" if record.get("special_ids_filled") else ""


def _runner(path: Path, threads: int | None):
    from corp_deploy.exporters.runners import OrtRunner

    return OrtRunner(path, "cpu", threads)  # its decode-step graph alone; generation is bench.decode's


def _file_name(stem: str, precision: str) -> str:
    return genai_name(stem, int4=precision == INT4.name)


register(
    Target(
        name=GENAI,
        what="onnxruntime-genai folders of a decoder, verified by generating against transformers",
        precisions=(FP32.name, INT4.name),
        file_name=_file_name,
        write=write,
        runner=_runner,
        modules=("onnxruntime_genai",),
        files=(
            (f"*{GENAI_SUFFIX}{INT4_SUFFIX}/", "onnxruntime-genai folder, INT4 weights (MatMulNBits)", LOAD),
            (f"*{GENAI_SUFFIX}/", "onnxruntime-genai folder (FP32 decode-step graph)", LOAD),
        ),
        automatic=True,
        record=GENAI,
        by_file=True,
        step=None,
    )
)
