"""Engines on this GPU: which TensorRT flavours import, and what building and running one does.

Two looks per flavour. The probe uses the library's raw API on a one-GEMM network (no ONNX, no
project code in between), so it records the library's own behaviour here: e.g. TensorRT-RTX
building fine on a Hopper GPU and then refusing to deserialize, since compute capability 9.0 is
outside its support matrix. The pipeline check goes the way ``prune-export`` goes: a tiny dense and
a tiny CORP-pruned ViT to FP16 ONNX, ``engine_verified`` (verified against onnxruntime where this
machine can run the engine), and what the project's runner says here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from corp_deploy.base.tables import markdown_table
from tools.gpu_suite.core import Context


class _StepFailed(Exception):
    pass


def _engine_probe(module: str, targets: str) -> dict[str, Any]:
    """Build a one-GEMM engine with ``module`` (the raw TensorRT API), then load and run it here.

    Each step is recorded with its outcome and the library's own messages, so a refusal (an engine
    built for other GPUs, a GPU outside a flavour's support matrix) is written down as it happened.
    """
    trt = importlib.import_module(module)
    messages: list[str] = []

    class Logger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)

        def log(self, severity, msg) -> None:  # noqa: ANN001 (TensorRT's signature)
            if severity <= trt.ILogger.Severity.WARNING:
                messages.append(f"{severity.name}: {msg}"[:300])

    steps: list[dict[str, Any]] = []

    def step(name: str, fn: Callable[[], Any]) -> Any:
        before = len(messages)
        try:
            result = fn()
        except Exception as e:
            steps.append({"step": name, "ok": False, "error": f"{type(e).__name__}: {str(e).strip()[:300]}"})
            raise _StepFailed from e
        ok = result is not None and result is not False
        steps.append({"step": name, "ok": ok, "messages": messages[before:]})
        if not ok:
            raise _StepFailed
        return result

    logger = Logger()
    n = 64
    weight = torch.randn(n, n)
    x = torch.randn(4, n)
    record: dict[str, Any] = {"module": module, "version": trt.__version__, "targets": targets, "steps": steps}
    try:
        builder = step("builder", lambda: trt.Builder(logger))
        network = step("network", lambda: builder.create_network(0))
        inp = network.add_input("x", trt.float32, (4, n))
        const = network.add_constant((n, n), trt.Weights(weight.T.contiguous().numpy()))
        mm = network.add_matrix_multiply(inp, trt.MatrixOperation.NONE, const.get_output(0), trt.MatrixOperation.NONE)
        network.mark_output(mm.get_output(0))
        config = builder.create_builder_config()
        if targets == "current" and hasattr(trt, "ComputeCapability"):
            config.num_compute_capabilities = 1
            config.set_compute_capability(trt.ComputeCapability.CURRENT, 0)
        plan = step("build_serialized_network", lambda: builder.build_serialized_network(network, config))
        record["engine_bytes"] = plan.nbytes
        runtime = step("runtime", lambda: trt.Runtime(logger))
        engine = step("deserialize_cuda_engine", lambda: runtime.deserialize_cuda_engine(plan))
        context = step("create_execution_context", lambda: engine.create_execution_context())
        xc, out = x.cuda(), torch.empty(4, n, device="cuda")
        context.set_tensor_address("x", xc.data_ptr())
        context.set_tensor_address(engine.get_tensor_name(1), out.data_ptr())
        stream = torch.cuda.current_stream().cuda_stream
        step("execute_async_v3", lambda: context.execute_async_v3(stream))
        torch.cuda.synchronize()
        err = float((out.cpu() - x @ weight).abs().max())
        steps.append({"step": "compare with torch", "ok": err < 1e-2, "max_abs_error": err})
    except _StepFailed:
        pass
    record["ran"] = all(s["ok"] for s in steps) and steps[-1]["step"] == "compare with torch"
    return record


TINY = {"img_size": 32, "patch_size": 8, "embed_dim": 64, "depth": 2, "num_heads": 2, "mlp_ratio": 2.0}
"""Two heads of 32 dims: the pruned Q/K width 16 is one TensorRT's fused attention accepts in FP16."""


