"""Decoder speed: prefill tokens/s and decode ms/token, dense and pruned interleaved in the same run.

A decoder is not timed as one forward. Two phases are: **prefill** (the prompt of ``prompt_len`` tokens through
the model from an empty key/value cache, one timed call: tokens/s = batch x prompt / latency) and **decode** (one
new token per sequence through the model with the cache holding the prompt and the tokens so far: ms/token, and
tokens/s = batch / latency). A decode step is what generation repeats, so its p50 is the number that says how fast a
model generates. Each model keeps its own session: the prompt is prefilled once, untimed, then every timed call
decodes one greedy token; after ``new_tokens`` steps the session starts again from a fresh prefill (untimed), so
the context stays between ``prompt_len`` and ``prompt_len + new_tokens`` tokens whatever the iteration count.
Dense and pruned alternate in rounds (``timing.interleaved``), as every bench does.

The runtimes are backends of their own (``DECODE_BACKENDS``): the model in torch (``transformers``' own cache, as
``generate`` runs it) and onnxruntime-genai on the CPU from ``prune-export``'s genai folders (FP32, and INT4 weights
where ``--precision int4`` wrote them). Token ids are random (values do not change a decoder's latency).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from corp_deploy.base.deps import missing as uninstalled
from corp_deploy.base.deps import require
from corp_deploy.base.errors import CorpError, first_line
from corp_deploy.base.timing import (
    NEW_TOKENS,
    GenaiSession,
    Method,
    Session,
    Stats,
    Step,
    interleaved,
    median_of_repeats,
    summarize,
)
from corp_deploy.bench.backends import MODELS, RunFolder, all_backends, causal_lm, select_backends
from corp_deploy.bench.run import new_record
from corp_deploy.exporters.int4_gate import gate_words
from corp_deploy.formats.run_folder import BASELINE, BASELINE_GENAI, GENAI_CONFIG, genai_name

PHASES = ("prefill", "decode")
PROMPTS = "128,512"


class TorchSession(Session):
    """``model`` (a ``transformers`` causal LM) with its own ``DynamicCache``, under ``inference_mode``."""

    def __init__(self, model: nn.Module, batch: int, prompt: int, new_tokens: int = NEW_TOKENS) -> None:
        super().__init__(batch, prompt, model.config.vocab_size, new_tokens)
        self.model = model

    @torch.inference_mode()
    def start(self) -> np.ndarray:
        ids = torch.from_numpy(self.ids)
        self.mask = torch.ones_like(ids)
        out = self.model(input_ids=ids, attention_mask=self.mask, use_cache=True)
        self.cache = out.cache
        return out.logits[:, -1:].argmax(-1).numpy()

    @torch.inference_mode()
    def step(self, tokens: np.ndarray) -> np.ndarray:
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        ids = torch.from_numpy(tokens)
        out = self.model(input_ids=ids, attention_mask=self.mask, cache=self.cache, use_cache=True)
        self.cache = out.cache
        return out.logits[:, -1:].argmax(-1).numpy()


@dataclass(frozen=True)
class DecodeBackend:
    name: str
    device: str
    precision: str
    load: Callable[[RunFolder, str, int | None], Callable[[int, int, int], Session]]
    """(run, model, CPU threads) -> ((batch, prompt, new_tokens) -> a session)."""
    missing: Callable[[RunFolder], str | None]


def _torch_cpu(run: RunFolder, which: str, threads: int | None) -> Callable[[int, int, int], Session]:
    model = causal_lm(run, which)
    return lambda batch, prompt, new_tokens: TorchSession(model, batch, prompt, new_tokens)


GENAI_PRECISIONS = ("fp32", "int4")
"""The weight precisions of a run's genai folders (``formats.run_folder.genai_name``)."""
"""Precision -> the suffix of ``prune-export``'s genai folders (``dense-genai/``, ``pruned-genai-int4/``)."""


def _genai(precision: str) -> Callable[[RunFolder, str, int | None], Callable[[int, int, int], Session]]:
    def load(run: RunFolder, which: str, threads: int | None) -> Callable[[int, int, int], Session]:
        og = require("onnxruntime_genai", "the genai decoder backends")
        config = og.Config(str(run.root / genai_name(which, precision == "int4")))
        if threads:
            config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        model, vocab = og.Model(config), run.graph["vocab_size"]
        return lambda batch, prompt, new_tokens: GenaiSession(og, model, vocab, batch, prompt, new_tokens)

    return load


def _genai_missing(precision: str) -> Callable[[RunFolder], str | None]:
    def missing(run: RunFolder) -> str | None:
        if absent := uninstalled("onnxruntime_genai"):
            return f"not installed: {absent}"
        folders = [genai_name(m, precision == "int4") for m in MODELS]
        if absent := [f for f in folders if not (run.root / f / GENAI_CONFIG).is_file()]:
            flag = " --precision int4" if precision == "int4" else ""
            return f"no {', '.join(absent)} in {run.root} (corp-deploy prune-export{flag} on a decoder writes them)"
        return None

    return missing


DECODE_BACKENDS = {
    b.name: b
    for b in (
        DecodeBackend("torch-cpu-fp32", "cpu", "fp32", _torch_cpu, lambda run: None),
        *(DecodeBackend(f"genai-cpu-{p}", "cpu", p, _genai(p), _genai_missing(p)) for p in GENAI_PRECISIONS),
    )
}
"""Every decoder backend; ``auto`` keeps those that can run here."""


