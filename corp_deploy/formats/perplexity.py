"""Perplexity of a causal language model with SparseGPT's protocol (the numbers the CORP paper reports).

The whole test text is tokenized once into one stream, cut into non-overlapping ``seq_len`` windows (the
tail shorter than a window is dropped), and every window is scored on its own: no context carries over,
so the number depends on ``seq_len`` and is comparable only at equal ``seq_len``. Perplexity is
``exp`` of the mean negative log-likelihood over every predicted token (``seq_len - 1`` per window).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm


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