def _pipeline(ctx: Context, flavour: str) -> list[dict[str, Any]]:
    import tempfile
    import warnings
    from pathlib import Path

    import corp_deploy
    from corp_deploy.base.errors import CorpError
    from corp_deploy.exporters import BuildOptions, Profile, VerifyOptions, convert_fp16, engine_verified, export_onnx
    from corp_deploy.exporters.tensorrt_engine import run_missing
    from corp_deploy.formats.sources import describe

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # random weights and noise calibration, on purpose
        dense = corp_deploy.create_model("deit_tiny", weights="random", model_args=TINY)
        pruned = corp_deploy.create_model("deit_tiny", weights="random", model_args=TINY)
        batches, total = corp_deploy.calibration_batches(pruned, "synthetic", 16, 8)
        corp_deploy.prune(pruned, batches, corp_deploy.PruneConfig(sparsity=0.5), ctx.device, total, False)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for which, model in (("dense", dense), ("pruned", pruned.cpu())):
            fp32, fp16, plan = (Path(tmp) / f"{which}{ext}" for ext in (".onnx", ".fp16.onnx", ".fp16.plan"))
            row: dict[str, Any] = {"flavour": flavour, "model": which}
            try:
                export_onnx(model, fp32, (3, 32, 32), metadata=describe(model, "deit_tiny", TINY, "random"))
                convert_fp16(fp32, fp16)
                options = BuildOptions("fp16", Profile(1, 4, 8), workspace_gib=1.0, runtime=flavour)
                record = engine_verified(fp16, plan, options, VerifyOptions(batches=(1, 4)))
                row |= {k: record.get(k) for k in ("version", "targets", "build_seconds", "engine_bytes", "status")}
                row |= {"attention": record["attention"], "verify": record["verify"], "runner": run_missing(plan)}
            except (CorpError, ImportError) as e:
                row["error"] = str(e).strip().splitlines()[0][:300]
            ctx.log(f"engines pipeline {flavour} {which}: {row.get('status') or row.get('error')}")
            rows.append(row)
    return rows


def run_engines(ctx: Context) -> dict[str, Any]:
    """Which TensorRT flavours import here, and what building and running an engine does on this GPU."""
    found: dict[str, Any] = {}
    probes, pipeline = [], []
    for module in ("tensorrt", "tensorrt_rtx_bindings"):
        try:
            found[module] = {"version": __import__(module).__version__}
        except ImportError as e:
            found[module] = {"missing": str(e).splitlines()[0]}
            continue
        except Exception as e:  # a wheel built for another CUDA can fail on import
            found[module] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
            continue
        pipeline += _pipeline(ctx, "tensorrt" if module == "tensorrt" else "tensorrt-rtx")
        if ctx.device.type == "cuda":
            for targets in ("default", "current") if module == "tensorrt_rtx_bindings" else ("default",):
                probes.append(_engine_probe(module, targets))
                last = probes[-1]["steps"][-1] if probes[-1]["steps"] else {}
                ctx.log(f"engines {module} ({targets} targets): ran={probes[-1]['ran']}; last step {last}")
    record: dict[str, Any] = {"modules": found, "probes": probes, "pipeline": pipeline}
    if all("version" not in v for v in found.values()):
        record["skipped"] = "neither tensorrt nor tensorrt_rtx_bindings is importable here (see make gpu-wheels)"
    try:
        import onnxruntime as ort

        record["onnxruntime_providers"] = ort.get_available_providers()
    except ImportError:
        record["onnxruntime_providers"] = "onnxruntime not installed"
    return record


def engines_markdown(e: dict[str, Any]) -> list[str]:
    rows = [
        [p["flavour"], p["model"], p.get("status") or p.get("error"), p.get("runner") or "runs here"]
        + [f"{(p.get('attention') or {}).get('fused_mha_layers')} / {(p.get('attention') or {}).get('blocks')}"]
        for p in e.get("pipeline", [])
    ]
    table = ["", markdown_table(["flavour", "tiny ViT", "engine (FP16)", "runner here", "fused MHA / blocks"], rows)]
    mods = "; ".join(f"`{m}` {v.get('version') or v.get('missing') or v.get('error')}" for m, v in e["modules"].items())
    lines = [f"**Engines**: {mods}. onnxruntime providers: {e['onnxruntime_providers']}. {e.get('skipped', '')}"]
    for p in e["probes"]:
        last = p["steps"][-1] if p["steps"] else {}
        what = last.get("error") or "; ".join(last.get("messages", [])) or f"max abs error {last.get('max_abs_error')}"
        ok = [s["step"] for s in p["steps"] if s["ok"]]
        lines.append(
            f"- `{p['module']}` {p['version']}, {p['targets']} targets: ran = {p['ran']}; succeeded: "
            f"{', '.join(ok)}; last step `{last.get('step')}`: {what}"
        )
    return lines + (table if rows else [])
