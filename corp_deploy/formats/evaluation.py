"""A decoder's perplexity on held-out documents (the text counterpart of the image probe in ``bench.accuracy``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from corp_deploy.base.errors import CorpError
from corp_deploy.families import adapter_for
from corp_deploy.formats.data import HELDOUT_SEED_OFFSET, SYNTHETIC
from corp_deploy.formats.perplexity import perplexity
from corp_deploy.formats.text import (
    check_seq_len,
    evaluation_documents,
    packed_sequences,
    read_documents,
    shuffled,
    split_documents,
)


def text_perplexity(
    model: nn.Module,
    tokenizer: Any,
    text: str | Path,
    seq_len: int,
    batch_size: int = 1,
    device: torch.device | str = "cpu",
    all_text: bool = False,
    max_windows: int | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """A decoder's perplexity (``perplexity``: SparseGPT's protocol) on the evaluation documents of a text folder
    (``text.split_documents``: never a calibration document of the same folder), or on all of it (``all_text``,
    for a test set that calibration never saw), over the first ``max_windows`` windows when given.
    Returns the number and what it was measured on."""
    if not adapter_for(model).causal:
        raise CorpError(f"perplexity needs a decoder (a causal LM); {type(model).__name__} is an encoder")
    if tokenizer is None:
        raise CorpError("perplexity needs the model's tokenizer, and its folder has none")
    check_seq_len(seq_len, model.config)
    chosen, of_documents = evaluation_documents(text, all_text, "pass --all-text if calibration never read this folder")
    part = "all" if all_text else "evaluation"
    windows = packed_sequences(tokenizer, chosen, seq_len, part=part)
    of_windows, windows = windows.shape[0], windows[:max_windows]
    value = perplexity(model.to(device), windows, batch_size, device, progress)
    return {
        "perplexity": value,
        "windows": windows.shape[0],
        "of_windows": of_windows,
        "seq_len": seq_len,
        "documents": len(chosen),
        "of_documents": of_documents,
        "part": part,
        "text": str(text),
    }


def heldout_windows(tokenizer: Any, source: str | Path, vocab: int, seq_len: int, num: int, seed: int = 0) -> Tensor:
    """(``num``, ``seq_len``) token ids that verify a quantized decoder: packed windows of a text folder's held-out
    documents (``text.split_documents``: never calibration or evaluation text), or random tokens below ``vocab``
    for ``source == "synthetic"`` (structure only: a random stream says nothing about quantization error)."""
    if num < 1 or seq_len < 2:
        raise CorpError(f"verification needs >= 1 window of >= 2 tokens, got {num} x {seq_len}")
    if str(source) == SYNTHETIC:
        g = torch.Generator().manual_seed(seed + HELDOUT_SEED_OFFSET)
        return torch.randint(0, vocab, (num, seq_len), generator=g)
    if tokenizer is None:
        raise CorpError(f"{source}: decoder verification needs the model's tokenizer, and its folder has none")
    parts = split_documents(read_documents(source))
    return packed_sequences(tokenizer, shuffled(parts.heldout, seed), seq_len, num, "held-out")
