"""``transformers`` BERT-family encoders (BertModel, RobertaModel and their task heads) as a CORP family.

Layout per layer (``encoder.layer[i]``): MLP ``intermediate.dense -> act -> output.dense``; attention
``attention.self.{query,key,value}`` (separate Linears with biases), ``attention.output.dense`` reading the
head outputs. Post-LN: ``output.dense`` and ``attention.output.dense`` feed ``LayerNorm(x + residual)``, so
folding the compensation into them is exact. Positions are learned and absolute (added to the input), so
the Q/K logit compensation applies unchanged. Padding is excluded from every statistic through the
batch's attention mask (``token_mask``).

Pruned attention keeps ``attention.self``'s parameter names (``query``/``key``/``value``) in
``hf_modeling.PrunedSelfAttention``, whose Q/K and V head widths may differ and whose softmax scale stays the dense
one; the model remains the same ``transformers`` class, with the usual ``forward(input_ids,
attention_mask)`` outputs. ``transformers`` is imported only when a model is one of these.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from corp_deploy.deps import require
from corp_deploy.errors import CorpError, first_line
from corp_deploy.family import Adapter, QKHook

MODEL_TYPES = ("bert", "roberta")
"""``config.model_type`` of the supported layout."""
MACS_SEQ_LEN = 128
"""Tokens per sequence at which a text model's MACs are counted (``report.model_size``, budgets) unless
``count_macs_at`` set another."""
MACS_SEQ_LEN_KEY = "corp_macs_seq_len"
"""The config attribute holding a model's MACs sequence length: saved in config.json, so a reloaded artifact
counts at the length it was pruned for."""


def qk_hooks(query: nn.Linear, key: nn.Linear, heads: int, fn: QKHook) -> list[RemovableHandle]:
    """Hooks handing ``fn`` (q, k) as (batch, tokens, heads, d) from separate query and key Linears.

    The query output is kept until the key Linear of the same forward runs (the attention calls query first).
    """
    held: list[Tensor] = []

    def on_query(_m: nn.Module, _args: tuple, out: Tensor) -> None:
        held[:] = [out]

    def on_key(_m: nn.Module, _args: tuple, out: Tensor) -> None:
        q = held.pop()
        fn(q.unflatten(-1, (heads, -1)), out.unflatten(-1, (heads, -1)))

    return [query.register_forward_hook(on_query), key.register_forward_hook(on_key)]


class HfText(Adapter):
    """What every ``transformers`` text family shares: ``{"input_ids", "attention_mask"}`` batches, padding
    excluded through the mask, MACs at ``count_macs_at``'s tokens, config and tokenizer in the artifact."""

    unit = "sequences"
    standard_parts = ("mlp",)
    """A transformers config has one MLP width, and one head width for Q, K and V (``hf_folder.layout``)."""

    def write_files(self, model: nn.Module, folder: Path) -> dict[str, Any]:
        """The artifact folder as a transformers folder (``hf_folder``: standard or remote-code form)."""
        from corp_deploy import hf_folder

        return hf_folder.write(model, folder)

    def stored(self, model: nn.Module) -> nn.Module:
        from corp_deploy import hf_folder

        return hf_folder.stored(model)

    def apply_structure(self, model: nn.Module, entries: list[dict[str, Any]]) -> None:
        """Unfilled layers of the recorded widths (``load_pruned``; weights load next): the same rebuild a
        remote-code folder's own classes run (``hf_modeling.apply_widths``)."""
        from corp_deploy.hf_modeling import apply_widths

        apply_widths(model, entries)

    def run(self, model: nn.Module, inputs: Mapping[str, Tensor], device: torch.device | str) -> None:
        """A decoder runs without its key/value cache: calibration never generates, and the cache only costs."""
        extra = {"use_cache": False} if self.causal else {}
        model(**{k: t.to(device, non_blocking=True) for k, t in inputs.items()}, **extra)

    def count(self, inputs: Mapping[str, Tensor]) -> int:
        return inputs["input_ids"].shape[0]

    def token_mask(self, inputs: Mapping[str, Tensor], device: torch.device | str) -> Tensor | None:
        mask = inputs.get("attention_mask")
        return None if mask is None else mask.to(device).bool()

    def features(self, model: nn.Module, x: Tensor, inputs: Mapping[str, Tensor]) -> Tensor:
        """The last hidden state at the real tokens: ``final`` of the last block's output, padding left out."""
        x = self.final(model, x)
        mask = self.token_mask(inputs, x.device)
        return x if mask is None else x[mask]

    def final(self, model: nn.Module, x: Tensor) -> Tensor:
        """What the stack applies after its last block (nothing for post-LN BERT)."""
        return x

    def tokens(self, model: nn.Module) -> int:
        """The length ``count_macs_at`` set (else ``MACS_SEQ_LEN``), or the model's positions when it has fewer."""
        return min(getattr(model.config, MACS_SEQ_LEN_KEY, MACS_SEQ_LEN), max_positions(model.config))

    def example(self, model: nn.Module) -> dict[str, Tensor]:
        """One sequence of ``tokens`` tokens (what MACs are counted on)."""
        device = next(model.parameters()).device
        ids = torch.zeros(1, self.tokens(model), dtype=torch.long, device=device)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


