"""The INT4 recipe choice (``exporters.int4``): genai's builder recipes beside the project's scheme, each gated, the
fastest passing one kept.

A tiny random Llama (one layer, heads 16 wide: the builder takes it) as a fused genai folder; timings come from a
fake timer (a test asserts no speed), the gate's figures from the real graphs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import tiny_llama_folder

from corp_deploy.base.errors import CorpError

pytest.importorskip("transformers", reason="text models need transformers (pip install '.[text]')")
onnx = pytest.importorskip("onnx")
og = pytest.importorskip("onnxruntime_genai", reason="genai folders need onnxruntime-genai (pip install '.[genai]')")

from corp_deploy.exporters import int4, int4_gate  # noqa: E402
from corp_deploy.exporters.genai import GRAPH, tokenizer_files, write_genai_folder  # noqa: E402
from corp_deploy.exporters.int4 import (  # noqa: E402
    AUTO,
    RECIPES,
    BuilderInput,
    format_int4,
    format_int4_speed,
    int4_baseline,
    int4_graphs,
    int4_speed,
    recipes,
)
from corp_deploy.exporters.int4_gate import DecoderTolerance  # noqa: E402
from corp_deploy.exporters.int4_quant import Scheme  # noqa: E402
from corp_deploy.exporters.onnx_export import read_metadata  # noqa: E402
from corp_deploy.families.hf import hub  # noqa: E402
from corp_deploy.formats.run_folder import BASELINE_GENAI  # noqa: E402

SEQ = 16
SCHEME = Scheme(block_size=16, int8_outliers_db=None)
"""minmax without the calibrated outlier ranking: every candidate reads only the gate's windows."""
LOOSE = DecoderTolerance(100.0, 0.0)
ALL = (*RECIPES, "minmax")


@pytest.fixture(scope="module")
def fused(tmp_path_factory) -> tuple[Path, tuple]:
    """(the FP32 genai folder written by genai's builder, the builder's input: the model's reader, tokenizer files
    and folder on disk)."""
    root = tmp_path_factory.mktemp("int4-choice")
    folder, _ = tiny_llama_folder(root, layers=1)
    model, _ = hub.load(str(folder))
    genai = root / "dense-genai"
    write_genai_folder(model, genai, {"modality": "text"}, folder, graph="fused")
    return genai, BuilderInput(lambda: model, tokenizer_files(folder), folder)


def _windows() -> np.ndarray:
    return np.random.default_rng(3).integers(4, 300, (4, SEQ))


class FakeTimer:
    """Decode ms/token by name from a table; remembers what it was asked to time."""

    def __init__(self, ms: dict[str, float]) -> None:
        self.ms, self.asked = ms, []

    def __call__(self, folders: dict[str, Path]) -> dict[str, float]:
        assert all((f / GRAPH).is_file() for f in folders.values())  # the candidates exist while timed
        self.asked.append(sorted(folders))
        return {name: self.ms[name] for name in folders}


def _choose(fused, out: Path, tol: DecoderTolerance, timer: FakeTimer, candidates=ALL, say=lambda line: None):
    genai, source = fused
    pair, windows = [(genai, out)], _windows()
    return int4_graphs(pair, windows, tol, SCHEME, None, False, None, None, candidates, [source], timer, say)[0]


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_a_builder_recipe_writes_matmulnbits_at_the_schemes_block_that_generate_in_genai(fused, tmp_path, recipe):
    out = tmp_path / "dense-genai-int4"
    record = _choose(fused, out, LOOSE, FakeTimer({}), candidates=(recipe,))
    proto = onnx.load(str(out / GRAPH))
    constants = {t.name for t in proto.graph.initializer}
    nbits = [n for n in proto.graph.node if n.op_type == "MatMulNBits"]
    attrs = [{a.name: a.i for a in n.attribute} for n in nbits]
    assert nbits and {a["block_size"] for a in attrs} == {16} and {a["accuracy_level"] for a in attrs} == {4}
    assert not [n for n in proto.graph.node if n.op_type == "MatMul" and constants & set(n.input)]  # none left float
    eight = sorted(n.name for n, a in zip(nbits, attrs, strict=True) if a["bits"] == 8)
    assert sorted(e["node"] for e in record["int4_int8"]) == eight
    assert bool(eight) == (recipe == "builder-k_quant_mixed")  # its LM head (and sensitive layers) in 8 bits
    assert record["int4_matmuls"] == len(nbits) - len(eight)
    meta = {e.key: json.loads(e.value) if e.value[:1] in "{[" else e.value for e in proto.metadata_props}
    assert meta["precision"] == "int4" and meta["int4_scheme"]["method"] == recipe
    choice = record["int4_choice"]
    assert choice["chosen"] == recipe and choice["why"].startswith("forced") and choice["timing"] is None
    assert record["verify"]["candidate_ppl"] != record["verify"]["reference_ppl"]  # the weights really changed
    model = og.Model(str(out))  # genai runs it: greedy tokens within the vocabulary
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=12, min_length=12, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens([[5, 17, 42, 9]])
    while not generator.is_done():
        generator.generate_next_token()
    tokens = list(generator.get_sequence(0))[4:]
    assert len(tokens) == 8 and all(0 <= t < 300 for t in tokens)


