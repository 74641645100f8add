"""The export and engine commands' option groups and their converters: the ONNX export (``--opset``...
``--decode-graph``), verification (``--verify-batch-sizes``, the tolerances) and TensorRT engines (``--batch-range``...
``--compute-capability``), as ``VerifyOptions`` and ``BuildOptions``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from corp_deploy.base.errors import CorpError
from corp_deploy.cli.options import group
from corp_deploy.exporters import targets
from corp_deploy.exporters.compare import FP16, FP32, INT8, Tolerance
from corp_deploy.exporters.genai import GRAPHS
from corp_deploy.exporters.onnx_export import DEFAULT_OPSET, OPSETS
from corp_deploy.exporters.pipeline import VerifyOptions
from corp_deploy.exporters.targets import ONNX, TENSORRT, Option
from corp_deploy.exporters.tensorrt_engine import (
    BuildOptions,
    parse_compute_capabilities,
    parse_profile,
)

verify_group = group(
    click.option(
        "--verify-batch-sizes",
        "verify_batches",
        default="1,4",
        show_default=True,
        help="Batch sizes compared (two or more).",
    ),
    click.option("--tol-cosine", type=float, help=f"Minimum cosine vs the reference [fp32 {FP32.min_cosine}]."),
    click.option("--tol-rel", type=float, help=f"Maximum max-abs error / max |reference| [fp32 {FP32.max_rel_error}]."),
    into="verify",
)


onnx_options = group(
    click.option(  # checked as the flags are read: before a prune that would be lost to it
        "--opset",
        type=click.IntRange(OPSETS.start, OPSETS.stop - 1),
        default=DEFAULT_OPSET,
        show_default=True,
        help="ONNX opset.",
    ),
    click.option("--simplify", is_flag=True, help="Simplify the graph with onnxslim."),
    click.option(
        "--pad-qk",
        is_flag=True,
        help="Zero-pad pruned Q/K to the V width inside the graph (exact): one head size, so fused "
        "attention kernels apply while the smaller qkv GEMM is kept.",
    ),
    click.option(
        "--rewrites",
        default="auto",
        show_default=True,
        help="Exact rewrites in every exported graph, dense and pruned alike: patch-linear (the patch-embedding "
        "conv as reshape + GEMM), none, or auto: those measured to pay on a latency budget's backend (prune-export "
        "--latency-on; none without one).",
    ),
    click.option(
        "--decode-graph",
        type=click.Choice(GRAPHS),
        default="auto",
        show_default=True,
        help="Decoders' genai folders: fused (onnxruntime-genai's model builder: fused norms, rotary and "
        "GroupQueryAttention; one head size for Q, K and V), export (torch.export: any widths) or auto (fused where "
        "the builder takes the model, the reason recorded where not).",
    ),
)


def option(spec: Option) -> Callable:
    """A target's option (``exporters.targets.Option``, data) as a click option: a tuple type is a choice, ``Path``
    a file, anything else click's type from the type or the default."""
    kind = spec.type
    if isinstance(kind, tuple):
        kind = click.Choice(kind)
    elif kind is Path:
        kind = click.Path(dir_okay=False)
    shown = spec.default is not None and not spec.is_flag
    extra = {} if spec.is_flag else {"type": kind, "default": spec.default, "show_default": shown}
    return click.option(spec.flag, spec.name, is_flag=spec.is_flag, metavar=spec.metavar, help=spec.help, **extra)


def target_group(*names: str, into: str) -> Callable:
    """The option groups of the registered targets ``names`` (all but ONNX's and TensorRT's when none are named:
    those have their own groups, ``onnx_options`` and ``engine_group``), as click options handed to the command
    as one dict ``into``."""
    registered = targets.load()
    chosen = [registered[n] for n in names] or [t for t in registered.values() if t.name not in (ONNX, TENSORRT)]
    return group(*(option(o) for t in chosen for o in t.options), into=into)


engine_group = target_group(TENSORRT, into="engine")


def verify_options(verify: dict[str, Any]) -> VerifyOptions:
    """Two or more batch sizes; a given tolerance replaces the per-precision defaults."""
    batches = verify["verify_batches"]
    try:
        sizes = tuple(sorted({int(b) for b in batches.split(",")}))
    except ValueError:
        sizes = ()
    if len(sizes) < 2 or sizes[0] < 1:
        raise CorpError(f"--verify-batch-sizes needs two or more batch sizes >= 1 (e.g. 1,4), got {batches!r}")
    return VerifyOptions(sizes, *(tolerance(t, verify["tol_cosine"], verify["tol_rel"]) for t in (FP32, FP16, INT8)))


def tolerance(default: Tolerance, tol_cosine: float | None, tol_rel: float | None) -> Tolerance:
    """``default`` with the gates the user gave (--tol-cosine, --tol-rel) in place of its own."""
    cosine = default.min_cosine if tol_cosine is None else tol_cosine
    return Tolerance(cosine, default.max_rel_error if tol_rel is None else tol_rel)


def build_options(engine: dict[str, Any], precision: str, opts: VerifyOptions) -> BuildOptions:
    """The engine group as ``BuildOptions``, checked before any work: the batch range must take the verify batches."""
    cache = None if engine["timing_cache"] is None else Path(engine["timing_cache"])
    options = BuildOptions(
        precision,
        parse_profile(engine["batch"]),
        engine["workspace_gib"],
        engine["opt_level"],
        engine["tf32"],
        cache,
        engine["runtime"],
        parse_compute_capabilities(engine["compute_capability"]),
        None if engine["seq_range"] is None else parse_profile(engine["seq_range"], "--seq-range"),
    )
    options.profile.covers(opts.batches)
    return options
