"""The family contract, run over every registered family (``corp_deploy.families``): a tiny random model of each
is found by the registry, prunes every part the family can prune to a smaller model of the same class, CORP's
error is below plain removal's on held-out inputs, the artifact names the family and reloads to the same outputs,
and the pruned model exports to an ONNX graph that onnxruntime runs to the same outputs.

A family registered without a tiny model here fails ``test_every_registered_family_has_a_tiny_model_here``: a new
family is its own file plus its entry in ``TINY``. Mistral and Qwen2 are registrations of Llama's layout; their
own attention classes (sliding window, q/k/v biases) are what the contract exercises.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import TINY as TINY_VIT
from helpers import tiny_batches, tiny_vit

from corp_deploy.base.errors import CorpError
from corp_deploy.core.config import PruneConfig
from corp_deploy.core.pruner import calibrate, prune_model
from corp_deploy.families import adapter_for, get, registry
from corp_deploy.formats.artifact import load_pruned, read_meta, save_pruned
from corp_deploy.plan.width_plan import plan_widths

transformers = pytest.importorskip("transformers", reason="text models need transformers (pip install '.[text]')")

VOCAB = 100
COMMON = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": VOCAB}
ROPE = {"num_key_value_heads": 2, "intermediate_size": 64, "max_position_embeddings": 64}
IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _hf(config_cls: str, model_cls: str, **args) -> Callable[[], torch.nn.Module]:
    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        config = getattr(transformers, config_cls)(**IDS, **COMMON, **args)
        config._attn_implementation = "sdpa"
        model = getattr(transformers, model_cls)(config).eval()
        with torch.no_grad():  # random biases, so that the folds into q/k/v biases are exercised
            for m in model.modules():
                if isinstance(m, torch.nn.Linear) and m.bias is not None:
                    m.bias.normal_(0, 0.1)
        return model

    return make


def _hf_image(config_cls: str, model_cls: str, **args) -> Callable[[], torch.nn.Module]:
    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        config = getattr(transformers, config_cls)(image_size=32, patch_size=8, **COMMON_IMAGE, **args)
        config._attn_implementation = "sdpa"
        return getattr(transformers, model_cls)(config).eval()

    return make


COMMON_IMAGE = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
TINY: dict[str, Callable[[], torch.nn.Module]] = {
    "timm-vit": tiny_vit,
    "hf-vit": _hf_image("ViTConfig", "ViTModel", intermediate_size=64),
    "hf-dinov2": _hf_image("Dinov2Config", "Dinov2ForImageClassification", mlp_ratio=2, num_labels=5),
    "hf-bert": _hf("BertConfig", "BertModel", intermediate_size=64, max_position_embeddings=64),
    "hf-opt": _hf("OPTConfig", "OPTForCausalLM", ffn_dim=64, word_embed_proj_dim=32, max_position_embeddings=64),
    "hf-llama": _hf("LlamaConfig", "LlamaForCausalLM", **ROPE),
    "hf-mistral": _hf("MistralConfig", "MistralForCausalLM", sliding_window=8, **ROPE),
    "hf-qwen2": _hf(
        "Qwen2Config", "Qwen2ForCausalLM", use_sliding_window=True, sliding_window=8, max_window_layers=0, **ROPE
    ),
}
"""Family -> a tiny random model of it (Mistral and Qwen2 with sliding windows shorter than the sequences)."""


def token_batches(n: int, seed: int, batch: int = 4, seq: int = 24) -> list[tuple[dict, int]]:
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, VOCAB, (batch, seq), generator=g) for _ in range(n)]
    return [({"input_ids": x, "attention_mask": torch.ones_like(x)}, 0) for x in ids]


def batches(name: str, seed: int, n: int) -> list:
    return tiny_batches(n=16 * n, seed=seed) if get(name).modality == "image" else token_batches(n, seed)


def outputs(model: torch.nn.Module, data: list) -> torch.Tensor:
    """The features the sensitivity pass compares, for every held-out batch."""
    family = adapter_for(model)
    with torch.no_grad():
        found = []
        for inputs, _ in data:
            x, call = family.block_call(model, inputs, "cpu")
            found.append(family.features_from(model, 0, x, call, inputs))
        return torch.cat([f.reshape(-1, f.shape[-1]) for f in found])


def pruned(dense: torch.nn.Module, name: str, compensation: str) -> torch.nn.Module:
    model = copy.deepcopy(dense)
    config = PruneConfig(sparsity=0.5, target=",".join(get(name).parts), round_to=2, compensation=compensation)
    stats = calibrate(model, batches(name, 1, 12), config, "cpu", progress=False)
    prune_model(model, stats, config, plan_widths(model, config, stats))
    return model


def test_every_registered_family_has_a_tiny_model_here() -> None:
    assert {f.name for f in registry.families()} == set(TINY)


@pytest.mark.parametrize("name", list(TINY))
def test_a_family_prunes_smaller_compensates_reloads_and_exports(name: str, tmp_path: Path) -> None:
    dense, family = TINY[name](), get(name)
    assert adapter_for(dense) is family
    heldout = batches(name, 9, 3)
    model = pruned(dense, name, "corp")
    assert type(model) is type(dense) and not any(m.training for m in model.modules())
    assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in dense.parameters())
    for before, after in zip(*(map(family.structure, family.blocks(m)) for m in (dense, model)), strict=True):
        assert after["mlp_hidden"] == before["mlp_hidden"] // 2
        assert after["v_dim"] == before["v_dim"] // 2
        assert after["qk_dim"] == (before["qk_dim"] // 2 if "qk" in family.parts else before["qk_dim"])
    ref = outputs(dense, heldout)
    error = lambda m: float((outputs(m, heldout) - ref).square().sum() / ref.square().sum())  # noqa: E731
    assert error(model) < 0.75 * error(pruned(dense, name, "none"))

    record = (
        {"name": "deit_tiny_patch16_224", "args": {**TINY_VIT, "num_classes": 10}}
        if name == "timm-vit"
        else {"name": name}
    )
    save_pruned(model, tmp_path / "art", {"model": record})
    assert read_meta(tmp_path / "art")["family"] == name
    torch.testing.assert_close(outputs(load_pruned(tmp_path / "art"), heldout), outputs(model, heldout))

    pytest.importorskip("onnxruntime")
    if family.modality == "image":
        from corp_deploy.exporters.compare import compare
        from corp_deploy.exporters.onnx_export import export_onnx, image_graph
        from corp_deploy.exporters.runners import OrtRunner

        path = export_onnx(model, tmp_path / "pruned.onnx", (3, 32, 32))
        x = tiny_batches(n=3, seed=5)[0][0]
        with torch.no_grad():
            assert compare(image_graph(model)(x).numpy(), OrtRunner(path)(x.numpy())).cosine > 0.99999
    else:
        from corp_deploy.exporters.text_onnx import export_text_onnx, verify_text_onnx

        path = export_text_onnx(model, tmp_path / "pruned.onnx")
        assert verify_text_onnx(model, path, shapes=((1, 5), (3, 19))) < 1e-4


@pytest.mark.parametrize("kind", ["gpt2", "linear"])
def test_an_unknown_model_is_one_line_naming_every_registered_family(kind: str) -> None:
    gpt2 = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)
    model = transformers.GPT2Model(gpt2) if kind == "gpt2" else torch.nn.Linear(2, 2)
    with pytest.raises(CorpError) as e:
        adapter_for(model)
    named = "GPT2Model (model_type 'gpt2')" if kind == "gpt2" else "Linear"
    assert str(e.value).startswith(f"{named} is not a supported model family; corp-deploy prunes ")
    assert "\n" not in str(e.value)
    for family in registry.families():
        assert family.summary in str(e.value)


def test_a_second_family_under_one_name_is_refused() -> None:
    with pytest.raises(ValueError, match="two model families are named 'hf-llama'"):
        registry.register(copy.copy(get("hf-llama")))


@pytest.mark.parametrize("name", ["hf-mistral", "hf-qwen2"])
def test_a_pruned_sliding_window_attention_keeps_its_window(name: str) -> None:
    """The pruned attention is the family's own class with the dense one's window: tokens beyond every layer's
    reach (2 layers x a window of 8) do not move the last token's logits (a full causal attention would)."""
    dense = TINY[name]()
    model = pruned(dense, name, "none")
    attn = get(name).attention(get(name).blocks(model)[0])
    dense_attn = get(name).attention(get(name).blocks(dense)[0])
    window = getattr(dense_attn, "sliding_window", getattr(dense_attn.config, "sliding_window", None))
    assert window == 8 and attn.sliding_window == window
    assert isinstance(attn, type(dense_attn))  # the family's own class: transformers' output capture finds it
    ids = torch.randint(3, VOCAB, (1, 20))
    with torch.no_grad():
        full = model(input_ids=ids).logits[0, -1]
        changed = ids.clone()
        changed[0, :4] = 3  # tokens outside the last query's window (and two layers' reach: 2 * 8 < 16)
        assert np.allclose(full.numpy(), model(input_ids=changed).logits[0, -1].numpy(), atol=1e-5)