def test_the_choice_takes_the_fastest_passing_candidate_and_never_a_failing_one(fused, tmp_path) -> None:
    everything = _choose(fused, tmp_path / "all" / "dense-genai-int4", LOOSE, FakeTimer(dict.fromkeys(ALL, 1.0)))
    ratios = {c["recipe"]: c["verify"]["ppl_ratio"] for c in everything["int4_choice"]["candidates"]}
    worst = max(ratios, key=ratios.get)
    bound = (ratios[worst] + max(r for n, r in ratios.items() if n != worst)) / 2  # only the worst fails it
    passing = sorted(n for n in ratios if n != worst)
    # the failing candidate would be the fastest, and the chosen one is not the first in the candidates' order
    ms = {name: 5.0 + i for i, name in enumerate(passing)} | {worst: 0.1, passing[-1]: 1.0}
    timer = FakeTimer(ms)
    record = _choose(fused, tmp_path / "dense-genai-int4", DecoderTolerance(bound, 0.0), timer)
    assert timer.asked == [passing]  # only the passing candidates were timed, once, together
    choice = record["int4_choice"]
    assert choice["chosen"] == passing[-1] and record["int4_scheme"]["method"] == passing[-1]
    by_name = {c["recipe"]: c for c in choice["candidates"]}
    assert not by_name[worst]["passed"] and by_name[worst]["decode_ms_per_token"] is None
    assert all(by_name[n]["passed"] and by_name[n]["decode_ms_per_token"] == ms[n] for n in passing)
    assert f"{worst} x{ratios[worst]:.3f}" in choice["why"] and "fastest passing" in choice["why"]
    assert [p.name for p in tmp_path.iterdir() if p.name != "all"] == ["dense-genai-int4"]  # the losers are gone
    assert choice["timing"]["batch"] == 1 and isinstance(choice["flags"], list) and choice["cpu"]


def test_the_fp32_graph_is_scored_once_for_every_candidate_and_never_beside_one(fused, tmp_path, monkeypatch) -> None:
    """The reference's perplexity and top-1 tokens are the same for every candidate: computed once (the 1.7B shape's
    FP32 graph is 6.8 GB and minutes of windows), each graph in its own onnxruntime session."""
    scored: list[str] = []
    real = int4_gate.scores

    def counting(graph, windows):
        scored.append(Path(graph).parent.name)
        return real(graph, windows)

    monkeypatch.setattr(int4_gate, "scores", counting)
    monkeypatch.setattr(int4, "scores", counting)
    lines: list[str] = []
    record = _choose(fused, tmp_path / "dense-genai-int4", LOOSE, FakeTimer(dict.fromkeys(ALL, 1.0)), say=lines.append)
    assert scored.count("dense-genai") == 1 and len(scored) == 1 + len(ALL)
    said = [line.split(" (")[0].strip() for line in lines if "..." not in line]  # each candidate and phase as it
    assert said[:2] == ["INT4 1/1: dense-genai-int4", "dense-genai-int4: the FP32 graph's scores on 4 held-out windows"]
    assert [line for line in said if line.startswith("candidate")] == [  # starts: minutes each at the 1.7B shape
        f"candidate {i}/{len(ALL)}: {n}" for i, n in enumerate(ALL, 1)
    ]
    assert said[-1] == "dense-genai-int4: minmax's scores on the held-out windows"
    assert {c["verify"]["reference_ppl"] for c in record["int4_choice"]["candidates"]} == {
        record["verify"]["reference_ppl"]
    }


