"""``corp-deploy``: a thin command-line layer over ``corp_deploy.api``.

Every user error ends as one ``error: ...`` line on stderr and a non-zero exit code, never a
traceback; outputs appear only when complete.
"""

from __future__ import annotations

import sys
import warnings

import click

from corp_deploy import api
from corp_deploy.artifact import check_writable
from corp_deploy.errors import CorpError
from corp_deploy.models import create_model, parse_model_args, resolve_name
from corp_deploy.pruner import DEFAULT_RIDGE, PruneConfig
from corp_deploy.report import format_report


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="corp-deploy")
def cli() -> None:
    """Prune vision transformers with CORP and export them for deployment."""


@cli.command()
@click.argument("model")
@click.option("--weights", default="pretrained", show_default=True, help="pretrained (timm hub) or random.")
@click.option("--checkpoint", type=click.Path(dir_okay=False), help="Weights file (.safetensors or .pth/.pt).")
@click.option("--model-arg", multiple=True, metavar="KEY=VALUE", help="Extra timm.create_model argument (repeatable).")
@click.option("--calib-dir", type=click.Path(), help="Folder of unlabeled calibration images (recursive).")
@click.option("--calib", type=str, help="'synthetic': noise images, for smoke tests only.")
@click.option("--num-calib", default=4000, show_default=True, help="Calibration images to use (paper: 4000).")
@click.option("--calib-batch-size", default=64, show_default=True)
@click.option("--workers", type=int, help="Image decoding processes [default: min(8, CPUs)].")
@click.option("--seed", default=0, show_default=True, help="Seed of the calibration subset.")
@click.option("--device", default="auto", show_default=True, help="auto (GPU if present), cpu or cuda[:N].")
@click.option("--sparsity", default=0.5, show_default=True, help="Fraction of channels to remove, in [0, 1).")
@click.option("--mlp-sparsity", type=float, help="Override --sparsity for MLP hidden channels.")
@click.option("--attn-sparsity", type=float, help="Override --sparsity for attention Q/K dims.")
@click.option("--target", default="both", show_default=True, help="mlp, attn or both.")
@click.option("--ranker", default="combined", show_default=True, help="energy, magnitude, combined or active.")
@click.option(
    "--compensation",
    default="corp",
    show_default=True,
    help="corp (closed form), mean (VBP mean shift) or none (plain removal).",
)
@click.option("--ridge", default=DEFAULT_RIDGE, show_default=True, help="Relative ridge damping alpha.")
@click.option("--round-to", default=8, show_default=True, help="Kept widths are multiples of this.")
@click.option("--out", required=True, type=click.Path(), help="Artifact folder to write.")
@click.option("--overwrite", is_flag=True, help="Replace --out if it exists.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def prune(
    model: str,
    weights: str,
    checkpoint: str | None,
    model_arg: tuple[str, ...],
    calib_dir: str | None,
    calib: str | None,
    num_calib: int,
    calib_batch_size: int,
    workers: int | None,
    seed: int,
    device: str,
    sparsity: float,
    mlp_sparsity: float | None,
    attn_sparsity: float | None,
    target: str,
    ranker: str,
    compensation: str,
    ridge: float,
    round_to: int,
    out: str,
    overwrite: bool,
    quiet: bool,
) -> None:
    """Prune MODEL (timm name or alias such as deit_base) with CORP and write an artifact to --out."""
    config = PruneConfig(
        sparsity=sparsity,
        mlp_sparsity=mlp_sparsity,
        attn_sparsity=attn_sparsity,
        target=target,
        ranker=ranker,
        compensation=compensation,
        ridge=ridge,
        round_to=round_to,
    )
    source = _calibration_source(calib_dir, calib)
    check_writable(out, overwrite)
    args = parse_model_args(model_arg)
    device_ = api.resolve_device(device)
    net = create_model(model, weights=weights, checkpoint=checkpoint, model_args=args)
    batches, total = api.calibration_batches(net, source, num_calib, calib_batch_size, seed, workers)
    result = api.prune(net, batches, config, device_, total=total, progress=not quiet)
    result.report["calibration"] |= {"source": str(source), "seed": seed}
    provenance = f"checkpoint:{checkpoint}" if checkpoint else weights
    path = api.save(result, out, resolve_name(model), args, weights=provenance, overwrite=overwrite)
    click.echo(format_report(result.report))
    click.echo(f"wrote {path}/ (model.safetensors, corp.json); load it with corp_deploy.load_pruned({str(path)!r})")


def _calibration_source(calib_dir: str | None, calib: str | None) -> str:
    if calib is not None and calib != api.SYNTHETIC:
        raise CorpError(f"--calib accepts only 'synthetic', got {calib!r}; real images go in --calib-dir")
    if (calib_dir is None) == (calib is None):
        raise CorpError("pass exactly one of --calib-dir DIR (real images) or --calib synthetic (smoke tests)")
    return calib_dir or api.SYNTHETIC


def _one_line_warning(message, category, filename, lineno, line=None) -> str:  # noqa: ANN001
    return f"warning: {message}\n"


def main(argv: list[str] | None = None) -> None:
    warnings.formatwarning = _one_line_warning
    try:
        code = cli.main(args=argv, prog_name="corp-deploy", standalone_mode=False)
    except CorpError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    except click.ClickException as e:
        click.echo(f"error: {e.format_message()} (see corp-deploy --help)", err=True)
        sys.exit(e.exit_code)
    except (KeyboardInterrupt, click.exceptions.Abort):
        click.echo("error: interrupted; nothing was written", err=True)
        sys.exit(130)
    sys.exit(code or 0)
