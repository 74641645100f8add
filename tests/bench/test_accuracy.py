"""Accuracy evaluation: the statistics, the probe, ``corp-deploy eval`` and the demo's plumbing."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import TINY_CLI_ARGS, run, tiny_vit
from safetensors.torch import save_file

from corp_deploy.bench.accuracy import Tally, cosine, evaluate, fit_probe, kl_divergence, topk_hits

pytest.importorskip("onnxruntime")


def test_topk_kl_and_cosine_by_hand() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0], [0.0, 5.0, 1.0]])
    labels = torch.tensor([1, 1])
    assert topk_hits(logits, labels, 1) == 1
    assert topk_hits(logits, labels, 2) == 2
    assert topk_hits(logits, labels, 5) == 2  # k larger than the number of classes
    assert torch.allclose(kl_divergence(logits, logits), torch.zeros(2, dtype=torch.float64))
    p, q = torch.tensor([[0.0, 0.0]]), torch.tensor([[math.log(3.0), 0.0]])  # (1/2, 1/2) vs (3/4, 1/4)
    expected = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    assert kl_divergence(p, q).item() == pytest.approx(expected)
    assert cosine(torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 1.0]])).item() == pytest.approx(2**-0.5)


def _clusters(n: int, seed: int, dim: int = 16, classes: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, dim, generator=torch.Generator().manual_seed(0)) * 3
    labels = torch.arange(n) % classes
    return centres[labels] + torch.randn(n, dim, generator=g), labels


def test_probe_separates_clusters_and_is_chosen_on_held_out_data() -> None:
    x, y = _clusters(400, seed=1)
    probe = fit_probe(x, y, 4)
    test_x, test_y = _clusters(200, seed=2)
    assert topk_hits(probe(test_x), test_y, 1) / 200 > 0.95
    assert probe.ridge in (1e-4, 1e-3, 1e-2, 1e-1, 1.0)
    scrambled = test_x[:, torch.randperm(16, generator=torch.Generator().manual_seed(3))]
    assert topk_hits(probe(scrambled), test_y, 1) / 200 < 0.6  # features that drift lose the probe


def test_evaluate_tallies_every_runner_against_the_reference() -> None:
    weight = np.random.default_rng(0).standard_normal((12, 5)).astype(np.float32)
    dense = lambda x: x.reshape(len(x), -1) @ weight  # noqa: E731
    noisy = lambda x: dense(x) + 0.5 * np.random.default_rng(len(x)).standard_normal((len(x), 5)).astype(np.float32)  # noqa: E731
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 3, 2, 2, generator=g), torch.randint(0, 5, (8,), generator=g), 1) for _ in range(3)]
    result = evaluate({"dense": dense, "noisy": noisy}, "dense", batches, head=lambda t: t)
    d, n = result.results["dense"], result.results["noisy"]
    assert result.skipped == 3 and d["images"] == n["images"] == 24
    assert d["top1_agreement"] == 1.0 and d["kl"] == pytest.approx(0.0, abs=1e-12) and d["rel_error"] == 0.0
    assert 0 < n["top1_agreement"] < 1 and n["kl"] > 0 and n["cosine_mean"] < 1 and n["cosine_min"] <= n["cosine_mean"]
    labels = torch.cat([b[1] for b in batches])
    logits = torch.from_numpy(dense(torch.cat([b[0] for b in batches]).numpy()))
    assert d["top1"] == topk_hits(logits, labels, 1) / 24

    unlabelled = [(x, None, 0) for x, _, _ in batches]
    features_only = evaluate({"dense": dense, "noisy": noisy}, "dense", unlabelled).results["noisy"]
    assert set(features_only) == {"images", "cosine_mean", "cosine_min", "rel_error"}


def test_tally_of_an_empty_run_is_zeros_not_nan() -> None:
    assert Tally().result() == {"images": 0, "cosine_mean": 0.0, "cosine_min": 1.0, "rel_error": 0.0}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A prune-export folder of the tiny classifier, pruned from a checkpoint so the dense model rebuilds."""
    tmp = tmp_path_factory.mktemp("eval")
    checkpoint = tmp / "dense.safetensors"
    save_file(tiny_vit().state_dict(), str(checkpoint))
    images = _labelled_images(tmp / "images")
    out = tmp / "run"
    argv = ["prune-export", "deit_tiny", "--checkpoint", str(checkpoint), *TINY_CLI_ARGS, "--round-to", "4"]
    argv += ["--calib-dir", str(images), "--num-calib", "16", "--precision", "fp32", "--quiet", "--out", str(out)]
    from corp_deploy.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    return out


