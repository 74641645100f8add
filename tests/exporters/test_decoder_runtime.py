"""Pruned decoders that generate in onnxruntime-genai (``exporters.kv_cache``, ``exporters.genai``, ``export``).

Tiny random Llama (4 query heads over 2 K/V heads) and OPT decoders, pruned so that the widths differ per layer
and between K and V, with a tiny byte-level BPE tokenizer (genai's tokenizer reads BPE, not word-level); no hub.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import decoder_tokenizer, run

transformers = pytest.importorskip("transformers", reason="text models need transformers (pip install '.[text]')")
pytest.importorskip("onnxruntime", reason="onnxruntime not installed (pip install '.[onnx]')")
pytest.importorskip("onnxscript", reason="onnxscript not installed (pip install '.[onnx]')")

from corp_deploy.base import memory  # noqa: E402
from corp_deploy.core.config import PruneConfig  # noqa: E402
from corp_deploy.core.pruner import calibrate, prune_model  # noqa: E402
from corp_deploy.exporters.genai import write_genai_folder  # noqa: E402
from corp_deploy.exporters.kv_cache import layout, positions  # noqa: E402
from corp_deploy.plan.width_plan import plan_widths  # noqa: E402

PROMPT = "the market news price team"


def tiny_decoder(kind: str, seed: int = 0, layers: int = 2, head: int = 8):
    """hidden 4 x ``head``, ``layers`` layers, 4 heads of ``head`` (Llama: over 2 K/V heads), MLP 64, 64 positions,
    SDPA as ``hub.load``."""
    torch.manual_seed(seed)
    size = {"hidden_size": 4 * head, "num_hidden_layers": layers, "num_attention_heads": 4}
    size["max_position_embeddings"] = 64
    ids = {"vocab_size": 300, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    if kind == "llama":
        config = transformers.LlamaConfig(
            num_key_value_heads=2, intermediate_size=64, initializer_range=0.2, **size, **ids
        )
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.OPTConfig(ffn_dim=64, word_embed_proj_dim=32, init_std=0.2, **size, **ids)
        cls = transformers.OPTForCausalLM
    config._attn_implementation = "sdpa"
    return cls(config).eval()


def _pruned(dense, target: str, sparsity: float):
    model = copy.deepcopy(dense)
    g = torch.Generator().manual_seed(1)
    batches = [
        ({"input_ids": (i := torch.randint(4, 300, (4, 24), generator=g)), "attention_mask": torch.ones_like(i)}, 0)
    ]
    config = PruneConfig(sparsity=sparsity, target=target, round_to=2, compensation="corp")
    stats = calibrate(model, batches * 4, config, "cpu", progress=False)
    prune_model(model, stats, config, plan_widths(model, config, stats))
    return model


def mixed(kind: str):
    """A pruned decoder whose two layers were pruned differently: Llama V widths 6 and 4 under K width 8; OPT
    layer 0 with Q/K 4 under V 8 (mlp,qk) and layer 1 at 4 and 4 (all)."""
    dense = tiny_decoder(kind)
    if kind == "llama":
        first, second = _pruned(dense, "mlp,v", 0.25), _pruned(dense, "mlp,v", 0.5)
        first.model.layers[1] = second.model.layers[1]
    else:
        first, second = _pruned(dense, "mlp,qk", 0.5), _pruned(dense, "all", 0.5)
        first.model.decoder.layers[1] = second.model.decoder.layers[1]
    return first


EXPECTED = {"llama": ((8, 8), (6, 4), (8, 8)), "opt": ((4, 4), (8, 4), (8, 4))}
"""Per layer (K widths, V widths, cache widths): each layer's cache is its wider of K and V."""


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    decoder_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=["llama", "opt"])
def exported(request, tokenizer_dir, tmp_path_factory):
    """(model, genai folder, its record) for a mixed-width pruned decoder."""
    pytest.importorskip("onnxruntime_genai", reason="genai folders need onnxruntime-genai (pip install '.[genai]')")
    model = mixed(request.param)
    folder = tmp_path_factory.mktemp(request.param) / "genai"
    record = write_genai_folder(model, folder, {"modality": "text"}, tokenizer_dir)
    return request.param, model, folder, record


