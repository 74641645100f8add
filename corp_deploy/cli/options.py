"""The mechanism every command's options share, and the groups several commands take (the model, its calibration
data, the output folder, the precisions).

A group with ``into=NAME`` hands its flags to the command as one dict ``NAME``, so a command passes
the group to its converter (``prune_config``, ``verify_options``, ``build_options``, ``bench_method``) instead
of repeating the parameter list. Choices come from the library's own tuples. Each stage's own groups live beside its
command: ``prune_options``, ``export_options``, ``quantize_options``, and ``bench``'s timing group in ``bench``.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from corp_deploy.base.deps import missing
from corp_deploy.base.errors import CorpError
from corp_deploy.base.fsio import check_writable
from corp_deploy.core.config import PruneConfig
from corp_deploy.families.timm.models import WEIGHTS
from corp_deploy.formats.data import SYNTHETIC
from corp_deploy.formats.precisions import FP16, FP32, INT8

CALIB_IMAGES = 4000
SMOKE_IMAGES = 64  # noise only has to exercise the pass: enough for the statistics, minutes not hours on a CPU
TEXT_SEQUENCES = 128
"""Default calibration sequences of a text model: the paper's OPT count (128 C4 sequences)."""

RENAMED = {
    "--int8": f"--precision {FP32.name},{FP16.name},{INT8.name}",
    "--fp16": f"--precision {FP32.name},{FP16.name}",
    "--batch": "--batch-range",
    "--verify-batches": "--verify-batch-sizes",
    "--latency-batch": "--latency-batch-size",
    "--int8-batch": "--int8-batch-size",
}
"""Flags renamed for one vocabulary (issue 50, item 13), old -> new. A precision is chosen only with --precision; a
batch flag is ``[X-]batch-size`` (one size), ``[X-]batch-sizes`` (a list) or ``batch-range`` (an engine profile
MIN:OPT:MAX, as ``--seq-range``). No command declares an old flag: a script that passes one is told the new
spelling in one line (``renamed``) instead of a "no such option" that cannot guess it."""


def renamed(error: click.NoSuchOption) -> str | None:
    """The one-line error for an old flag in ``RENAMED`` (None for any other unknown flag)."""
    new = RENAMED.get(error.option_name)
    return None if new is None else f"{error.option_name} is now {new} (one vocabulary across commands)"


def group(*decorators: Callable, into: str | None = None) -> Callable:
    """Apply click options as one decorator; with ``into``, the command gets their values as one dict."""

    def apply(f: Callable) -> Callable:
        if into is not None:
            f = _collect(f, into, _names(decorators))
        for decorator in reversed(decorators):
            f = decorator(f)
        return f

    return apply


def command_line() -> str:
    """The running command line, as a user would type it again: what a run folder's README says made it."""
    given = click.get_current_context().find_root().obj
    return shlex.join(["corp-deploy", *(sys.argv[1:] if given is None else given)])


NOT_RESULTS = frozenset({"out", "overwrite", "resume", "quiet", "verbose"})
"""Options that change where results go or what is printed, never the results: outside a resume's fingerprint."""


def result_options(*which: str) -> dict[str, Any]:
    """The running command's options that change its results, by their longest flag (arguments by name), but not
    ``which`` (those that choose which results, e.g. a sweep's points): the fingerprint a resumable record stores
    and ``--resume`` compares (``steps.check_resume``)."""
    ctx = click.get_current_context()
    found = {}
    for p in ctx.command.params:
        if p.name in NOT_RESULTS or p.name in which or p.name not in ctx.params:
            continue
        flag = max(p.opts, key=len) if isinstance(p, click.Option) else p.name.upper()
        found[flag] = json.loads(json.dumps(ctx.params[p.name], default=str))  # tuples as lists, as read back
    return found


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
    fp16 = ("onnxconverter_common",) if FP16.name in precisions else ()
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
