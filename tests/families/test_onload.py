"""Sequential onloading (``families.onload``): a ``transformers`` folder pruned with its blocks' weights on disk, one
block read at a time by the walk, gives the artifact of the model loaded whole, bit for bit; at no point are two
blocks' weights in memory; sequential CORP onloads too. Tiny random Llama (tied and untied head) and BERT folders
built in the test; no hub."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="text models need transformers (pip install '.[text]')")

from helpers import padded_batches, run, tiny_bert, tiny_llama_folder, tiny_text_folder, token_batches  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from corp_deploy import api  # noqa: E402
from corp_deploy.base import memory  # noqa: E402
from corp_deploy.core import blockwise  # noqa: E402
from corp_deploy.core.config import PruneConfig  # noqa: E402
from corp_deploy.families import adapter_for, onload  # noqa: E402
from corp_deploy.families.hf import hub  # noqa: E402


def _llama_folder(root: Path, tied: bool, **overrides) -> Path:
    torch.manual_seed(0)
    shape = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}
    shape["intermediate_size"] = 128
    config = transformers.LlamaConfig(
        vocab_size=300,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        **(shape | overrides),
    )
    folder = root / f"llama-tied{tied}"
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _bert_folder(root: Path) -> Path:
    folder = root / "bert"
    tiny_bert().save_pretrained(folder)
    return folder


def _headless_folder(root: Path) -> Path:
    """A Llama checkpoint (``model.``-prefixed names) whose config names no architecture, as
    ``studies.scale_study`` writes them: ``hub.load`` builds the base ``LlamaModel``, whose names lack the prefix."""
    folder = _llama_folder(root, tied=False)
    config = json.loads((folder / "config.json").read_text())
    del config["architectures"]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


FOLDERS = {
    "llama": lambda root: _llama_folder(root, tied=False),
    "llama-headless": _headless_folder,
    "llama-tied": lambda root: _llama_folder(root, tied=True),
    "bert": _bert_folder,
}
BATCHES = {"llama": token_batches, "llama-headless": token_batches, "llama-tied": token_batches, "bert": padded_batches}


def _pruned(folder: Path, name: str, onloaded: bool, out: Path, **config) -> dict[str, torch.Tensor]:
    model, _ = hub.load(str(folder), onload=onloaded)
    assert (onload.of(model) is not None) == onloaded
    config = PruneConfig(sparsity=0.5, target="mlp,v", round_to=2, **config)
    result = api.prune(model, BATCHES[name](n=12), config, "cpu", progress=False)
    api.save(result, out, name)
    return load_file(out / "model.safetensors")


@pytest.mark.parametrize("name", ["llama", "llama-headless", "llama-tied", "bert"])
@pytest.mark.parametrize("sequential", [False, True])
def test_the_onloaded_prune_is_the_resident_one_bit_for_bit(name: str, sequential: bool, tmp_path: Path) -> None:
    folder = FOLDERS[name](tmp_path)
    resident = _pruned(folder, name, False, tmp_path / "resident", sequential=sequential)
    onloaded = _pruned(folder, name, True, tmp_path / "onloaded", sequential=sequential)
    assert resident.keys() == onloaded.keys()
    for key, tensor in resident.items():
        assert torch.equal(tensor, onloaded[key]), key


def _weights_file(path: Path) -> tuple[dict, bytes]:
    """A safetensors file's header (parsed: its ``__metadata__`` order changes from run to run) and data bytes."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


