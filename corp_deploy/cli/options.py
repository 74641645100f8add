"""Option groups shared by the commands, and the converters that turn their flags into config objects.

A group with ``into=NAME`` hands its flags to the command as one dict ``NAME``, so a command passes
the group to its converter (``prune_config``, ``verify_options``, ``build_options``, ``method``) instead
of repeating the parameter list. Choices come from the library's own tuples.
"""

from __future__ import annotations

import functools
import re
import shlex
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from corp_deploy.base.deps import missing
from corp_deploy.base.errors import CorpError
from corp_deploy.base.fsio import check_writable
from corp_deploy.bench.measure import Method
from corp_deploy.core.compensation import DEPTH_FITS
from corp_deploy.core.pruner import (
    COMPENSATIONS,
    CRITERIA,
    DEFAULT_RIDGE,
    LAYOUTS,
    SELECTIONS,
    Budget,
    PruneConfig,
    parse_budget,
)
from corp_deploy.core.ranking import RANKERS
from corp_deploy.core.recover import KEPT_INPUTS, TARGETS, Recovery
from corp_deploy.exporters.compare import FP16, FP32, INT8, Tolerance
from corp_deploy.exporters.genai import GRAPHS
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
    Scheme,
)
from corp_deploy.exporters.onnx_export import DEFAULT_OPSET
from corp_deploy.exporters.pipeline import VerifyOptions
from corp_deploy.exporters.quantize import CALIB_METHODS
from corp_deploy.exporters.smooth import SMOOTH_ALPHA
from corp_deploy.exporters.tensorrt_engine import (
    PRECISIONS,
    RUNTIMES,
    BuildOptions,
    Profile,
    parse_compute_capabilities,
    parse_profile,
)
from corp_deploy.families.timm.models import WEIGHTS
from corp_deploy.formats.data import SYNTHETIC

CALIB_IMAGES = 4000
SMOKE_IMAGES = 64  # noise only has to exercise the pass: enough for the statistics, minutes not hours on a CPU
TEXT_SEQUENCES = 128
"""Default calibration sequences of a text model: the paper's OPT count (128 C4 sequences)."""


def group(*decorators: Callable, into: str | None = None) -> Callable:
    """Apply click options as one decorator; with ``into``, the command gets their values as one dict."""

    def apply(f: Callable) -> Callable:
        if into is not None:
            f = _collect(f, into, _names(decorators))
        for decorator in reversed(decorators):
            f = decorator(f)
        return f

    return apply


def _names(decorators: tuple[Callable, ...]) -> list[str]:
    """The parameter names a list of click decorators declares (applied to a throwaway function)."""

    def probe() -> None: ...

    for decorator in decorators:
        probe = decorator(probe)
    return [p.name for p in getattr(probe, "__click_params__", [])]


def _collect(f: Callable, into: str, names: list[str]) -> Callable:
    @functools.wraps(f)
    def command(*args: Any, **kwargs: Any) -> Any:
        kwargs[into] = {name: kwargs.pop(name) for name in names}
        return f(*args, **kwargs)

    return command


model_options = group(
    click.option(
        "--weights",
        type=click.Choice(WEIGHTS),
        default="pretrained",
        show_default=True,
        help="pretrained (timm hub) or random.",
    ),
    click.option("--checkpoint", type=click.Path(dir_okay=False), help="Weights file (.safetensors or .pth/.pt)."),
    click.option(
        "--model-arg", multiple=True, metavar="KEY=VALUE", help="Extra timm.create_model argument (repeatable)."
    ),
)

calib_options = group(
    click.option(
        "--calib-dir",
        type=click.Path(),
        help="Folder of unlabeled calibration images (recursive); for a text model, .txt/.jsonl documents.",
    ),
    click.option(
        "--calib",
        type=str,
        help="'synthetic': noise images (random tokens), for smoke tests only; 'text-mix' (text models): packaged, "
        "pinned news, quotations, definitions and glosses (Debian packages fetched once into the cache).",
    ),
    click.option(
        "--num-calib",
        type=int,
        help=f"Calibration images or text sequences [default: {CALIB_IMAGES} images (the paper's), "
        f"{TEXT_SEQUENCES} sequences; {SMOKE_IMAGES} with --calib synthetic].",
    ),
    click.option("--calib-batch-size", default=64, show_default=True),
    click.option(
        "--seq-len", default=128, show_default=True, help="Text models: most tokens per calibration sequence."
    ),
    click.option("--workers", type=int, help="Image decoding processes [default: min(8, CPUs)]."),
    click.option("--seed", default=0, show_default=True, help="Seed of the calibration subset."),
    click.option("--device", default="auto", show_default=True, help="auto (GPU if present), cpu or cuda[:N]."),
)

