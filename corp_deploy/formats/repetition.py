"""Greedy continuations and the repeated-loop check: a pruned decoder that falls into "she is a woman named Sarah,
she is a woman named Sarah, ..." can keep a tolerable perplexity, so loops are checked on generated text, with the
same rule for dense and pruned.

The rule (issue 44): a continuation loops when some n-gram of ``n`` tokens (4 by default) occurs ``times`` times
(3 by default) or more in it, occurrences allowed to overlap (a run of one token repeated is a loop too).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

LOOP_N = 4
LOOP_TIMES = 3


def repeated_ngram(tokens: Sequence[int], n: int = LOOP_N, times: int = LOOP_TIMES) -> tuple[int, ...] | None:
    """The most frequent n-gram of ``tokens`` when it occurs at least ``times`` times (the loop), else None."""
    if n < 1 or times < 2:
        raise ValueError(f"a loop needs n >= 1 and times >= 2, got n={n}, times={times}")
    counts = Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))
    if not counts:
        return None
    gram, count = counts.most_common(1)[0]
    return gram if count >= times else None


@torch.no_grad()
def greedy_continuations(model: nn.Module, tokenizer: Any, prompts: Sequence[str], new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation (``new_tokens`` ids, without the prompt), one prompt at a time (no
    padding to move positions); generation stops early only at EOS."""
    model.eval()
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        mask = torch.ones_like(ids)
        tokens = model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id
        )
        out.append(tokens[0, ids.shape[1] :].tolist())
    return out


def loop_report(model: nn.Module, tokenizer: Any, prompts: Sequence[str], new_tokens: int) -> dict[str, Any]:
    """Per prompt: the continuation's text and its loop (decoded, or None); and how many prompts loop."""
    items = []
    for tokens in greedy_continuations(model, tokenizer, prompts, new_tokens):
        loop = repeated_ngram(tokens)
        items.append({"text": tokenizer.decode(tokens), "loop": None if loop is None else tokenizer.decode(loop)})
    return {"looping": sum(i["loop"] is not None for i in items), "prompts": len(items), "items": items}
