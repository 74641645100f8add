"""``eval``: the accuracy of a run's dense and pruned models on every backend that runs; a text run's
perplexity or held-out drop."""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import click
import torch

from corp_deploy.apps import floor
from corp_deploy.base.env import device_name
from corp_deploy.base.errors import CorpError
from corp_deploy.base.fsio import check_writable
from corp_deploy.bench.accuracy import Evaluation, append_evaluation, evaluate_run, format_evaluation
from corp_deploy.bench.report import skipped_lines
from corp_deploy.families.registry import get as get_family
from corp_deploy.formats import sources
from corp_deploy.formats.artifact import META_FILE, read_meta


@click.command("eval")
@click.argument("run_dir", type=click.Path())
@click.option("--data-dir", type=click.Path(), help="Labelled ImageFolder (a subfolder per class): top-1/top-5.")
@click.option("--images", type=click.Path(), help="Unlabelled images: agreement, KL and cosine vs the dense model.")
@click.option("--probe-train", type=click.Path(), help="Labelled ImageFolder to fit a linear probe (backbones).")
@click.option(
    "--num",
    default=10**9,
    show_default="all",
    help="Evaluate a seeded subset of this many images (with --text: the first this many windows).",
)
@click.option("--batch-size", type=int, help="Images (default 32) or text windows (default 1) per batch.")
@click.option(
    "--backends",
    default="auto",
    show_default=True,
    help="auto (torch-cpu-fp32, ort-cpu-fp32, ort-cpu-int8, tensorrt-fp32/fp16/int8: what the folder holds and "
    "this machine runs), or a comma list of bench's backends (eager ones: torch-cuda-fp16, ort-cuda-fp32...).",
)
@click.option(
    "--text",
    type=click.Path(),
    help="Text runs: this .txt/.jsonl folder's evaluation part (decoders: perplexity; encoders: pooled embedding "
    "cosine to the dense model, and accuracy by a probe when the documents come from class folders).",
)
@click.option("--seq-len", type=int, help="With --text: tokens per window [default: the positions, at most 2048].")
@click.option("--all-text", is_flag=True, help="With --text: every document (calibration never read this folder).")
@click.option("--checkpoint", type=click.Path(dir_okay=False), help="The dense weights, if the recorded ones moved.")
@click.option("--seed", default=0, show_default=True)
@click.option("--workers", default=0, show_default=True, help="Image decoding worker processes.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
def eval_command(
    run_dir: str, quiet: bool, text: str | None, seq_len: int | None, all_text: bool, **kwargs: Any
) -> None:
    """Accuracy of dense and pruned models from RUN_DIR on every backend that can run; appended to RUN_DIR/eval.json.

    With --text, RUN_DIR is a text run (a prune-export or sweep folder, a prune artifact; a decoder also a
    transformers folder or hf:NAME). A decoder's measure is its perplexity (SparseGPT's protocol), for an artifact the
    dense model it was pruned from too, when it loads; an encoder's the held-out drop (``bench.drop``): the pooled
    embedding cosine to the dense model (and a probe's accuracy with class folders), on every model the run holds.
    """
    encoder = _text_run(run_dir, text)
    if text is not None:
        if kwargs["data_dir"] or kwargs["images"] or kwargs["probe_train"]:
            raise CorpError("--text measures a text model; --data-dir, --images and --probe-train are image sets")
        if encoder:
            _encoder_eval(run_dir, text, seq_len, all_text, kwargs)
            return
        source = str(floor.artifact_of(run_dir)) if Path(run_dir, "pruned", META_FILE).is_file() else run_dir
        batch_size, results, local = kwargs["batch_size"] or 1, {}, Path(run_dir).is_dir()  # hf:NAME: no folder
        if local:
            check_writable(Path(run_dir) / "eval.json", overwrite=True)
        lines = floor.decoder_perplexities(
            source, text, seq_len, all_text, batch_size, kwargs["num"], not quiet, results
        )
        for line in lines:
            click.echo(line)
        if local:
            record = {"metric": "perplexity", "text": str(text), "results": results}
            record |= {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": device_name(torch.device("cpu"))}
            click.echo(f"appended to {append_evaluation(run_dir, record)}")
        return
    kwargs["batch_size"] = kwargs["batch_size"] or 32
    check_writable(Path(run_dir) / "eval.json", overwrite=True)
    dense = functools.partial(sources.dense_original, checkpoint=kwargs.pop("checkpoint"))
    record = evaluate_run(run_dir, dense=dense, progress=not quiet, **kwargs)
    record |= {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": device_name(torch.device("cpu"))}
    for line in skipped_lines(record["skipped_backends"]):
        click.echo(line)
    probe = record["probe"]
    header = (
        f"{record['images']} images from {record['data']} ({'labelled' if record['labelled'] else 'unlabelled'}"
        + (f"; {record['skipped_files']} unreadable, skipped" if record["skipped_files"] else "")
        + "), "
        f"input {'x'.join(map(str, record['input_size']))}"
        + (f"; linear probe fit on {probe['train_images']} dense features (ridge {probe['ridge']:g})" if probe else "")
    )
    click.echo(format_evaluation(Evaluation(record["reference"], record["results"]), header))
    click.echo(f"appended to {append_evaluation(run_dir, record)}")


def _text_run(run_dir: str, text: str | None) -> bool:
    """Whether RUN_DIR holds a text encoder (its family, read from corp.json); one line when a text run comes
    without --text (an image option would not fit it)."""
    try:
        family = get_family(read_meta(floor.artifact_of(run_dir))["family"])
    except CorpError:
        return False  # a transformers folder or hf:NAME (decoders), or an error eval's own paths report
    if family is None or family.modality != "text":
        return False
    if text is None:
        kind = "decoder" if family.causal else "text encoder"
        raise CorpError(f"{run_dir} holds a {kind}: pass --text DIR, a .txt/.jsonl folder of held-out text")
    return not family.causal


def _encoder_eval(run_dir: str, text: str, seq_len: int | None, all_text: bool, kwargs: dict[str, Any]) -> None:
    """``eval --text`` of a text encoder's run: ``floor.evaluate_text``, printed and appended to eval.json."""
    num = min(kwargs["num"], floor.HELDOUT_NUM * 4)
    record = floor.evaluate_text(run_dir, text, (), all_text, num, seq_len, kwargs["batch_size"] or 16, kwargs["seed"])
    record |= {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": device_name(torch.device("cpu"))}
    click.echo(f"held-out: {floor.heldout_words(record['heldout'])}")
    click.echo(floor.format_scores(record))
    click.echo(f"appended to {append_evaluation(run_dir, record)}")