quiet_option = click.option("--quiet", is_flag=True, help="No progress bar.")

method_options = group(
    click.option(
        "--target",
        default="mlp,qk",
        show_default=True,
        help="What to prune: a comma list of mlp (MLP channels), qk (attention Q/K dims), v (attention V "
        "channels); all = mlp,qk,v; both = joint = mlp,qk; attn = qk. Left out, the parts the model's family "
        "cannot prune are dropped from the default (Llama, Mistral, Qwen2: no qk under RoPE).",
    ),
    click.option(
        "--ranker",
        type=click.Choice(RANKERS),
        default="combined",
        show_default=True,
        help="Channel score: energy, magnitude, combined (the paper's), active, variance (VBP's) or obs (greedy "
        "Optimal Brain Surgeon on the error CORP's compensation leaves; MLP and V channels, Q/K keep the logit "
        "energy).",
    ),
    click.option(
        "--compensation",
        type=click.Choice(COMPENSATIONS),
        default="corp",
        show_default=True,
        help="corp (closed form), mean (VBP mean shift) or none (plain removal).",
    ),
    click.option("--ridge", default=DEFAULT_RIDGE, show_default=True, help="Relative ridge damping alpha."),
    click.option("--round-to", default=8, show_default=True, help="Kept widths are multiples of this."),
)

sparsity_options = group(
    click.option("--sparsity", default=0.5, show_default=True, help="Fraction of channels to remove, in [0, 1)."),
    click.option("--mlp-sparsity", type=float, help="Override --sparsity for MLP hidden channels."),
    click.option(
        "--qk-sparsity",
        "--attn-sparsity",
        "qk_sparsity",
        type=float,
        help="Override --sparsity for attention Q/K dims.",
    ),
    click.option("--v-sparsity", type=float, help="Override --sparsity for attention V channels."),
    click.option(
        "--budget",
        metavar="macs=F|latency=F",
        help="Instead of --sparsity: keep fraction F of the dense MACs, or of the dense latency measured on "
        "--latency-on, with every block's widths chosen where they hurt least (see --allocation).",
    ),
    click.option(
        "--allocation",
        type=click.Choice(CRITERIA),
        default="sensitivity",
        show_default=True,
        help="--budget: weight block errors by their measured effect on the final features (sensitivity; "
        "holds out --sensitivity-images calibration images) or compare them as they are (local).",
    ),
    click.option(
        "--sensitivity-images", default=32, show_default=True, help="Calibration images held out for sensitivity."
    ),
    click.option(
        "--selection",
        type=click.Choice(SELECTIONS),
        default="per-layer",
        show_default=True,
        help="MLP channels: the same fraction in every block, or VBP's one score threshold across all blocks "
        "(global; each block's count rounded to --round-to).",
    ),
    click.option(
        "--layout",
        type=click.Choice(LAYOUTS),
        default="auto",
        show_default=True,
        help="Text models: the folder's form. auto: the family's own transformers format when the widths allow it, "
        "else a remote-code folder (trust_remote_code=True); standard: keep the plan to the family's own format "
        "(uniform --sparsity of the MLP only).",
    ),
    click.option(
        "--depth",
        default="",
        metavar="attn[,mlp]",
        help="With a latency budget: the allocation may also replace a block's whole attention (and/or MLP) by its "
        "closed-form prediction from the block's input (see --depth-fit), judged by its measured end-to-end error. "
        "Off by default.",
    ),
    click.option(
        "--depth-fit",
        type=click.Choice(DEPTH_FITS),
        default="affine-mean",
        show_default=True,
        help="--depth: what replaces a module: its mean output, an affine map per token, or affine in the token "
        "and the image's token mean (ridge fits from the same calibration pass).",
    ),
    click.option(
        "--sequential",
        is_flag=True,
        help="Error-correcting calibration: block by block, each block's compensation regresses the dense "
        "model's targets from the stream pruned so far (about 4x the calibration passes; pays at high sparsity).",
    ),
)

