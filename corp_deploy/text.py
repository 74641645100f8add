"""Text in, as an encoder takes it: documents from .txt / .jsonl files, tokenized into padded, masked batches.

The text counterpart of ``data``: one document per sequence (truncated to ``seq_len`` tokens, padded to the
longest in its batch, with its attention mask: padding is excluded from every statistic), or random token ids
for smoke runs. Batches are ``({"input_ids", "attention_mask"}, skipped)`` pairs, as the calibration expects.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from corp_deploy.errors import CorpError
from corp_deploy.hf import max_positions

TEXT_SUFFIXES = (".txt", ".jsonl")


@dataclass(frozen=True)
class Document:
    text: str
    folder: str
    """The folder it came from under the root (its class in a labelled tree; ``.`` when flat)."""


def read_documents(root: str | Path) -> list[Document]:
    """Every document under ``root`` (recursive, path order): a .txt file is one; a .jsonl line with a
    ``text`` field is one. Empty documents are left out."""
    root = Path(root)
    if not root.is_dir():
        raise CorpError(f"text folder {root} does not exist or is not a folder")
    docs = []
    for path in sorted(p for p in root.rglob("*") if p.suffix.lower() in TEXT_SUFFIXES and p.is_file()):
        folder = path.parent.relative_to(root).as_posix()
        docs += [Document(t, folder) for t in _texts(path) if t.strip()]
    if not docs:
        raise CorpError(f"no text (.txt files, or .jsonl lines with a 'text' field) under {root}; point it at text")
    return docs


def _texts(path: Path) -> list[str]:
    raw = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix.lower() == ".txt":
        return [raw]
    out = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise CorpError(f"{path}:{n} is not JSON; a .jsonl file holds one JSON object per line") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise CorpError(f"{path}:{n} has no 'text' string field")
        out.append(record["text"])
    return out


def tokenize(tokenizer: Any, texts: Sequence[str], seq_len: int) -> dict[str, Tensor]:
    """One sequence per text, truncated to ``seq_len`` tokens, padded to the longest, with its attention mask."""
    enc = tokenizer(list(texts), padding=True, truncation=True, max_length=seq_len, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def text_batches(
    tokenizer: Any, docs: Sequence[Document], seq_len: int, batch_size: int
) -> Iterator[tuple[dict[str, Tensor], int]]:
    """Tokenized batches of ``docs`` in order (tokenized lazily, one batch at a time)."""
    for start in range(0, len(docs), batch_size):
        yield tokenize(tokenizer, [d.text for d in docs[start : start + batch_size]], seq_len), 0


def synthetic_text_batches(
    vocab: int, num: int, seq_len: int, batch_size: int, seed: int
) -> Iterator[tuple[dict[str, Tensor], int]]:
    """Random token ids (every position real): structure and speed only, like noise images."""
    g = torch.Generator().manual_seed(seed)
    for start in range(0, num, batch_size):
        ids = torch.randint(0, vocab, (min(batch_size, num - start), seq_len), generator=g)
        yield {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, 0


def check_seq_len(seq_len: int, config: Any) -> None:
    """A sequence longer than the model's learned positions cannot run: refuse it before any work."""
    limit = max_positions(config)
    if not 1 <= seq_len <= limit:
        raise CorpError(f"--seq-len must be between 1 and {limit} (the model's positions), got {seq_len}")