def test_transformers_dinov2_prunes_like_timm_on_the_same_weights() -> None:
    """The same weights in timm's layout and in ``transformers``' (q/k/v split from the fused qkv, LayerScale)
    compute the same features, and CORP prunes them to the same widths and the same features: the two families
    are one method (``studies.hf_vit_check`` runs this on real DINOv2-S)."""
    from studies.hf_vit_check import cls_features, prune_both, to_hf_dinov2

    vit = tiny_vit(init_values=0.5, num_classes=0)
    x = tiny_batches(n=8, seed=4)[0][0]
    hf = to_hf_dinov2(vit)
    assert adapter_for(hf) is get("hf-dinov2")
    torch.testing.assert_close(cls_features(hf, x), cls_features(vit, x))
    timm_pruned, hf_pruned = prune_both(vit, tiny_batches(), PruneConfig(sparsity=0.5, target="mlp,qk,v", round_to=2))
    assert [b["mlp_hidden"] for b in registry.structure(hf_pruned)] == [64, 64]
    assert registry.structure(hf_pruned) == registry.structure(timm_pruned)
    torch.testing.assert_close(cls_features(hf_pruned, x), cls_features(timm_pruned, x))


def _vision_folder(root: Path, processor: bool = True) -> Path:
    """A tiny DINOv2 with a classification head saved as a transformers folder (with the image processor's
    settings, as a hub folder has them) and a folder of images."""
    from PIL import Image

    TINY["hf-dinov2"]().save_pretrained(root / "dino")
    settings = {"do_center_crop": True, "crop_size": {"height": 32, "width": 32}, "size": {"shortest_edge": 36}}
    settings |= {"resample": 3, "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}
    if processor:
        (root / "dino" / "preprocessor_config.json").write_text(json.dumps(settings))
    (root / "images").mkdir()
    rng = np.random.default_rng(0)
    for i in range(24):
        Image.fromarray((rng.random((40, 48, 3)) * 255).astype("uint8")).save(root / "images" / f"{i}.png")
    return root / "dino"


@pytest.mark.e2e
def test_prune_export_takes_a_transformers_vision_folder_and_its_images(tmp_path: Path, capsys) -> None:
    """MODEL a transformers DINOv2 folder: calibrated on image files preprocessed as its preprocessor_config.json
    says, pruned, its folder loads with its head, exported and verified; without the processor file, one line."""
    from helpers import run

    folder = _vision_folder(tmp_path)
    args = ["--calib-dir", str(tmp_path / "images"), "--num-calib", "16", "--calib-batch-size", "8", "--quiet"]
    args += ["--sparsity", "0.5", "--target", "mlp,qk,v", "--round-to", "2", "--precision", "fp32"]
    code, out, err = run(["prune-export", str(folder), *args, "--out", str(tmp_path / "run")], capsys)
    assert code == 0, err
    meta = read_meta(tmp_path / "run" / "pruned")
    assert meta["family"] == "hf-dinov2" and meta["report"]["calibration"]["source"] == str(tmp_path / "images")
    assert meta["report"]["pruned"]["params"] < meta["report"]["dense"]["params"]
    assert (tmp_path / "run" / "pruned" / "preprocessor_config.json").is_file()
    assert "AutoModelForImageClassification.from_pretrained(folder, trust_remote_code=True)" in out
    export = json.loads((tmp_path / "run" / "export.json").read_text())
    assert {o["file"] for o in export["onnx"]} >= {"dense.onnx", "pruned.onnx"}
    assert all(o["verify"]["cosine"] >= o["verify"]["tolerance"]["min_cosine"] for o in export["onnx"])
    assert next(o for o in export["onnx"] if o["file"] == "pruned.onnx")["input_size"] == [3, 32, 32]
    (folder / "preprocessor_config.json").unlink()
    code, _, err = run(["prune-export", str(folder), *args, "--out", str(tmp_path / "again")], capsys)
    assert code != 0 and "has no preprocessor_config.json" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "again").exists()


def test_unknown_names_and_transformers_folders_get_true_words(tmp_path) -> None:
    """Issue 50, item 12: ``deit_tinyy`` suggested ``rdnet_tiny`` (which is then refused), and ``create_model`` of a
    folder holding a config.json said it had none."""
    from corp_deploy.families.timm.models import create_model, resolve_name

    with pytest.raises(CorpError, match="did you mean") as e:
        resolve_name("deit_tinyy")
    assert "deit_tiny" in str(e.value) and "rdnet" not in str(e.value)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CorpError, match="is a transformers model folder and create_model builds timm models"):
        create_model(str(tmp_path))
