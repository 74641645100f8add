"""Decoder speed in ``bench`` (``bench.decode``): the step loop, the records, the arithmetic and the gate.

Tiny random Llama (4 query heads over 2 K/V heads) and OPT; the timings of tiny models are noise, so nothing here
asserts a speed: what is checked is what was timed (the decode steps generate exactly ``generate``'s greedy tokens
with the cache, the context is bounded), how tokens/s follow from the latencies, and that the records, table and gate
hold every (backend, batch, prompt, phase).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import run

pytest.importorskip("transformers", reason="text models need transformers (pip install '.[text]')")
import transformers  # noqa: E402

from corp_deploy import api
from corp_deploy.base.errors import CorpError  # noqa: E402
from corp_deploy.base.timing import Method, Stats  # noqa: E402
from corp_deploy.bench import gate  # noqa: E402
from corp_deploy.bench.backends import RunFolder  # noqa: E402
from corp_deploy.bench.decode import DECODE_BACKENDS, TorchSession, decode_benchmark, rows  # noqa: E402
from corp_deploy.bench.run import pairs  # noqa: E402
from corp_deploy.core.config import PruneConfig  # noqa: E402
from corp_deploy.formats import sources  # noqa: E402

FAST = Method(warmup_iters=1, warmup_seconds=0, min_iters=3, min_seconds=0, round_iters=1)


def _llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    size = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    config = transformers.LlamaConfig(vocab_size=50, max_position_embeddings=64, intermediate_size=64, **size)
    return transformers.LlamaForCausalLM(config).eval()


def _opt() -> transformers.OPTForCausalLM:
    torch.manual_seed(0)
    size = {"hidden_size": 32, "num_hidden_layers": 2, "ffn_dim": 64, "num_attention_heads": 4}
    config = transformers.OPTConfig(vocab_size=50, max_position_embeddings=64, word_embed_proj_dim=32, **size)
    return transformers.OPTForCausalLM(config).eval()


def _run_folder(root: Path, dense: torch.nn.Module) -> RunFolder:
    """A bench run folder as ``prune-export`` leaves it for the torch backends: the pruned artifact (MLP and V at
    half width, per-layer widths from the statistics) and ``pruned.onnx.json``'s description."""
    config = PruneConfig(sparsity=0.5, target="mlp,v", round_to=2)
    ids = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(1))
    batches = [({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, 0)]
    pruned = api.prune(copy.deepcopy(dense), batches, config, "cpu", progress=False)
    api.save(pruned, root / "pruned", "tiny", {})
    description = sources.describe(pruned.model, "tiny", {}, "corp-pruned", 16)
    (root / "pruned.onnx.json").write_text(json.dumps(description))
    return RunFolder.open(root)


@pytest.mark.parametrize("build", [_llama, _opt])
def test_decode_steps_generate_greedily_with_the_cache_and_restart_within_the_band(build) -> None:
    model = build()
    model.generation_config.eos_token_id = None  # generate stops at nothing, as the timed loop does
    session = TorchSession(model, batch=2, prompt=6, new_tokens=5)
    first = session.start()
    tokens, steps = [first], []
    for _ in range(4):
        tokens.append(session.step(tokens[-1]))
    expected = model.generate(
        torch.from_numpy(session.ids),
        attention_mask=torch.ones(2, 6, dtype=torch.long),
        max_new_tokens=5,
        do_sample=False,
        use_cache=True,
        pad_token_id=0,
    )[:, 6:]
    assert (torch.from_numpy(np.concatenate(tokens, 1)) == expected).all()
    session = TorchSession(model, batch=2, prompt=6, new_tokens=3)
    for _ in range(7):
        steps.append(session.decode())
        assert session.cache.get_seq_length() == 6 + session.steps <= 6 + 3  # never past the band
    assert session.steps == 1 and len(steps) == 7 and min(steps) > 0  # 7 = 3 + 3 + 1: restarted twice


def test_tokens_per_second_follow_the_phase() -> None:
    stats = {m: Stats(p50_ms=4.0, p90_ms=5, p99_ms=6, mean_ms=5.0, throughput=0, iters=3) for m in ("dense", "pruned")}
    backend = DECODE_BACKENDS["torch-cpu-fp32"]
    prefill, decode = rows(stats, backend, 8, 128, "prefill"), rows(stats, backend, 8, 128, "decode")
    assert prefill[0]["tokens_per_s"] == pytest.approx(8 * 128 / 5e-3)
    assert prefill[0]["p50_tokens_per_s"] == pytest.approx(8 * 128 / 4e-3)
    assert decode[1]["tokens_per_s"] == pytest.approx(8 / 5e-3) and decode[1]["p50_tokens_per_s"] == 2000
    assert [r["model"] for r in decode] == ["dense", "pruned"] and decode[0]["phase"] == "decode"


@pytest.mark.parametrize("build", [_llama, _opt])
def test_a_decoder_bench_records_every_phase_and_the_gate_reads_them(build, tmp_path) -> None:
    folder = _run_folder(tmp_path, build())
    assert folder.decoder
    record = decode_benchmark(folder, [DECODE_BACKENDS["torch-cpu-fp32"]], [1, 2], [4, 8], FAST, new_tokens=3)
    keys = sorted((r["model"], r["batch"], r["prompt_len"], r["phase"]) for r in record["results"])
    assert keys == sorted(
        (m, b, p, f) for m in ("dense", "pruned") for b in (1, 2) for p in (4, 8) for f in ("prefill", "decode")
    )
    assert all(r["iters"] >= 3 and r["p50_ms"] > 0 for r in record["results"])
    paired = pairs(record)
    assert len(paired) == 8 and all(p["p50_speedup"] == p["dense_p50_ms"] / p["pruned_p50_ms"] for p in paired)
    assert all(p["dense_tokens_per_s"] > 0 and "phase" in p for p in paired)
    for mode in gate.BASELINE_MODES:
        checks = gate.compare(record, record, 0.0, mode)
        assert len(checks) == (16 if mode == "absolute" else 8) and not any(c.regressed for c in checks)
    slower = copy.deepcopy(record)
    target = next(r for r in slower["results"] if r["model"] == "pruned" and r["phase"] == "decode")
    target["p50_ms"] *= 2
    bad = [c.key for c in gate.compare(slower, record, 0.05, "absolute") if c.regressed]
    assert bad == [f"torch-cpu-fp32 pruned batch {target['batch']} decode at prompt {target['prompt_len']} p50 ms"]
    bad = [c.key for c in gate.compare(slower, record, 0.05, "ratio") if c.regressed]
    assert bad == [
        f"torch-cpu-fp32 batch {target['batch']} decode at prompt {target['prompt_len']} pruned/dense p50 speedup"
    ]
    prefill_only = copy.deepcopy(record)
    prefill_only["results"] = [r for r in record["results"] if r["phase"] == "prefill"]
    with pytest.raises(CorpError, match="lacks 4 of the baseline's 8"):
        gate.compare(prefill_only, record, 0.05, "ratio")


def test_the_quantize_only_gate_reads_a_decoders_int4_baseline_per_phase() -> None:
    """A decoder's baseline (genai's builder int4 of the dense model) is timed on genai-cpu-int4 only: one check per
    phase there, none on the FP32 backend, which has no baseline to stand beside."""
    row = {"device": "cpu", "batch": 1, "prompt_len": 8, "throughput": 1.0, "p50_tokens_per_s": 1.0}
    p50 = {("genai-cpu-int4", "prefill"): (9.0, 8.0, 10.0), ("genai-cpu-int4", "decode"): (3.0, 2.5, 2.0)}
    p50 |= {("genai-cpu-fp32", phase): (20.0, 15.0) for phase in ("prefill", "decode")}
    results = [
        row | {"backend": b, "phase": f, "precision": b.rsplit("-", 1)[1], "model": m, "p50_ms": v}
        for (b, f), times in p50.items()
        for m, v in zip(("dense", "pruned", "baseline"), times, strict=False)  # FP32: no baseline
    ]
    checks = gate.against_quantize_only({"results": results}, 0.05)
    assert [(c.key.split(" pruned vs")[0], c.regressed) for c in checks] == [
        ("genai-cpu-int4 batch 1 prefill at prompt 8", False),  # 8 ms against the baseline's 10
        ("genai-cpu-int4 batch 1 decode at prompt 8", True),  # 2.5 ms/token against 2.0: 25% slower
    ]
    with pytest.raises(CorpError, match="genai-cpu-int4 on a decoder run with baseline-genai-int4/"):
        gate.against_quantize_only({"results": [r for r in results if r["model"] != "baseline"]}, 0.05)


@pytest.mark.e2e
def test_bench_on_a_decoder_run_prints_the_phases_writes_the_record_and_gates(tmp_path, capsys) -> None:
    _run_folder(tmp_path / "run", _llama())
    fast = ["--warmup-iters", "1", "--warmup-seconds", "0", "--min-iters", "3", "--min-seconds", "0"]
    argv = ["bench", str(tmp_path / "run"), "--batch-sizes", "1,2", "--prompt-lens", "8", "--new-tokens", "3", *fast]
    code, stdout, stderr = run(
        [*argv, "--json", str(tmp_path / "b.json"), "--markdown", str(tmp_path / "b.md")], capsys
    )
    assert code == 0, stderr
    assert "prefill" in stdout and "decode" in stdout and "dense tok/s" in stdout
    record = json.loads((tmp_path / "b.json").read_text())
    assert record["schema_version"] == 2 and record["method"]["new_tokens"] == 3 and len(record["results"]) == 8
    assert "| prompt | phase |" in (tmp_path / "b.md").read_text()
    # a baseline where dense was a million times slower: every check regresses, whatever microsecond noise (a
    # first call 200x slow was seen under load) does to a tiny model's p50
    record["results"] = [r | {"p50_ms": r["p50_ms"] * (1e6 if r["model"] == "dense" else 1)} for r in record["results"]]
    (tmp_path / "fast.json").write_text(json.dumps(record))
    code, stdout, stderr = run([*argv, "--baseline", str(tmp_path / "fast.json"), "--gate", "ratio"], capsys)
    assert code == 1 and "regression gate (ratio" in stdout and "4 of 4 checks" in stderr
    for bad, says in (
        (["--prompt-lens", "40", "--new-tokens", "32"], "exceeds the model's 64 positions"),
        (["--prompt-lens", "0"], "--prompt-lens takes"),
        (["--seq-len", "8"], "a decoder takes --prompt-lens"),
        (["--backends", "tensorrt-fp16"], "tensorrt-fp16 times encoder and image runs, not this run; choose auto"),
        (["--backends", "genai-cpu"], "unknown decoder backend 'genai-cpu'"),
    ):
        code, _, stderr = run([*argv, *bad], capsys)
        assert code == 1 and says in stderr and stderr.count("\n") == 1, stderr
