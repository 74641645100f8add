"""The run folder: what ``prune-export`` writes and ``bench``, ``eval``, ``quantize`` and ``sweep`` read, named in
one module so that the writer (``exporters.pipeline``, ``cli.export``) and the readers (``RunFolder`` below,
``bench.decode``) cannot drift apart. A ``prune-export`` folder ``RUN/`` holds::

    pruned/                          the prune artifact (``formats.artifact``), written first
    dense.onnx, pruned.onnx          FP32 graphs, each with a ``<file>.json`` sidecar (its verification record)
    <m>.fp16.onnx, <m>.int8.onnx     other precisions of model <m> (dense, pruned), same sidecars
    <m>.<precision>.plan             TensorRT engines, same sidecars
    <m>.xml, <m>.int8.xml, ...       each export target's files (``exporters.targets``: OpenVINO IR...), named by
                                     its ``file_name``, same sidecars
    <m>-genai/, <m>-genai-int4/      a decoder's onnxruntime-genai folders (FP32 and INT4 weights)
    baseline.int8.onnx               the quantize-only baseline (an encoder's or a ViT's; ``baseline-genai-int4/``
                                     a decoder's)
    export.json                      the run's record, written last: a folder that has it is whole
    README.md                        what the folder holds, in words, from export.json (``write_readme``)

The sidecar of ``pruned.onnx`` also says how to feed the graphs (image size, or a text encoder's vocabulary and
sequence length), so a reader needs no model to make inputs. Only names and records live here: nothing is exported.
"""

from __future__ import annotations

import fnmatch
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

from corp_deploy.base.errors import CorpError
from corp_deploy.base.fsio import atomic_file
from corp_deploy.base.steps import written
from corp_deploy.base.version import __version__
from corp_deploy.formats.artifact import META_FILE, read_meta

MODELS = ("dense", "pruned")
"""The two models of a run, by their stems: everything is written and timed for both."""
ARTIFACT = "pruned"
"""The prune artifact's subfolder."""
RECORD = "export.json"
README = "README.md"
GENAI_SUFFIX = "-genai"
"""``<model>-genai/``: a decoder's onnxruntime-genai folder."""
INT4_SUFFIX = "-int4"
"""Appended to a genai folder (``pruned-genai-int4/``) for its INT4 copy."""
GENAI_CONFIG = "genai_config.json"
"""What makes a folder an onnxruntime-genai folder."""
BASELINE = "baseline"
"""The quantize-only baseline's stem: the dense model quantized the runtime's own way (``baseline.int8.onnx``;
a decoder's ``baseline-genai-int4/``, genai's builder ``-p int4`` as shipped)."""


def onnx_name(which: str, precision: str = "fp32") -> str:
    """``dense.onnx``, ``pruned.fp16.onnx``, ``dense.int8.onnx``: FP32 carries no precision in its name."""
    return f"{which}.onnx" if precision == "fp32" else f"{which}.{precision}.onnx"


def engine_name(which: str, precision: str) -> str:
    return f"{which}.{precision}.plan"


def genai_name(which: str, int4: bool = False) -> str:
    return f"{which}{GENAI_SUFFIX}{INT4_SUFFIX if int4 else ''}"


BASELINE_GENAI = genai_name(BASELINE, int4=True)
"""A decoder's quantize-only baseline folder: the dense model through genai's builder ``-p int4`` as shipped."""


def sidecar(path: str | Path) -> Path:
    """The record beside a graph or an engine: ``x.onnx`` -> ``x.onnx.json``."""
    return Path(f"{path}.json")


def write_sidecar(path: str | Path, record: dict[str, Any]) -> None:
    sidecar(path).write_text(json.dumps(record, indent=2) + "\n")


def read_sidecar(path: str | Path) -> dict[str, Any]:
    """The record beside ``path``, or {} when it is missing or unreadable (a reader then says what it lacks)."""
    try:
        return json.loads(sidecar(path).read_text())
    except (OSError, ValueError):
        return {}


