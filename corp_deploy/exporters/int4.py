"""A decoder's INT4 weights: candidate recipes, each gated, the fastest passing one chosen; the INT4 genai folders.

Two quantizers can write a decoder's INT4 decode step. onnxruntime-genai's model builder (``-p int4``: what a user
gets from the runtime without corp-deploy) rewrites the model from its prune artifact, the same folder the fused FP32
graph is built from (``exporters.fused_decoder``), with one of its weight-only algorithms (``RECIPES``). The
project's quantizer (``exporters.int4_quant``, ``Scheme``) rewrites the FP32 graph: its ``minmax`` reproduces a
GGUF Q4_1 grid exactly, which round to nearest cannot, but pays for its float offsets with small nodes every step.
Which one passes depends on the checkpoint (a dequantized GGUF sits on Q4_1's grid) and which one is fastest on the
graph and the CPU, so ``--int4-method auto`` builds each candidate, gates each against the FP32 graph
(``exporters.int4_gate``), times those that pass in onnxruntime-genai (decode ms/token at batch 1, the candidates
interleaved) and keeps the fastest. The folder's sidecar records every candidate's gate figures and timing, the
CPU's flags, and why the chosen one won; nothing is written when none passes.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from corp_deploy.base.deps import require
from corp_deploy.base.env import cpu_features
from corp_deploy.base.errors import CorpError
from corp_deploy.base.fsio import check_writable, staged
from corp_deploy.base.steps import each, phases
from corp_deploy.base.tables import text_table
from corp_deploy.base.timing import Method, interleaved
from corp_deploy.exporters.int4_gate import INT4, DecoderTolerance, compare_decoders, gate_words, scores
from corp_deploy.exporters.int4_quant import (
    QUANTIZED_OP,
    Scheme,
    decoder_graph,
    needs_calibration,
    quantize_int4,
    quiet,
)
from corp_deploy.exporters.onnx_export import load_onnx, onnx_bytes, onnx_sha256, read_metadata
from corp_deploy.formats.run_folder import BASELINE_GENAI, read_sidecar, write_sidecar

BASELINE_RECIPE = "builder"


@dataclass(frozen=True)
class Recipe:
    """One of genai's builder int4 recipes."""

    options: dict[str, str]
    """Its ``--extra_options`` (``block_size`` and ``accuracy_level`` come from the scheme)."""
    lm_head: str
    what: str


RECIPES = {
    "builder": Recipe(
        {},
        "int4",
        "onnxruntime-genai's builder -p int4 as shipped: round to nearest, symmetric, every MatMul (the LM head "
        "too) in 4 bits",
    ),
    "builder-asym": Recipe(
        {"is_symmetric": "false"}, "int4", "the builder's round to nearest with a uint4 zero point per block"
    ),
    "builder-k_quant_mixed": Recipe(
        {"algo_config": "k_quant_mixed"},
        "int8",
        "the builder's k-quant (llama.cpp's search of scale and zero point), the LM head and llama.cpp's sensitive "
        "layers (first and last eighth, every third qkv/v/down) in 8 bits",
    ),
}
DEFAULT_SCHEME = Scheme()
AUTO = "auto"
"""``--int4-method auto``: every builder recipe and the project's scheme, the fastest passing one chosen."""
AUTO_MAX_BYTES = 2**31
"""FP32 decode-step graphs from this size on (external data: the 1.7B shape's 6.8 GB) get the project's scheme alone
under ``auto``: each builder recipe reads the model and rebuilds it through genai's builder (a model's copy and minutes
each at that size), and the gate runs every candidate on every window; ``--int4-method`` still names any one."""
Timer = Callable[[dict[str, Path]], dict[str, float]]
"""Genai folders by name -> decode ms/token by name."""


