"""Pruned text artifacts as folders ``transformers`` and ``sentence-transformers`` load WITHOUT corp-deploy
(``corp_deploy.families.hf.folder``):
the standard form (uniform MLP pruning: the family's own config, no ``auto_map``) and
the remote-code form (per-layer widths, Q/K narrower than V or V narrower than Q/K: ``auto_map`` +
``modeling_corp.py``).

Tiny random 2-layer BERT (a sentence-transformers folder with mean pooling and normalisation), OPT and Llama
models, each pruned twice: non-uniform (global MLP selection plus Q/K or V) and uniform MLP-only. One child
process loads all six folders with ``corp_deploy`` blocked from import (``-I``, a temporary cwd and a
``sys.meta_path`` finder that refuses it; the child proves ``import corp_deploy`` fails) and returns their
outputs: logits and greedy ``generate`` tokens for decoders, the last hidden state and the
``SentenceTransformer`` embeddings for the encoder. No hub, no downloads.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="text models need transformers (pip install '.[text]')")
pytest.importorskip("sentence_transformers", reason="the sentence-transformers check needs sentence-transformers")

from helpers import run  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertModel,
    BertTokenizerFast,
    LlamaConfig,
    LlamaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
)

from corp_deploy.base.errors import CorpError  # noqa: E402
from corp_deploy.core.config import PruneConfig  # noqa: E402
from corp_deploy.core.pruner import calibrate, prune_model  # noqa: E402
from corp_deploy.families import get, structure  # noqa: E402
from corp_deploy.families.hf import hub  # noqa: E402
from corp_deploy.families.hf.folder import MODELING_FILE, REMOTE, STANDARD  # noqa: E402
from corp_deploy.formats.artifact import build, load_pruned, read_meta, save_pruned  # noqa: E402
from corp_deploy.plan.width_plan import check_standard, plan_widths  # noqa: E402

WORDS = [f"w{i}" for i in range(40)]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
SENTENCES = ["w1 w2 w3 w4 w5", "w7 w8", "w30 w31 w32 w33 w34 w35 w36 w37 w38"]
PROMPTS = torch.tensor([[1, 8, 9, 10, 11, 12], [1, 20, 21, 22, 23, 24]])
NEW_TOKENS = 8
NAMES = {"bert": "intermediate_size", "opt": "ffn_dim", "llama": "intermediate_size", "dinov2": "mlp_ratio"}
"""Each family's config field of the MLP width."""
NON_UNIFORM = {"bert": "mlp,qk", "opt": "mlp,qk", "llama": "mlp,v", "dinov2": "mlp,qk,v"}
"""Each family's attention part that its config cannot express, pruned beside per-layer MLP widths."""


def token_batches(vocab: int, n: int = 6, batch: int = 4, seq: int = 16) -> list[tuple[dict, int]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(5, vocab, (batch, seq), generator=g)
        out.append(({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, 0))
    return out


def pruned(dense: torch.nn.Module, uniform: bool, family: str) -> torch.nn.Module:
    """Uniform MLP-only (the standard form), or a network-wide MLP threshold (per-layer widths) with the family's
    attention part at 50% (the remote-code form)."""
    model = copy.deepcopy(dense)
    if uniform:
        config = PruneConfig(sparsity=0.5, target="mlp", round_to=2)
    else:
        config = PruneConfig(sparsity=0.5, target=NON_UNIFORM[family], selection="global", round_to=2)
    data = [(PIXELS, 0)] * 3 if family == "dinov2" else token_batches(model.config.vocab_size)
    stats = calibrate(model, data, config, "cpu", progress=False)
    prune_model(model, stats, config, plan_widths(model, config, stats))
    return model.eval()


PIXELS_SEED = 3
PIXELS = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(PIXELS_SEED))
"""The images a DINOv2 folder is checked on; the child process draws the same ones from the seed."""


def tiny_dinov2() -> torch.nn.Module:
    """A DINOv2 with a classification head: the folder must load it with its head."""
    torch.manual_seed(0)
    args = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "mlp_ratio": 2, "num_labels": 5}
    config = transformers.Dinov2Config(image_size=32, patch_size=8, **args)
    config._attn_implementation = "sdpa"
    return transformers.Dinov2ForImageClassification(config).eval()


