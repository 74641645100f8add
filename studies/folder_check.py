"""Real pruned folders loaded WITHOUT corp-deploy (issue 31 item 5, issue 32 item 1), one line per folder.

    python -m studies.folder_check FOLDER [FOLDER ...] --text DIR

For each prune artifact FOLDER: the pruned model as ``corp_deploy.load_pruned`` builds it, here; then, in a child
process where ``import corp_deploy`` fails (``-I``, a temporary cwd and a ``sys.meta_path`` finder that refuses it),
the folder as its users load it: ``AutoModelForCausalLM.from_pretrained`` for a decoder (logits of ``--prompts``
prompts from the documents in DIR, and ``--new-tokens`` greedy tokens), ``SentenceTransformer`` for a
sentence-transformers folder (embeddings of ``--sentences`` sentences, against the pruned model's last hidden state
under the folder's pooling, mean or CLS, and normalisation); ``trust_remote_code=True`` where ``corp.json`` says the
folder is the remote-code form. Prints the form, max |logit difference| and whether the tokens agree, or the
lowest cosine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from corp_deploy.families.hf import hub
from corp_deploy.formats.artifact import load_pruned, read_meta
from corp_deploy.formats.text import read_documents

CHILD = """
import json, sys
import torch

class NoCorpDeploy:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "corp_deploy":
            raise ModuleNotFoundError(name)

sys.meta_path.insert(0, NoCorpDeploy())
try:
    import corp_deploy  # noqa: F401
    raise SystemExit("corp_deploy is importable in the child")
except ModuleNotFoundError:
    pass
job = json.loads(sys.argv[1])
trust = {"trust_remote_code": True} if job["trust"] else {}
with torch.no_grad():
    if job["sentences"]:
        from sentence_transformers import SentenceTransformer

        out = {"embeddings": SentenceTransformer(job["path"], device="cpu", **trust).encode(job["sentences"],
               convert_to_tensor=True)}
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(job["path"], **trust).eval()
        out = {"class": type(model).__module__, "logits": [], "tokens": []}
        for ids in job["prompts"]:
            ids = torch.tensor([ids])
            out["logits"].append(model(input_ids=ids).logits)
            kw = {"attention_mask": torch.ones_like(ids), "max_new_tokens": job["new"], "do_sample": False}
            out["tokens"].append(model.generate(ids, **kw))
torch.save(out, sys.argv[2])
"""


def blocked_child(job: dict) -> dict:
    """Run ``CHILD`` on ``job`` where corp_deploy cannot be imported; its outputs."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | {"HF_HUB_OFFLINE": "1"}
        command = [sys.executable, "-I", "-c", CHILD, json.dumps(job), str(Path(tmp) / "out.pt")]
        done = subprocess.run(command, env=env, cwd=tmp, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"the child failed:\n{done.stderr[-3000:]}")
        return torch.load(Path(tmp) / "out.pt")


def sentence_embeddings(model: torch.nn.Module, tokenizer, folder: Path, sentences: list[str]) -> torch.Tensor:
    """The pruned model's embeddings under the folder's own pooling (1_Pooling) and normalisation (2_Normalize)."""
    modules = [m["type"] for m in json.loads((folder / "modules.json").read_text())]
    pooling = json.loads((folder / "1_Pooling" / "config.json").read_text())
    limit = json.loads((folder / "sentence_bert_config.json").read_text())["max_seq_length"]
    batch = tokenizer(sentences, padding=True, truncation=True, max_length=limit, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    if pooling.get("pooling_mode_cls_token"):
        pooled = hidden[:, 0]
    else:
        mask = batch["attention_mask"].unsqueeze(-1).float()
        pooled = (hidden * mask).sum(1) / mask.sum(1)
    normalize = any(t.endswith("Normalize") for t in modules)
    return torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled


def check(folder: Path, docs: list[str], a: argparse.Namespace) -> str:
    meta = read_meta(folder)
    record = meta.get("folder") or {}
    trust = record.get("form") == "remote-code"
    model = load_pruned(folder)
    tokenizer = hub.load_tokenizer(folder, model.config.vocab_size)
    job = {"path": str(folder), "trust": trust, "sentences": [], "prompts": [], "new": a.new_tokens}
    why = record.get("why", "the family's own format")
    head = f"{folder.name}: {record.get('form')} form ({why})"
    if (folder / "modules.json").is_file():
        sentences = [d.strip().split("\n")[0][:400] for d in docs[: a.sentences]]
        loaded = blocked_child(job | {"sentences": sentences})["embeddings"]
        cosine = torch.nn.functional.cosine_similarity(loaded, sentence_embeddings(model, tokenizer, folder, sentences))
        return (
            f"{head}: SentenceTransformer(folder{', trust_remote_code=True' if trust else ''}) on {len(sentences)} "
            f"sentences, embedding cosine min {float(cosine.min()):.6f} mean {float(cosine.mean()):.6f}"
        )
    prompts = [tokenizer(d, truncation=True, max_length=a.prompt_tokens)["input_ids"] for d in docs[: a.prompts]]
    loaded = blocked_child(job | {"prompts": prompts})
    diffs, same = [], []
    with torch.no_grad():
        for ids, logits, tokens in zip(prompts, loaded["logits"], loaded["tokens"], strict=True):
            ids = torch.tensor([ids])
            diffs.append(float((model(input_ids=ids).logits - logits).abs().max()))
            kw = {"attention_mask": torch.ones_like(ids), "max_new_tokens": a.new_tokens, "do_sample": False}
            same.append(torch.equal(model.generate(ids, **kw), tokens))
    return (
        f"{head}: {loaded['class']} from_pretrained(folder{', trust_remote_code=True' if trust else ''}), "
        f"{len(prompts)} prompts of {a.prompt_tokens} tokens: max |logit difference| {max(diffs):.2e}, "
        f"{a.new_tokens} greedy tokens {'identical' if all(same) else 'DIFFERENT'}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="+", type=Path)
    p.add_argument("--text", required=True, help="documents (.txt) for the prompts and sentences")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--sentences", type=int, default=32)
    a = p.parse_args()
    docs = [d.text for d in read_documents(a.text)]
    for folder in a.folders:
        print(check(folder, docs, a), flush=True)


if __name__ == "__main__":
    main()