def check(root: str | Path) -> Path:
    """``root`` as a run folder, or one line saying what it is instead and what to run."""
    root = Path(root)
    if not (root / ARTIFACT / META_FILE).is_file() and (root / META_FILE).is_file():
        raise CorpError(f"{root} is a prune artifact; bench a `corp-deploy prune-export` folder (it has ONNX too)")
    if not (root / ARTIFACT / META_FILE).is_file():
        raise CorpError(
            f"{root} is not a prune-export folder (no {ARTIFACT}/{META_FILE}); run `corp-deploy prune-export`"
        )
    return root


def fp32_graphs(source: Path) -> list[Path]:
    """A run folder's dense and pruned FP32 graphs, or one .onnx file."""
    if source.is_dir():
        graphs = [source / onnx_name(m) for m in MODELS if (source / onnx_name(m)).is_file()]
        if not graphs:
            raise CorpError(
                f"{source} has no dense.onnx or pruned.onnx; run `corp-deploy prune-export` or pass a .onnx"
            )
    elif source.suffix == ".onnx":
        graphs = [source]
    else:
        raise CorpError(f"{source} is neither a prune-export folder nor a .onnx file")
    return graphs


def int8_pairs(source: Path) -> list[tuple[Path, Path]]:
    """(FP32 graph, INT8 file) for a run folder's dense and pruned graphs, or for one .onnx file."""
    return [(g, g.with_name(onnx_name(g.stem, "int8"))) for g in fp32_graphs(source)]


def int4_pairs(source: Path) -> list[tuple[Path, Path]]:
    """(FP32, INT4) for a decoder's genai folders (a run folder's ``*-genai/``, or one such folder), else for its
    dense/pruned.onnx or one .onnx file (``<name>.int4.onnx``)."""
    genai_folders = [source] if (source / GENAI_CONFIG).is_file() else sorted(source.glob(f"*{GENAI_SUFFIX}"))
    if source.is_dir() and genai_folders:
        return [(f, f.with_name(f"{f.name}{INT4_SUFFIX}")) for f in genai_folders]
    return [(g, g.with_name(f"{g.stem}.int4.onnx")) for g in fp32_graphs(source)]


class Text(NamedTuple):
    """A text run's inputs: token ids below ``vocab``, ``seq_len`` real tokens per sequence."""

    vocab: int
    seq_len: int


@dataclass(frozen=True)
class RunFolder:
    """A ``prune-export`` folder as its readers (``bench``, ``eval``) see it: its records, inputs and files.

    ``seq_len``: a text run's tokens per sequence, instead of the one ``prune-export`` recorded.
    """

    root: Path
    rewrites: tuple[str, ...] | None = None
    """The exact rewrites (``exporters.rewrites``) the torch backends apply; None: each backend's defaults."""
    seq_len: int | None = None

    @classmethod
    def open(cls, path: str | Path, seq_len: int | None = None) -> RunFolder:
        run = cls(check(path), seq_len=seq_len)
        _ = run.text  # a bad --seq-len fails here, before any backend loads
        return run

    @cached_property
    def meta(self) -> dict:
        return read_meta(self.root / ARTIFACT)

    @cached_property
    def graph(self) -> dict:
        """What ``prune-export`` recorded beside pruned.onnx (input size, or a text encoder's inputs); empty when
        missing, for torch backends to run without it (``input_size`` then says what is missing)."""
        return read_sidecar(self.onnx("pruned"))

    @cached_property
    def text(self) -> Text | None:
        """A text encoder's inputs (``seq_len`` checked against its positions), or None for an image model."""
        if self.graph.get("modality") != "text":
            if self.seq_len is not None:
                raise CorpError(f"--seq-len is for text encoders; {self.root} holds an image model")
            return None
        seq_len, limit = self.seq_len or self.graph["seq_len"], self.graph["max_positions"]
        if not 1 <= seq_len <= limit:
            raise CorpError(f"--seq-len must be between 1 and {limit} (the model's positions), got {seq_len}")
        return Text(self.graph["vocab_size"], seq_len)

    @cached_property
    def decoder(self) -> bool:
        """Whether the run holds a causal LM (its artifact's config.json names one): ``bench`` times it by phase
        (``bench.decode``)."""
        try:
            config = json.loads((self.root / ARTIFACT / "config.json").read_text())
        except (OSError, ValueError):
            return False
        return any(a.endswith("ForCausalLM") for a in config.get("architectures") or [])

    def onnx(self, which: str, precision: str = "fp32") -> Path:
        return self.root / onnx_name(which, precision)

    def engine(self, which: str, precision: str) -> Path:
        return self.root / engine_name(which, precision)

    @cached_property
    def input_size(self) -> tuple[int, int, int]:
        """(C, H, W) as ``prune-export`` recorded it beside pruned.onnx: no model is built to learn it."""
        try:
            return tuple(self.graph["input_size"])
        except (KeyError, TypeError):
            raise CorpError(
                f"{self.root}/pruned.onnx.json is missing or records no input_size; re-run `corp-deploy prune-export`"
            ) from None