class HfBert(HfText):
    """BertModel-layout encoders."""

    name = "hf-bert"
    block_keys = frozenset({"heads", "mlp_hidden", "qk_dim", "v_dim"})
    mlp_out_name = "output.dense"

    def blocks(self, model: nn.Module) -> Sequence[nn.Module]:
        return model.base_model.encoder.layer

    def mlp_out(self, block: nn.Module) -> nn.Linear:
        return block.output.dense

    def set_mlp(self, block: nn.Module, keep: Tensor, w: Tensor, b: Tensor | None) -> None:
        from corp_deploy.hf_modeling import linear_like

        up, down = block.intermediate.dense, block.output.dense
        new_up, new_down = linear_like(up, up.in_features, keep.numel()), linear_like(down, keep.numel(), w.shape[0])
        with torch.no_grad():
            new_up.weight.copy_(up.weight[keep])
            new_up.bias.copy_(up.bias[keep])
            new_down.weight.copy_(w)
            if b is not None:
                new_down.bias.copy_(b)
        block.intermediate.dense, block.output.dense = new_up, new_down

    def heads(self, block: nn.Module) -> int:
        return block.attention.self.num_attention_heads

    def head_widths(self, block: nn.Module) -> tuple[int, int]:
        from corp_deploy.hf_modeling import bert_head_widths

        return bert_head_widths(block.attention.self)

    def qk_weights(self, block: nn.Module) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
        attn, heads = block.attention.self, self.heads(block)
        q, k = attn.query, attn.key
        return (
            q.weight.unflatten(0, (heads, -1)),
            q.bias.unflatten(0, (heads, -1)),
            k.weight.unflatten(0, (heads, -1)),
            k.bias.unflatten(0, (heads, -1)),
        )

    def on_qk(self, block: nn.Module, fn: QKHook) -> list[RemovableHandle]:
        attn = block.attention.self
        return qk_hooks(attn.query, attn.key, self.heads(block), fn)

    def _rebuilt(self, block: nn.Module, qk_dim: int, v_dim: int) -> nn.Module:
        """An unfilled ``PrunedSelfAttention`` with ``block``'s heads and dense scale at the given widths."""
        from corp_deploy.hf_modeling import bert_attention_at

        return bert_attention_at(block.attention.self, qk_dim, v_dim)

    @torch.no_grad()
    def set_qk(self, block: nn.Module, q_w: Tensor, q_b: Tensor | None, k_w: Tensor, k_b: Tensor | None) -> None:
        old = block.attention.self
        new = self._rebuilt(block, q_w.shape[1], self.head_widths(block)[1])
        for lin, w, b in ((new.query, q_w, q_b), (new.key, k_w, k_b)):
            lin.weight.copy_(w.flatten(0, 1))
            lin.bias.copy_(b.flatten())
        new.value.load_state_dict(old.value.state_dict())
        block.attention.self = new

    def proj(self, block: nn.Module) -> nn.Linear:
        return block.attention.output.dense

    @torch.no_grad()
    def set_values(self, block: nn.Module, keep: Tensor, w: Tensor, b: Tensor) -> None:
        from corp_deploy.hf_modeling import linear_like

        old, proj = block.attention.self, self.proj(block)
        new = self._rebuilt(block, self.head_widths(block)[0], keep.numel() // self.heads(block))
        new.query.load_state_dict(old.query.state_dict())
        new.key.load_state_dict(old.key.state_dict())
        new.value.weight.copy_(old.value.weight[keep])
        new.value.bias.copy_(old.value.bias[keep])
        new_proj = linear_like(proj, keep.numel(), proj.out_features)
        new_proj.weight.copy_(w)
        new_proj.bias.copy_(b)
        block.attention.self, block.attention.output.dense = new, new_proj


HF_BERT = HfBert()


def max_positions(config: Any) -> int:
    """The longest sequence the learned positions cover (RoBERTa's start after the padding index)."""
    limit = config.max_position_embeddings
    if getattr(config, "model_type", "") == "roberta":
        limit -= (config.pad_token_id or 0) + 1
    return limit


def count_macs_at(model: nn.Module, seq_len: int) -> None:
    """Count ``model``'s MACs (its size in reports, a ``--budget macs=F``) at ``seq_len`` tokens per sequence:
    a text model's cost grows with its inputs' length, so the run's ``--seq-len`` is the one that means something."""
    setattr(model.config, MACS_SEQ_LEN_KEY, seq_len)


def adapter_for_hf(model: nn.Module) -> Adapter:
    """The adapter of a ``transformers`` model, or one line naming what is supported."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in MODEL_TYPES and hasattr(getattr(model, "base_model", None), "encoder"):
        return HF_BERT
    if model_type == "opt" and hasattr(getattr(model, "base_model", None), "decoder"):
        from corp_deploy.opt import HF_OPT

        return HF_OPT
    if model_type == "llama" and hasattr(getattr(model, "base_model", None), "layers"):
        from corp_deploy.llama import HF_LLAMA

        return HF_LLAMA
    raise CorpError(
        f"{type(model).__name__} (model_type {model_type!r}) is not supported; corp-deploy prunes timm "
        f"VisionTransformers, transformers BERT-family encoders (model_type {', '.join(MODEL_TYPES)}) "
        "OPT decoders (model_type opt) and Llama decoders (model_type llama)"
    )


FAMILY_NAMES = (HF_BERT.name, "hf-opt", "hf-llama")
"""Artifact families built from a config.json (``build``, ``apply_structure``); ``corp_deploy.opt`` is hf-opt,
``corp_deploy.llama`` hf-llama."""
BLOCK_KEYS = HF_BERT.block_keys | {"mlp_bias", "proj_bias"}
"""What their block entries may hold: the widths, and (hf-llama) which bias-free readers gained a bias."""


def apply_structure(model: nn.Module, entries: list[dict[str, Any]]) -> None:
    """The recorded widths on a ``build`` tree, by its family's adapter."""
    adapter_for_hf(model).apply_structure(model, entries)


def transformers_module(purpose: str) -> Any:
    """``transformers``, or the one-line install hint (``pip install 'corp-deploy[text]'``)."""
    return require("transformers", purpose)


# ------------------------------------------------------------------------------ models and artifacts

HUB_PREFIX = "hf:"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "sentencepiece.bpe.model",
    "spiece.model",
)
"""Tokenizer files copied from the source folder into the artifact (whichever exist)."""


