"""The quantize stage's option groups (``quantize``, ``prune-export --precision ...,int8``/``int4``) and their
converters: INT8 calibration and recipes, and INT4's scheme and gate.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click

from corp_deploy.base.errors import CorpError
from corp_deploy.cli.options import group
from corp_deploy.exporters.compare import Tolerance
from corp_deploy.exporters.int4 import AUTO, RECIPES, recipes
from corp_deploy.exporters.int4_gate import INT4, DecoderTolerance
from corp_deploy.exporters.int4_quant import (
    ACCURACY_LEVEL,
    BLOCK_SIZE,
    CALIB_WINDOWS,
    DEFAULT_LM_HEAD,
    DEFAULT_METHOD,
    LM_HEAD,
    METHODS,
    OUTLIERS_DB,
    RANK_WINDOWS,
    Scheme,
)
from corp_deploy.exporters.int8_quant import CALIB_METHODS, IMAGE_CALIB, TEXT_CALIB
from corp_deploy.exporters.int8_recipes import parse_recipes, quantize_graphs
from corp_deploy.exporters.smooth import SMOOTH_ALPHA

int8_options = group(
    click.option(
        "--int8-calib",
        type=click.IntRange(1),
        help=f"INT8 calibration images (text: documents): CORP's first N [{IMAGE_CALIB}; text {TEXT_CALIB}].",
    ),
    click.option(
        "--int8-verify",
        default=64,
        show_default=True,
        help="Held-out images (the next N; text: held-out documents) verifying INT8.",
    ),
    click.option(
        "--calib-method",
        type=click.Choice(CALIB_METHODS),
        default="minmax",
        show_default=True,
        help=f"{', '.join(CALIB_METHODS)}.",
    ),
    click.option(
        "--smooth-alpha",
        type=click.FloatRange(0, 1),
        default=SMOOTH_ALPHA,
        show_default=True,
        help="When INT8 misses its gate, SmoothQuant moves this much of each GEMM input's range into its "
        "weights before any GEMM is kept float (0: never).",
    ),
    click.option(
        "--int8-recipe",
        default="auto",
        show_default=True,
        help="auto: every INT8 recipe (static Q/DQ, onnxruntime's dynamic per channel / per tensor, smoothed "
        "dynamic; on the plain and the verified fused graph) is gated and the fastest that passes kept; only static "
        "where INT8 engines are built. Or a comma list of them (corp_deploy.exporters.int8_recipes).",
    ),
    click.option(
        "--int8-batch-size",
        "int8_batch",
        default=32,
        show_default=True,
        type=click.IntRange(1),
        help="The batch INT8 graphs are timed at on onnxruntime CPU (text: x the tokens per sequence the graph was "
        "exported with).",
    ),
    into="int8_opts",
)


def int8_calib(int8_opts: dict[str, Any], text: bool) -> int:
    """``--int8-calib``, or the default of the graph's modality: min-max over more images only widened the ranges
    (``int8_quant.IMAGE_CALIB``); text keeps ``TEXT_CALIB`` documents."""
    n = int8_opts["int8_calib"]
    return n if n is not None else TEXT_CALIB if text else IMAGE_CALIB


def int8_quantizer(
    int8_opts: dict[str, Any], source: str, tol: Tolerance, seed: int, workers: int, text, overwrite: bool = False
) -> Callable[[Sequence[tuple[Path, Path]]], list[dict[str, Any]]]:
    """The INT8 group as one call, (FP32 graph, INT8 file) pairs -> verified INT8 records: ``quantize`` and
    ``prune-export --int8`` quantize alike (every recipe of ``--int8-recipe`` gated, the quantize-only baseline
    beside them). ``text``: a text encoder's feeds (``quant_data.text_int8``), None for images."""
    return functools.partial(
        quantize_graphs,
        source=source,
        tol=tol,
        num_calib=int8_calib(int8_opts, text is not None),
        num_verify=int8_opts["int8_verify"],
        seed=seed,
        method=int8_opts["calib_method"],
        workers=workers,
        overwrite=overwrite,
        text=text,
        say=click.echo,
        smooth_alpha=int8_opts["smooth_alpha"],
        recipes=parse_recipes(int8_opts["int8_recipe"]),
        batch=int8_opts["int8_batch"],
        baseline=True,
    )


