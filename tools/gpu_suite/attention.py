"""Attention kernels: which SDPA kernel each head shape pruning produces dispatches to, and its time.

Fused kernels want one head size for Q, K and V (flash on CPU and CUDA; cuDNN on Hopper allows few
unequal pairs). CORP's Q/K pruning leaves V at the original width, so the section times four shapes
per model: dense, Q/K pruned, equal widths (Q/K and V pruned alike), and Q/K zero-padded back to
the V width after the projection (exact, since the extra dims are zero).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from corp_deploy.base.tables import markdown_table
from tools.gpu_suite.core import DTYPES, Context, measure, precision_mode, sync

SDPA_OPS = {
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_attention_math_for_mps": "math",
}


def _dispatched(call: Callable[[], object]) -> str:
    """The SDPA kernel PyTorch picks by default, read from the profiler's op names."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    names = {e.key for e in prof.key_averages()}
    found = sorted({kernel for op, kernel in SDPA_OPS.items() if op in names})
    return ",".join(found) or "unknown"


def _attention_inputs(ctx: Context, shape: tuple[int, int, int, int], qk: int, v: int, dtype: torch.dtype):
    b, h, n, _ = shape
    g = torch.Generator(device=ctx.device).manual_seed(0)
    q, k = (torch.randn(b, h, n, qk, device=ctx.device, dtype=dtype, generator=g) for _ in range(2))
    return q, k, torch.randn(b, h, n, v, device=ctx.device, dtype=dtype, generator=g)


def run_sdpa(ctx: Context) -> dict[str, Any]:
    """Kernel choice and attention-only time for the head shapes pruning produces."""
    from torch.nn.attention import SDPBackend

    kernels = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }
    rows = []
    for label, shape in ctx.plan.sdpa_shapes.items():
        d = shape[3]
        variants = {  # name -> (Q/K width, V width, zero-pad Q/K to)
            "dense": (d, d, None),
            "qk_pruned": (d // 2, d, None),
            "equal_width": (d // 2, d // 2, None),
            "qk_zero_padded": (d // 2, d, d),
        }
        for precision in ctx.plan.sdpa_precisions:
            dtype = DTYPES[precision]
            calls, row_of = {}, {}
            for variant, (qk, v, pad) in variants.items():
                q, k, vv = _attention_inputs(ctx, shape, qk, v, dtype)
                if pad:
                    q, k = (F.pad(t, (0, pad - qk)) for t in (q, k))
                scale = d**-0.5  # CORP keeps the original head dim's scale

                def call(q=q, k=k, vv=vv, scale=scale) -> torch.Tensor:
                    with torch.inference_mode():
                        return F.scaled_dot_product_attention(q, k, vv, scale=scale)

                accepted = {kname: _accepts(ctx, call, kernel) for kname, kernel in kernels.items()}
                calls[variant] = call
                row_of[variant] = {
                    "shape": label,
                    "batch_heads_tokens": list(shape[:3]),
                    "precision": precision,
                    "variant": variant,
                    "qk_dim": pad or qk,
                    "v_dim": v,
                    "dispatched": _dispatched(call),
                    "accepted": accepted,
                }
            if ctx.time_left() < 0:
                rows += list(row_of.values())
                continue
            with precision_mode(precision):
                stats = measure(ctx, calls, shape[0])
            for variant, row in row_of.items():
                row |= {
                    "p50_ms": stats[variant]["p50_ms"],
                    "vs_dense": stats[variant]["p50_ms"] / stats["dense"]["p50_ms"],
                }
                ctx.log(
                    f"sdpa {label} {precision} {variant} (q/k {row['qk_dim']}, v {row['v_dim']}): "
                    f"{row['dispatched']}, {row['p50_ms']:.3f} ms (x{row['vs_dense']:.2f} of dense)"
                )
                rows.append(row)
    return {"scale": "original head dim ** -0.5", "rows": rows}


def _accepts(ctx: Context, call: Callable[[], object], kernel: Any) -> str:
    """``yes``, or ``no: `` and PyTorch's own reason (it warns the reason, then raises a generic error)."""
    from torch.nn.attention import sdpa_kernel

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel([kernel]):
                call()
            sync(ctx.device)
            return "yes"
        except RuntimeError as e:
            reasons = [str(w.message).split(" (Triggered")[0] for w in caught]
            specific = [r for r in reasons if not r.endswith("because:") and "runtime disabled" not in r]
            return "no: " + (specific or [str(e).strip().splitlines()[0]])[0][:200]


def sdpa_markdown(s: dict[str, Any]) -> list[str]:
    head = ["shape", "precision", "variant", "q/k dim", "v dim", "dispatched", "kernels that accept it", "p50 ms"]
    rows = [
        [r["shape"], r["precision"], r["variant"], r["qk_dim"], r["v_dim"], r["dispatched"]]
        + [", ".join(k for k, v in r["accepted"].items() if v == "yes")]
        + [f"{r['p50_ms']:.3f} (x{r['vs_dense']:.2f})" if "p50_ms" in r else "-"]
        for r in s["rows"]
    ]
    refusals = sorted({f"{k}: {v[4:]}" for r in s["rows"] for k, v in r["accepted"].items() if v != "yes"})
    lines = [f"**Attention kernels** (`F.scaled_dot_product_attention`, scale = {s['scale']}):", ""]
    return lines + [markdown_table(head, rows), ""] + [f"- refused by {r}" for r in refusals]