dist_option = click.option(
    "--dist-timeout",
    default=1800.0,
    show_default=True,
    help="Under torchrun: seconds to wait for the other ranks before failing.",
)

max_stats_option = click.option(
    "--max-stats-gib",
    type=float,
    help="Bound the calibration statistics held at once (GiB): blocks are calibrated in groups that fit "
    "(the same result as one pass; for big models on small GPUs).",
)

latency_options = group(
    click.option("--speedup", type=float, help="Instead of --sparsity: be S times faster (= --budget latency=1/S)."),
    click.option(
        "--latency-on",
        metavar="BACKEND",
        help="The bench backend a latency budget is measured on (e.g. ort-cpu-fp32, torch-cpu-fp32).",
    ),
    click.option("--latency-batch", default=32, show_default=True, help="Batch size the latency budget is for."),
    click.option(
        "--latency-table",
        type=click.Path(dir_okay=False),
        help="A latency table (corp-deploy profile --out) instead of the cached or newly measured one.",
    ),
    into="latency",
)

recover_options = group(
    click.option(
        "--recover-steps",
        type=int,
        help="After pruning (and after a latency budget's check): train the pruned model's Linear weights for N "
        "steps to reproduce the dense model on unlabeled calibration inputs (label-free recovery; one step per "
        f"--calib-batch-size batch of the first {KEPT_INPUTS} calibration images or sequences, never the held-out "
        "ones). Widths, hence speed, unchanged. Off by default: CORP alone.",
    ),
    click.option("--recover-minutes", type=float, help="Instead of --recover-steps: recover for M minutes."),
    click.option("--recover-lr", default=1e-4, show_default=True, help="Recovery: AdamW's peak learning rate."),
    click.option(
        "--recover-target",
        type=click.Choice(TARGETS),
        default="blocks",
        show_default=True,
        help="Recovery: each block reproduces its dense block's output from the dense input (blocks), or from "
        "the pruned model's own input (hidden: end to end), or the model its dense final features (features).",
    ),
    into="recovery",
)

prune_options = group(
    click.argument("model"),
    model_options,
    calib_options,
    quiet_option,
    group(sparsity_options, method_options, into="pruning"),
    latency_options,
    recover_options,
    max_stats_option,
    dist_option,
)

verify_group = group(
    click.option("--verify-batches", default="1,4", show_default=True, help="Batch sizes compared (two or more)."),
    click.option("--tol-cosine", type=float, help=f"Minimum cosine vs the reference [fp32 {FP32.min_cosine}]."),
    click.option("--tol-rel", type=float, help=f"Maximum max-abs error / max |reference| [fp32 {FP32.max_rel_error}]."),
    into="verify",
)