def test_the_kv_graph_equals_the_full_sequence_forward_over_prefill_and_decode_steps(exported) -> None:
    """Independent of the export's own check: onnxruntime fed its own presents, against torch without a cache."""
    import onnxruntime as ort

    kind, model, folder, record = exported
    assert max(record["verify"]["max_rel_error_per_step"]) < 1e-5 and record["verify"]["decode_steps"] == 4
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    lay = layout(model)
    ids = torch.tensor([[0, 0, 5, 9, 40, 77], [3, 250, 17, 8, 99, 120]])  # the first left-padded
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    past = [np.zeros((2, lay.kv_heads, 0, w), np.float32) for w in lay.stored("key") for _ in "kv"]
    chunks = [(0, 6), (6, 7), (7, 8), (8, 9)]  # prefill, then three single-token steps
    for step in range(3):
        ids = torch.cat([ids, torch.tensor([[60 + step], [200 - step]])], 1)
        mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.numpy()
    for a, b in chunks:
        feeds = {"input_ids": ids[:, a:b].numpy(), "attention_mask": mask[:, :b].numpy()}
        if "position_ids" in names:
            feeds["position_ids"] = positions(mask[:, :b])[:, a:b].numpy()
        logits, *past = session.run(None, {**feeds, **dict(zip(names[len(feeds) :], past, strict=True))})
        real = mask[:, a:b].numpy().astype(bool)
        assert np.abs(logits - full[:, a:b])[real].max() < 1e-4 * np.abs(full).max(), (kind, a)
    assert past[0].shape[2] == 9  # the cache grew to every token


def test_per_layer_k_and_v_widths_are_read_from_the_model_and_appear_in_the_graph(exported) -> None:
    import onnx

    kind, model, folder, record = exported
    keys, values, widths = EXPECTED[kind]
    cache = record["kv_cache"]
    assert (tuple(cache["key"]), tuple(cache["value"])) == (keys, values)
    assert tuple(cache["key_cache"]) == tuple(cache["value_cache"]) == widths
    heads = cache["kv_heads"]
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    dims = {
        v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in (*graph.input, *graph.output)
    }
    for i, width in enumerate(widths):
        for kind_ in ("key", "value"):
            assert dims[f"past_key_values.{i}.{kind_}"] == ["batch_size", heads, "past_sequence_length", width]
            assert dims[f"present.{i}.{kind_}"] == ["batch_size", heads, "total_sequence_length", width]
    assert dims["attention_mask"] == ["batch_size", "total_sequence_length"]
    assert ("position_ids" in dims) == (kind == "llama")  # OPT counts its learned positions over the mask
    padded = [i for i, (k, v) in enumerate(zip(keys, values, strict=True)) if k != v]
    assert cache["padding"]["padded_layers"] == padded
    assert cache["padding"]["cache_floats_per_token"] == 2 * heads * sum(widths)


def test_genai_loads_the_folder_and_greedy_generates_transformers_tokens(exported, tokenizer_dir) -> None:
    import onnxruntime_genai as og

    kind, model, folder, record = exported
    config = json.loads((folder / "genai_config.json").read_text())["model"]
    assert config["type"] == {"llama": "llama", "opt": "decoder"}[kind]
    assert config["decoder"]["num_key_value_heads"] == {"llama": 2, "opt": 4}[kind]
    assert all(p["genai_equal"] and len(p["tokens"]) == 32 for p in record["genai"]["prompts"])
    assert len(record["genai"]["prompts"]) == 2 and record["tokenizer"]["tokens"]
    genai_model = og.Model(str(folder))
    prompt = [int(t) for t in og.Tokenizer(genai_model).encode(PROMPT)]
    assert prompt == decoder_tokenizer()(PROMPT)["input_ids"]
    params = og.GeneratorParams(genai_model)
    params.set_search_options(max_length=len(prompt) + 32, min_length=len(prompt) + 32, do_sample=False)
    generator = og.Generator(genai_model, params)
    generator.append_tokens([prompt])
    while not generator.is_done():
        generator.generate_next_token()
    got = [int(t) for t in generator.get_sequence(0)]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32)
    assert got == want[0].tolist() and len(got) == len(prompt) + 32