@pytest.mark.parametrize("name", ["llama", "llama-tied", "bert"])
def test_the_streamed_save_writes_what_the_whole_pruned_model_wrote(name: str, tmp_path: Path, monkeypatch) -> None:
    """The save of an onloaded prune (its pruned blocks written from the store, one tensor at a time, the report's
    sizes measured streamed) against the path before it (the pruned model read back whole, measured, and written by
    ``safetensors.torch.save_model``): the same header and data bytes in model.safetensors, the same other files,
    the same corp.json but for the timings and the measured peak RSS."""
    from safetensors.torch import save_model

    from corp_deploy.formats import artifact
    from corp_deploy.plan.report import model_size

    model, _ = hub.load(str(FOLDERS[name](tmp_path)), onload=True)
    config = PruneConfig(sparsity=0.5, target="mlp,v", round_to=2)
    result = api.prune(model, BATCHES[name](n=12), config, "cpu", progress=False)
    new = api.save(result, tmp_path / "new", name)
    onload.restore(result.model)
    result.report["pruned"] = model_size(result.model)

    def whole(model: torch.nn.Module, path: Path, loader: onload.Onloader | None) -> None:
        assert not any(p.is_meta for p in model.parameters())
        save_model(model, str(path), metadata={"format": artifact.FORMAT})

    monkeypatch.setattr(artifact, "write_weights", whole)
    old = api.save(result, tmp_path / "old", name)
    assert _weights_file(new / "model.safetensors") == _weights_file(old / "model.safetensors")
    files = sorted(p.name for p in old.iterdir())
    assert files == sorted(p.name for p in new.iterdir())
    for f in set(files) - {"model.safetensors", "corp.json"}:
        assert (new / f).read_bytes() == (old / f).read_bytes(), f
    metas = [json.loads((folder / "corp.json").read_text()) for folder in (new, old)]
    for meta in metas:
        del meta["report"]["seconds"], meta["report"]["memory"]["host_rss_mib"]
    assert metas[0] == metas[1]


def test_no_two_blocks_are_in_memory_at_once(tmp_path: Path, monkeypatch) -> None:
    """Every block forward (the walk's statistics, the report's measure of the pruned model) counts the blocks whose
    weights are resident: one at most, and the resident bytes stay below half the dense model's; then the save
    writes the pruned blocks one tensor at a time from the store, with no block resident. The pruned model is never
    read back whole (``restore`` fails the test: the save of the walk's result once read it all)."""
    monkeypatch.setattr(onload.Onloader, "restore", lambda self: pytest.fail("the pruned model was read back whole"))
    folder = FOLDERS["llama"](tmp_path)
    model, _ = hub.load(str(folder), onload=True)
    loader = onload.of(model)
    blocks = adapter_for(model).blocks(model)
    dense_bytes = sum(p.numel() * 4 for p in transformers.LlamaForCausalLM.from_pretrained(folder).parameters())
    seen: list[tuple[int, int]] = []

    def live() -> int:
        return sum(not any(p.is_meta for p in b.parameters()) for b in blocks)

    def count(*_) -> None:
        seen.append((live(), loader.resident_bytes()))

    for block in blocks:
        block.register_forward_pre_hook(count)
    assert all(p.is_meta for b in blocks for p in b.parameters())
    result = api.prune(model, token_batches(n=12), PruneConfig(sparsity=0.5, target="mlp"), "cpu", progress=False)
    assert len(seen) >= 2 * len(blocks)  # the walk's, then the report's
    assert max(n for n, _ in seen) == 1
    assert max(size for _, size in seen) < dense_bytes / 2
    assert result.report["calibration"]["mode"] == "blockwise"
    assert result.report["calibration"]["groups"] == len(blocks)
    saving: list[int] = []  # blocks resident at each tensor the save reads from the store
    read = onload.Onloader.tensor
    monkeypatch.setattr(onload.Onloader, "tensor", lambda self, name: saving.append(live()) or read(self, name))
    api.save(result, tmp_path / "out", "llama")
    assert len(saving) == sum(1 for b in blocks for _ in b.parameters()) and max(saving) == 0
    assert onload.of(result.model) is loader and all(p.is_meta for b in blocks for p in b.parameters())


def test_a_budget_reads_the_onloaded_model_whole_and_prunes_it_as_before(tmp_path: Path) -> None:
    """A budget compares every block's statistics at once: the model is read whole first, same result."""
    folder = FOLDERS["llama"](tmp_path)
    budget = {"budget": "macs=0.8", "allocation": "local"}
    resident = _pruned(folder, "llama", False, tmp_path / "resident", **budget)
    onloaded = _pruned(folder, "llama", True, tmp_path / "onloaded", **budget)
    assert all(torch.equal(t, onloaded[k]) for k, t in resident.items())


