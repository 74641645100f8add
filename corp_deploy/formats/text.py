"""Text in, as a model takes it: documents from .txt / .jsonl files, tokenized into batches.

The text counterpart of ``data``. Encoders get one document per sequence (truncated to ``seq_len`` tokens,
padded to the longest in its batch, with its attention mask: padding is excluded from every statistic).
Decoders get documents joined into one token stream (the tokenizer's EOS between them) cut into fixed-length
sequences with no padding, so every token counts (``packed_batches``; the paper's C4 protocol). Random token
ids serve smoke runs. Batches are ``({"input_ids", "attention_mask"}, skipped)`` pairs, as the calibration
expects.

Corpora are often stored sorted by class or source, so the calibration, held-out and evaluation documents
are disjoint draws of one seeded permutation (``split_documents``), fixed by ``SPLIT_SEED`` and not by
``--seed``: prune and eval on the same folder never share a document, whatever seeds they ran with.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from corp_deploy.base.errors import CorpError
from corp_deploy.families.hf.adapter import max_positions
from corp_deploy.formats.data import SYNTHETIC, sample

TEXT_SUFFIXES = (".txt", ".jsonl")
SPLIT_SEED = 0
"""The permutation that splits a folder's documents; fixed so that every command draws the same split."""
EVAL_FRACTION = HELDOUT_FRACTION = 0.1
"""Shares of a folder's documents kept for evaluation and for held-out checks (rounded down; the rest calibrates)."""


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


@dataclass(frozen=True)
class DocumentSplit:
    """Disjoint parts of one folder's documents, each in the folder's (path) order."""

    calibration: list[Document]
    heldout: list[Document]
    evaluation: list[Document]


def split_documents(docs: Sequence[Document]) -> DocumentSplit:
    """A seeded permutation of ALL documents cut into evaluation, held-out and calibration parts.

    Drawn across the whole folder, because taking the first or last files of a folder sorted by class would
    calibrate on some classes and evaluate on others. A folder of one document calibrates on it (parts that
    would round to zero stay empty)."""
    n = len(docs)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED)).tolist()
    n_eval, n_held = int(n * EVAL_FRACTION), int(n * HELDOUT_FRACTION)
    part = {i: 0 for i in order[:n_eval]} | {i: 1 for i in order[n_eval : n_eval + n_held]}
    pick = lambda k: [d for i, d in enumerate(docs) if part.get(i, 2) == k]  # noqa: E731
    return DocumentSplit(pick(2), pick(1), pick(0))


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


def evaluation_documents(folder: str | Path, all_text: bool, hint: str) -> tuple[list[Document], int]:
    """The documents of ``folder`` no calibration reads: its evaluation part (``split_documents``), or all of them
    (``all_text``: a folder calibration never read), and how many the folder holds. One line ending in ``hint`` when
    too few to keep a part apart."""
    docs = read_documents(folder)
    chosen = docs if all_text else split_documents(docs).evaluation
    if not chosen:
        raise CorpError(
            f"{folder} holds {len(docs)} documents, too few to keep an evaluation part apart from calibration; {hint}"
        )
    return chosen, len(docs)


def shuffled(docs: Sequence[Document], seed: int) -> list[Document]:
    """``docs`` in a seeded random order: packing takes windows from the front, which must not be one class."""
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed))
    return [docs[i] for i in order.tolist()]


def token_stream(tokenizer: Any, docs: Sequence[Document]) -> Iterator[int]:
    """The documents' tokens as one stream: BOS first (when the tokenizer has one), EOS after each document.

    Each document is tokenized on its own, lazily, so that packing reads only as much text as it needs; a
    document longer than the model's positions is expected (it is cut into windows), so no warning says so."""
    if tokenizer.bos_token_id is not None:
        yield tokenizer.bos_token_id
    for doc in docs:
        yield from tokenizer(doc.text, add_special_tokens=False, verbose=False)["input_ids"]
        if tokenizer.eos_token_id is not None:
            yield tokenizer.eos_token_id


