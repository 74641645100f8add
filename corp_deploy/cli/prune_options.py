"""The pruning command's option groups and their converters: what to prune and how (``--sparsity``... ``--round-to``),
a latency budget (``--speedup``, ``--latency-on``...), label-free recovery, and ``prune_options``, every input
``prune`` and ``prune-export`` share. ``prune_config`` and ``recovery_setup`` turn them into checked config objects.
"""

from __future__ import annotations

from typing import Any

import click

from corp_deploy.base.errors import CorpError
from corp_deploy.cli.options import calib_options, group, model_options, quiet_option, typed
from corp_deploy.core.compensation import DEPTH_FITS
from corp_deploy.core.config import (
    CRITERIA,
    DEFAULT_RIDGE,
    DEFAULT_TARGET,
    LAYOUTS,
    Budget,
    PruneConfig,
    parse_budget,
)
from corp_deploy.core.fit import COMPENSATIONS
from corp_deploy.core.ranking import RANKERS, SELECTIONS
from corp_deploy.core.recover import KEPT_INPUTS, TARGETS, Recovery

method_options = group(
    click.option(
        "--target",
        default=",".join(DEFAULT_TARGET),
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
        help="Instead of a sparsity: keep fraction F of the dense MACs, or of the dense latency measured on "
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
    "(the same result as one pass). [default: planned from the memory available (MemAvailable, the cgroup's limit, "
    "the GPU's free memory; CORP_DEPLOY_MEMORY_GIB overrides): one pass when it fits, else 1 GiB groups]",
)


latency_options = group(
    click.option(
        "--speedup",
        type=float,
        help="Instead of a sparsity: be S times faster (a latency budget: 1/S of the dense time).",
    ),
    click.option(
        "--latency-on",
        metavar="BACKEND",
        help="The bench backend a latency budget is measured on (e.g. ort-cpu-fp32, torch-cpu-fp32).",
    ),
    click.option(
        "--latency-batch-size",
        "latency_batch",
        default=32,
        show_default=True,
        help="Batch size the latency budget is for.",
    ),
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
        help="Recovery's objective: blocks (each pruned block reproduces its dense block's output, both fed the "
        "dense model's input of that block), hidden (the same, fed the pruned model's own input: end to end), or "
        "features (the pruned model reproduces the dense model's final features).",
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


def prune_config(pruning: dict[str, Any], latency: dict[str, Any], **override: Any) -> PruneConfig:
    """The pruning group (``--sparsity``... ``--round-to``) and the latency group as one validated ``PruneConfig``,
    built once per command: ``--budget`` parsed, ``--speedup S`` turned into its latency ``Budget`` directly,
    both checked against the latency flags; ``override`` replaces fields (a sweep's sparsity).

    A ``--sparsity`` typed next to ``--budget``/``--speedup`` (which choose every width) is refused, not silently
    ignored. A ``--target`` left out is left to the API (``PruneConfig.target`` None: ``api.for_model``).
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
        raise CorpError(f"--latency-batch-size must be >= 1, got {latency['latency_batch']}")
    fields = pruning | {"budget": budget} | override
    if not typed("target"):
        fields["target"] = None
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
