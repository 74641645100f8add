"""A latency model measured on the deployment backend: every block's time as a function of its widths.

What a width buys in time differs by backend, batch and device (a GEMM of 1152 channels may cost what one
of 768 does; unequal Q/K and V widths can lose a fused attention kernel), so a MACs count is a poor guide.
In a ViT every block has the same shapes, so a few uniform-width models give the table:

- the block-free model (patch embedding, norms, head): the fixed cost ``F``;
- the MLP grid at dense attention and the attention grid at dense MLP: with ``T`` a model's measured time
  and ``L`` its depth, one block costs ``(T - F) / L`` at those widths.

A block's time is then ``mlp(m) + attn(qk, v) - dense_block + joint(m, a)``: the MLP and attention parts, each
interpolated piecewise-linearly between measured widths (bilinearly over the (Q/K, V) grid), extrapolated below
the smallest measured width with the last segment's slope, plus their interaction: a few models narrowed in both
parts (``JOINT_GRID``) measure what a block saves beyond the sum of the two savings (they share its memory traffic),
interpolated bilinearly over (MLP width, mean head width) with zero on the axes; never below 0.
With ``--depth`` the grid adds a model with every block's attention (``no-attn``) or MLP (``no-mlp``) replaced by
its fitted stand-in (``families.layers.AffineBranch``): a removed module's time replaces that part's, and a width
of 0 in a (mlp, qk, v) triple means the module is replaced (``REMOVED``).
Backends whose fused attention needs one head size (torch SDPA's flash kernels, TensorRT's MHA:
``bench.backends.Backend.equal_heads``) measure and allocate equal Q/K and V widths only (``tied``).

Everything here is pure (times in, table out); ``corp_deploy.plan.speed`` measures. A table is tied to what it
was measured on (``key``: model and its arguments, backend, device, precision, batch, threads, library
versions, rewrites) and is refused for anything else.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from statistics import median
from typing import Any

from corp_deploy.base.errors import CorpError
from corp_deploy.base.fsio import atomic_file, cache_dir

SCHEMA = "corp-deploy/latency-table"
SCHEMA_VERSION = 2
MLP_GRID = (1.0, 0.75, 0.5, 0.25, 0.125)
"""Measured MLP widths, as fractions of the dense width (rounded to multiples of 8)."""
ATTN_GRID = (1.0, 0.5, 0.25)
"""Measured per-head Q/K and V widths, as fractions of the head dim (the full grid; its diagonal when tied)."""
JOINT_GRID = ((0.5, 0.5), (0.5, 0.25), (0.125, 0.5), (0.125, 0.25))
"""(MLP, Q/K = V) fractions of the models narrowed in both parts at once: where a block saves more than its two
parts' savings measured one at a time (deit_small on ort-cpu: 1.04-1.29x), the ``joint`` interaction term."""
FIXED = "fixed"
"""Name of the block-free model among the measured ones."""
REMOVED = 0
"""The width that stands for a replaced module in (mlp, qk, v): ``(m, 0, 0)`` has no attention, ``(0, q, v)`` no MLP."""


def grid_width(full: int, fraction: float) -> int:
    """A grid width: ``fraction`` of ``full``, a multiple of 8 where it can be, at least 1."""
    w = round(full * fraction)
    return max(1, w - w % 8 if w >= 8 else w)


@dataclass(frozen=True)
class Shape:
    """A ViT's block shapes as a latency table needs them: depth and dense widths (MLP, per-head Q/K and V)."""

    depth: int
    mlp: int
    head_dim: int