def sentence_source(folder: Path) -> Path:
    """A tiny random BertModel saved as a sentence-transformers model: tokenizer, modules.json, mean pooling,
    normalisation."""
    torch.manual_seed(0)
    args = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
    BertModel(
        BertConfig(vocab_size=len(VOCAB), max_position_embeddings=40, initializer_range=0.2, **args)
    ).save_pretrained(folder)
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt"), do_lower_case=False).save_pretrained(folder)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32, "do_lower_case": False}))
    (folder / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (folder / "2_Normalize").mkdir()
    return folder


def tiny_opt() -> OPTForCausalLM:
    torch.manual_seed(0)
    args = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "ffn_dim": 64, "vocab_size": 60}
    config = OPTConfig(pad_token_id=0, bos_token_id=1, eos_token_id=2, word_embed_proj_dim=32, **args)
    config._attn_implementation = "sdpa"
    return OPTForCausalLM(config).eval()


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    args = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    args |= {"intermediate_size": 64, "vocab_size": 60, "max_position_embeddings": 64, "initializer_range": 0.2}
    config = LlamaConfig(pad_token_id=0, bos_token_id=1, eos_token_id=2, **args)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


CHILD = textwrap.dedent(
    """
    import json, sys
    import torch

    class NoCorpDeploy:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "corp_deploy":
                raise ModuleNotFoundError(name)

    sys.meta_path.insert(0, NoCorpDeploy())
    try:
        import corp_deploy  # noqa: F401
    except ModuleNotFoundError:
        blocked = True
    else:
        blocked = False
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageClassification

    jobs, out = json.loads(sys.argv[1]), {"blocked": blocked}
    for name, job in jobs.items():
        trust = {"trust_remote_code": True} if job["trust"] else {}
        with torch.no_grad():
            if job["kind"] == "causal":
                model = AutoModelForCausalLM.from_pretrained(job["path"], **trust).eval()
                prompts = torch.tensor(job["prompts"])
                kw = {"attention_mask": torch.ones_like(prompts), "max_new_tokens": job["new"], "do_sample": False}
                result = {"logits": model(input_ids=prompts).logits, "tokens": model.generate(prompts, **kw)}
            elif job["kind"] == "image":
                model = AutoModelForImageClassification.from_pretrained(job["path"], **trust).eval()
                pixels = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(job["pixels_seed"]))
                result = {"logits": model(pixel_values=pixels).logits}
            else:
                from sentence_transformers import SentenceTransformer

                model = AutoModel.from_pretrained(job["path"], **trust).eval()
                ids = torch.tensor(job["prompts"])
                st = SentenceTransformer(job["path"], device="cpu", **trust)
                embeddings = st.encode(job["sentences"], convert_to_tensor=True)
                result = {"hidden": model(input_ids=ids).last_hidden_state, "embeddings": embeddings}
        result["class"] = type(model).__module__ + "." + type(model).__name__
        out[name] = result
    torch.save(out, sys.argv[2])
    """
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    """Every family pruned both ways and saved; their pruned models; what the child loaded from each folder."""
    root = tmp_path_factory.mktemp("folders")
    bert, tokenizer = hub.load(str(sentence_source(root / "st-source")))
    dense = {"bert": bert, "opt": tiny_opt(), "llama": tiny_llama(), "dinov2": tiny_dinov2()}
    models, jobs = {}, {}
    for family, net in dense.items():
        for uniform in (False, True):
            name = f"{family}-{STANDARD if uniform else REMOTE}"
            models[name] = pruned(net, uniform, family)
            save_pruned(models[name], root / name, {"model": {"name": name, "args": {}}})
            kind = {"bert": "encoder", "dinov2": "image"}.get(family, "causal")
            prompts = PROMPTS.tolist()
            job = {"path": str(root / name), "kind": kind, "trust": not uniform, "prompts": prompts, "new": NEW_TOKENS}
            jobs[name] = job | {"sentences": SENTENCES, "pixels_seed": PIXELS_SEED}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env |= {"HF_HOME": str(root / "hf-home"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-I", "-c", CHILD, json.dumps(jobs), str(root / "out.pt")]
    done = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = torch.load(root / "out.pt")
    return {"root": root, "models": models, "loaded": loaded, "tokenizer": tokenizer, "dense": dense}


def test_the_child_process_cannot_import_corp_deploy(folders) -> None:
    assert folders["loaded"]["blocked"] is True


@pytest.mark.parametrize("family", ["opt", "llama"])
@pytest.mark.parametrize("form", [STANDARD, REMOTE])
def test_a_pruned_decoder_folder_loads_alone_with_the_same_logits_and_greedy_tokens(folders, family, form) -> None:
    name = f"{family}-{form}"
    model, loaded = folders["models"][name], folders["loaded"][name]
    prompts = PROMPTS
    with torch.no_grad():
        logits = model(input_ids=prompts).logits
        kw = {"attention_mask": torch.ones_like(prompts), "max_new_tokens": NEW_TOKENS, "do_sample": False}
        tokens = model.generate(prompts, **kw)
    torch.testing.assert_close(loaded["logits"], logits, atol=1e-5, rtol=1e-5)
    assert tokens.shape == (2, prompts.shape[1] + NEW_TOKENS) and torch.equal(loaded["tokens"], tokens)
    is_remote = loaded["class"].startswith("transformers_modules.")
    assert is_remote == (form == REMOTE), loaded["class"]


@pytest.mark.parametrize("form", [STANDARD, REMOTE])
def test_a_pruned_dinov2_folder_loads_alone_with_its_head_and_the_same_logits(folders, form) -> None:
    name = f"dinov2-{form}"
    model, loaded = folders["models"][name], folders["loaded"][name]
    with torch.no_grad():
        torch.testing.assert_close(loaded["logits"], model(pixel_values=PIXELS).logits, atol=1e-5, rtol=1e-5)
    assert loaded["class"].endswith("Dinov2ForImageClassification")
    assert loaded["class"].startswith("transformers_modules.") == (form == REMOTE), loaded["class"]
    meta = read_meta(folders["root"] / name)
    assert meta["folder"]["loads_with"].startswith("AutoModelForImageClassification.from_pretrained(folder")
    if form == STANDARD:
        config = json.loads((folders["root"] / name / "config.json").read_text())
        assert config["mlp_ratio"] == 1 and "auto_map" not in config  # 64 -> 32 channels of a 32-wide model
    assert structure(build(meta, folders["root"] / name)) == structure(folders["dense"]["dinov2"])


@pytest.mark.parametrize("form", [STANDARD, REMOTE])
def test_a_pruned_sentence_transformers_folder_gives_the_pruned_models_embeddings(folders, form) -> None:
    name = f"bert-{form}"
    model, loaded, tokenizer = folders["models"][name], folders["loaded"][name], folders["tokenizer"]
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(loaded["hidden"], model(input_ids=PROMPTS).last_hidden_state, atol=1e-5, rtol=1e-5)
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    cosine = torch.nn.functional.cosine_similarity(loaded["embeddings"], pooled, dim=-1)
    assert cosine.min() >= 0.9999, cosine
    folder = folders["root"] / name
    assert {"modules.json", "sentence_bert_config.json", "vocab.txt"} <= {p.name for p in folder.iterdir()}
    assert (folder / "1_Pooling" / "config.json").is_file() and (folder / "2_Normalize").is_dir()
    assert read_meta(folder)["folder"]["sentence_transformers"].startswith("SentenceTransformer(folder")


@pytest.mark.parametrize("family", ["bert", "opt", "llama"])
def test_the_form_follows_the_structure_and_is_recorded_and_load_pruned_still_reads_both(folders, family) -> None:
    for form in (STANDARD, REMOTE):
        folder, model = folders["root"] / f"{family}-{form}", folders["models"][f"{family}-{form}"]
        config, meta = json.loads((folder / "config.json").read_text()), read_meta(folder)
        assert meta["folder"]["form"] == form
        assert ("auto_map" in config) == (form == REMOTE) == (folder / MODELING_FILE).is_file()
        assert ("why" in meta["folder"]) == (form == REMOTE)
        widths = {b["mlp_hidden"] for b in meta["structure"]}
        assert len(widths) == 1 if form == STANDARD else len(widths) > 1  # the plans did what the test needs
        dense = folders["dense"][family]
        if form == STANDARD:  # config.json holds the pruned MLP width; the dense one is recorded beside it
            assert meta["folder"]["dense_config"] == {NAMES[family]: getattr(dense.config, NAMES[family])}
        widths = ("mlp_hidden", "qk_dim", "v_dim", "heads")  # a standard Llama keeps its config's new bias flag
        built = [{k: b[k] for k in widths} for b in structure(build(meta, folder))]
        assert built == [{k: b[k] for k in widths} for b in structure(dense)]  # bench's dense reference
        again = load_pruned(folder)
        ids = PROMPTS
        with torch.no_grad():
            ref = model(input_ids=ids)[0]
            torch.testing.assert_close(again(input_ids=ids)[0], ref, atol=1e-5, rtol=1e-5)


def test_a_standard_llama_with_folded_biases_says_so_in_its_config(folders) -> None:
    """CORP's constant makes down_proj biased; transformers' Llama has one flag for gate, up and down, so the
    folder sets it and stores zero gate/up biases (the pruned model in memory is left as it was)."""
    config = json.loads((folders["root"] / f"llama-{STANDARD}" / "config.json").read_text())
    model = folders["models"][f"llama-{STANDARD}"]
    assert model.model.layers[0].mlp.down_proj.bias is not None and model.model.layers[0].mlp.gate_proj.bias is None
    assert config["mlp_bias"] is True and config["intermediate_size"] == 32


def test_cli_layout_standard_writes_the_familys_own_folder_and_refuses_what_it_cannot_keep(folders, capsys) -> None:
    source, root = folders["root"] / "st-source", folders["root"]
    common = [str(source), "--calib", "synthetic", "--num-calib", "8", "--seq-len", "16", "--round-to", "2", "--quiet"]
    argv = ["prune", *common, "--layout", "standard", "--target", "mlp", "--out", str(root / "cli")]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    assert "loads without corp-deploy: AutoModel.from_pretrained(folder) or SentenceTransformer(folder)" in out
    assert read_meta(root / "cli")["report"]["config"]["layout"] == STANDARD
    refusals = {
        ("--target", "mlp,qk"): "the hf-bert config expresses only mlp pruning, not qk",
        ("--budget", "macs=0.7"): "--layout standard keeps every layer's widths equal",
        ("--selection", "global"): "drop --selection global",
    }
    for (flag, value), message in refusals.items():
        bad = root / f"bad-{value}"
        code, _, err = run(["prune", *common, "--layout", "standard", flag, value, "--out", str(bad)], capsys)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 1 and len(lines) == 1 and message in lines[0], err
        assert not bad.exists()


def test_layout_standard_is_refused_for_a_family_without_one() -> None:
    with pytest.raises(CorpError, match="timm-vit artifacts have one layout"):
        check_standard(get("timm-vit"), PruneConfig(layout="standard", target="mlp"))
