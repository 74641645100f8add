"""Export steps with verification built in: each writes a file only if it matches its reference.

- ``export_verified``: PyTorch -> ONNX, checked against PyTorch with onnxruntime;
- ``convert_verified``: FP32 ONNX -> FP16 ONNX, checked against the FP32 graph;
- ``engine_verified``: ONNX -> TensorRT or TensorRT-RTX engine, checked against onnxruntime on the same
  graph where this machine can run it, else recorded as built only;
- ``export_run``: all of it for a dense and a pruned model, as ``prune-export`` writes it, and
  ``write_export_record`` its ``export.json``;
- ``fp16_graph``: the FP16 copy an engine build needs, reused while its FP32 source is unchanged.

Every ONNX file gets a ``<file>.json`` sidecar holding its verification record; engines get theirs
from ``tensorrt_engine``. Callers stage the outputs (``corp_deploy.base.fsio.staged``/``atomic_dir``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from torch import nn

from corp_deploy.base.env import describe_cpu, exact_fp32
from corp_deploy.base.errors import CorpError, first_line
from corp_deploy.base.fsio import atomic_file, staged
from corp_deploy.base.tables import text_table
from corp_deploy.exporters.compare import (
    FP16,
    FP32,
    INT8,
    Inputs,
    Tolerance,
    check,
    image_inputs,
    summary,
    text_inputs,
    verify,
)
from corp_deploy.exporters.fp16 import convert_fp16
from corp_deploy.exporters.int4 import int4_baseline, int4_speed
from corp_deploy.exporters.onnx_export import (
    DEFAULT_OPSET,
    check_opset,
    export_onnx,
    input_shape,
    load_onnx,
    onnx_bytes,
    onnx_files,
    onnx_sha256,
    read_metadata,
)
from corp_deploy.exporters.rewrites import rewritten
from corp_deploy.exporters.runners import Memo, OrtRunner, TorchRunner
from corp_deploy.exporters.targets import ONNX, TENSORRT, Job, Target, load
from corp_deploy.exporters.tensorrt_engine import (
    TEXT_ENGINES,
    VERIFIED,
    BuildOptions,
    TrtRunner,
    build_engine,
)
from corp_deploy.exporters.text_onnx import export_text_onnx, graph
from corp_deploy.formats.run_folder import (
    BASELINE_GENAI,
    RECORD,
    genai_name,
    read_sidecar,
    write_sidecar,
)


@dataclass(frozen=True)
class VerifyOptions:
    """Where and how strictly outputs are compared; two or more batch sizes test the dynamic axis."""

    batches: tuple[int, ...] = (1, 4)
    fp32: Tolerance = FP32
    fp16: Tolerance = FP16
    int8: Tolerance = INT8
    seed: int = 0

    def __post_init__(self) -> None:
        if len(set(self.batches)) < 2 or min(self.batches) < 1:
            raise CorpError(f"verify batches must be two or more batch sizes >= 1 (e.g. 1,4), got {self.batches}")


TEXT = "text"
"""The ``modality`` a text encoder's description (and graph metadata) records; images record none."""


def is_text(meta: dict[str, Any]) -> bool:
    """Whether a description or a graph's metadata is a text encoder's."""
    return meta.get("modality") == TEXT


def graph_inputs(proto, seed: int = 0) -> Inputs:
    """The verification inputs of an ONNX graph: token ids with padding for a text encoder (from its
    metadata), else random images of its input shape."""
    meta = read_metadata(proto)
    return described_inputs(meta if is_text(meta) else {"input_size": input_shape(proto)}, seed)


def described_inputs(description: dict[str, Any], seed: int = 0) -> Inputs:
    """``graph_inputs`` of the graph a model of ``description`` (``sources.describe``) exports to, known before the
    graph is written: its metadata is the description."""
    if is_text(description):
        return text_inputs(description["vocab_size"], description["max_positions"], seed)
    return image_inputs(tuple(description["input_size"]), seed)


def _verified(reference, candidate, inputs: Inputs, opts: VerifyOptions, tol: Tolerance, what: str) -> dict:
    comparisons = verify(reference, candidate, inputs, opts.batches)
    check(comparisons, tol, what)
    return {"reference": reference.name, "runtime": candidate.name, **summary(comparisons), "tolerance": asdict(tol)}