def grid(shape: Shape, equal_heads: bool, removals: Sequence[str] = ()) -> dict[str, tuple[int, int, int] | None]:
    """Name -> uniform widths (mlp, qk, v) of every model to measure; ``fixed`` (None) is the block-free one;
    ``removals`` (``attn``, ``mlp``) add the models with that module replaced in every block (width ``REMOVED``)."""
    mlps = sorted({grid_width(shape.mlp, f) for f in MLP_GRID}, reverse=True)
    heads = sorted({grid_width(shape.head_dim, f) for f in ATTN_GRID}, reverse=True)
    pairs = [(q, q) for q in heads] if equal_heads else [(q, v) for q in heads for v in heads]
    out: dict[str, tuple[int, int, int] | None] = {FIXED: None}
    out |= {f"mlp{m}": (m, shape.head_dim, shape.head_dim) for m in mlps}
    out |= {f"qk{q}-v{v}": (shape.mlp, q, v) for q, v in pairs if (q, v) != (shape.head_dim, shape.head_dim)}
    for m, a in JOINT_GRID:
        mlp, head = grid_width(shape.mlp, m), grid_width(shape.head_dim, a)
        out[f"joint{mlp}-qk{head}-v{head}"] = (mlp, head, head)
    if "attn" in removals:
        out["no-attn"] = (shape.mlp, REMOVED, REMOVED)
    if "mlp" in removals:
        out["no-mlp"] = (REMOVED, shape.head_dim, shape.head_dim)
    return out


def interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys) (xs ascending, two or more), extrapolated with the end segments' slopes."""
    i = 1
    while i < len(xs) - 1 and x > xs[i]:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class LatencyTable:
    """Seconds per forward at ``key``'s batch: ``fixed_s`` + the sum of the blocks' times, times ``scale``.

    ``scale`` and ``fixed_s`` are corrected by the closed loop (``corrected``) from a measured pair of models.
    """

    key: dict[str, Any]
    shape: Shape
    tied: bool
    fixed_s: float
    mlp: dict[int, float]
    """MLP width -> one block's seconds at dense attention."""
    attn: dict[tuple[int, int], float]
    """(Q/K, V) per-head widths -> one block's seconds at the dense MLP width."""
    scale: float = 1.0
    corrections: tuple[dict[str, float], ...] = field(default=())
    removed: dict[str, float] = field(default_factory=dict)
    """Module (``attn``, ``mlp``) -> one block's seconds with it replaced, the rest dense (``--depth``)."""
    joint: dict[tuple[int, int], float] = field(default_factory=dict)
    """(MLP width, per-head Q/K = V width) -> a block's seconds beyond the additive ``mlp + attn - dense``
    (negative: it saved more); zero on the axes (a dense part) and when absent."""
    savings: float = 1.0
    """Factor on every block's saving over the dense block (``corrected``): above 1 where pruned blocks measured
    faster than the additive model says (a block whose MLP and attention both shrink saves more than the two
    savings measured one at a time)."""

    @property
    def dense_block_s(self) -> float:
        return self.mlp[self.shape.mlp]

    def block_s(self, mlp: int, qk: int, v: int) -> float:
        """Predicted seconds of one block with these widths (before ``scale``), never below 0; a width of
        ``REMOVED`` is the module replaced."""
        widths = sorted(self.mlp)
        m = self._removed_s("mlp") if mlp == REMOVED else interp(widths, [self.mlp[w] for w in widths], mlp)
        a = self._removed_s("attn") if qk == REMOVED else self._attn_s(qk, v)
        both = 0.0 if REMOVED in (mlp, qk) else self._joint_s(mlp, (qk + v) / 2)
        saved = self.dense_block_s - max(0.0, m + a - self.dense_block_s + both)
        return max(0.0, self.dense_block_s - self.savings * saved)

    def _removed_s(self, module: str) -> float:
        if module not in self.removed:
            raise CorpError(f"this latency table has no time for a block without its {module}; measure it with --depth")
        return self.removed[module]

    def _joint_s(self, mlp: float, head: float) -> float:
        """The interaction term, bilinear over the measured (MLP, head width) points and zero at the dense widths;
        held at the nearest measured value beyond them (a plan stays within the measured widths)."""
        if not self.joint:
            return 0.0
        mlps = sorted({m for m, _ in self.joint} | {self.shape.mlp})
        heads = sorted({h for _, h in self.joint} | {self.shape.head_dim})
        at = lambda m, h: self.joint.get((m, h), 0.0)  # noqa: E731
        clamp = lambda xs, x: min(max(x, xs[0]), xs[-1])  # noqa: E731
        rows = [interp(mlps, [at(m, h) for m in mlps], clamp(mlps, mlp)) for h in heads]
        return interp(heads, rows, clamp(heads, head))

    def _attn_s(self, qk: int, v: int) -> float:
        if self.tied:
            qks = sorted(q for q, _ in self.attn)
            return interp(qks, [self.attn[(q, q)] for q in qks], (qk + v) / 2)
        qks = sorted({q for q, _ in self.attn})
        vs = sorted({w for _, w in self.attn})
        rows = [interp(vs, [self.attn[(q, w)] for w in vs], v) for q in qks]
        return interp(qks, rows, qk)

    def predict(self, widths: Sequence[tuple[int, int, int]]) -> float:
        """Seconds of a model whose blocks have these (mlp, qk, v) widths."""
        return self.fixed_s + self.scale * sum(self.block_s(*w) for w in widths)

    @property
    def dense_s(self) -> float:
        return self.predict([(self.shape.mlp, self.shape.head_dim, self.shape.head_dim)] * self.shape.depth)

    def corrected(self, dense_s: float, pruned_s: float, pruned: Sequence[tuple[int, int, int]]) -> LatencyTable:
        """The table after one more measured pair (the closed loop): dense and ``pruned`` timed in one run.

        A measured speedup pins one number. With ``T = F + s B`` it is the fixed cost relative to the block scale:
        ``S = (c + B_dense) / (c + B_pruned)`` for ``c = F / s``. Each measured pair gives a ``c``; their median over
        all pairs so far (noise on a shared machine moves single pairs by several percent) replaces the table's.
        A negative median means no fixed cost explains the pairs: the pruned blocks saved MORE than the table says
        (heavily pruned DINOv2-S blocks on ort-cpu: 13-25% more speedup than predicted). Then ``c = 0`` and the
        pairs pin the factor ``k`` on the blocks' savings instead, ``S = B_dense / (B_dense - k (B_dense -
        B_pruned))`` (``savings``, their median). The scale then matches the latest dense time.
        """
        raw = replace(self, savings=1.0)
        dense_blocks = self.shape.depth * self.dense_block_s
        point = {
            "dense_s": dense_s,
            "pruned_s": pruned_s,
            "blocks_s": sum(raw.block_s(*w) for w in pruned),
            "predicted_s": self.predict(pruned),
        }
        points = (*self.corrections, point)
        if any(p["pruned_s"] >= p["dense_s"] or p["blocks_s"] >= dense_blocks for p in points):
            raise CorpError(
                f"the pruned model measured {pruned_s * 1e3:.1f} ms against the dense {dense_s * 1e3:.1f} ms: "
                "no correction of the latency table can follow that; re-run on a quieter machine"
            )
        pairs = [(p["dense_s"] / p["pruned_s"], p["blocks_s"]) for p in points]  # (speedup, predicted blocks)
        c = median([(dense_blocks - r * blocks) / (r - 1) for r, blocks in pairs])
        k = 1.0
        if c < 0:
            c = 0.0
            k = median([dense_blocks * (1 - 1 / r) / (dense_blocks - blocks) for r, blocks in pairs])
        scale = dense_s / (c + dense_blocks)
        table = replace(self, scale=scale, fixed_s=scale * c, corrections=points, savings=k)
        if table.cheapest_block_s() <= 0:  # every later plan would be predicted to cost nothing
            raise CorpError(
                f"the pruned model measured {pruned_s * 1e3:.1f} ms against the dense {dense_s * 1e3:.1f} ms: a saving "
                "larger than the latency table's blocks cost; re-run on a quieter machine"
            )
        return table

    def cheapest_block_s(self) -> float:
        """The least any measured width combination's block is predicted to cost (modules replaced included)."""
        mlps = [*self.mlp, *([REMOVED] if "mlp" in self.removed else [])]
        heads = [*self.attn, *([(REMOVED, REMOVED)] if "attn" in self.removed else [])]
        return min(self.block_s(m, q, v) for m in mlps for q, v in heads)

    # ------------------------------------------------------------------------------------- files

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "key": self.key,
            "shape": asdict(self.shape),
            "tied": self.tied,
            "fixed_s": self.fixed_s,
            "mlp": [[w, s] for w, s in sorted(self.mlp.items(), reverse=True)],
            "attn": [[q, v, s] for (q, v), s in sorted(self.attn.items(), reverse=True)],
            "scale": self.scale,
            "savings": self.savings,
            "corrections": list(self.corrections),
            "removed": self.removed,
            "joint": [[m, h, s] for (m, h), s in sorted(self.joint.items(), reverse=True)],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str = "the latency table") -> LatencyTable:
        if data.get("schema") != SCHEMA or data.get("schema_version") != SCHEMA_VERSION:
            raise CorpError(
                f"{source} is not a {SCHEMA} v{SCHEMA_VERSION} file; rebuild it with corp-deploy profile"
            ) from None
        try:
            return cls(
                key=data["key"],
                shape=Shape(**data["shape"]),
                tied=bool(data["tied"]),
                fixed_s=float(data["fixed_s"]),
                mlp={int(w): float(s) for w, s in data["mlp"]},
                attn={(int(q), int(v)): float(s) for q, v, s in data["attn"]},
                scale=float(data.get("scale", 1.0)),
                savings=float(data.get("savings", 1.0)),
                corrections=tuple(data.get("corrections", ())),
                removed={str(m): float(t) for m, t in data.get("removed", {}).items()},
                joint={(int(m), int(h)): float(s) for m, h, s in data.get("joint", [])},
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CorpError(
                f"{source} is damaged ({type(e).__name__}: {e}); rebuild it with corp-deploy profile"
            ) from None


@dataclass(frozen=True)
class Timing:
    """Dense against pruned, timed in one interleaved run on the table's backend (the closed loop's point)."""

    dense_s: float
    pruned_s: float
    band: float
    """Relative half-width of the noise band of the speedup."""

    @property
    def speedup(self) -> float:
        return self.dense_s / self.pruned_s


def fit(
    key: dict[str, Any], shape: Shape, equal_heads: bool, seconds: Mapping[str, float], removals: Sequence[str] = ()
) -> LatencyTable:
    """The table from the measured times (seconds) of ``grid(shape, equal_heads, removals)``'s models; pure."""
    models = grid(shape, equal_heads, removals)
    absent = sorted(set(models) - set(seconds))
    if absent:
        raise CorpError(f"latency table: no time for {', '.join(absent)}")
    fixed = seconds[FIXED]
    per_block = {name: (seconds[name] - fixed) / shape.depth for name in models if name != FIXED}
    mlp = {w[0]: per_block[n] for n, w in models.items() if n.startswith("mlp")}
    dense = mlp[shape.mlp]
    attn = {(w[1], w[2]): per_block[n] for n, w in models.items() if n.startswith("qk")}
    attn[(shape.head_dim, shape.head_dim)] = dense
    removed = {m: per_block[f"no-{m}"] for m in removals}
    additive = LatencyTable(key, shape, equal_heads, fixed, mlp, attn, removed=removed)
    joint = {(w[0], w[1]): per_block[n] - additive.block_s(*w) for n, w in models.items() if n.startswith("joint")}
    return replace(additive, joint=joint)


# ------------------------------------------------------------------------------------------ keys


def key_id(key: Mapping[str, Any]) -> str:
    """A short stable name for a key: its cache file's name."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def cache_path(key: Mapping[str, Any]) -> Path:
    return cache_dir() / "latency" / f"{key['backend']}-b{key['batch']}-{key_id(key)}.json"


def check_key(table: LatencyTable, key: Mapping[str, Any], source: str) -> LatencyTable:
    """``table`` if it was measured for exactly ``key``; otherwise one line naming what differs."""
    differ = [k for k in sorted(set(key) | set(table.key)) if table.key.get(k) != key.get(k)]
    if differ:
        what = "; ".join(f"{k} {table.key.get(k)!r} (here {key.get(k)!r})" for k in differ[:3])
        raise CorpError(
            f"{source} was measured for another setup: {what}; drop --latency-table to measure one for this setup"
        )
    return table


def read(path: str | Path, key: Mapping[str, Any]) -> LatencyTable:
    """A table file checked against ``key``."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CorpError(f"--latency-table {path} does not exist; build one with corp-deploy profile") from None
    except (OSError, ValueError) as e:
        raise CorpError(f"--latency-table {path} cannot be read as JSON: {e}") from None
    return check_key(LatencyTable.from_json(data, str(path)), key, str(path))


def cached(key: Mapping[str, Any]) -> LatencyTable | None:
    """The cached table for ``key``, or None when none was measured (or its file is damaged)."""
    path = cache_path(key)
    if not path.is_file():
        return None
    try:
        return read(path, key)
    except CorpError:
        return None


def write(table: LatencyTable, path: str | Path) -> Path:
    with atomic_file(path, overwrite=True) as tmp:
        tmp.write_text(json.dumps(table.to_json(), indent=1) + "\n")
    return Path(path)


def workload(record: Mapping[str, Any]) -> str:
    """What a table key or a latency record was timed on: ``batch 32``, or ``batch 32 x 128 tokens`` for a text
    encoder (its ``seq_len``)."""
    seq_len = record.get("seq_len")
    return f"batch {record['batch']}" + ("" if seq_len is None else f" x {seq_len} tokens")


def format_table(table: LatencyTable) -> str:
    """The table as a person reads it: fixed cost, then per-block milliseconds over the measured widths."""
    k = table.key
    fixed = "patch embedding, final norm, head" if k.get("seq_len") is None else "embeddings, pooler"
    lines = [
        f"latency table: {k['model']} on {k['backend']} ({k['device']}), {workload(k)}, {k['threads']} threads",
        f"  fixed ({fixed}): {table.fixed_s * 1e3:8.2f} ms",
        f"  dense: {table.dense_s * 1e3:8.2f} ms = fixed + {table.shape.depth} blocks x "
        f"{table.dense_block_s * 1e3:.2f} ms",
        "  one block, MLP width at dense attention: "
        + ", ".join(f"{w}: {s * 1e3:.2f}" for w, s in sorted(table.mlp.items(), reverse=True))
        + " ms",
        "  one block, (Q/K, V) per head at the dense MLP: "
        + ", ".join(f"{q}/{v}: {s * 1e3:.2f}" for (q, v), s in sorted(table.attn.items(), reverse=True))
        + " ms",
    ]
    if table.joint:
        lines.append(
            "  one block narrowed in both parts, beyond the sum of the parts (MLP, head width): "
            + ", ".join(f"{m}, {h}: {s * 1e3:+.2f}" for (m, h), s in sorted(table.joint.items(), reverse=True))
            + " ms"
        )
    if table.removed:
        lines.append(
            "  one block with a module replaced by its fit: "
            + ", ".join(f"no {m}: {t * 1e3:.2f}" for m, t in table.removed.items())
            + " ms"
        )
    if table.tied:
        lines.append("  equal Q/K and V widths only (this backend's fused attention needs one head size)")
    return "\n".join(lines)
