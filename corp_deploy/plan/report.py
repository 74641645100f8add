"""What pruning bought and cost: parameters, FLOPs, reconstruction error, time, memory."""

from __future__ import annotations

import resource
import sys
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from corp_deploy.families import adapter_for
from corp_deploy.plan.latency import workload


def model_size(model: nn.Module) -> dict[str, Any]:
    """Parameters and MACs for one input (an image; a sequence of ``tokens``), in total and per block.

    MACs are measured by tracing a real forward pass (FlopCounterMode counts FLOPs = 2 x MACs),
    so attention's token-token products and the pruned Q/K width are included as they run.
    MACs are what the ViT literature (and the CORP paper) call "FLOPs".

    Attention runs on the math backend while counting: the counter sees its two matmuls on every
    torch version, whereas fused kernels are counted only where the counter knows them (torch 2.11's
    misses the CPU flash kernel that dense attention takes, not the math fallback a pruned Q/K width
    takes), which made dense-vs-pruned ratios depend on the machine.
    """
    adapter = adapter_for(model)
    x = adapter.example(model)
    with torch.inference_mode(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        adapter.run(model, x, next(model.parameters()).device)
    flops = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
    names = {id(m): f"{type(model).__name__}.{name}" for name, m in model.named_modules()}
    blocks = adapter.blocks(model)
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "macs": flops["Global"] // 2,
        "tokens": adapter.tokens(model),
        "blocks": [
            {"params": sum(p.numel() for p in b.parameters()), "macs": flops.get(names[id(b)], 0) // 2} for b in blocks
        ],
    }


def peak_memory(device: torch.device) -> dict[str, float]:
    """Peak process RSS (always) and peak CUDA allocation (on a GPU), in MiB."""
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    out = {"host_rss_mib": rss_kib / (1024 * 1024 if sys.platform == "darwin" else 1024)}
    if device.type == "cuda":
        out["cuda_peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def _pct(after: float, before: float) -> str:
    return f"{100 * (after / before - 1):+.1f}%" if before else "-"


def _affine_cols(entry: dict | None, width: str = "head_dim") -> tuple[str, str]:
    """Kept/width and none/mean/corp errors of an MLP or V entry, '-' where the part was not pruned."""
    if not entry:
        return ("-", "-")
    e = entry["rel_error"]
    return (f"{entry['kept']}/{entry[width]}", f"{e['none']:.3f}/{e['mean']:.3f}/{e['corp']:.3f}")


def _spent(alloc: dict[str, Any]) -> str:
    """What a budget's widths cost: a share of the dense MACs, or a predicted time on the latency backend."""
    if "planned_macs" in alloc:
        return f"{alloc['planned_macs'] / alloc['dense_macs']:.3f} of the dense MACs"
    t = alloc["latency"]
    return (
        f"predicted {t['planned_s'] * 1e3:.1f} ms vs dense {t['dense_s'] * 1e3:.1f} ms on {t['backend']} at "
        f"{workload(t)} ({t['predicted_speedup']:.2f}x)"
    )


def verdict(check: dict[str, Any]) -> str:
    """A measured speedup against its target: ``met`` only when reached (the record's ``met`` says the same);
    inside the noise band below it, the loop stops (no correction can tell the difference) but the target was not
    reached, and the words say so. Records written before ``within_band`` held the band test in ``met``."""
    if check["measured_speedup"] >= check["target_speedup"]:
        return "met"
    return "within the noise band, not reached" if check.get("within_band", check["met"]) else "MISSED"


def _checked(check: dict[str, Any]) -> str:
    """The closed loop's verdict: target, predicted and measured speedup, noise band, rounds."""
    return (
        f"speedup on {check['backend']} at {workload(check)}: target {check['target_speedup']:.2f}x, "
        f"predicted {check['predicted_speedup']:.2f}x, measured {check['measured_speedup']:.2f}x "
        f"(noise band +-{100 * check['spread']:.1f}%, dense and pruned interleaved in one run): {verdict(check)} "
        f"after {check['rounds']} round{'s' if check['rounds'] > 1 else ''}"
    )


def _recovered(rec: dict[str, Any], unit: str) -> str:
    """A recovery's line: budget and settings, steps and seconds, its loss on the first training batch and on the
    held-out inputs (never trained on), before -> after, and why the widths and speed are the pruned ones."""
    budget = ", ".join(f"{v:g} {k}" for k, v in rec["budget"].items())
    batches = f"{rec['batches']} batch{'es' if rec['batches'] != 1 else ''}"
    held = (
        f", held-out {rec['check_before']:.4g} -> {rec['check_after']:.4g} ({rec['check_inputs']} {unit} never "
        "trained on)"
        if rec.get("check_before") is not None
        else ", no held-out inputs (no sensitivity pass held any out)"
    )
    return (
        f"recovery ({rec['target']} target, {rec['optimizer']} lr {rec['lr']:g}, budget {budget}): {rec['steps']} "
        f"steps in {rec['seconds']:.1f}s on {rec['inputs']} calibration {unit} ({batches}); objective "
        f"{rec['loss_before']:.4g} -> {rec['loss_after']:.4g} on the first batch{held}; widths unchanged, so the "
        "speed is the pruned model's (it does not depend on weight values)"
        + ("; the held-out objective rose, so CORP's weights were kept" if rec.get("kept") == "corp" else "")
    )


def format_report(report: dict[str, Any]) -> str:
    """The terminal table: per-block widths and errors, then model totals, time and memory."""
    dense, pruned = report["dense"], report["pruned"]
    lines = [
        f"{'block':>5} {'mlp kept':>10} {'mlp err none/mean/corp':>24} {'qk kept':>8} {'logit err none/corp':>20}"
        f" {'v kept':>7} {'proj err none/mean/corp':>24} {'MMACs':>15}",
    ]
    for entry, d_blk, p_blk in zip(report["blocks"], dense["blocks"], pruned["blocks"], strict=True):
        mlp_cols, attn_cols, v_cols = _affine_cols(entry.get("mlp"), "width"), ("-", "-"), _affine_cols(entry.get("v"))
        if attn := entry.get("qk"):
            e = attn["rel_error"]
            attn_cols = (f"{attn['kept']}/{attn['head_dim']}", f"{e['none']:.3f}/{e['corp']:.3f}")
        macs = f"{d_blk['macs'] / 1e6:.1f}->{p_blk['macs'] / 1e6:.1f}"
        lines.append(
            f"{entry['block']:>5} {mlp_cols[0]:>10} {mlp_cols[1]:>24} {attn_cols[0]:>8} {attn_cols[1]:>20}"
            f" {v_cols[0]:>7} {v_cols[1]:>24} {macs:>15}"
        )
    lines.append(
        f"(errors: relative reconstruction error on the calibration data; mlp = {report.get('mlp_out', 'fc2')} "
        "output, logit = Q K^T, "
        "proj = attention output projection; v kept is per head)"
    )
    replaced = [(e["block"], m, r) for e in report["blocks"] for m, r in e.get("replaced", {}).items()]
    if replaced:
        lines.append(
            "replaced by their fit from the block's input (--depth; residual energy on the calibration data): "
            + ", ".join(f"block {i} {m} ({r['fit']}, {r['rel_error']:.3f})" for i, m, r in replaced)
        )
    if alloc := report.get("allocation"):
        lines.append(f"widths per block from --budget {alloc['budget']} ({alloc['criterion']} errors): {_spent(alloc)}")
    if check := report.get("latency"):
        lines.append(_checked(check))
    t, unit = report["seconds"], report["calibration"].get("unit", "images")
    if rec := report.get("recovery"):
        lines.append(_recovered(rec, unit))
    params = _pct(pruned["params"], dense["params"])
    lines.append(
        f"params {dense['params'] / 1e6:.2f}M -> {pruned['params'] / 1e6:.2f}M ({params})"
        f"   MACs {dense['macs'] / 1e9:.3f}G -> {pruned['macs'] / 1e9:.3f}G ({_pct(pruned['macs'], dense['macs'])})"
    )
    calibrated = report["calibration"].get(unit, report["calibration"].get("images"))
    lines.append(
        f"time {sum(t.values()):.1f}s = "
        + " + ".join(f"{k} {v:.2f}s" for k, v in t.items())
        + f"   on {report['device']}, {calibrated} calibration {unit}"
        + (f" ({report['calibration']['skipped']} unreadable, skipped)" if report["calibration"]["skipped"] else "")
    )
    mem = report["memory"]
    lines.append(
        "memory: statistics "
        + f"{mem['statistics_mib']:.0f} MiB, peak host RSS {mem['host_rss_mib']:.0f} MiB"
        + (f", peak CUDA {mem['cuda_peak_mib']:.0f} MiB" if "cuda_peak_mib" in mem else "")
    )
    return "\n".join(lines)