def test_a_genai_folder_is_loaded_once_for_its_tokenizer_and_generation_checks(tokenizer_dir, tmp_path, monkeypatch):
    """Issue 49: each ``onnxruntime_genai.Model`` builds an onnxruntime session over the whole graph (seconds for
    SmolLM2-135M); the tokenizer check and the greedy-token check each made one. One serves both now, and both
    checks still run."""
    og = pytest.importorskip("onnxruntime_genai", reason="genai folders need onnxruntime-genai")
    made, model_ = [], og.Model
    monkeypatch.setattr(og, "Model", lambda path: made.append(path) or model_(path))
    record = write_genai_folder(tiny_decoder("llama"), tmp_path / "genai", {"modality": "text"}, tokenizer_dir)
    assert made == [str(tmp_path / "genai")] and record["tokenizer"]["tokens"]
    assert all(p["genai_equal"] for p in record["genai"]["prompts"])


# --------------------------------------------------------------------------- the fused graph (genai's builder)


@pytest.fixture(scope="module")
def fused(tokenizer_dir, tmp_path_factory):
    """{name: (model, folder, record)}: a dense tiny Llama with heads of 16 (the CPU GroupQueryAttention's
    multiple) and one pruned MLP-only to a different width per layer (the remote-code form's case), written with
    ``graph="fused"``."""
    pytest.importorskip("onnxruntime_genai", reason="genai folders need onnxruntime-genai (pip install '.[genai]')")
    dense = tiny_decoder("llama", head=16)
    per_layer = _pruned(dense, "mlp", 0.25)
    per_layer.model.layers[1] = _pruned(dense, "mlp", 0.5).model.layers[1]
    out = {}
    for name, model in (("dense", dense), ("per-layer", per_layer)):
        folder = tmp_path_factory.mktemp(name) / "genai"
        out[name] = model, folder, write_genai_folder(model, folder, {"modality": "text"}, tokenizer_dir, graph="fused")
    return out


@pytest.mark.parametrize("name", ["dense", "per-layer"])
def test_the_fused_graph_is_genais_own_ops_at_the_models_widths_and_generates_transformers_tokens(fused, name):
    import onnx

    model, folder, record = fused[name]
    assert record["writer"].startswith("onnxruntime-genai") and "why_not_fused" not in record
    assert max(record["verify"]["max_rel_error_per_step"]) < 1e-5 and not record["verify"]["batched"]
    assert all(p["genai_equal"] and len(p["tokens"]) == 32 for p in record["genai"]["prompts"])
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("GroupQueryAttention") == 2 and "SkipSimplifiedLayerNormalization" in ops
    assert len(ops) < 25 * 2 + 10  # ~10 a layer (torch.export's graph: ~90)
    cache = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim[1::2]] for i in graph.input}
    assert cache["past_key_values.1.value"] == [2, 16] and not graph.value_info  # pinned; no stale annotations
    downs = {t.name: list(t.dims) for t in graph.initializer if "down_proj" in t.name and "weight" in t.name}
    widths = [layer.mlp.down_proj.in_features for layer in model.model.layers]
    assert [v[0] for _, v in sorted(downs.items())] == widths and (name == "dense") == (widths[0] == widths[1])


def test_the_builder_reads_the_models_folder_and_runs_with_the_model_let_go(
    fused, tokenizer_dir, tmp_path, monkeypatch
):
    """References first (the decode steps' logits, ``generate``'s tokens), then ``free``, then genai's builder on the
    model's own folder on disk (no copy written), onnxruntime's check and genai's generation, none with the torch
    model's weights resident: the record and its tokens are those of a run that held the model throughout."""
    pytest.importorskip("onnxruntime_genai", reason="genai folders need onnxruntime-genai (pip install '.[genai]')")
    from corp_deploy.exporters import fused_decoder, genai

    held, _, want = fused["dense"]
    model = copy.deepcopy(held)
    source = tmp_path / "source"
    model.save_pretrained(source)
    shutil.copytree(tokenizer_dir, source, dirs_exist_ok=True)
    order: list[tuple[str, bool]] = []

    def resident() -> bool:
        return any(not p.is_meta for p in model.parameters())

    def spying(module, name):
        real = getattr(module, name)

        def spy(*args, **kwargs):
            order.append((name, resident()))
            if name == "build_from_folder":
                assert args[0] == source  # the folder on disk, not a copy
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)

    for module, name in ((fused_decoder, "build_from_folder"), (genai, "check_decode_steps"), (genai, "genai_model")):
        spying(module, name)
    monkeypatch.setattr(fused_decoder, "save_pruned", _never)

    def free() -> None:
        model.to("meta")
        order.append(("free", resident()))

    got = write_genai_folder(
        model, tmp_path / "genai", {"modality": "text"}, tokenizer_dir, graph="fused", source=source, free=free
    )
    assert order == [
        ("free", False),
        ("build_from_folder", False),
        ("check_decode_steps", False),
        ("genai_model", False),
    ]
    assert got["genai"] == want["genai"] and got["verify"] == want["verify"] and got["kv_cache"] == want["kv_cache"]


