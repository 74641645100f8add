"""The export and engine commands' option groups and their converters: the ONNX export (``--opset``...
``--decode-graph``), verification (``--verify-batch-sizes``, the tolerances) and TensorRT engines (``--batch-range``...
``--compute-capability``), as ``VerifyOptions`` and ``BuildOptions``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from corp_deploy.base.errors import CorpError
from corp_deploy.cli.options import group
from corp_deploy.exporters.compare import FP16, FP32, INT8, Tolerance
from corp_deploy.exporters.genai import GRAPHS
from corp_deploy.exporters.onnx_export import DEFAULT_OPSET, OPSETS
from corp_deploy.exporters.pipeline import VerifyOptions
from corp_deploy.exporters.tensorrt_engine import (
    RUNTIMES,
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


engine_group = group(
    click.option(
        "--batch-range", "batch", default="1:32:256", show_default=True, help="Engine batch range MIN:OPT:MAX."
    ),
    click.option(
        "--seq-range",
        metavar="MIN:OPT:MAX",
        help="Text encoders: the engine's tokens-per-sequence range [1:SEQ:SEQ, SEQ the graph's sequence length: "
        "export --seq-len].",
    ),
    click.option("--workspace-gib", default=8.0, show_default=True, help="TensorRT workspace limit."),
    click.option("--opt-level", default=3, show_default=True, help="TensorRT builder optimization level 0..5."),
    click.option("--tf32", is_flag=True, help="Allow TF32 in FP32 engines (off: exact FP32)."),
    click.option("--timing-cache", type=click.Path(dir_okay=False), help="Timing cache file [per GPU, ~/.cache]."),
    click.option(
        "--runtime",
        type=click.Choice(RUNTIMES),
        default="auto",
        show_default=True,
        help="Engine flavour; auto: TensorRT with a CUDA GPU, else TensorRT-RTX (builds without a GPU).",
    ),
    click.option(
        "--compute-capability",
        metavar="CC[,CC]",
        help="TensorRT-RTX target GPUs, e.g. 8.9 (RTX 4090) or 7.5 (Turing) [8.0,8.6,8.9,12.0,12.1].",
    ),
    into="engine",
)


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
