"""The CUDA paths: statistics, pruning, half-precision runners and CUDA-event timing on a real GPU.

Every test here is marked ``gpu`` and skips with the reason on a machine without CUDA; on a GPU
machine ``make gpu-suite`` (or ``pytest -m gpu``) runs them. CPU float64 is the ground truth.
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import pytest
import torch
from helpers import PRUNE, run, tiny_batches, tiny_vit

from corp_deploy.base.timing import Method
from corp_deploy.bench.backends import (
    MODELS,
    RunFolder,
    compile_model,
    cuda_step,
    select_backends,
    torch_forward,
    torch_model,
)
from corp_deploy.bench.run import benchmark
from corp_deploy.cli import main
from corp_deploy.core.config import PruneConfig
from corp_deploy.core.pruner import calibrate, prune_model
from corp_deploy.plan.width_plan import plan_widths

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible"),
]

CONFIG = PruneConfig(sparsity=0.5, round_to=4)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error; an all-zero reference (e.g. a LayerNorm bias at init) must match absolutely."""
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm()) if b.norm() > 0 else float((a - b).norm())


@pytest.fixture(autouse=True)
def _no_tf32():
    """Exact fp32 on the GPU (cuDNN convolutions default to TF32, which would blur the comparison)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_cuda_statistics_equal_cpu_float64_sums() -> None:
    batches = tiny_batches()
    exact = calibrate(tiny_vit().double(), [(x.double(), n) for x, n in batches], CONFIG, "cpu", progress=False)
    cuda = calibrate(tiny_vit().cuda(), batches, CONFIG, "cuda", progress=False)
    assert cuda.images == exact.images == 48
    assert exact.mlp.keys() == cuda.mlp.keys() and exact.qk.keys() == cuda.qk.keys() and exact.qk  # not vacuous
    for i in exact.mlp:
        assert cuda.mlp[i].sum.device.type == "cuda"
        assert _rel(cuda.mlp[i].sum, exact.mlp[i].sum) < 1e-5
        assert _rel(cuda.mlp[i].outer, exact.mlp[i].outer) < 1e-5
        assert _rel(cuda.mlp[i].active, exact.mlp[i].active) < 1e-3  # a token near |x| = eps may flip
    for i in exact.qk:
        assert _rel(cuda.qk[i].moment, exact.qk[i].moment) < 1e-5


def test_cuda_prune_equals_cpu_prune() -> None:
    batches = tiny_batches()
    cpu_model, cuda_model = tiny_vit(), tiny_vit().cuda()
    stats = calibrate(cpu_model, batches, CONFIG, "cpu", progress=False)
    cpu_report = prune_model(cpu_model, stats, CONFIG, plan_widths(cpu_model, CONFIG, stats))
    stats = calibrate(cuda_model, batches, CONFIG, "cuda", progress=False)
    cuda_report = prune_model(cuda_model, stats, CONFIG, plan_widths(cuda_model, CONFIG, stats))
    cpu_state, cuda_state = cpu_model.state_dict(), cuda_model.state_dict()
    assert cpu_state.keys() == cuda_state.keys()
    for name, ref in cpu_state.items():
        assert cuda_state[name].shape == ref.shape, name
        assert _rel(cuda_state[name], ref) < 1e-4, name
    for ours, theirs in zip(cuda_report, cpu_report, strict=True):
        assert ours["mlp"]["rel_error"]["corp"] == pytest.approx(theirs["mlp"]["rel_error"]["corp"], rel=1e-3)
    x = torch.randn(4, 3, 32, 32)
    with torch.inference_mode():
        assert _rel(cuda_model(x.cuda()), cpu_model(x)) < 1e-4


def test_a_graphed_forward_keeps_what_it_reads_alive() -> None:
    """The graph reads the weights and the static input at fixed addresses: dropping every other reference and
    emptying the allocator's cache (as each later capture does) must not change a replay (it read unmapped memory,
    an illegal access, on an H200 on 2026-11-26)."""
    model = tiny_vit().cuda().eval()
    forward = torch_forward(model, torch.randn(2, 3, 32, 32, device="cuda"), graph=True)
    expected = forward().clone()
    del model
    gc.collect()
    torch.cuda.empty_cache()
    scribble = torch.full((1 << 22,), float("nan"), device="cuda")  # whatever was freed is reused now
    assert torch.equal(forward(), expected) and scribble.isnan().all()


@pytest.mark.parametrize(("dtype", "min_cosine"), [(torch.float16, 0.999), (torch.bfloat16, 0.99)])
def test_pruned_model_runs_in_half_precision_on_cuda(dtype, min_cosine) -> None:
    model = tiny_vit()
    stats = calibrate(model, tiny_batches(), CONFIG, "cpu", progress=False)
    prune_model(model, stats, CONFIG, plan_widths(model, CONFIG, stats))
    x = torch.randn(8, 3, 32, 32)
    with torch.inference_mode():
        ref = model(x)
        out = model.to("cuda", dtype)(x.to("cuda", dtype)).float().cpu()
    cosine = torch.nn.functional.cosine_similarity(out, ref, dim=-1)
    assert out.isfinite().all() and cosine.min() > min_cosine


def test_cuda_event_step_times_the_gpu_work_it_encloses() -> None:
    cycles = 50_000_000  # ~25-40 ms at 1.2-2 GHz

    def timed(n: int) -> tuple[float, float]:
        step = cuda_step(lambda: torch.cuda._sleep(n))
        step()  # warm-up
        wall = time.perf_counter()
        gpu = step()
        return gpu, time.perf_counter() - wall

    short_gpu, _ = timed(cycles // 10)
    long_gpu, long_wall = timed(cycles)
    assert 0 < short_gpu < long_gpu <= long_wall + 1e-3  # events are synchronised: never more than wall time
    assert long_gpu / short_gpu > 5  # it measures the GPU work, not the launch


@pytest.fixture(scope="module")
def cuda_run(tmp_path_factory) -> Path:
    """A prune-export folder of the tiny model, pruned on the GPU (engines for batch 1..8 where TensorRT is)."""
    out = tmp_path_factory.mktemp("cuda") / "run"
    prune_export = ["prune-export", *PRUNE[1:], "--calib", "synthetic", "--device", "cuda", "--precision", "fp32"]
    with pytest.raises(SystemExit) as done:
        main([*prune_export, "--batch-range", "1:4:8", "--out", str(out)])
    assert done.value.code == 0
    return out


@pytest.mark.e2e
def test_prune_and_bench_cli_on_cuda(cuda_run, tmp_path, capsys) -> None:
    meta = json.loads((cuda_run / "pruned" / "corp.json").read_text())
    assert meta["report"]["device"].startswith("cuda")
    assert meta["report"]["memory"]["cuda_peak_mib"] > 0
    record = tmp_path / "bench.json"
    backends = "torch-cuda-fp32,torch-cuda-fp16,torch-cuda-bf16"
    code, stdout, stderr = run(
        ["bench", str(cuda_run), "--backends", backends, "--batch-sizes", "1,4", "--warmup-iters", "2"]
        + ["--warmup-seconds", "0", "--min-iters", "5", "--min-seconds", "0", "--json", str(record)],
        capsys,
    )
    assert code == 0, stderr
    results = json.loads(record.read_text())
    assert results["environment"]["gpu"] == torch.cuda.get_device_name()
    rows = {(r["backend"], r["model"], r["batch"]) for r in results["results"]}
    assert rows == {(b, m, n) for b in backends.split(",") for m in ("dense", "pruned") for n in (1, 4)}
    assert all(r["p50_ms"] > 0 and r["device"] == torch.cuda.get_device_name() for r in results["results"])


@pytest.mark.e2e
def test_graph_and_compile_backends_bench_dense_and_pruned_with_eager_outputs(cuda_run) -> None:
    folder = RunFolder.open(cuda_run)
    names = "torch-cuda-fp16-graph,torch-cuda-fp16-compile,torch-cuda-fp16-compile-graph"
    chosen, _ = select_backends(names, folder)
    method = Method(warmup_iters=2, warmup_seconds=0, min_iters=5, min_seconds=0)
    record = benchmark(folder, chosen, [1, 4], method)
    assert record["skipped"] == {}
    rows = {(r["backend"], r["model"], r["batch"]) for r in record["results"]}
    assert rows == {(b, m, n) for b in names.split(",") for m in MODELS for n in (1, 4)}
    assert all(r["p50_ms"] > 0 and r["throughput"] > 0 for r in record["results"])

    x = torch.randn(4, *folder.input_size, device="cuda", dtype=torch.float16)
    for which in MODELS:
        model = torch_model(folder, which).to("cuda", torch.float16).eval()
        eager = torch_forward(model, x)().float()
        variants = {
            "graph": torch_forward(model, x, graph=True),
            "compile": torch_forward(compile_model(model), x),
            "compile+graph": torch_forward(compile_model(model), x, graph=True),
        }
        for variant, forward in variants.items():
            out = forward().float()
            cosine = torch.nn.functional.cosine_similarity(out, eager, dim=-1)
            assert out.isfinite().all() and cosine.min() > 0.999, (which, variant, cosine.min())