def tiny_rope(kind: str, **window):
    """A tiny random Mistral or Qwen2 (heads of 16 over 2 K/V heads, random biases for Qwen2's q/k/v)."""
    torch.manual_seed(0)
    size = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    size |= {"intermediate_size": 64, "max_position_embeddings": 64, "vocab_size": 300}
    config_class, model_class = {
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[kind]
    config = config_class(pad_token_id=0, bos_token_id=1, eos_token_id=2, **size, **window)
    config._attn_implementation = "sdpa"
    model = model_class(config).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_mistral_and_qwen2_take_the_fused_graph_dense_and_mlp_pruned(kind, tokenizer_dir, tmp_path) -> None:
    """Mistral without a window (v0.2 on), Qwen2 with its q/k/v biases and, pruned, the compensation's bias on
    down_proj (a flag Qwen2's config lacks: the remote-code form the builder loads)."""
    pytest.importorskip("onnxruntime_genai", reason="genai folders need onnxruntime-genai (pip install '.[genai]')")
    dense = tiny_rope(kind, sliding_window=None)
    for name, model in (("dense", dense), ("pruned", _pruned(dense, "mlp", 0.25))):
        record = write_genai_folder(model, tmp_path / name, {"modality": "text"}, tokenizer_dir, graph="fused")
        assert max(record["verify"]["max_rel_error_per_step"]) < 1e-5, name
        assert all(p["genai_equal"] for p in record["genai"]["prompts"]), name


def test_a_fused_graph_that_fails_its_check_is_replaced_under_auto_and_refused_when_asked(
    tokenizer_dir, tmp_path, monkeypatch
) -> None:
    pytest.importorskip("onnxruntime_genai", reason="genai folders need onnxruntime-genai (pip install '.[genai]')")
    from corp_deploy.base.errors import CorpError
    from corp_deploy.exporters import genai

    real = genai.check_decode_steps

    def broken_fused(reference, path):  # the fused graph is checked one prompt at a time
        if not reference.batched:
            raise CorpError("onnxruntime cannot run the decode-step graph: (a stand-in failure)")
        return real(reference, path)

    monkeypatch.setattr(genai, "check_decode_steps", broken_fused)
    model = tiny_decoder("llama", head=16, layers=1)
    record = write_genai_folder(model, tmp_path / "auto", {"modality": "text"}, tokenizer_dir)
    assert record["writer"].startswith("torch.export") and "a stand-in failure" in record["why_not_fused"]
    assert not (tmp_path / "auto" / "model.onnx.data").exists()  # nothing of the fused attempt is left
    with pytest.raises(CorpError, match="a stand-in failure"):
        write_genai_folder(model, tmp_path / "fused", {"modality": "text"}, tokenizer_dir, graph="fused")


def test_auto_takes_the_fused_graph_only_where_the_builder_can_and_says_why_not(tokenizer_dir) -> None:
    from corp_deploy.base.errors import CorpError
    from corp_deploy.exporters.genai import TOKENIZER_FILES, choose_graph

    files = [tokenizer_dir / n for n in TOKENIZER_FILES if (tokenizer_dir / n).is_file()]
    dense = tiny_decoder("llama", head=16)
    assert choose_graph(dense, "auto", files) == ("fused", None)
    cases = {
        "V pruned": (_pruned(dense, "mlp,v", 0.5), files, "16 wide for Q/K and 8 for V: GroupQueryAttention"),
        "heads of 8": (tiny_decoder("llama"), files, "heads are 8 wide"),
        "OPT": (tiny_decoder("opt", head=16), files, "model builder has no OPTForCausalLM"),
        "no tokenizer": (dense, [], "no tokenizer.json"),
        "Mistral's window": (tiny_rope("mistral", sliding_window=8), files, "sliding-window attention (window 8)"),
        "Qwen2's window": (tiny_rope("qwen2", use_sliding_window=True, sliding_window=8), files, "(window 8)"),
    }
    for case, (model, given, why) in cases.items():
        writer, reason = choose_graph(model, "auto", given)
        assert writer == "export" and why in reason, case
        with pytest.raises(CorpError, match="--decode-graph fused: .*; use --decode-graph export or auto"):
            choose_graph(model, "fused", given)
    assert choose_graph(dense, "export", files)[0] == "export"


# ------------------------------------------------------------------------------------------ command line


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory, tokenizer_dir) -> Path:
    """A dense tiny Llama saved as a transformers folder with its tokenizer; one layer (the command line's export
    does not depend on the depth, and a decode-step export takes about twice as long with two)."""
    folder = tmp_path_factory.mktemp("src") / "tiny-llama"
    tiny_decoder("llama", layers=1).save_pretrained(folder)
    decoder_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.e2e
