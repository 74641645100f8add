"""The data INT8 and INT4 read from text: a text encoder's INT8 feeds, a decoder's INT4 held-out and calibration
windows. Each comes from the model's own tokenizer (or random tokens for ``synthetic``), so a command and the
pipeline prepare it the same way."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from corp_deploy.base.errors import CorpError
from corp_deploy.exporters.int4_quant import Scheme
from corp_deploy.exporters.int8_quant import Data, calibration_data
from corp_deploy.exporters.onnx_export import read_metadata
from corp_deploy.families.hf import hub
from corp_deploy.formats import calibration, evaluation
from corp_deploy.formats.data import SYNTHETIC
from corp_deploy.formats.text import int8_feeds


def _tokenizer(tokenizer_source: str | Path | None, data: str, vocab: int):
    """The tokenizer windows of ``data`` are cut with; none for random tokens or a source without one."""
    if data == SYNTHETIC or tokenizer_source is None:
        return None
    return hub.load_tokenizer(tokenizer_source, vocab)


def int4_windows(
    tokenizer_source: str | Path | None, data: str, vocab: int, seq_len: int, num: int, seed: int
) -> np.ndarray:
    """The held-out windows that verify INT4 graphs: ``data``'s held-out documents, or random tokens."""
    tokenizer = _tokenizer(tokenizer_source, data, vocab)
    return evaluation.heldout_windows(tokenizer, data, vocab, seq_len, num, seed).numpy()


def int4_calibration(
    tokenizer_source: str | Path | None, data: str, vocab: int, seq_len: int, num: int, seed: int, scheme: Scheme
) -> dict[str, Any]:
    """``int4_graphs``' calibration arguments: windows of ``data``'s calibration documents (disjoint from the
    held-out ones the gate reads) when the scheme reads any (GPTQ, the error ranking), else none."""
    if not scheme.calibrated:
        return {}
    tokenizer = _tokenizer(tokenizer_source, data, vocab)
    windows = calibration.calibration_windows(tokenizer, data, vocab, seq_len, num, seed).numpy()
    part = "random tokens" if data == SYNTHETIC else "calibration documents (disjoint from the held-out ones)"
    return {"calibration": windows, "calibration_info": {"text": data, "part": part, "seed": seed}}


def text_int8(
    tokenizer_from: str | Path, source: str, num_calib: int, num_verify: int, seed: int
) -> Callable[[Any], Data]:
    """Graph -> a text encoder's INT8 data (``text.int8_feeds``): vocabulary and sequence length from the graph's
    metadata, documents from ``source`` tokenized by the tokenizer of ``tokenizer_from`` (the model's)."""

    def feeds(proto) -> Data:
        meta = read_metadata(proto)
        tokenizer = None if source == SYNTHETIC else hub.load_tokenizer(tokenizer_from, meta["vocab_size"])
        if source != SYNTHETIC and tokenizer is None:
            raise CorpError(f"{tokenizer_from} has no tokenizer; text INT8 calibrates on documents tokenized by it")
        return int8_feeds(tokenizer, source, meta["vocab_size"], num_calib, num_verify, meta["seq_len"], seed)

    return feeds


def int8_data(
    source: str, num_calib: int, num_verify: int, seed: int, workers: int = 0, text: Callable[[Any], Data] | None = None
) -> Callable[[Any], Data]:
    """Graph -> the (calibration, held-out) inputs every INT8 target reads: a text encoder's feeds (``text_int8``),
    else ``source``'s images (or noise) as the graph's metadata preprocesses them."""
    return text or (lambda proto: calibration_data(source, proto, num_calib, num_verify, seed, workers))