def test_a_budget_plans_the_onloaded_model_whole_and_is_refused_before_it_is_read_whole(tmp_path: Path, monkeypatch):
    """A budget reads the onloaded model whole before calibrating: the memory plan counts the whole model's float32
    weights, and a run that cannot hold them is refused before the model is read whole (it was read, then planned)."""
    config = PruneConfig(sparsity=0.5, target="mlp", round_to=2, budget="macs=0.8", allocation="local")
    model, _ = hub.load(str(FOLDERS["llama"](tmp_path)), onload=True)
    whole = sum(p.numel() * 4 for p in model.parameters())
    result = api.prune(model, token_batches(n=12), config, "cpu", progress=False)
    assert result.report["memory"]["plan"]["weights_gib"] * memory.GIB == whole
    model, _ = hub.load(str(FOLDERS["llama"](tmp_path)), onload=True)
    monkeypatch.setattr(onload.Onloader, "restore", lambda self: pytest.fail("read whole before the plan"))
    monkeypatch.setenv(memory.ENV, "0.0001")
    with pytest.raises(api.CorpError, match=r"^this run needs about .* of host memory"):
        api.prune(model, token_batches(n=12), config, "cpu", progress=False)


def test_an_onloaded_model_is_checked_for_what_it_holds_not_for_its_whole_weights(tmp_path: Path, monkeypatch):
    """With room for the embeddings, the head and one block but not for every weight, ``hub.load`` onloads (the
    7B shape's case: its pruned model was once read back whole, so it was refused by its whole float32 size) and
    refuses to load the model whole."""
    folder = FOLDERS["llama"](tmp_path)
    whole = memory.safetensors_bytes(folder, itemsize=4)
    model, _ = hub.load(str(folder), onload=True)
    held = onload.of(model).held_bytes()
    assert held == onload.of(model).resident_bytes() + onload.of(model).block_bytes() < whole
    monkeypatch.setenv(memory.ENV, str((memory.RUNTIME + (held + whole) / 2) / memory.HEADROOM / memory.GIB))
    assert onload.of(hub.load(str(folder), onload=True)[0]) is not None
    with pytest.raises(api.CorpError, match=r"^this run needs about .* of host memory"):
        hub.load(str(folder))


def test_prune_export_reads_the_dense_model_again_instead_of_copying_it(tmp_path: Path, capsys, monkeypatch) -> None:
    """The dense graph is exported from the folder read again after the onloaded prune, not from a copy held
    through it: ``copy.deepcopy`` of a model in ``cli.prune`` fails the test; the pruned one from its artifact, the
    onloaded prune's store deleted before the exports."""
    import copy

    from corp_deploy.cli import prune as cli_prune

    def no_model_copy(x, *args):
        assert not isinstance(x, torch.nn.Module), "the dense model was copied"
        return copy.deepcopy(x, *args)

    monkeypatch.setattr(cli_prune, "copy", SimpleNamespace(deepcopy=no_model_copy))
    import tempfile

    from corp_deploy.cli import prune_export

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stores: list[list[Path]] = []  # the onloaded prune's store, once its artifact is saved: deleted before the exports
    real_run = prune_export.export_run
    monkeypatch.setattr(
        prune_export,
        "export_run",
        lambda *a, **k: stores.append(list(tmp_path.glob("corp-onload-*"))) or real_run(*a, **k),
    )
    loads = []
    real_load = hub.load
    monkeypatch.setattr(hub, "load", lambda source, onload=False: loads.append(onload) or real_load(source, onload))
    folder = tiny_text_folder(tmp_path)
    out = tmp_path / "run"
    argv = ["prune-export", str(folder), "--calib", "synthetic", "--seq-len", "16", "--num-calib", "8"]
    code, _, stderr = run([*argv, "--precision", "fp32", "--quiet", "--out", str(out)], capsys)
    assert code == 0, stderr
    assert loads == [True, False]  # onloaded for the prune, then the dense model read again
    assert stores == [[]]
    record = json.loads((out / "export.json").read_text())
    assert [r["file"] for r in record["onnx"]] == ["dense.onnx", "pruned.onnx"]
    dense_params = sum(p.numel() for p in real_load(str(folder))[0].parameters())
    assert record["size"]["dense"]["params"] == dense_params > record["size"]["pruned"]["params"]