def export_verified(
    model: nn.Module,
    path: Path,
    description: dict[str, Any],
    opset: int = DEFAULT_OPSET,
    simplify: bool = False,
    opts: VerifyOptions = VerifyOptions(),
    rewrites: Sequence[str] = (),
    free: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Export ``model`` to ``path`` and check it against PyTorch on the CPU; return its record.

    ``rewrites`` (``exporters.rewrites``) are applied to the exported copy where exact; the check compares it
    with ``model`` as given, so a rewrite that changed the function would fail here, and the record lists them.
    A text model (``description`` from ``sources.describe``) takes ``input_ids`` and ``attention_mask`` with
    dynamic batch and sequence (``text_onnx``: an encoder's last hidden state, a decoder's logits) and is
    checked at untraced shapes with padding.

    PyTorch's outputs on the verification inputs are computed first and kept (``runners.Memo``), then the graph is
    written, then ``free`` lets go of the model (``targets.Job.free``) before onnxruntime opens the graph: the model
    and the session are never resident together (a 1.7B decoder's 6.8 GB twice would not fit in 10 GB). The inputs,
    the tolerances and the record are the same as when both were held.
    """
    text = is_text(description)
    if text and simplify:
        raise CorpError("--simplify is for image graphs; export text encoders without it")
    check_opset(opset)
    reference = Memo(TorchRunner(graph(model)[0] if text else model))
    inputs = described_inputs(description, opts.seed)
    with exact_fp32():
        for batch in opts.batches:
            reference(inputs(batch))  # kept: the check below reads these, not the model
    start = time.perf_counter()
    deployed, applied = rewritten(model, rewrites)
    metadata = {**description, "precision": "fp32", "rewrites": list(applied)}
    if text:
        export_text_onnx(deployed, path, opset, metadata)
    else:
        export_onnx(deployed, path, tuple(description["input_size"]), opset, simplify, metadata)
    seconds = time.perf_counter() - start
    del deployed  # a rewritten copy goes now; the model itself goes with ``free``
    free()
    proto = load_onnx(path, weights=False)  # once: a traced decoder's weights are inside, seconds to parse
    lean = len(onnx_files(path, proto)) > 1  # weights in a .data file: a big graph, checked at one copy
    check_ = _verified(reference, OrtRunner(path, "cpu", lean=lean), inputs, opts, opts.fp32, f"ONNX {path.name}")
    record = {
        "file": path.name,
        "precision": "fp32",
        "opset": opset,
        "simplified": simplify,
        "rewrites": list(applied),
        "bytes": onnx_bytes(path, proto),
        "seconds": round(seconds, 2),
        "verify": check_,
        **description,
    }
    write_sidecar(path, record)
    return record


def convert_verified(src: Path, path: Path, opts: VerifyOptions = VerifyOptions()) -> dict[str, Any]:
    """FP16 copy of ``src`` at ``path``, checked against ``src`` in onnxruntime on the CPU."""
    proto = load_onnx(src, weights=False)
    start = time.perf_counter()
    convert_fp16(src, path)
    seconds = time.perf_counter() - start
    runners = OrtRunner(src, "cpu"), OrtRunner(path, "cpu")
    check_ = _verified(*runners, graph_inputs(proto, opts.seed), opts, opts.fp16, f"FP16 ONNX {path.name}")
    check_["reference"] = f"{src.name} ({check_['reference']})"
    record = {**read_metadata(proto), "file": path.name, "precision": "fp16", "bytes": onnx_bytes(path)}
    record |= {
        "seconds": round(seconds, 2),
        "verify": check_,
        "converted_from": src.name,
        "source_sha256": onnx_sha256(src),
    }
    write_sidecar(path, record)
    return record


def engine_verified(
    onnx_path: Path, out: Path, options: BuildOptions, opts: VerifyOptions = VerifyOptions(), overwrite: bool = False
) -> dict[str, Any]:
    """Build an engine; where this machine can run it, check it against onnxruntime on its own graph.

    Elsewhere (TensorRT-RTX builds ahead of time on machines without a supported GPU) the record
    says "built only" and why: nothing claims a verification that did not run. Text engines are
    built only everywhere (``TEXT_ENGINES``).
    """
    options.profile.covers(opts.batches)
    tol = {"fp32": opts.fp16 if options.tf32 else opts.fp32, "fp16": opts.fp16, "int8": opts.int8}[options.precision]
    proto = load_onnx(onnx_path, weights=False)
    if is_text(read_metadata(proto)):
        return build_engine(onnx_path, out, options, overwrite=overwrite, unchecked=TEXT_ENGINES)

    def check_engine(engine: Path) -> dict:
        runner = TrtRunner(engine, onnx=onnx_path)  # still staged: name its graph for the staleness check
        what = f"{runner.label} {options.precision} engine {out.name}"
        return _verified(OrtRunner(onnx_path), runner, graph_inputs(proto, opts.seed), opts, tol, what)

    return build_engine(onnx_path, out, options, overwrite=overwrite, check=check_engine)


def fp16_graph(src: Path, half: Path, opts: VerifyOptions, say: Callable[[str], None] = print) -> Path:
    """``half`` if it was converted from the current ``src`` (its sidecar says so), else a fresh verified conversion."""
    try:
        if read_sidecar(half)["source_sha256"] == onnx_sha256(src):
            say(f"using {half} (converted from the current {src.name})")
            return half
    except KeyError:
        pass
    with staged(half, overwrite=True) as stage:
        record = convert_verified(src, stage / half.name, opts)
    say(f"converted {src.name} -> {half.name}: cosine {record['verify']['cosine']:.6f} vs FP32")
    return half


class OneAtATime(Mapping[str, tuple[nn.Module, dict[str, Any]]]):
    """Stem -> (model, description), each model read when asked for and the one asked for before it freed first: a
    run holds one model at a time (the 1.7B shape's dense and pruned float32 weights together are 11.8 GB, beside
    the exporters' own copies). Freeing moves the model's tensors to the meta device, so a reference kept elsewhere
    (a loop's variable, the prune's result) holds no memory; asked for again, a model is read again by its reader.
    ``export_run``'s models, for a decoder of a ``transformers`` folder (a timm model stays a plain dict: both are
    small, and the dense one has no file to be read again from)."""

    def __init__(
        self,
        readers: Mapping[str, Callable[[], tuple[nn.Module, dict[str, Any]]]],
        held: tuple[str, tuple[nn.Module, dict[str, Any]]] | None = None,
    ) -> None:
        """``held``: (stem, (model, description)) already in memory (the prune's result), freed as any other."""
        self._readers = dict(readers)
        self._held = held

    def __getitem__(self, stem: str) -> tuple[nn.Module, dict[str, Any]]:
        if self._held is not None and self._held[0] == stem:
            return self._held[1]
        reader = self._readers[stem]  # an unknown stem fails before anything is freed
        self.free()
        self._held = stem, reader()
        return self._held[1]

    def free(self) -> None:
        """Let go of the model held, if any, its tensors on the meta device."""
        if self._held is not None:
            self._held[1][0].to("meta")
            self._held = None

    def __iter__(self) -> Iterator[str]:
        return iter(self._readers)

    def __len__(self) -> int:
        return len(self._readers)


def export_run(
    models: Mapping[str, tuple[nn.Module, dict[str, Any]]],
    out: Path,
    precisions: Sequence[str] = ("fp32", "fp16"),
    opset: int = DEFAULT_OPSET,
    simplify: bool = False,
    opts: VerifyOptions = VerifyOptions(),
    build: BuildOptions | None = None,
    require_engines: bool = False,
    quantize: Callable[[list[tuple[Path, Path]]], list[dict[str, Any]]] | None = None,
    rewrites: Sequence[str] = (),
    no_engines: str | None = None,
    step: Callable[[str], AbstractContextManager] = lambda what: nullcontext(),
    say: Callable[[str], None] = lambda line: None,
    targets: Sequence[Target] = (),
    data: Callable[[Any], Any] | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """Every registered export target (``exporters.targets``) this run writes, in the registry's order: ONNX first
    (FP16 and INT8 too when asked; the others convert from its verified FP32 graphs), those in ``targets`` and the
    automatic ones (TensorRT engines per model and precision, unless ``no_engines`` says why not, recorded as the
    skip reason). Each target's records go to its key of the record (``onnx``, ``engines``), else to
    ``record["targets"][name]``; why it wrote nothing or less to ``<key>_skipped`` (``targets_skipped[name]``).

    ``models`` maps a stem (``dense``, ``pruned``) to (model, description), read by a target as it needs each
    (``OneAtATime``: one held at a time). ``rewrites`` go into every model's graph
    alike (``export_verified``), so dense and pruned stay comparable. ``quantize`` turns (FP32 graph, INT8 file)
    pairs into verified INT8 graphs (``int8_recipes.quantize_graphs`` bound to calibration images); INT8 engines need
    it. Engines are skipped, with the reason recorded, where no TensorRT flavour can build them, unless
    ``require_engines``. ``data`` (graph -> its calibration and held-out inputs) is what a target's INT8 reads;
    ``options`` each target's option group values, by target name.

    Every file is staged on its own into ``out`` (an existing folder), so a run that stops keeps each file that
    finished, whole; ``step`` wraps each phase (``corp_deploy.base.steps.Steps``: it announces, times, and turns a stop
    into one line); ``say`` gets a line as each model's export starts, with the time the rest should take
    (``corp_deploy.base.steps.each``: a decoder's graph is minutes of tracing).
    """
    if "int8" in precisions and quantize is None:
        raise CorpError("INT8 engines are built from INT8 Q/DQ graphs: quantize with calibration images first")
    given = {
        ONNX: {"opset": opset, "simplify": simplify, "rewrites": rewrites, "quantize": quantize},
        TENSORRT: {"build": build, "require": require_engines, "skip": no_engines},
    }
    record: dict[str, Any] = {"onnx": [], "engines": [], "engines_skipped": None}
    named = {t.name for t in targets}
    for target in load().values():
        if target.name == ONNX or target.name in named or target.automatic:
            values = {**given.get(target.name, {}), **(options or {}).get(target.name, {})}
            job = Job(out, tuple(models), tuple(precisions), opts, data, values, say, models, step)
            _write(target, job, record)
    return record


def _write(target: Target, job: Job, record: dict[str, Any]) -> None:
    """``target``'s files of ``job`` (announced as its step, unless it announces its own phases), its records and
    any skip reason into ``record``."""
    skipped: list[str] = []
    job = replace(job, skip=skipped.append)
    with nullcontext() if target.step is None else job.step(target.step or f"{target.name}: {target.what}"):
        written = target.write(job)
    if target.record is None:
        record.setdefault("targets", {})[target.name] = written
    elif target.by_file and written:
        record[target.record] = {r.pop("file"): r for r in written}
    elif written or target.record in record:
        record[target.record] = record.get(target.record, []) + written
    if skipped and target.record is None:
        record.setdefault("targets_skipped", {})[target.name] = "; ".join(skipped)
    elif skipped:
        record[f"{target.record}_skipped"] = "; ".join(skipped)


def write_export_record(
    out: Path, model: str, report: dict[str, Any], record: dict[str, Any], versions: dict[str, Any]
) -> dict[str, Any]:
    """``out/export.json``: the model, its prune config, sizes and recovery if any (from the prune ``report``: the
    pruned graphs hold the recovered weights), ``export_run``'s record and the library versions; returns it."""
    sizes = {k: {m: report[k][m] for m in ("params", "macs")} for k in ("dense", "pruned")}
    recovered = {"recovery": report["recovery"]} if "recovery" in report else {}
    record = {"model": model, "prune_config": report["config"], **recovered, "size": sizes, **record}
    record["versions"] = versions
    with atomic_file(out / RECORD, overwrite=True) as tmp:  # last: a run folder with it is whole
        tmp.write_text(json.dumps(record, indent=2) + "\n")
    return record


def record_quantized(
    out: Path, onnx: Sequence[dict[str, Any]] = (), int4: list[dict[str, Any]] | None = None
) -> dict[str, Any] | None:
    """``out/export.json`` after ``quantize`` wrote into the run folder: its INT8 graphs' records replace those of the
    same files (or join them), an INT4 run's ``int4`` is replaced; the updated record, or None when ``out`` has no
    export.json (a lone graph's folder)."""
    if not (out / RECORD).is_file():
        return None
    record = json.loads((out / RECORD).read_text())
    files = {r["file"] for r in onnx}
    record["onnx"] = [r for r in record.get("onnx", []) if r["file"] not in files] + list(onnx)
    if int4 is not None:
        record["int4"] = int4
    with atomic_file(out / RECORD, overwrite=True) as tmp:
        tmp.write_text(json.dumps(record, indent=2) + "\n")
    return record


def genai_brief(record: dict[str, Any]) -> dict[str, Any]:
    """A genai folder's checks and cache layout, for ``export.json`` (its ``model.onnx.json`` has it all)."""
    genai_ = record["genai"]
    equal = all(p["genai_equal"] for p in genai_["prompts"])
    checks = {"runtime": genai_["runtime"], "prompts": len(genai_["prompts"]), "new_tokens": genai_["new_tokens"]}
    brief = {"verify": record["verify"], "genai": {**checks, "tokens_equal": equal}, "kv_cache": record["kv_cache"]}
    return brief | {k: record[k] for k in ("writer", "why_not_fused") if k in record}


def decoder_int4_baseline(
    run_dir: Path, folders: list[str], windows, tol, source, info: dict[str, Any]
) -> dict[str, Any]:
    """The decoder's quantize-only baseline (genai's builder ``-p int4`` of the dense model, gated) and its decode
    speed beside the INT4 ``folders``, interleaved in one run: ``export.json``'s ``int4_baseline`` and
    ``int4_speed``. A model the builder does not take leaves the reason instead."""
    try:
        dense = run_dir / genai_name("dense")
        baseline = int4_baseline(dense, run_dir / BASELINE_GENAI, windows, tol, source, info)
    except CorpError as e:
        return {"int4_baseline": {"error": first_line(e)}}
    return {"int4_baseline": baseline, "int4_speed": int4_speed(run_dir, [*folders, BASELINE_GENAI])}


def format_summary(record: dict[str, Any], params: dict[str, int] | None = None) -> str:
    """What ``prune-export`` prints: the ONNX files and every export target's (``record["targets"]``) with their
    verification, then the engines."""
    params = params or {}
    files = [*record["onnx"], *(r for written in record.get("targets", {}).values() for r in written)]
    rows = [("file", "precision", "MB", "params", "reference", "runtime", "max-abs", "cosine", "top-1", "seconds")]
    timed = any("speed" in r for r in record["onnx"])
    rows[0] += ("p50 ms", "vs quantize-only") if timed else ()
    for r in files:
        v, stem = r["verify"], r["file"].split(".")[0]
        rows.append(
            (
                r["file"] + (" (quantize-only baseline)" if "int8_baseline" in r else ""),
                r["precision"],
                f"{r['bytes'] / 2**20:.1f}",
                _millions(params.get(stem)),
                v["reference"],
                v["runtime"],
                f"{v['max_abs']:.2e}",
                f"{v['cosine']:.7f}",
                f"{v['top1']:.2f}",
                f"{r['seconds']:.1f}",
            )
            + (_speed(r.get("speed")) if timed else ())
        )
    lines = [text_table(rows)] if files else []
    if flipped := [r["file"] for r in files if r["verify"]["top1"] < 1]:  # beside a passing cosine
        lines.append(
            f"top-1 below 1.00 ({', '.join(flipped)}): the worst batch's share of samples whose largest output kept "
            "its place; near-tied outputs (random weights) swap under harmless rounding, so it is reported, never "
            "gated: cosine and max-abs are the checks"
        )
    if timed:
        speed = next(r["speed"] for r in record["onnx"] if "speed" in r)
        lines.append(
            f"p50: {speed['runtime']}, {speed['shape']}, {describe_cpu(speed['cpu'])}, every graph interleaved in one "
            "run: " + ", ".join(f"{name} {ms:.1f} ms" for name, ms in speed["graphs_p50_ms"].items())
        )
    if rewritten_graphs := [f"{r['file']} ({', '.join(r['rewrites'])})" for r in record["onnx"] if r.get("rewrites")]:
        lines.append(f"exact rewrites (verified above): {'; '.join(rewritten_graphs)}")
    if record["engines"]:
        lines.append(format_engines(record["engines"]))
    if record["engines_skipped"]:
        lines.append(f"TensorRT engines skipped: {record['engines_skipped']}")
    return "\n".join(lines)


def format_engines(engines: Sequence[dict[str, Any]]) -> str:
    """One row per engine: flavour, targets, size, build time, fused attention, verified or built only."""
    rows = [("engine", "precision", "flavour", "targets", "MB", "build s", "fused attention", "status")]
    for r in engines:
        a = r["attention"]
        fused = "unknown" if a["fused_mha_layers"] is None else f"{a['fused_mha_layers']}/{a['blocks'] or '?'} blocks"
        v = r["verify"]
        status = f"verified: cosine {v['cosine']:.7f}, max-abs {v['max_abs']:.2e}" if v else "built, not executed"
        rows.append(
            (
                r["file"],
                r["precision"] + (" (tf32)" if r["tf32"] else ""),
                f"{r['flavour']} {r['version']}",
                ",".join(r["targets"]),
                f"{r['engine_bytes'] / 2**20:.1f}",
                f"{r['build_seconds']:.1f}",
                fused,
                status,
            )
        )
    notes = sorted({r["status"] for r in engines if r["status"] != VERIFIED})
    return "\n".join([text_table(rows), *(f"engines {note}" for note in notes)])


def _speed(speed: dict[str, Any] | None) -> tuple[str, str]:
    """An INT8 graph's p50 and its speed against the quantize-only baseline (``int8_recipes.int8_speed``)."""
    if speed is None:
        return "", ""
    return f"{speed['p50_ms']:.1f}", f"{speed['vs_baseline']:.2f}x" if speed["vs_baseline"] else ""


def _millions(n: int | None) -> str:
    return "" if n is None else f"{n / 1e6:.2f}M"