onnx_options = group(
    click.option("--opset", default=DEFAULT_OPSET, show_default=True, help="ONNX opset (18..23)."),
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
        "conv as reshape + GEMM), none, or auto: those measured to pay on the --latency-on backend (none without).",
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
    click.option("--batch", default="1:32:256", show_default=True, help="Engine batch range MIN:OPT:MAX."),
    click.option(
        "--seq-range",
        metavar="MIN:OPT:MAX",
        help="Text encoders: the engine's tokens-per-sequence range [1:SEQ:SEQ, SEQ the graph's --seq-len].",
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

int8_options = group(
    click.option(
        "--int8-calib",
        default=256,
        show_default=True,
        help="INT8 calibration images (text: documents): CORP's first N.",
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
        "--int8-batch",
        default=32,
        show_default=True,
        type=click.IntRange(1),
        help="The batch INT8 recipes are timed at on onnxruntime CPU (text: x the exported --seq-len tokens).",
    ),
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
        "--int4-calib-windows",
        default=CALIB_WINDOWS,
        show_default=True,
        help="INT4: calibration-document windows for gptq and --int4-keep-float.",
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


timing_group = group(
    click.option("--warmup-iters", default=Method.warmup_iters, show_default=True),
    click.option("--warmup-seconds", default=Method.warmup_seconds, show_default=True),
    click.option("--min-iters", default=Method.min_iters, show_default=True, help="Timed iterations, at least."),
    click.option("--min-seconds", default=Method.min_seconds, show_default=True, help="Timed seconds, at least."),
    into="timing",
)


def out_options(what: str) -> Callable:
    return group(
        click.option(
            "--out", type=click.Path(), help=f"{what} to write [default: runs/<MODEL>-s<SPARSITY %> or -macs<F %>]."
        ),
        click.option("--overwrite", is_flag=True, help="Replace --out if it exists."),
    )


def out_path(out: str | None, model: str, config: PruneConfig, overwrite: bool) -> str:
    """--out, or ``runs/<model>-s<percent>`` (``runs/deit_base-s50``; ``-macs40`` under ``--budget macs=0.4``; a
    model given by a path is named by its last part); checked writable before any work."""
    budget = config.budget
    tag = f"s{100 * config.sparsity:g}" if budget is None else f"{budget.kind}{100 * budget.fraction:g}"
    name = Path(model.rstrip("/")).name or model  # a folder (or org/name): its last part, not the whole path
    out = out or f"runs/{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}-{tag}"
    check_writable(out, overwrite)
    return out


ONNX_EXPORT = ("onnx", "onnxscript", "onnxruntime")
"""What every verified ONNX export imports: the graph format, torch's exporter, the runtime that verifies it."""


def onnx_needs(precisions: tuple[str, ...], simplify: bool = False) -> tuple[str, ...]:
    """The optional modules an export writing ``precisions`` needs (FP16 conversion, onnxslim when simplifying)."""
    fp16 = ("onnxconverter_common",) if "fp16" in precisions else ()
    return (*ONNX_EXPORT, *fp16, *(("onnxslim",) if simplify else ()))


def needs(purpose: str, *modules: str) -> None:
    """Fail in one line, before any expensive work, when a module ``purpose`` imports later is missing."""
    reason = missing(*modules)
    if reason:
        raise CorpError(f"{purpose} needs {reason}")


def typed(name: str) -> bool:
    """Whether the running command's option ``name`` came from the command line (not its default)."""
    ctx = click.get_current_context(silent=True)
    return ctx is not None and ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE


def prune_config(pruning: dict[str, Any], latency: dict[str, Any], **override: Any) -> PruneConfig:
    """The pruning group (``--sparsity``... ``--round-to``) and the latency group as one validated ``PruneConfig``,
    built once per command: ``--budget`` parsed, ``--speedup S`` turned into its latency ``Budget`` directly,
    both checked against the latency flags; ``override`` replaces fields (a sweep's sparsity).

    A ``--sparsity`` typed next to ``--budget``/``--speedup`` (which choose every width) is refused, not silently
    ignored. A latency budget prunes mlp,qk,v unless ``--target`` was typed (V channels are time too).
    """
    speedup, backend, budget = latency["speedup"], latency["latency_on"], pruning.get("budget")
    budget = parse_budget(budget) if isinstance(budget, str) else budget
    if speedup is not None:
        if typed("sparsity"):
            raise CorpError("--speedup chooses every block's widths; drop --sparsity or drop --speedup")
        if not speedup >= 1:
            raise CorpError(f"--speedup must be >= 1 (dense / pruned time), got {speedup:g}")
        if budget is not None:
            raise CorpError("--speedup S is --budget latency=1/S; pass one of the two")
        budget = Budget("latency", 1 / speedup)
    elif budget is not None and typed("sparsity"):
        raise CorpError("--budget chooses every block's widths; drop --sparsity or drop --budget")
    latency_budget = budget is not None and budget.kind == "latency"
    if latency_budget and backend is None:
        raise CorpError("a latency budget is measured on a backend: add --latency-on BACKEND (e.g. ort-cpu-fp32)")
    if not latency_budget and (backend is not None or latency["latency_table"] is not None):
        raise CorpError("--latency-on/--latency-table serve a latency budget: add --speedup S or --budget latency=F")
    if latency["latency_batch"] < 1:
        raise CorpError(f"--latency-batch must be >= 1, got {latency['latency_batch']}")
    fields = pruning | {"budget": budget} | override
    if latency_budget and not typed("target"):
        fields["target"] = "mlp,qk,v"
    return PruneConfig(**fields)


def recovery_setup(options: dict[str, Any]) -> Recovery | None:
    """The recovery group as a checked ``Recovery``, or None without a budget (CORP alone); ``--recover-lr`` or
    ``--recover-target`` typed without a budget is refused, not silently ignored."""
    steps, minutes = options["recover_steps"], options["recover_minutes"]
    if steps is None and minutes is None:
        if typed("recover_lr") or typed("recover_target"):
            raise CorpError(
                "--recover-lr/--recover-target set a recovery: add --recover-steps N or --recover-minutes M"
            )
        return None
    return Recovery(steps, minutes, options["recover_lr"], options["recover_target"])


def verify_options(verify: dict[str, Any]) -> VerifyOptions:
    """Two or more batch sizes; a given tolerance replaces the per-precision defaults."""
    batches = verify["verify_batches"]
    try:
        sizes = tuple(sorted({int(b) for b in batches.split(",")}))
    except ValueError:
        sizes = ()
    if len(sizes) < 2 or sizes[0] < 1:
        raise CorpError(f"--verify-batches needs two or more batch sizes >= 1 (e.g. 1,4), got {batches!r}")
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


def for_graph(options: BuildOptions, seq_len: int | None) -> BuildOptions:
    """``options`` for a text encoder of ``seq_len`` tokens (sequence range 1:seq_len:seq_len unless --seq-range
    gave one), or for an image model (``seq_len`` None), which has no sequence axis to give a range."""
    if seq_len is None:
        if options.sequence is not None:
            raise CorpError("--seq-range is for text encoders' engines; an image graph has no sequence axis")
        return options
    return replace(options, sequence=options.sequence or Profile(1, seq_len, seq_len))


def bench_method(timing: dict[str, Any]) -> Method:
    """The timing group as a bench ``Method``."""
    return Method(**timing)


ONNX_ONLY = ("int4",)
"""Precisions written as ONNX graphs only (no engine): INT4 weights (MatMulNBits) for decoders."""


def precisions(text: str) -> tuple[str, ...]:
    values = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in values if p not in PRECISIONS + ONNX_ONLY]
    if bad or not values:
        choices = ", ".join(PRECISIONS + ONNX_ONLY)
        raise CorpError(f"--precision takes a comma-separated list of {choices}, got {text!r}")
    return values


def calibration_source(calib_dir: str | None, calib: str | None, text: bool = False) -> str:
    """``--calib-dir``, ``synthetic`` or, for a ``text`` model, the packaged text mix's folder (``corpora.text_mix``,
    fetched on first use); neither is one line saying what to pass."""
    from corp_deploy.formats.offline.corpora import TEXT_MIX, text_mix

    if calib_dir is None and calib is None and text:
        raise CorpError(
            "no calibration text: pass --calib-dir DIR (.txt/.jsonl documents of your domain), --calib text-mix "
            "(packaged news, quotations, definitions and glosses; fetched once) or --calib synthetic for a smoke run "
            "on random tokens (structure and speed only)"
        )
    if calib == TEXT_MIX:
        if calib_dir is not None or not text:
            raise CorpError(f"--calib {TEXT_MIX} is a text model's calibration without --calib-dir; pass one of them")
        return str(text_mix())
    if calib is not None and calib != SYNTHETIC:
        raise CorpError(
            f"--calib accepts 'synthetic' or '{TEXT_MIX}', got {calib!r}; real images (or text) go in --calib-dir"
        )
    if calib_dir is not None and calib is not None:
        raise CorpError(
            "pass one of --calib-dir DIR (real images or text) or --calib synthetic (smoke tests), not both"
        )
    if calib_dir is None and calib is None:
        raise CorpError(
            "no calibration images: pass --calib-dir DIR (a few thousand unlabelled images of your domain, e.g. "
            f"ImageNet train); a smoke run on noise (structure and speed only, no accuracy): {_smoke_command()}"
        )
    return calib_dir or SYNTHETIC


def _smoke_command() -> str:
    """The command line as typed plus noise calibration, and random weights unless weights were chosen."""
    ctx = click.get_current_context()
    given = ctx.find_root().obj
    argv = ["corp-deploy", *(sys.argv[1:] if given is None else given)]
    chose = [p for p in ("weights", "checkpoint") if ctx.get_parameter_source(p) != click.core.ParameterSource.DEFAULT]
    return shlex.join(argv + ([] if chose else ["--weights", "random"]) + ["--calib", "synthetic"])