def test_the_plan_of_an_onloaded_model_holds_one_block_and_its_peak_is_below_the_resident_plans(tmp_path: Path) -> None:
    """Eight wide-attention blocks with a narrow MLP (the blocks' weights dominate): the walk's plan counts what is
    resident and one block, and one block's statistics, and corp.json records it."""
    folder = _llama_folder(tmp_path, False, hidden_size=256, num_hidden_layers=8, intermediate_size=64)
    config = PruneConfig(sparsity=0.5, target="mlp", round_to=2)
    model, _ = hub.load(str(folder), onload=True)
    plan, bound = blockwise.memory_plan(model, config, 4, 24, 4, torch.device("cpu"), None, False)
    resident = sum(p.numel() * 4 for p in model.parameters() if not p.is_meta)
    block = sum(p.numel() * 4 for p in adapter_for(model).blocks(model)[0].parameters())
    whole = sum(p.numel() * 4 for p in model.parameters())
    assert bound is None and plan.parts["weights"] == resident + block < whole / 4
    assert plan.parts["statistics"] == blockwise.block_stats(model, config, [0], "meta").nbytes()
    everything, _ = blockwise.memory_plan(hub.load(str(folder))[0], config, 4, 24, 4, torch.device("cpu"), None, False)
    assert plan.peak < everything.peak - whole / 2
    result = api.prune(model, token_batches(n=1), config, "cpu", progress=False)
    assert result.report["memory"]["plan"]["weights_gib"] * memory.GIB == resident + block


def test_the_stored_form_of_a_pruned_decoder_shares_its_weights(tmp_path: Path) -> None:
    """A pruned Llama's standard folder flags ``mlp_bias`` (the compensation's bias): the stored copy has new
    Linears with zero biases beside the folded one, and the model's own weight tensors (a save holds them once)."""
    from corp_deploy.families.hf.folder import stored

    folder = FOLDERS["llama"](tmp_path)
    model, _ = hub.load(str(folder))
    result = api.prune(model, token_batches(n=12), PruneConfig(sparsity=0.5, target="mlp"), "cpu", progress=False)
    copy_ = stored(result.model)
    assert copy_ is not result.model and copy_.config.mlp_bias and not result.model.config.mlp_bias
    ours, theirs = (adapter_for(m).blocks(m)[0].mlp for m in (result.model, copy_))
    assert ours.gate_proj.bias is None and not theirs.gate_proj.bias.any()
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert getattr(theirs, name).weight is getattr(ours, name).weight


def test_a_tied_head_stays_tied_through_the_onloaded_prune(tmp_path: Path) -> None:
    """The head and the embedding are one parameter before and after: moving the resident weights to the compute
    device once made two (the report then counted the embedding twice: SmolLM2-135M '134.5M -> 138.8M')."""
    model, _ = hub.load(str(FOLDERS["llama-tied"](tmp_path)), onload=True)
    result = api.prune(model, token_batches(n=12), PruneConfig(sparsity=0.5, target="mlp"), "cpu", progress=False)
    assert result.model.lm_head.weight is result.model.model.embed_tokens.weight
    assert result.report["pruned"]["params"] < result.report["dense"]["params"]


