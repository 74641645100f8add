"""The repeated-loop check and greedy continuations (``formats.repetition``), on token lists and a tiny Llama."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_llama_folder

from corp_deploy.formats.repetition import greedy_continuations, loop_report, repeated_ngram

SARAH = [5, 9, 2, 7, 11, 3]
"""'she is a woman named Sarah,' as six token ids."""


def test_a_phrase_repeated_three_times_is_a_loop():
    tokens = [20, 21] + SARAH * 3 + [22]
    assert repeated_ngram(tokens) in {tuple((SARAH * 2)[i : i + 4]) for i in range(len(SARAH))}


def test_varied_text_and_a_phrase_said_twice_are_not_loops():
    assert repeated_ngram(list(range(64))) is None
    assert repeated_ngram([20] + SARAH * 2 + [21, 22, 23]) is None  # twice: a repetition, not yet a loop
    assert repeated_ngram([1, 2, 3]) is None  # shorter than one n-gram


def test_a_run_of_one_token_loops_and_the_thresholds_are_the_callers():
    assert repeated_ngram([4] * 6) == (4, 4, 4, 4)  # overlapping occurrences count
    assert repeated_ngram([4] * 5) is None  # only two 4-grams
    assert repeated_ngram([20] + SARAH * 2, times=2) is not None
    with pytest.raises(ValueError):
        repeated_ngram(SARAH, times=1)


def test_greedy_continuations_are_the_argmax_chain_without_the_prompt(tmp_path):
    import transformers

    folder, _ = tiny_llama_folder(tmp_path, layers=1)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    prompts = ["the market", "a vote on the"]
    got = greedy_continuations(model, tokenizer, prompts, 8)
    for prompt, tokens in zip(prompts, got, strict=True):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        want = []
        with torch.no_grad():
            for _ in range(8):
                nxt = int(model(input_ids=ids).logits[0, -1].argmax())
                want.append(nxt)
                if nxt == tokenizer.eos_token_id:
                    break
                ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        assert tokens == want
    report = loop_report(model, tokenizer, prompts, 8)
    assert report["prompts"] == 2 and [i["text"] for i in report["items"]] == [tokenizer.decode(t) for t in got]
    assert report["looping"] == sum(repeated_ngram(t) is not None for t in got)