class BuilderInput(NamedTuple):
    """What the builder reads for a model: its ``transformers`` ``folder`` on disk (the builder loads it itself),
    else the model, read by ``read`` only when a builder recipe runs (a decoder's run holds one model at a time:
    ``pipeline.OneAtATime``) and written as its prune artifact first; its ``tokenizer`` files."""

    read: Callable[[], Any]
    tokenizer: Sequence[Path]
    folder: Path | None = None


def recipes(method: str, scheme: Scheme) -> tuple[str, ...]:
    """The candidates ``--int4-method`` names: one recipe forced, or under ``auto`` every builder recipe and the
    project's ``scheme`` (its own method)."""
    if method == AUTO:
        return (*RECIPES, scheme.method)
    if method not in RECIPES and method != scheme.method:
        raise CorpError(f"--int4-method must be {AUTO}, a builder recipe ({', '.join(RECIPES)}) or {scheme.method}")
    return (method,)


def builder_scheme(recipe: str, scheme: Scheme) -> dict[str, Any]:
    """The sidecar's ``int4_scheme`` for a builder recipe (the keys ``Scheme.describe`` writes)."""
    r = RECIPES[recipe]
    return {
        "format": f"{QUANTIZED_OP} (onnxruntime contrib op), weight only",
        "bits": 4,
        "method": recipe,
        "block_size": scheme.block_size,
        "symmetric": r.options.get("is_symmetric", "true") == "true",
        "accuracy_level": scheme.accuracy_level,
        "lm_head": r.lm_head,
        "quantizer": f"onnxruntime-genai model builder: {r.what}",
        "extra_options": builder_options(recipe, scheme),
    }


def builder_options(recipe: str, scheme: Scheme) -> list[str]:
    """The builder's ``--extra_options`` for ``recipe`` at the scheme's block size and accuracy level."""
    options = {
        "block_size": str(scheme.block_size),
        "accuracy_level": str(scheme.accuracy_level),
        **RECIPES[recipe].options,
    }
    return [f"{k}={v}" for k, v in options.items()]


def cpu_record() -> dict[str, Any]:
    """The CPU a timing is tied to: its model and the instruction sets MatMulNBits' kernels pick their path by."""
    cpu = cpu_features()
    return {"cpu": cpu["model"], "flags": cpu["flags"]}


TIMING_PROMPT = 32
TIMING_TOKENS = 16
"""Each candidate's timed session: a ``TIMING_PROMPT``-token prompt, then decode steps, a fresh prefill (untimed)
every ``TIMING_TOKENS``."""


TIMING = Method(warmup_iters=8, warmup_seconds=0.5, min_iters=48, min_seconds=1.5, round_iters=4)


def decode_ms(folders: dict[str, Path]) -> dict[str, float]:
    """Decode ms/token (the median step) of each genai folder at batch 1 in onnxruntime-genai on the CPU, the
    folders interleaved in rounds after a warm-up (``base.timing.interleaved``): the same-run comparison the
    choice rests on, not an absolute figure."""
    og = require("onnxruntime_genai", "timing INT4 candidates")
    from corp_deploy.base.timing import GenaiSession
    from corp_deploy.exporters.genai import CONFIG

    steps = {}
    for name, folder in folders.items():
        vocab = json.loads((folder / CONFIG).read_text())["model"]["vocab_size"]
        session = GenaiSession(og, og.Model(str(folder)), vocab, 1, TIMING_PROMPT, TIMING_TOKENS)
        steps[name] = session.decode
    times = interleaved(steps, TIMING)
    return {name: float(np.median(t)) * 1e3 for name, t in times.items()}


def calibration_record(calibration: np.ndarray, info: dict | None = None) -> dict[str, Any]:
    """What the sidecar says of the calibration windows: their count and length, a digest of their token ids (so
    a rerun can show it drew the same ones), and where they came from (``info``)."""
    ids = np.ascontiguousarray(calibration, dtype=np.int64)
    return {
        "windows": int(ids.shape[0]),
        "seq_len": int(ids.shape[1]),
        "ids_sha256": hashlib.sha256(ids).hexdigest(),
    } | (info or {})