def is_source(model: str) -> bool:
    """Whether ``model`` names a ``transformers`` model: ``hf:NAME`` or a local folder with a config.json."""
    return model.startswith(HUB_PREFIX) or Path(model, "config.json").is_file()


def load(source: str) -> tuple[nn.Module, Any]:
    """(model in eval mode, tokenizer or None) from a local folder or ``hf:NAME``; one line when it cannot.

    Always float32, whatever the checkpoint holds (OPT's are float16): calibration, the fold and perplexity run
    as for ViTs, and a float16 model on a CPU would be slow and lose precision; exports make FP16 themselves."""
    transformers = transformers_module("pruning a transformers model")
    transformers.utils.logging.disable_progress_bar()  # corp-deploy prints its own progress
    where, offline = source.removeprefix(HUB_PREFIX), _offline(source)
    try:
        config = transformers.AutoConfig.from_pretrained(where, **offline)
        cls = _architecture(transformers, config)
        model = cls.from_pretrained(where, attn_implementation="sdpa", dtype=torch.float32, **offline)
    except (OSError, ValueError, KeyError) as e:
        if offline:
            raise CorpError(
                f"cannot load {source}: the model hub is not reachable from here and {where} is not in the local "
                "cache; download it once where there is network (it is cached then), or pass a local folder"
            ) from None
        raise CorpError(f"cannot load the transformers model {source} ({first_line(e)})") from None
    adapter_for_hf(model)
    return model.eval(), load_tokenizer(source, model.config.vocab_size)


def _offline(source: str) -> dict[str, bool]:
    """``local_files_only`` for an ``hf:NAME`` whose hub's host does not resolve: without it ``huggingface_hub``
    retries for ~25 s, printing a line per try, before it falls back to the cache or fails."""
    if not source.startswith(HUB_PREFIX):
        return {}
    from huggingface_hub import constants

    try:
        socket.getaddrinfo(urlparse(constants.ENDPOINT).hostname, 443)
    except OSError:
        return {"local_files_only": True}
    return {}


def load_tokenizer(source: str | Path, vocab_size: int) -> Any:
    """The tokenizer beside a model (a folder, ``hf:NAME``, a prune artifact), or None when it has none; one line
    when it has more tokens than the model's embedding (it belongs to other weights)."""
    transformers = transformers_module("tokenizing text")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            str(source).removeprefix(HUB_PREFIX), **_offline(str(source))
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not tokenizer.vocab_size:  # no tokenizer files: transformers still builds the config's class, empty
        return None
    if len(tokenizer) > vocab_size:
        raise CorpError(
            f"the tokenizer of {source} has {len(tokenizer)} tokens and the model {vocab_size}: "
            "they do not belong together; use the tokenizer the weights were trained with"
        )
    return tokenizer


def _architecture(transformers: Any, config: Any) -> type:
    """The class named first in ``config.architectures`` (``AutoModel`` when there is none)."""
    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if names else None
    return cls if cls is not None else transformers.AutoModel._model_mapping[type(config)]


def build(model: dict[str, Any], folder: Path) -> nn.Module:
    """The dense module tree of an artifact from its config.json (weights unfilled; widths applied next)."""
    transformers = transformers_module("loading a pruned transformers model")
    config = transformers.AutoConfig.from_pretrained(str(folder))
    config._attn_implementation = "sdpa"
    return _architecture(transformers, config)(config)