def test_auto_on_a_graph_over_its_size_bound_tries_the_projects_scheme_alone_and_says_why(
    fused, tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(int4, "AUTO_MAX_BYTES", 1)  # the tiny graph stands for the 1.7B shape's 6.8 GB
    timer = FakeTimer(dict.fromkeys(ALL, 1.0))
    record = _choose(fused, tmp_path / "dense-genai-int4", LOOSE, timer)
    choice = record["int4_choice"]
    assert [c["recipe"] for c in choice["candidates"]] == ["minmax"] and timer.asked == []
    assert choice["chosen"] == "minmax" and choice["why"].startswith("the project's scheme alone: ")
    assert "over auto's 0 GiB" in choice["why"] and "--int4-method" in choice["why"]


def test_every_candidate_failing_is_one_line_that_names_each_and_writes_nothing(fused, tmp_path) -> None:
    out = tmp_path / "run" / "dense-genai-int4"
    with pytest.raises(CorpError, match="fails its gate") as e:
        _choose(fused, out, DecoderTolerance(0.5, 1.0), FakeTimer({}))
    assert "\n" not in str(e.value) and all(f"{name} x" in str(e.value) for name in ALL)
    assert not any(out.parent.iterdir())


def test_without_the_model_the_builder_is_recorded_as_not_built_and_the_scheme_still_chosen(fused, tmp_path) -> None:
    genai, _ = fused
    out = tmp_path / "dense-genai-int4"
    candidates = recipes(AUTO, SCHEME)
    record = int4_graphs([(genai, out)], _windows(), LOOSE, SCHEME, None, False, None, None, candidates)[0]
    choice = record["int4_choice"]
    assert choice["chosen"] == "minmax" and choice["why"].startswith("the only candidate")
    assert all("prune-export" in c["error"] for c in choice["candidates"] if c["recipe"] in RECIPES)
    line = format_int4([record]).splitlines()[-1]
    assert (
        line.startswith("dense-genai-int4: minmax, the only candidate") and "not built (why: in the record): " in line
    )
    assert "failed the gate" not in line  # issue 50, item 11: a candidate never built did not fail the gate
    assert "dense-genai-int4/model.onnx" in format_int4([record])  # two folders' rows were both "model.onnx"


def test_the_sidecar_round_trips_and_the_method_option_names_the_candidates(fused, tmp_path) -> None:
    out = tmp_path / "dense-genai-int4"
    record = _choose(fused, out, LOOSE, FakeTimer(dict.fromkeys(RECIPES, 2.0) | {"minmax": 1.5}))
    sidecar = json.loads((out / f"{GRAPH}.json").read_text())
    assert sidecar | {"folder": out.name} == record
    choice = sidecar["int4_choice"]
    assert choice["chosen"] == "minmax" and [c["recipe"] for c in choice["candidates"]] == list(ALL)
    assert [c["decode_ms_per_token"] for c in choice["candidates"]] == [2.0] * len(RECIPES) + [1.5]
    assert "minmax 1.50, builder 2.00" in choice["why"]
    assert format_int4([record]).splitlines()[-1] == f"dense-genai-int4: minmax, {choice['why']}"
    assert recipes(AUTO, SCHEME) == (*RECIPES, "minmax")
    assert recipes("builder-asym", SCHEME) == ("builder-asym",) and recipes("rtn", Scheme(method="rtn")) == ("rtn",)
    with pytest.raises(CorpError, match="--int4-method"):
        recipes("gptq", SCHEME)


def test_a_candidate_graph_onnxruntime_cannot_load_is_recorded_and_the_others_still_compete(
    fused, tmp_path, monkeypatch
) -> None:
    # genai 0.18's builder writes such a graph for SmolLM2 (tied embeddings) with is_symmetric=false: a
    # GatherBlockQuantized without its scales; here a builder graph with one node's input dropped stands in for it
    real = int4._builder_candidate

    def broken(recipe, src, folder, scheme, source):
        real(recipe, src, folder, scheme, source)
        proto = onnx.load(str(folder / GRAPH))
        node = next(n for n in proto.graph.node if n.op_type == "MatMulNBits")
        del node.input[2:]
        onnx.save(proto, str(folder / GRAPH))

    monkeypatch.setattr(int4, "_builder_candidate", broken)
    record = _choose(fused, tmp_path / "dense-genai-int4", LOOSE, FakeTimer({}), candidates=("builder", "minmax"))
    choice = record["int4_choice"]
    assert choice["chosen"] == "minmax" and choice["why"].endswith("not built (why: in the record): builder")
    assert choice["candidates"][0]["error"].startswith("onnxruntime cannot load model.onnx")
    assert [p.name for p in tmp_path.iterdir()] == ["dense-genai-int4"]


@pytest.mark.parametrize("tol", [LOOSE, DecoderTolerance(1.0, 1.0)], ids=["passes", "fails"])
def test_the_quantize_only_baseline_is_the_builders_int4_kept_and_labelled_with_its_verdict(fused, tmp_path, tol):
    """genai's builder -p int4 of the dense model beside the chosen INT4 folder, timed in one run: kept whatever its
    gate says (the bound of 1.0 / 1.0 fails any change of weights), and its row says which."""
    genai, source = fused
    chosen = _choose(fused, tmp_path / "dense-genai-int4", LOOSE, FakeTimer({}), candidates=("minmax",))
    baseline = int4_baseline(genai, tmp_path / BASELINE_GENAI, _windows(), tol, source)
    sidecar = json.loads((tmp_path / BASELINE_GENAI / f"{GRAPH}.json").read_text())
    assert sidecar | {"folder": BASELINE_GENAI} == baseline and baseline["int4_scheme"]["method"] == "builder"
    assert baseline["int4_baseline"]["passes_gate"] is (tol is LOOSE)
    assert {n.op_type for n in onnx.load(str(tmp_path / BASELINE_GENAI / GRAPH)).graph.node} >= {"MatMulNBits"}
    timer = FakeTimer({"dense-genai-int4": 3.0, BASELINE_GENAI: 2.4})
    speed = int4_speed(tmp_path, ["dense-genai-int4", BASELINE_GENAI], timer)
    assert timer.asked == [["baseline-genai-int4", "dense-genai-int4"]]  # one interleaved run of both
    assert speed["vs_baseline"] == {"dense-genai-int4": 0.8, BASELINE_GENAI: 1.0} and speed["flags"]
    rows = format_int4_speed([chosen, baseline], speed).splitlines()
    row = next(line for line in rows if line.startswith(f"{BASELINE_GENAI} (quantize-only baseline)"))
    v = baseline["verify"]
    verdict = f"{'passes' if tol is LOOSE else 'fails'} gate x{v['ppl_ratio']:.3f} / {v['agreement']:.3f}"
    assert "genai builder -p int4 of the dense model" in row and verdict in row and "2.40" in row and "1.00x" in row
    row = next(line for line in rows if line.startswith("dense-genai-int4 "))
    assert "minmax" in row and "passes gate" in row and "3.00" in row and "0.80x" in row


def test_the_builder_reads_the_models_folder_and_the_model_only_where_there_is_none(fused, tmp_path, monkeypatch):
    """An INT4 builder candidate (the quantize-only baseline) is built from the model's folder on disk: the model is
    not read, nor written again as a copy. Without a folder the model is read and written for the builder, to the
    same graph."""
    from corp_deploy.exporters import fused_decoder

    genai, source = fused
    tol, never = LOOSE, BuilderInput(_never, source.tokenizer, source.folder)
    saves: list[Path] = []
    real = fused_decoder.save_pruned
    monkeypatch.setattr(
        fused_decoder, "save_pruned", lambda model, out, meta: saves.append(out) or real(model, out, meta)
    )
    from_folder = int4_baseline(genai, tmp_path / "folder" / BASELINE_GENAI, _windows(), tol, never)
    assert saves == []
    from_model = int4_baseline(
        genai, tmp_path / "model" / BASELINE_GENAI, _windows(), tol, source._replace(folder=None)
    )
    assert len(saves) == 1 and from_folder["verify"] == from_model["verify"]
    meta = [
        read_metadata(onnx.load(str(tmp_path / f / BASELINE_GENAI / GRAPH), load_external_data=False))
        for f in ("folder", "model")
    ]
    assert meta[0] == meta[1] and meta[0]["kv_cache"] and meta[0]["precision"] == "int4"


def _never():
    raise AssertionError("the model was read although its folder is on disk")


def test_the_quantize_only_baseline_of_a_graph_over_the_size_bound_is_not_built_and_says_why(
    fused, tmp_path, monkeypatch
) -> None:
    """genai's builder -p int4 of the 1.7B shape's 6.8 GB graph passed 11 GiB: from ``AUTO_MAX_BYTES`` on the baseline
    is one line in the record (``decoder_int4_baseline``), nothing is written, and the model is never read."""
    from corp_deploy.exporters.pipeline import decoder_int4_baseline

    genai, source = fused
    monkeypatch.setattr(int4, "AUTO_MAX_BYTES", 1)  # the tiny graph stands for the 1.7B shape's 6.8 GB
    never = BuilderInput(_never, source.tokenizer, None)
    run = genai.parent
    got = decoder_int4_baseline(run, [], _windows(), LOOSE, never, {})
    assert set(got) == {"int4_baseline"} and "-p int4 of a 0.0 GiB FP32 decode graph" in got["int4_baseline"]["error"]
    assert not (run / BASELINE_GENAI).exists()