def _refusal(out: Path, src: Path, outcomes: dict[str, dict], tol: DecoderTolerance, windows: int) -> str:
    """One line: every candidate's figures (or why it was not built), the bounds, what to try."""
    figures = ", ".join(
        f"{name} x{o['verify']['ppl_ratio']:.3f} / {o['verify']['agreement']:.3f}"
        if "verify" in o
        else f"{name} not built ({o['error']})"
        for name, o in outcomes.items()
    )
    return (
        f"INT4 ONNX {out.name} fails its gate against {src.name} on {windows} held-out windows (perplexity at most "
        f"x{tol.max_ppl_ratio}, top-1 agreement at least {tol.min_agreement}): {figures}; try --int4-method hqq, "
        "--int4-keep-float N, or keep FP32"
    )


def _record(src: Path, out: Path, verify: dict[str, Any], tol, windows, info, seconds: float) -> dict[str, Any]:
    """An INT4 graph's sidecar record: its metadata, size, and gate figures against ``src``."""
    meta = read_metadata(load_onnx(out, weights=False))
    verify = {"reference": src.name, "runtime": "onnxruntime CPUExecutionProvider", **verify}
    verify |= {"seq_len": int(windows.shape[1]), "tolerance": asdict(tol), **(info or {})}
    record = {**meta, "file": out.name, "bytes": onnx_bytes(out), "seconds": round(seconds, 2), "verify": verify}
    return record | {"quantized_from": src.name, "source_sha256": onnx_sha256(src)}


@dataclass(frozen=True)
class Int4Gate:
    """How an INT4 graph is made and gated: its ``scheme``, the held-out ``windows`` it is scored on against FP32
    within ``tol`` (``info`` describes them in the record), and the ``calibration`` windows drawn apart from them
    (GPTQ, ``keep_float``), described by ``calibration_info``."""

    windows: np.ndarray
    tol: DecoderTolerance
    scheme: Scheme
    info: dict | None = None
    calibration: np.ndarray | None = None
    calibration_info: dict | None = None

    @property
    def calibrated(self) -> np.ndarray | None:
        """The calibration windows where the scheme reads them, else None."""
        return self.calibration if self.scheme.calibrated else None

    def record(self, src: Path, out: Path, verify: dict[str, Any], seconds: float) -> dict[str, Any]:
        """The sidecar record of ``out`` gated against ``src`` (``verify``: its figures), its calibration named."""
        record = _record(src, out, verify, self.tol, self.windows, self.info, seconds)
        if self.scheme.calibrated:
            record["calibration"] = calibration_record(self.calibration, self.calibration_info)
        return record


def quantize_int4_verified(src: Path, out: Path, gate: Int4Gate) -> dict[str, Any]:
    """Quantize ``src`` to ``out``, score it against ``src`` on the gate's windows; return its record (also the
    sidecar).

    Raises one line (measured and allowed) when outside the gate's tolerance; callers stage ``out`` so nothing is left.
    """

    start = time.perf_counter()
    quantize_int4(src, out, gate.scheme, gate.calibrated)
    seconds = time.perf_counter() - start
    c = compare_decoders(src, out, gate.windows)
    if not c.within(gate.tol):
        raise CorpError(_refusal(out, src, {gate.scheme.method: {"verify": c.as_dict()}}, gate.tol, c.windows))
    record = gate.record(src, out, c.as_dict(), seconds)
    write_sidecar(out, record)
    return record


def _project_candidate(
    src: Path, folder: Path, scheme: Scheme, calibration: np.ndarray | None, say: Callable[[str], None]
) -> None:
    """The project's scheme: ``src``'s folder with its graph quantized (its genai_config.json and tokenizer files
    copied unchanged: the graph keeps its names and cache layout; a fused graph's ``model.onnx.data`` is not copied:
    the INT4 graph is one file)."""
    from corp_deploy.exporters.genai import GRAPH

    folder.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith(GRAPH):
            shutil.copy2(f, folder / f.name)
    quantize_int4(src / GRAPH, folder / GRAPH, scheme, calibration if scheme.calibrated else None, say)


