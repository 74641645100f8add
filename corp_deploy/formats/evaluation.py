"""A decoder's perplexity: SparseGPT's protocol (``perplexity``), on a text folder's evaluation documents
(``text_perplexity``, the text counterpart of the image probe in ``bench.accuracy``), and the held-out windows that
verify a quantized decoder (``heldout_windows``).

SparseGPT's protocol (the numbers the CORP paper reports): the whole test text is tokenized once into one stream,
cut into non-overlapping ``seq_len`` windows (the tail shorter than a window is dropped), and every window is scored
on its own: no context carries over, so the number depends on ``seq_len`` and is comparable only at equal
``seq_len``. Perplexity is ``exp`` of the mean negative log-likelihood over every predicted token (``seq_len - 1``
per window).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from corp_deploy.base.errors import CorpError
from corp_deploy.families import adapter_for
from corp_deploy.formats.data import HELDOUT_SEED_OFFSET, SYNTHETIC
from corp_deploy.formats.text import (
    check_seq_len,
    evaluation_documents,
    packed_sequences,
    read_documents,
    shuffled,
    split_documents,
)


@torch.inference_mode()
def perplexity(
    model: nn.Module, windows: Tensor, batch_size: int = 1, device: torch.device | str = "cpu", progress: bool = False
) -> float:
    """``exp(mean NLL)`` of ``model`` (a ``transformers`` causal LM) over ``windows`` (n, seq_len) token ids.

    The loss is summed in float64 across windows, so the mean does not depend on the batching. ``progress``
    shows a bar: a 2048-token window of a 135M model takes seconds on a CPU, a few dozen minutes."""
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64), 0
    starts = range(0, windows.shape[0], batch_size)
    for start in tqdm(starts, desc="perplexity", unit="batch", disable=not progress, leave=False):
        ids = windows[start : start + batch_size].to(device)
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, :-1].float()
        nll = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
        total += nll.double().cpu()
        count += ids[:, 1:].numel()
    return math.exp(float(total) / count)


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