def _labelled_images(root: Path, n: int = 24) -> Path:
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(n):
        folder = root / f"class{i % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (36, 36, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return root


@pytest.mark.e2e
def test_eval_labelled_and_unlabelled_across_backends(run_dir, capsys) -> None:
    images = run_dir.parent / "images"
    code, out, err = run(["eval", str(run_dir), "--data-dir", str(images), "--batch-size", "5", "--quiet"], capsys)
    assert code == 0, err
    assert "24 images" in out and "(labelled)" in out
    for name in (
        "dense torch-cpu-fp32 (reference)",
        "pruned torch-cpu-fp32",
        "dense ort-cpu-fp32",
        "pruned ort-cpu-fp32",
    ):
        assert name in out  # bench's backend names
    assert "top-1" in out and "agree" in out and "cos mean" in out
    log = json.loads((run_dir / "eval.json").read_text())
    results = log[-1]["results"]
    assert results["dense ort-cpu-fp32"]["cosine_min"] > 0.99999  # the dense graph is the dense model
    assert results["pruned ort-cpu-fp32"]["top1_agreement"] == results["pruned torch-cpu-fp32"]["top1_agreement"]

    code, out, err = run(["eval", str(run_dir), "--images", str(images), "--num", "10", "--quiet"], capsys)
    assert code == 0, err
    log = json.loads((run_dir / "eval.json").read_text())
    assert len(log) >= 2 and log[-1]["images"] == 10 and not log[-1]["labelled"]
    pruned = log[-1]["results"]["pruned torch-cpu-fp32"]
    assert "top1" not in pruned and "top1_agreement" in pruned

    some = run_dir.parent / "some-unreadable"  # issue 50, item 12: an unreadable file was counted as scored
    some.mkdir()
    for i, f in enumerate(sorted(images.rglob("*.png"))[:3]):
        (some / f"{i}.png").write_bytes(f.read_bytes())
    (some / "broken.png").write_bytes(b"not an image")
    code, out, err = run(["eval", str(run_dir), "--images", str(some), "--quiet"], capsys)
    assert code == 0 and f"3 images from {some} (unlabelled; 1 unreadable, skipped)" in out, err
    log = json.loads((run_dir / "eval.json").read_text())
    assert log[-1]["images"] == 3 and log[-1]["skipped_files"] == 1


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "exactly one of --data-dir"),
        (["--data-dir", "X", "--images", "X"], "exactly one of --data-dir"),
        (["--images", "X", "--backends", "tensorflow"], "unknown backend tensorflow for eval; choose auto or from"),
        (["--images", "X", "--backends", "torch-cuda-fp16-graph"], "unknown backend torch-cuda-fp16-graph for eval"),
        (["--data-dir", "NOWHERE"], "not an ImageFolder tree"),
    ],
)
@pytest.mark.e2e
def test_bad_eval_input_is_one_line(run_dir, capsys, extra, message) -> None:
    extra = [str(run_dir.parent / "images") if a == "X" else a for a in extra]
    before = (run_dir / "eval.json").read_text() if (run_dir / "eval.json").exists() else None
    code, out, err = run(["eval", str(run_dir), *extra, "--quiet"], capsys)
    assert code == 1 and message in err and len(err.strip().splitlines()) == 1
    after = (run_dir / "eval.json").read_text() if (run_dir / "eval.json").exists() else None
    assert before == after


@pytest.mark.e2e
def test_eval_of_a_backbone_needs_a_probe(tmp_path, capsys) -> None:
    images = _labelled_images(tmp_path / "images")
    checkpoint = tmp_path / "dense.safetensors"
    save_file(tiny_vit(num_classes=0).state_dict(), str(checkpoint))
    out = tmp_path / "backbone"
    argv = ["prune", "deit_tiny", "--checkpoint", str(checkpoint), *TINY_CLI_ARGS, "--model-arg", "num_classes=0"]
    argv += ["--round-to", "4", "--calib-dir", str(images), "--num-calib", "16", "--quiet", "--out", str(out)]
    assert run(argv, capsys)[0] == 0
    code, _, err = run(["eval", str(out), "--data-dir", str(images), "--quiet"], capsys)
    assert code == 1 and "--probe-train" in err
    code, text, err = run(
        ["eval", str(out), "--data-dir", str(images), "--probe-train", str(images), "--quiet"], capsys
    )
    assert code == 0, err
    assert "linear probe fit on 24 dense features" in text
    record = json.loads((out / "eval.json").read_text())[-1]
    assert record["probe"]["train_images"] == 24 and "top1" in record["results"]["pruned torch-cpu-fp32"]
