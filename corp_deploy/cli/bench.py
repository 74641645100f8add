"""``bench``: dense against pruned (and the quantize-only baseline) from a run folder, timed on every backend."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import click

from corp_deploy.base.env import describe_cpu
from corp_deploy.base.errors import CorpError
from corp_deploy.base.fsio import atomic_file, check_writable
from corp_deploy.base.timing import Method
from corp_deploy.bench import gate
from corp_deploy.bench.backends import RunFolder, select_backends
from corp_deploy.bench.baseline import quantize_only_baseline
from corp_deploy.bench.decode import (
    DECODE_BACKENDS,
    NEW_TOKENS,
    PROMPTS,
    decode_benchmark,
    parse_prompts,
    select_decoders,
)
from corp_deploy.bench.report import format_markdown, format_table, to_csv
from corp_deploy.bench.report import plot as draw
from corp_deploy.bench.run import benchmark, parse_batch_sizes
from corp_deploy.cli.options import group, needs

timing_group = group(
    click.option("--warmup-iters", default=Method.warmup_iters, show_default=True),
    click.option("--warmup-seconds", default=Method.warmup_seconds, show_default=True),
    click.option("--min-iters", default=Method.min_iters, show_default=True, help="Timed iterations, at least."),
    click.option("--min-seconds", default=Method.min_seconds, show_default=True, help="Timed seconds, at least."),
    into="timing",
)


def bench_method(timing: dict[str, Any]) -> Method:
    """The timing group as a bench ``Method``."""
    return Method(**timing)


@click.command()
@click.argument("run_dir", type=click.Path())
@click.option("--batch-sizes", help="Comma-separated batch sizes [1,8,32; a decoder's 1,8].")
@click.option(
    "--backends",
    default="auto",
    show_default=True,
    help="auto: every backend this machine can run (CUDA graphs, torch-cuda-*-graph, included) except torch.compile's "
    "(torch-cuda-*-compile[-graph]), which compile each model and batch size first: minutes in all. "
    "Or a comma list (see corp_deploy.bench.backends).",
)
@click.option(
    "--seq-len", type=int, help="Text encoders: tokens per sequence [the --seq-len the run was exported for]."
)
@click.option(
    "--prompt-lens",
    default=PROMPTS,
    show_default=True,
    help="Decoders: prompt lengths (tokens); each is timed as prefill, then decode one token at a time.",
)
@click.option(
    "--new-tokens",
    default=NEW_TOKENS,
    show_default=True,
    help="Decoders: decode steps per prompt before a fresh prefill (the context stays within prompt + this).",
)
@click.option("--repeats", default=1, show_default=True, help="Repeat the measurement; report medians.")
@click.option("--threads", type=int, help="CPU threads for PyTorch and onnxruntime [default: theirs].")
@click.option("--include-copies", is_flag=True, help="Time host->device input and device->host output copies too.")
@timing_group
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write the versioned record here.")
@click.option("--csv", "csv_out", type=click.Path(dir_okay=False), help="Write every statistic as CSV.")
@click.option("--markdown", type=click.Path(dir_okay=False), help="Write the table as markdown.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Write a PNG: throughput and p50 vs batch size.")
@click.option("--baseline", type=click.Path(dir_okay=False), help="Bench JSON to gate against.")
@click.option("--max-regression", default="5%", show_default=True, help="Gate threshold.")
@click.option(
    "--gate",
    "gate_mode",
    type=click.Choice(gate.MODES),
    default="absolute",
    show_default=True,
    help="absolute (p50) or ratio (speedup) against --baseline; quantize-only: pruned INT8 against the dense model "
    "quantized by onnxruntime's quantize_dynamic (a decoder: pruned INT4 against genai's builder -p int4 of the dense "
    "model), timed in this run (no --baseline).",
)
@click.option(
    "--no-quantize-only",
    is_flag=True,
    help="Leave out the quantize-only baseline (the dense graph through onnxruntime's quantize_dynamic; a decoder's: "
    "genai's builder -p int4 of the dense model, baseline-genai-int4/), otherwise timed beside dense and pruned on "
    "the onnxruntime CPU backends (a decoder's: genai-cpu-int4).",
)
def bench(
    run_dir: str,
    batch_sizes: str | None,
    backends: str,
    seq_len: int | None,
    prompt_lens: str,
    new_tokens: int,
    repeats: int,
    threads: int | None,
    include_copies: bool,
    timing: dict[str, Any],
    json_out: str | None,
    csv_out: str | None,
    markdown: str | None,
    plot: str | None,
    baseline: str | None,
    max_regression: str,
    gate_mode: str,
    no_quantize_only: bool,
) -> None:
    """Time dense against pruned from a prune-export RUN_DIR on every backend this machine has.

    A text encoder's run is timed on full sequences of --seq-len tokens: sentences/s and tokens/s. A decoder's
    (OPT, Llama, Mistral, Qwen2) is timed by phase at each --prompt-lens: prefill tokens/s, and decode ms/token and
    tokens/s with the key/value cache (corp_deploy.bench.decode); the gate compares each phase.
    """
    run = RunFolder.open(run_dir, seq_len)
    if run.decoder and (seq_len is not None or plot or include_copies):
        raise CorpError(
            "--seq-len, --plot and --include-copies are for encoders and images; a decoder takes --prompt-lens"
        )
    sizes = parse_batch_sizes(batch_sizes or ("1,8" if run.decoder else "1,8,32"))
    prompts = parse_prompts(prompt_lens, run.graph.get("max_positions", 0), new_tokens) if run.decoder else []
    method = bench_method(timing)
    limit = gate.parse_fraction(max_regression)
    quantize_only = gate_mode == gate.QUANTIZE_ONLY
    if quantize_only and (baseline or no_quantize_only):
        raise CorpError(
            "--gate quantize-only gates this run's pruned INT8 (a decoder's INT4) against the quantize-only baseline "
            "timed beside it: run it without --baseline and --no-quantize-only"
        )
    reference = gate.load_baseline(baseline) if baseline else None
    for path in (json_out, csv_out, markdown, plot):
        if path:
            check_writable(path, overwrite=True)
    if plot:
        needs("--plot", "matplotlib")
    if run.decoder:
        chosen, skipped = select_decoders(backends, run)
        click.echo(f"method: {method.describe()}; {repeats} repeat(s); decode: {new_tokens} tokens per prefill")
        record = decode_benchmark(
            run, chosen, sizes, prompts, method, repeats, new_tokens, threads, skipped, click.echo, not no_quantize_only
        )
    else:
        chosen, skipped = select_backends(backends, run, elsewhere=("decoder runs", DECODE_BACKENDS))
        click.echo(
            f"method: {method.describe()}; {repeats} repeat(s); inputs on the device"
            + (" (host copies timed)" if include_copies else " (copies not timed)")
        )
        with tempfile.TemporaryDirectory(prefix="corp-bench-baseline-") as tmp:
            base = None if no_quantize_only else quantize_only_baseline(run, chosen, Path(tmp), skipped)
            record = benchmark(
                run, chosen, sizes, method, repeats, include_copies, threads, skipped, click.echo, base and base[0]
            )
        if base:
            record["quantize_only_baseline"] = base[1]
    if not record["results"]:  # a record of nothing would read as a run that passed
        why = "; ".join(f"{k}: {v}" for k, v in record["skipped"].items())
        raise CorpError(f"nothing measured: every backend was skipped ({why}); pass --backends with one that runs here")
    env = record["environment"]
    click.echo(
        f"{record['model']} | cpu {describe_cpu(env['cpu_features'])} ({env['torch_threads']} threads)"
        + (
            f" | gpu {env['gpu']}, CUDA {env['cuda']}, driver {env['driver']}, TF32 matmul {env['tf32_matmul']}"
            if "gpu" in env
            else ""
        )
    )
    click.echo(format_table(record))
    outputs = {
        json_out: lambda: json.dumps(record, indent=2) + "\n",
        csv_out: lambda: to_csv(record),
        markdown: lambda: format_markdown(record),
    }
    for path, text in outputs.items():
        if path:
            with atomic_file(path, overwrite=True) as tmp:
                tmp.write_text(text())
    if plot:
        with atomic_file(plot, overwrite=True) as tmp:
            draw(record, tmp)
    if reference is not None or quantize_only:
        checks = (
            gate.against_quantize_only(record, limit)
            if quantize_only
            else gate.compare(record, reference, limit, gate_mode)
        )
        click.echo(gate.format_checks(checks, limit, gate_mode))
        bad = sum(c.regressed for c in checks)
        if bad:
            raise CorpError(f"latency regression: {bad} of {len(checks)} checks beyond {limit:.1%} ({gate_mode} gate)")