def test_a_full_disk_under_the_store_is_one_line(tmp_path: Path, monkeypatch) -> None:
    def full(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(onload, "save_file", full)
    model, _ = hub.load(str(FOLDERS["llama"](tmp_path)), onload=True)
    with pytest.raises(api.CorpError, match=r"^could not keep pruned block 0 in .*No space left.*TMPDIR"):
        api.prune(model, token_batches(n=2), PruneConfig(sparsity=0.5, target="mlp"), "cpu", progress=False)


def _hub_cache(root: Path, folder: Path, monkeypatch) -> str:
    """``folder`` as the hub cache holds ``org/tiny`` (``models--org--tiny/snapshots/REV``), with no network: what
    ``hf:org/tiny`` reads on a machine that downloaded it once."""
    import shutil
    import socket

    def unresolved(*_args, **_kwargs):
        raise socket.gaierror("Name or service not known")

    repo, revision = root / "models--org--tiny", "0" * 40
    shutil.copytree(folder, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(root))
    monkeypatch.setattr(socket, "getaddrinfo", unresolved)
    return "hf:org/tiny"


def test_a_hub_name_is_onloaded_from_its_snapshot_and_refused_by_size_before_loading(tmp_path: Path, monkeypatch):
    """``hf:NAME`` is onloaded as its folder is (one block at a time, the same artifact) and what it will hold is
    checked before a weight is read: a model the machine cannot hold is one line, not the kernel's kill."""
    folder = FOLDERS["llama"](tmp_path)
    name = _hub_cache(tmp_path / "hub", folder, monkeypatch)
    model, _ = hub.load(name, onload=True)
    assert onload.of(model) is not None and all(p.is_meta for p in adapter_for(model).blocks(model)[0].parameters())
    config = PruneConfig(sparsity=0.5, target="mlp,v", round_to=2)
    api.save(api.prune(model, token_batches(n=12), config, "cpu", progress=False), tmp_path / "hub-run", "tiny")
    local = _pruned(folder, "llama", True, tmp_path / "local")
    assert all(torch.equal(t, local[k]) for k, t in load_file(tmp_path / "hub-run" / "model.safetensors").items())
    monkeypatch.setattr(memory, "available", lambda *args: 1024)
    monkeypatch.setattr(onload.Onloader, "start", lambda self: pytest.fail("a weight was read before the size check"))
    with pytest.raises(api.CorpError, match="this run needs about .* of host memory") as info:
        hub.load(name, onload=True)
    assert "\n" not in str(info.value)


def test_a_disk_that_may_not_take_the_store_and_the_artifact_is_said_before_the_walk(tmp_path: Path, monkeypatch):
    """The 7B shape's prune writes ~22 GB of pruned blocks to TMPDIR and as much again as its artifact, after half an
    hour of work: where the disks have less than the dense float32 bound free, one line says so before the walk
    (and a prune that then fills the disk still ends in one line)."""
    folder = FOLDERS["llama"](tmp_path)
    model, _ = hub.load(str(folder), onload=True)
    loader = onload.of(model)
    store = sum(p.numel() * 4 for block in loader.blocks for p in block.parameters())
    artifact = store + loader.held_bytes() - loader.block_bytes()
    assert artifact == sum(p.numel() * 4 for n, p in model.named_parameters() if n not in loader.tied)
    free = {"bytes": store + artifact}
    monkeypatch.setattr(onload, "shutil", SimpleNamespace(disk_usage=lambda where: SimpleNamespace(free=free["bytes"])))
    assert onload.disk_shortfall(model, tmp_path / "out") is None  # room for both on one disk
    free["bytes"] -= 1
    line = onload.disk_shortfall(model, tmp_path / "out")
    assert line.startswith("disk: the pruned blocks wait in ") and f"up to {memory.gib(store)})" in line
    assert "may run out of disk" in line and "TMPDIR" in line and "\n" not in line
    assert onload.disk_shortfall(hub.load(str(folder))[0], tmp_path / "out") is None  # resident: nothing to store


def test_the_prune_command_says_the_disk_shortfall_and_still_prunes(tmp_path: Path, monkeypatch, capsys) -> None:
    folder, text = tiny_llama_folder(tmp_path / "src")
    monkeypatch.setattr(onload, "shutil", SimpleNamespace(disk_usage=lambda where: SimpleNamespace(free=1)))
    args = ["prune", str(folder), "--calib-dir", str(text), "--num-calib", "8", "--seq-len", "16", "--sparsity", "0.5"]
    code, out, err = run([*args, "--target", "mlp", "--out", str(tmp_path / "p")], capsys)
    assert code == 0, err
    assert "disk: the pruned blocks wait in" in out and (tmp_path / "p" / "corp.json").is_file()