int4_options = group(
    click.option(
        "--int4-windows", default=8, show_default=True, help="INT4: held-out text windows verifying it (--calib-dir)."
    ),
    click.option("--int4-seq-len", default=128, show_default=True, help="INT4: tokens per verification window."),
    click.option(
        "--int4-method",
        type=click.Choice((AUTO, *METHODS, *RECIPES)),
        default=AUTO,
        show_default=True,
        help=f"INT4: {AUTO}: the fastest that passes the gate of genai's builder recipes ({', '.join(RECIPES)}) and "
        f"the project's scheme ({DEFAULT_METHOD}, or the method named); or one forced: the project's {DEFAULT_METHOD} "
        "or onnxruntime's quantizers (hqq: float zero point per block; gptq: calibrated; rtn, k_quant), or a "
        "builder recipe.",
    ),
    click.option("--int4-block-size", default=BLOCK_SIZE, show_default=True, help="INT4: input channels per scale."),
    click.option(
        "--int4-asymmetric", is_flag=True, help="INT4: a 4-bit zero point per block for rtn/gptq (hqq has one)."
    ),
    click.option(
        "--int4-accuracy-level",
        default=ACCURACY_LEVEL,
        show_default=True,
        help="INT4: MatMulNBits compute (4: int8 activations inside the kernel, 0: float).",
    ),
    click.option(
        "--int4-lm-head",
        type=click.Choice(LM_HEAD),
        default=DEFAULT_LM_HEAD,
        show_default=True,
        help="INT4: the LM head (tied embedding) in int4, 8-bit MatMulNBits, or float.",
    ),
    click.option(
        "--int4-keep-float",
        default=0,
        show_default=True,
        help="INT4: leave float the N MatMuls with the lowest output SQNR on calibration windows.",
    ),
    click.option(
        "--int4-int8-outliers-db",
        default=str(OUTLIERS_DB),
        show_default=True,
        help="INT4: MatMuls whose output SQNR is this far below the median (and under 30 dB) in 8 bits; 'off': none.",
    ),
    click.option(
        "--int4-error-feedback/--no-int4-error-feedback",
        default=True,
        show_default=True,
        help="INT4 minmax: the outliers (off its grid) in 4 bits with GPTQ's error feedback; no: in 8 bits.",
    ),
    click.option(
        "--int4-calib-windows",
        default=CALIB_WINDOWS,
        show_default=True,
        help="INT4: calibration-document windows for gptq and error feedback (the error ranking of outliers and "
        f"--int4-keep-float reads the first {RANK_WINDOWS}).",
    ),
    click.option("--tol-ppl-ratio", type=float, help=f"INT4 gate: perplexity / FP32's at most [{INT4.max_ppl_ratio}]."),
    click.option(
        "--tol-agreement", type=float, help=f"INT4 gate: top-1 agreement with FP32 at least [{INT4.min_agreement}]."
    ),
    into="int4",
)


def _outliers_db(value: str) -> float | None:
    if value.strip().lower() in ("off", "none"):
        return None
    try:
        return float(value)
    except ValueError:
        raise CorpError(f"--int4-int8-outliers-db takes dB or 'off', got {value!r}") from None


def int4_setup(int4: dict[str, Any]) -> tuple[Scheme, DecoderTolerance]:
    """The INT4 group as the quantizer's scheme and the gate (the user's gates in place of the defaults)."""
    scheme = Scheme(
        block_size=int4["int4_block_size"],
        symmetric=False if int4["int4_asymmetric"] else None,
        accuracy_level=int4["int4_accuracy_level"],
        method=int4["int4_method"] if int4["int4_method"] in METHODS else DEFAULT_METHOD,
        lm_head=int4["int4_lm_head"],
        keep_float=int4["int4_keep_float"],
        int8_outliers_db=_outliers_db(int4["int4_int8_outliers_db"]),
        error_feedback=int4["int4_error_feedback"],
    )
    if int4["int4_calib_windows"] < 1:
        raise CorpError(f"--int4-calib-windows must be >= 1, got {int4['int4_calib_windows']}")
    ratio, agreement = int4["tol_ppl_ratio"], int4["tol_agreement"]
    tol = DecoderTolerance(
        INT4.max_ppl_ratio if ratio is None else ratio, INT4.min_agreement if agreement is None else agreement
    )
    return scheme, tol


def int4_candidates(int4: dict[str, Any], scheme: Scheme) -> tuple[str, ...]:
    """The INT4 recipes ``--int4-method`` asks for (``exporters.int4.recipes``)."""
    return recipes(int4["int4_method"], scheme)