def _builder_candidate(recipe: str, src: Path, folder: Path, scheme: Scheme, source: BuilderInput | None) -> None:
    """genai's builder with ``recipe``: a folder of its own (graph, config, tokenizer), the graph's metadata the FP32
    graph's with the scheme and its 4- and 8-bit MatMuls. The builder reads the model's folder on disk where it can
    (its cache widths then pinned as the FP32 graph pins them), else the model, written as its prune artifact."""
    import onnx

    from corp_deploy.exporters.fused_decoder import build_from_folder, build_fused, builder_folder, cache_dims
    from corp_deploy.exporters.genai import GRAPH
    from corp_deploy.exporters.onnx_export import add_metadata

    if source is None:
        raise CorpError("the builder reads the model, which this command does not hold (prune-export does)")
    meta = read_metadata(load_onnx(src / GRAPH, weights=False)) | {"precision": "int4"}
    folder.mkdir(parents=True)
    options = builder_options(recipe, scheme)
    with quiet():
        if (read := builder_folder(source.folder, source.tokenizer)) is not None:
            fp32 = read_sidecar(src / GRAPH)
            if not fp32.get("writer", "").startswith("onnxruntime-genai"):  # the FP32 graph says why not the builder's
                raise CorpError(f"genai's model builder cannot write this model: {fp32.get('why_not_fused')}")
            build_from_folder(read, folder, meta, cache_dims(src / GRAPH), precision="int4", options=options)
        else:
            meta.pop("kv_cache", None)
            build_fused(source.read(), folder, meta, source.tokenizer, precision="int4", options=options)
    proto = onnx.load(str(folder / GRAPH), load_external_data=False)
    bits = {
        n.name: next(a.i for a in n.attribute if a.name == "bits")
        for n in proto.graph.node
        if n.op_type == QUANTIZED_OP
    }
    eight = [{"node": n, "reason": f"the builder's recipe {recipe}"} for n, b in bits.items() if b == 8]
    extra = {"int4_scheme": builder_scheme(recipe, scheme), "int4_matmuls": list(bits.values()).count(4)}
    add_metadata(proto, extra | {"int4_int8": eight, "int4_kept_float": []})
    onnx.save(proto, str(folder / GRAPH))


def _why(chosen: str, outcomes: dict[str, dict], forced: bool) -> str:
    """One line: which recipe, and why it and not the others."""
    timed = {n: o["decode_ms_per_token"] for n, o in outcomes.items() if o.get("decode_ms_per_token") is not None}
    failed = [  # measured and refused by the gate
        f"{n} x{o['verify']['ppl_ratio']:.3f} / {o['verify']['agreement']:.3f}"
        for n, o in outcomes.items()
        if not o.get("passed") and "verify" in o
    ]
    unbuilt = [n for n, o in outcomes.items() if not o.get("passed") and "verify" not in o]  # never reached the gate

    if forced:
        why = "forced (--int4-method)"
    elif timed:
        speeds = ", ".join(f"{n} {ms:.2f}" for n, ms in sorted(timed.items(), key=lambda e: e[1]))
        why = f"the fastest passing candidate (decode ms/token, batch 1, genai CPU: {speeds})"
    else:
        why = "the only candidate that passes the gate"
    why += f"; failed the gate: {', '.join(failed)}" if failed else ""
    return why + (f"; not built (why: in the record): {', '.join(unbuilt)}" if unbuilt else "")