def quantize_only(run: RunFolder, skipped: dict[str, str]) -> str | None:
    """What the run's quantize-only baseline is and its gate verdict, from its sidecar; None (the reason in
    ``skipped``) when the run has none."""
    sidecar = run.root / BASELINE_GENAI / "model.onnx.json"  # timed as the model ``baseline`` of genai-cpu-int4
    if not sidecar.is_file():
        skipped["quantize-only baseline"] = (
            f"no {BASELINE_GENAI}/ in {run.root} (corp-deploy prune-export --precision int4 writes it)"
        )
        return None
    record = json.loads(sidecar.read_text())
    return f"{BASELINE_GENAI}/: {record['int4_baseline']['what']}, of the dense model; {gate_words(record['verify'])}"


def select_decoders(names: str, run: RunFolder) -> tuple[list[DecodeBackend], dict[str, str]]:
    """``auto`` or a comma list of decoder backends -> (to run, {skipped: why})."""
    return select_backends(names, run, DECODE_BACKENDS, "decoder backend", ("encoder and image runs", all_backends()))


def parse_prompts(text: str, limit: int, new_tokens: int) -> list[int]:
    """``--prompt-lens``: sizes >= 1 whose prompt plus the decoded tokens fit the model's positions."""
    try:
        sizes = sorted({int(p) for p in text.split(",") if p.strip()})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise CorpError(f"--prompt-lens takes a comma-separated list of token counts >= 1 (e.g. 128,512), got {text!r}")
    if sizes[-1] + new_tokens > limit:
        raise CorpError(
            f"--prompt-lens {sizes[-1]} + --new-tokens {new_tokens} exceeds the model's {limit} positions; "
            "pass shorter prompts"
        )
    return sizes


def rows(stats: dict[str, Stats], backend: DecodeBackend, batch: int, prompt: int, phase: str) -> list[dict]:
    """One result per model timed: the latency statistics and tokens/s (prefill: batch x prompt tokens per call;
    decode: batch tokens per call, and its p50 is ms per token)."""
    tokens = batch * (prompt if phase == "prefill" else 1)
    out = []
    for m in stats:
        s = asdict(stats[m])
        r = {"backend": backend.name, "device": backend.device, "precision": backend.precision, "model": m}
        r |= {"batch": batch, "phase": phase, "prompt_len": prompt, **s}
        out.append(r | {"tokens_per_s": tokens * 1e3 / s["mean_ms"], "p50_tokens_per_s": tokens * 1e3 / s["p50_ms"]})
    return out


def decode_benchmark(
    run: RunFolder,
    backends: Sequence[DecodeBackend],
    batch_sizes: Sequence[int],
    prompts: Sequence[int],
    method: Method | None = None,
    repeats: int = 1,
    new_tokens: int = NEW_TOKENS,
    threads: int | None = None,
    skipped: dict[str, str] | None = None,
    progress: Callable[[str], None] = lambda line: None,
    baseline: bool = True,
) -> dict[str, Any]:
    """Measure every backend x batch x prompt length x phase, dense and pruned interleaved; the bench record
    (``run.benchmark``'s schema; each result also holds ``phase``, ``prompt_len`` and ``tokens_per_s``). With
    ``baseline``, ``genai-cpu-int4`` also times the run's quantize-only baseline in the same loop (``quantize_only``;
    the record says what it is and whether it passes the INT4 gate)."""
    method = method or Method()
    skipped = dict(skipped or {})
    int4 = any(b.precision == "int4" for b in backends)
    what = quantize_only(run, skipped) if baseline and int4 else None
    record = new_record(
        run,
        method,
        repeats,
        threads,
        skipped,
        new_tokens=new_tokens,
        phases="prefill: one call from an empty cache; decode: one token per sequence with the cache",
    )
    if what:
        record["quantize_only_baseline"] = what
    for backend in backends:
        models = (*MODELS, *((BASELINE,) if what and backend.precision == "int4" else ()))
        try:
            loaders = {m: backend.load(run, m, threads) for m in models}
        except CorpError as e:
            record["skipped"][backend.name] = first_line(e)
            progress(f"{backend.name} skipped ({first_line(e)})")
            continue
        for batch in batch_sizes:
            for prompt in prompts:
                sessions = {m: loaders[m](batch, prompt, new_tokens) for m in models}
                for phase in PHASES:
                    steps: dict[str, Step] = {m: getattr(s, phase) for m, s in sessions.items()}
                    repeats_ = [interleaved(steps, method, warm_up=i == 0) for i in range(repeats)]
                    stats = {m: median_of_repeats([summarize(r[m], batch) for r in repeats_]) for m in models}
                    found = rows(stats, backend, batch, prompt, phase)
                    record["results"] += found
                    progress(_line(found))
    return record


def _line(found: list[dict]) -> str:
    d, p, *base = found
    unit = "ms/token" if d["phase"] == "decode" else "ms"
    beside = f", quantize-only baseline {base[0]['p50_ms']:8.2f} {unit}" if base else ""
    return (
        f"{d['backend']} batch {d['batch']:3d} prompt {d['prompt_len']:4d} {d['phase']:7s}: p50 dense "
        f"{d['p50_ms']:8.2f} {unit}, pruned {p['p50_ms']:8.2f} {unit} ({d['p50_ms'] / p['p50_ms']:.2f}x){beside}; "
        f"tokens/s {d['p50_tokens_per_s']:.0f} -> {p['p50_tokens_per_s']:.0f}"
    )