def packed_sequences(
    tokenizer: Any, docs: Sequence[Document], seq_len: int, num: int | None = None, part: str = "calibration"
) -> Tensor:
    """(sequences, seq_len) token ids: ``docs`` joined (``token_stream``) and cut into non-overlapping windows,
    the first ``num`` of them (all whole windows when None); the tail shorter than a window is left out.
    ``part`` names the documents in the error when they fill no window."""
    stream, rows = token_stream(tokenizer, docs), []
    while num is None or len(rows) < num:
        row = [t for _, t in zip(range(seq_len), stream, strict=False)]
        if len(row) < seq_len:
            break
        rows.append(row)
    if not rows:
        raise CorpError(
            f"the {part} documents hold fewer than --seq-len {seq_len} tokens; pass more text or a lower --seq-len"
        )
    return torch.tensor(rows, dtype=torch.long)


def packed_batches(ids: Tensor, batch_size: int) -> Iterator[tuple[dict[str, Tensor], int]]:
    """Batches of packed sequences: every position is a real token (a mask of ones)."""
    for start in range(0, ids.shape[0], batch_size):
        chunk = ids[start : start + batch_size]
        yield {"input_ids": chunk, "attention_mask": torch.ones_like(chunk)}, 0


def synthetic_text_batches(
    vocab: int, num: int, seq_len: int, batch_size: int, seed: int
) -> Iterator[tuple[dict[str, Tensor], int]]:
    """Random token ids (every position real): structure and speed only, like noise images."""
    g = torch.Generator().manual_seed(seed)
    for start in range(0, num, batch_size):
        ids = torch.randint(0, vocab, (min(batch_size, num - start), seq_len), generator=g)
        yield {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, 0


def int8_feeds(
    tokenizer: Any,
    source: str | Path,
    vocab_size: int,
    num_calib: int,
    num_verify: int,
    seq_len: int,
    seed: int = 0,
    batch_size: int = 32,
) -> tuple[list[dict[str, np.ndarray]], dict[str, np.ndarray], dict[str, dict[str, int]]]:
    """INT8 data for an encoder: (calibration batches, ONE held-out batch, documents per folder of each).

    Calibration takes the first ``num_calib`` documents of the seeded sample CORP calibrated on (the same
    ``sample`` of the split's calibration part, so a subset of it); verification ``num_verify`` held-out
    documents, which neither calibration nor evaluation reads, padded to their longest as the gate runs them.
    ``synthetic``: random tokens, structure only."""
    if num_calib < 1 or num_verify < 1:
        raise CorpError("--int8-calib and --int8-verify must be >= 1")
    if str(source) == SYNTHETIC:
        calib = [b for b, _ in synthetic_text_batches(vocab_size, num_calib, seq_len, batch_size, seed)]
        held = next(synthetic_text_batches(vocab_size, num_verify, seq_len, num_verify, seed + 1))[0]
        folders = {"calibration": {SYNTHETIC: num_calib}, "verification": {SYNTHETIC: num_verify}}
    else:
        parts = split_documents(read_documents(source))
        if not parts.heldout:
            raise CorpError(
                f"{source} has too few documents to hold any out for INT8 verification (a tenth of them is kept "
                "for it); pass 10 or more documents"
            )
        docs, held_docs = sample(parts.calibration, num_calib, seed), sample(parts.heldout, num_verify, seed)
        calib = [b for b, _ in text_batches(tokenizer, docs, seq_len, batch_size)]
        held = tokenize(tokenizer, [d.text for d in held_docs], seq_len)
        folders = {"calibration": _per_folder(docs), "verification": _per_folder(held_docs)}
    as_numpy = lambda feed: {k: v.numpy() for k, v in feed.items()}  # noqa: E731
    return [as_numpy(b) for b in calib], as_numpy(held), folders


def _per_folder(docs: Sequence[Document]) -> dict[str, int]:
    return dict(Counter(d.folder for d in docs))


def check_seq_len(seq_len: int, config: Any) -> None:
    """A sequence longer than the model's learned positions cannot run: refuse it before any work."""
    limit = max_positions(config)
    if not 1 <= seq_len <= limit:
        raise CorpError(f"--seq-len must be between 1 and {limit} (the model's positions), got {seq_len}")