def test_export_writes_a_dense_decoders_genai_folder_that_continues_the_prompts(llama_folder, tmp_path, capsys):
    pytest.importorskip("onnxruntime_genai", reason="genai folders need onnxruntime-genai (pip install '.[genai]')")
    out = tmp_path / "genai"
    argv = ["export", str(llama_folder), "--seq-len", "32", "--prompt", PROMPT, "--prompt", "a film game", "--out"]
    code, stdout, stderr = run([*argv, str(out)], capsys)
    assert code == 0, stderr
    files = {"model.onnx", "model.onnx.json", "genai_config.json", "tokenizer.json", "tokenizer_config.json"}
    assert files <= {p.name for p in out.iterdir()}
    record = json.loads((out / "model.onnx.json").read_text())
    prompts = [p["prompt"] for p in record["genai"]["prompts"]]
    assert prompts == [decoder_tokenizer()(t)["input_ids"] for t in (PROMPT, "a film game")]
    assert record["kv_cache"]["padding"]["overhead"] == 0 and record["weights"] == "pretrained"
    assert f"{out.name}: '{PROMPT}|" in stdout and "greedy = transformers for 2 prompts x 32 tokens" in stdout


def _corp_json(root: Path, record: dict) -> Path:
    root.mkdir()
    (root / "corp.json").write_text(json.dumps(record))
    return root


BAD = {
    "no genai extra": ("{llama}", [], "needs onnxruntime-genai (pip install 'corp-deploy[genai]')"),
    "another corp-deploy format": (
        "{other_format}",
        [],
        "is not a prune artifact this corp-deploy version reads",
    ),
    "a vit artifact": ("{vit}", [], "is a timm-vit prune artifact: --out must be a .onnx file"),
    "an encoder folder": ("{bert}", [], "is a bert model: --out must be a .onnx file"),
    "a decoder folder without its head": ("{headless}", [], "is a llama model without a language-model head"),
    "a foreign folder": ("{foreign}", [], "is neither a prune artifact (no corp.json) nor a transformers folder"),
    "a prompt longer than the positions": (
        "{llama}",
        ["--prompt", " ".join(["market"] * 40)],
        "passes the model's 64 positions; shorten it to 32 tokens or fewer",
    ),
    "fp16": ("{llama}", ["--precision", "fp32,fp16"], "are not for a genai folder"),
    "decode-graph for a .onnx": (
        "{llama}",
        ["--decode-graph", "fused", "--out", "x.onnx"],
        "are for a decoder's genai",
    ),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_decoder_export_input_is_one_line_and_writes_nothing(case, llama_folder, tmp_path, capsys, monkeypatch):
    from helpers import tiny_text_folder

    source, extra, expected = BAD[case]
    if case == "no genai extra":
        monkeypatch.setitem(sys.modules, "onnxruntime_genai", None)  # as when it is not installed
    monkeypatch.setattr("corp_deploy.formats.sources.load_source", _never)  # every refusal comes before the model loads
    places = {
        "llama": llama_folder,
        "other_format": _corp_json(tmp_path / "other", {"format": "corp-deploy/bench", "format_version": 1}),
        "vit": _corp_json(
            tmp_path / "vit",
            {"format": "corp-deploy/pruned-vit", "format_version": 3, "model": {"name": "deit_tiny"}, "structure": []},
        ),
        "bert": tiny_text_folder(tmp_path) if case == "an encoder folder" else None,
        "foreign": (tmp_path / "foreign").mkdir() or tmp_path / "foreign",
        "headless": _headless(llama_folder, tmp_path / "headless"),
    }
    out = tmp_path / ("out.onnx" if case == "decode-graph for a .onnx" else "out")
    capsys.readouterr()  # what building the folders printed
    code, stdout, stderr = run(["export", source.format(**places), *extra, "--out", str(out)], capsys)
    lines = stderr.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], stderr
    assert "Traceback" not in stderr and not out.exists()