def int4_genai_folder(
    src: Path,
    out: Path,
    gate: Int4Gate,
    candidates: Sequence[str] | None = None,
    source: BuilderInput | None = None,
    timer: Timer = decode_ms,
    say: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """``out`` (created; callers stage it): the onnxruntime-genai folder ``src`` with its decode step in INT4 by the
    fastest of ``candidates`` (``recipes``; default: the gate's scheme alone) that passes the gate against ``src``'s
    FP32 graph on its windows. Each candidate is built beside ``out`` and gated; when more than one passes, ``timer``
    times them all. A candidate that cannot be built (the builder without ``source``, or a model it does not take)
    is recorded as such, unless it was the only one asked for. The record (also the sidecar) holds the chosen
    graph's gate figures and ``int4_choice``: every candidate's figures and timing, the CPU, and why."""
    from corp_deploy.exporters.genai import GRAPH

    windows, tol, scheme = gate.windows, gate.tol, gate.scheme
    names, narrowed = tuple(candidates or (scheme.method,)), None
    if len(names) > 1 and (size := onnx_bytes(src / GRAPH)) >= AUTO_MAX_BYTES:
        names = (scheme.method,)
        narrowed = (
            f"the project's scheme alone: {size / 2**30:.1f} GiB of FP32 graph is over auto's "
            f"{AUTO_MAX_BYTES / 2**30:.0f} GiB (each builder recipe rebuilds the model; --int4-method names one)"
        )
    outcomes: dict[str, dict[str, Any]] = {}
    folders = {name: out.parent / f".{out.name}.{name}" for name in names}
    phase = phases(out.name, say)
    phase(f"the FP32 graph's scores on {len(windows)} held-out windows (once, for every candidate)")
    reference = scores(src / GRAPH, windows)
    phase(None)
    for name, folder in each("candidate", [(name, (name, folder)) for name, folder in folders.items()], say):
        start = time.perf_counter()  # ``say`` gets a line as each starts: minutes each at the 1.7B shape
        try:
            if name in RECIPES:
                _builder_candidate(name, src, folder, scheme, source)
            else:
                _project_candidate(src, folder, scheme, gate.calibrated, say)
            seconds = time.perf_counter() - start
            phase(f"{name}'s scores on the held-out windows (the gate)")
            c = compare_decoders(reference, folder / GRAPH, windows)
            phase(None)
        except CorpError as e:  # e.g. the builder without the model, or a graph onnxruntime cannot load
            if len(names) == 1:
                raise
            shutil.rmtree(folder, ignore_errors=True)
            outcomes[name] = {"recipe": name, "error": str(e)}
            continue
        scheme_record = builder_scheme(name, scheme) if name in RECIPES else scheme.describe()
        outcomes[name] = {"recipe": name, "int4_scheme": scheme_record, "seconds": round(seconds, 2)}
        outcomes[name] |= {"bytes": onnx_bytes(folder / GRAPH), "verify": c.as_dict(), "passed": c.within(tol)}
    passing = [name for name, o in outcomes.items() if o.get("passed")]
    if not passing:
        raise CorpError(_refusal(out, src, outcomes, tol, len(windows)))
    timed = timer({name: folders[name] for name in passing}) if len(passing) > 1 else {}
    for name, o in outcomes.items():
        o["decode_ms_per_token"] = round(timed[name], 3) if name in timed else None
    chosen = min(passing, key=lambda name: timed.get(name, 0.0))
    for name, folder in folders.items():
        if name != chosen:
            shutil.rmtree(folder, ignore_errors=True)
    folders[chosen].rename(out)
    record = gate.record(src / GRAPH, out / GRAPH, outcomes[chosen]["verify"], outcomes[chosen]["seconds"])
    if chosen in RECIPES:  # the builder reads no calibration windows
        record.pop("calibration", None)
    record["int4_choice"] = {
        "chosen": chosen,
        "why": narrowed or _why(chosen, outcomes, forced=candidates is not None and len(names) == 1),
        "candidates": list(outcomes.values()),
        "timing": {"batch": 1, "prompt": TIMING_PROMPT, "runtime": "onnxruntime-genai CPU", **TIMING.as_dict()}
        if timed
        else None,
        **cpu_record(),
    }
    write_sidecar(out / GRAPH, record)
    return record | {"folder": out.name}


def int4_baseline(
    src: Path,
    out: Path,
    windows: np.ndarray,
    tol: DecoderTolerance,
    source: BuilderInput,
    info: dict | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """``out`` (staged): what a user gets from the runtime alone, genai's builder ``-p int4`` as shipped (its defaults:
    ``DEFAULT_SCHEME``'s block and accuracy level) of the dense model ``source``, beside its FP32 genai folder
    ``src``. Gated on ``windows`` as every INT4 candidate is, and kept whatever the verdict: it is the alternative a
    user weighs pruning against, so a baseline that fails the gate is shown, and its record (also the sidecar) says
    so in ``int4_baseline``. Not built (one line) for an FP32 graph of ``AUTO_MAX_BYTES`` or more: the builder's int4
    of the 1.7B shape passed 11 GiB (2026-12-02, docs/BENCHMARKS.md "Scale")."""
    from corp_deploy.exporters.genai import GRAPH

    if (size := onnx_bytes(src / GRAPH)) >= AUTO_MAX_BYTES:
        raise CorpError(
            f"genai's builder -p int4 of a {size / 2**30:.1f} GiB FP32 decode graph holds more than 11 GiB (measured "
            f"at the 1.7B shape); it is not built from {AUTO_MAX_BYTES / 2**30:.0f} GiB on: run "
            "`python -m onnxruntime_genai.models.builder -p int4` on the dense folder where memory allows"
        )
    with staged(out, overwrite) as stage:
        folder = stage / out.name
        start = time.perf_counter()
        _builder_candidate(BASELINE_RECIPE, src, folder, DEFAULT_SCHEME, source)
        seconds = time.perf_counter() - start
        c = compare_decoders(src / GRAPH, folder / GRAPH, windows)
        record = _record(src / GRAPH, folder / GRAPH, c.as_dict(), tol, windows, info, seconds)
        record["int4_baseline"] = {"what": RECIPES[BASELINE_RECIPE].what, "passes_gate": c.within(tol)}
        write_sidecar(folder / GRAPH, record)
    return record | {"folder": out.name}


def int4_speed(run: Path, folders: Sequence[str], timer: Timer = decode_ms) -> dict[str, Any]:
    """Decode ms/token at batch 1 of ``run``'s genai ``folders`` (dense and pruned INT4, the quantize-only
    baseline), interleaved in one run by ``timer``, and each one's speed against the baseline's where it is one of
    them: pruning's gain on top of quantizing alone, measured in the same run."""
    ms = timer({name: run / name for name in folders})
    base = ms.get(BASELINE_GENAI)
    return {
        "decode_ms_per_token": {name: round(v, 3) for name, v in ms.items()},
        "vs_baseline": {name: round(base / v, 4) for name, v in ms.items()} if base else None,
        "timing": {"batch": 1, "prompt": TIMING_PROMPT, "runtime": "onnxruntime-genai CPU", **TIMING.as_dict()},
        **cpu_record(),
    }


def format_int4_speed(records: Sequence[dict[str, Any]], speed: dict[str, Any]) -> str:
    """One row per timed INT4 folder (``int4_speed``): what quantized it, its gate verdict, decode ms/token, and its
    speed against the quantize-only baseline."""
    rows = [("folder", "INT4 by", "gate", "decode ms/token", "vs quantize-only")]
    by_folder = {r["folder"]: r for r in records}
    for name, ms in speed["decode_ms_per_token"].items():
        r = by_folder[name]
        what = r["int4_choice"]["chosen"] if "int4_choice" in r else r["int4_scheme"]["method"]
        if "int4_baseline" in r:
            name, what = f"{name} (quantize-only baseline)", "genai builder -p int4 of the dense model"
        vs = speed["vs_baseline"]
        rows.append((name, what, gate_words(r["verify"]), f"{ms:.2f}", f"{vs[r['folder']]:.2f}x" if vs else ""))
    t = speed["timing"]
    return "\n".join(
        [
            text_table(rows),
            f"decode: batch {t['batch']}, prompt {t['prompt']}, {t['runtime']}, {speed['cpu']}, every folder "
            "interleaved in one run",
        ]
    )


def int4_graphs(
    pairs: Sequence[tuple[Path, Path]],
    windows: np.ndarray,
    tol: DecoderTolerance = INT4,
    scheme: Scheme = DEFAULT_SCHEME,
    info: dict | None = None,
    overwrite: bool = False,
    calibration: np.ndarray | None = None,
    calibration_info: dict | None = None,
    candidates: Sequence[str] | None = None,
    sources: Sequence[BuilderInput | None] | None = None,
    timer: Timer = decode_ms,
    say: Callable[[str], None] = lambda line: None,
) -> list[dict[str, Any]]:
    """Quantize each (FP32 graph, INT4 file) pair, verified, ``say`` told as each starts (``steps.each``: minutes each
    for a decoder's candidates); every graph and destination is checked before any work. Each INT4 file and its
    ``.json`` record appear only when verified. A pair of folders is an onnxruntime-genai folder and its INT4 copy,
    chosen among ``candidates`` (``int4_genai_folder``; the builder's reading the model and tokenizer of the pair's
    entry in ``sources``); a single graph takes ``scheme``. ``calibration``: token windows drawn apart from
    ``windows`` (GPTQ, ``keep_float``), described by ``calibration_info`` in each record."""
    from corp_deploy.exporters.genai import GRAPH

    needs_calibration(scheme, calibration)
    for src, out in pairs:
        decoder_graph(src / GRAPH if src.is_dir() else src)
        if not src.is_dir() and candidates and scheme.method not in candidates:
            raise CorpError(f"--int4-method {candidates[0]} writes genai folders; a single graph takes {scheme.method}")
        check_writable(out, overwrite)
    records = []
    for i, (src, out) in enumerate(each("INT4", [(out.name, (src, out)) for src, out in pairs], say)):
        with staged(out, overwrite) as stage:
            gate = Int4Gate(windows, tol, scheme, info, calibration, calibration_info)
            if src.is_dir():
                source = sources[i] if sources else None
                records.append(int4_genai_folder(src, stage / out.name, gate, candidates, source, timer, say))
            else:
                records.append(quantize_int4_verified(src, stage / out.name, gate))
    return records


def format_int4(records: Sequence[dict[str, Any]]) -> str:
    """One row per INT4 graph: size, the scheme, and its gate figures against FP32."""
    rows = [
        (
            "file",
            "MB",
            "method",
            "block",
            "symmetric",
            "LM head",
            "8-bit",
            "kept float",
            "windows x tokens",
            "ppl FP32",
            "ppl INT4",
            "ratio",
            "top-1 agree",
        )
    ]
    for r in records:
        v, s = r["verify"], r["int4_scheme"]
        rows.append(
            (
                f"{r['folder']}/{r['file']}" if "folder" in r else r["file"],  # two folders' graphs: model.onnx
                f"{r['bytes'] / 2**20:.1f}",
                s.get("method", "rtn"),
                str(s["block_size"]),
                "yes" if s["symmetric"] else "no",
                s.get("lm_head", "int4").split(" ")[0],
                str(len(r.get("int4_int8", []))),
                str(len([f for f in r.get("int4_kept_float", []) if not f["reason"].startswith("the LM head")])),
                f"{v['windows']} x {v['seq_len']}",
                f"{v['reference_ppl']:.3f}",
                f"{v['candidate_ppl']:.3f}",
                f"x{v['ppl_ratio']:.4f}",
                f"{v['agreement']:.3f}",
            )
        )
    lines = [
        f"{r['folder']}: {r['int4_choice']['chosen']}, {r['int4_choice']['why']}" for r in records if "int4_choice" in r
    ]
    return "\n".join([text_table(rows), *lines])