KINDS = (
    (
        f"{ARTIFACT}/",
        "the pruned model: model.safetensors + corp.json (its prune report)",
        "corp_deploy.load_pruned({p})",
    ),
    (RECORD, "the run's record: every file's checks, sizes, versions", "json.load(open({p}))"),
    ("eval.json", "accuracy evaluations, oldest first (corp-deploy eval)", "json.load(open({p}))"),
    ("bench.json", "a benchmark record (corp-deploy bench --json)", "json.load(open({p}))"),
    (README, "this file", ""),
)
"""A run folder's entries by name pattern (first match) beside its export targets' files (``exporters.targets``:
each target lists its own): what each is and how to load it."""


def describe_entry(name: str, kinds: Sequence[tuple[str, str, str]] = ()) -> tuple[str, str]:
    """(what ``name`` is, how to load it) from ``kinds`` (an export target's files) and ``KINDS``; an entry no pattern
    knows is said to be unknown."""
    for pattern, what, how in (*kinds, *KINDS):
        if fnmatch.fnmatch(name, pattern):
            return what, how.format(p=repr(name.rstrip("/")))
    return "not written by corp-deploy", ""


def write_readme(
    root: str | Path, record: dict[str, Any], summary: str, command: str, kinds: Sequence[tuple[str, str, str]] = ()
) -> Path:
    """``root/README.md``: the command that made the folder, the figures (``summary``: the table the command printed,
    from the same ``record``), and every entry the folder holds now, read from the disk, with how to load it."""
    root = Path(root)
    size = record.get("size", {})
    figures = [
        f"- {m}: {size[m]['params'] / 1e6:.2f}M parameters, {size[m]['macs'] / 1e9:.3f} GMACs per input"
        for m in MODELS
        if m in size
    ]
    config = record.get("prune_config", {})
    pruned = ", ".join(f"{k} {config[k]}" for k in ("target", "sparsity", "budget") if config.get(k) is not None)
    rows = ["| entry | what it is | how to load it |", "|---|---|---|"]
    entries = sorted({*written(root), README})  # this file among them
    rows += [f"| `{n}` | {w} | {f'`{h}`' if h else ''} |" for n in entries for w, h in [describe_entry(n, kinds)]]
    text = "\n".join(
        [
            f"# {record.get('model', root.name)}: a CORP run folder",
            "",
            f"Made by `{command}` (corp-deploy {__version__}, {time.strftime('%Y-%m-%d %H:%M:%S')}).",
            *(["", f"Pruned: {pruned}."] if pruned else []),
            "",
            "## Figures",
            "",
            *figures,
            "",
            "```text",
            summary,
            "```",
            "",
            "## Files",
            "",
            *rows,
            "",
            f"Every graph and engine has a `<file>.json` beside it with its own record; `{RECORD}` holds them all.",
            "",
        ]
    )
    with atomic_file(root / README, overwrite=True) as tmp:
        tmp.write_text(text)
    return root / README