def _headless(folder: Path, to: Path) -> Path:
    """``folder`` with no ``architectures`` in its config: ``hub.load`` builds the base ``LlamaModel`` (hidden states,
    no head to generate with), as it did for the scale study's folders before they named their class."""
    shutil.copytree(folder, to)
    config = json.loads((to / "config.json").read_text())
    del config["architectures"]
    (to / "config.json").write_text(json.dumps(config))
    return to


def _never(*args, **kwargs):
    raise AssertionError("the model was loaded before the input was checked")


def test_prune_export_on_a_decoder_needs_genai_before_pruning(llama_folder, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", None)
    monkeypatch.setattr("corp_deploy.cli.inputs.create_model", _never)
    monkeypatch.setattr("corp_deploy.families.hf.hub.load", _never)
    argv = ["prune-export", str(llama_folder), "--calib", "synthetic", "--seq-len", "16", "--precision", "fp32"]
    code, _, stderr = run([*argv, "--out", str(tmp_path / "run")], capsys)
    assert code == 1 and stderr.strip().splitlines() == [
        "error: a decoder's onnxruntime-genai folder needs onnxruntime-genai (pip install 'corp-deploy[genai]')"
    ]
    assert not (tmp_path / "run").exists()


@pytest.mark.e2e
def test_prune_export_of_a_decoder_holds_one_model_at_a_time(llama_folder, tmp_path, capsys, monkeypatch) -> None:
    """Each graph and genai folder is written with one model's weights in memory, the other's let go (on the meta
    device): the 1.7B shape's dense and pruned float32 weights together would be 11.8 GB beside the exporters'. A
    genai folder's graph is checked and generated with once the model is let go too (its references kept)."""
    pytest.importorskip("onnxruntime_genai", reason="genai folders need onnxruntime-genai (pip install '.[genai]')")
    import gc

    from corp_deploy.exporters import genai, pipeline

    written: list[str] = []

    def llamas() -> list[torch.nn.Module]:
        gc.collect()
        return [m for m in gc.get_objects() if isinstance(m, transformers.LlamaForCausalLM)]

    others = llamas()  # other tests' (module fixtures in this process): not the command's

    def spying(real, what):
        def spy(model, *args, **kwargs):
            made = [m for m in llamas() if not any(m is o for o in others)]
            resident = [m for m in made if any(not p.is_meta for p in m.parameters())]
            assert resident == [model], f"{what}: {len(resident)} models resident"
            written.append(what)
            return real(model, *args, **kwargs)

        return spy

    def let_go(real, what):  # onnxruntime's check and genai's run of the folder: no model beside them
        def spy(*args, **kwargs):
            made = [m for m in llamas() if not any(m is o for o in others)]
            assert not [m for m in made if any(not p.is_meta for p in m.parameters())], what
            written.append(what)
            return real(*args, **kwargs)

        return spy

    monkeypatch.setattr(pipeline, "export_verified", spying(pipeline.export_verified, "onnx"))
    monkeypatch.setattr(genai, "write_genai_folder", spying(genai.write_genai_folder, "genai"))
    monkeypatch.setattr(genai, "check_decode_steps", let_go(genai.check_decode_steps, "check"))
    monkeypatch.setattr(genai, "genai_model", let_go(genai.genai_model, "run"))
    argv = ["prune-export", str(llama_folder), "--calib", "synthetic", "--seq-len", "16", "--precision", "fp32"]
    code, _, stderr = run([*argv, "--verify-batch-sizes", "1,2", "--quiet", "--out", str(tmp_path / "run")], capsys)
    assert code == 0, stderr
    assert written == ["onnx", "onnx", *["genai", "check", "run"] * 2]  # dense, pruned, each read again
    memory_ = json.loads((tmp_path / "run" / "export.json").read_text())["memory"]  # predicted beside measured
    assert memory_["plan"]["model_gib"] * memory.GIB == memory.safetensors_bytes(llama_folder, itemsize=4)
    assert memory_["plan"]["peak_gib"] > memory_["plan"]["model_gib"] and memory_["host_rss_mib"] > 0
