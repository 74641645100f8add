"""Pruned ``transformers`` layers at per-layer widths: corp-deploy's own, and the modeling file of every
remote-code folder it writes (copied there verbatim as ``modeling_corp.py``), so this module imports torch and
transformers only: a user loads the folder with ``from_pretrained(folder, trust_remote_code=True)`` and no
corp-deploy.

Such a folder's config.json is the family's own config (same ``model_type``: the dense layers are described as
they were) plus ``corp_layers``, one entry per layer as ``corp.json`` records it (``mlp_hidden``, ``qk_dim``,
``v_dim``; Llama's ``mlp_bias``/``proj_bias``), and an ``auto_map`` naming the ``Corp*`` classes below: each is
the family's ``transformers`` class whose layers are rebuilt at the recorded widths (``apply_widths``, the same
function ``load_pruned`` uses) before the weights load.

The pruned attentions keep the dense layers' parameter names, call and key/value cache use, and the DENSE
softmax scale (CORP's Q/K fold reproduces the dense logits at the narrower width).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor, nn
from transformers import BertModel, LlamaForCausalLM, LlamaModel, OPTForCausalLM, OPTModel, RobertaModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.bert.modeling_bert import eager_attention_forward as bert_attention
from transformers.models.llama.modeling_llama import LlamaAttention, apply_rotary_pos_emb
from transformers.models.llama.modeling_llama import eager_attention_forward as llama_attention
from transformers.models.opt.modeling_opt import OPTAttention
from transformers.models.opt.modeling_opt import eager_attention_forward as opt_attention

WIDTHS_KEY = "corp_layers"
"""The config attribute holding the per-layer widths in a remote-code folder."""


def linear_like(old: nn.Linear, in_features: int, out_features: int, bias: bool | None = None) -> nn.Linear:
    """An unfilled Linear of the new shape on ``old``'s device, dtype and mode (an eval model stays in eval);
    with a bias when ``old`` has one, unless ``bias`` says otherwise."""
    bias = old.bias is not None if bias is None else bias
    kw = {"device": old.weight.device, "dtype": old.weight.dtype}
    return nn.Linear(in_features, out_features, bias=bias, **kw).train(old.training)


def layer_cache(past_key_values: Any, kwargs: dict[str, Any]) -> Any:
    """An attention layer's key/value cache, taken out of ``kwargs``: transformers 5.24 renamed the layers'
    ``past_key_values=`` argument to ``cache=`` (a pruned attention that reads only the old name never fills the
    cache, and generation with it silently diverges from generation without it)."""
    cache = kwargs.pop("cache", None)
    return past_key_values if cache is None else cache


def _attend(module: nn.Module, fallback: Callable) -> Callable:
    """The configured attention backend (eager or SDPA), which takes unequal Q/K and V head widths."""
    return ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, fallback)


class PrunedSelfAttention(nn.Module):
    """BERT self-attention with Q/K head width ``qk_dim`` and V head width ``v_dim``, and the ORIGINAL scale.

    Drop-in for ``attention.self``: same Linear names (so state dicts keep their keys), same call
    (``hidden_states, attention_mask, ...``), same outputs ``(context, weights)``. Reshapes use -1 so that no
    batch or sequence size is baked into exported graphs.
    """

    def __init__(self, config: Any, heads: int, qk_dim: int, v_dim: int, scaling: float) -> None:
        super().__init__()
        dim = config.hidden_size
        self.config = config
        self.num_attention_heads, self.qk_dim, self.v_dim, self.scaling = heads, qk_dim, v_dim, scaling
        self.query = nn.Linear(dim, heads * qk_dim)
        self.key = nn.Linear(dim, heads * qk_dim)
        self.value = nn.Linear(dim, heads * v_dim)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)
        self.is_decoder = False
        self.is_causal = False

    def forward(
        self, hidden_states: Tensor, attention_mask: Tensor | None = None, past_key_values: Any = None, **kwargs: Any
    ) -> tuple[Tensor, Tensor | None]:
        if layer_cache(past_key_values, kwargs) is not None:
            raise ValueError("a pruned BERT encoder takes no key/value cache")
        shape = (*hidden_states.shape[:-1], self.num_attention_heads, -1)
        q, k, v = (lin(hidden_states).view(shape).transpose(1, 2) for lin in (self.query, self.key, self.value))
        dropout = self.dropout.p if self.training else 0.0
        out, weights = _attend(self, bert_attention)(
            self, q, k, v, attention_mask, dropout=dropout, scaling=self.scaling, **kwargs
        )
        return out.reshape(*hidden_states.shape[:-1], -1).contiguous(), weights


class PrunedOptAttention(OPTAttention):
    """OPT attention with Q/K head width ``qk_dim``, V head width ``v_dim`` and the dense ``scaling``.

    Built without ``OPTAttention.__init__`` (which makes dense-size Linears); it stays an ``OPTAttention`` so that
    ``transformers``' output capture (``output_attentions``) still finds it. Its K cache is ``heads * qk_dim`` wide
    and its V cache ``heads * v_dim``."""

    def __init__(self, config: Any, layer_idx: int | None, heads: int, qk_dim: int, v_dim: int, scaling: float) -> None:
        nn.Module.__init__(self)
        dim, bias = config.hidden_size, config.enable_bias
        self.config, self.layer_idx, self.embed_dim = config, layer_idx, dim
        self.num_heads, self.qk_dim, self.v_dim, self.scaling = heads, qk_dim, v_dim, scaling
        self.dropout, self.enable_bias, self.is_causal = config.attention_dropout, bias, True
        self.q_proj = nn.Linear(dim, heads * qk_dim, bias=bias)
        self.k_proj = nn.Linear(dim, heads * qk_dim, bias=bias)
        self.v_proj = nn.Linear(dim, heads * v_dim, bias=bias)
        self.out_proj = nn.Linear(heads * v_dim, dim, bias=bias)

    def forward(
        self,
        hidden_states: Tensor,
        past_key_values: Any = None,
        attention_mask: Tensor | None = None,
        output_attentions: bool = False,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor | None]:
        shape = (*hidden_states.shape[:-1], self.num_heads, -1)
        q = (self.q_proj(hidden_states) * self.scaling).view(shape).transpose(1, 2)
        k, v = (lin(hidden_states).view(shape).transpose(1, 2) for lin in (self.k_proj, self.v_proj))
        cache = layer_cache(past_key_values, kwargs)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        dropout = self.dropout if self.training else 0.0
        out, weights = _attend(self, opt_attention)(
            self, q, k, v, attention_mask, dropout=dropout, scaling=1.0, **kwargs
        )
        return self.out_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


class PrunedLlamaAttention(LlamaAttention):
    """Llama attention whose heads carry ``v_dim`` V channels (Q/K keep the dense ``head_dim`` and scale) and
    whose o_proj may have a bias (the compensation's constant).

    Built without ``LlamaAttention.__init__`` (which makes dense-size Linears); it stays a ``LlamaAttention``
    so that ``transformers``' output capture still finds it, with the same parameter names, call and
    key/value cache use (the V cache is ``kv_heads * v_dim`` wide)."""

    def __init__(self, config: Any, layer_idx: int | None, v_dim: int, proj_bias: bool) -> None:
        nn.Module.__init__(self)
        dim, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.config, self.layer_idx, self.v_dim = config, layer_idx, v_dim
        self.head_dim = getattr(config, "head_dim", None) or dim // heads
        self.num_key_value_groups, self.scaling = heads // kv, self.head_dim**-0.5
        self.attention_dropout, self.is_causal = config.attention_dropout, True
        bias = config.attention_bias
        self.q_proj = nn.Linear(dim, heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, kv * v_dim, bias=bias)
        self.o_proj = nn.Linear(heads * v_dim, dim, bias=bias or proj_bias)

    def forward(
        self,
        hidden_states: Tensor,
        position_embeddings: tuple[Tensor, Tensor] | None = None,
        attention_mask: Tensor | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor | None]:
        """``LlamaAttention.forward`` with the V heads reshaped at their own width (-1: no size baked in)."""
        shape = (*hidden_states.shape[:-1], -1)
        q = self.q_proj(hidden_states).view(*shape, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(*shape, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(*shape, self.v_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        cache = layer_cache(past_key_values, kwargs)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        dropout = self.attention_dropout if self.training else 0.0
        out, weights = _attend(self, llama_attention)(
            self, q, k, v, attention_mask, dropout=dropout, scaling=self.scaling, **kwargs
        )
        return self.o_proj(out.reshape(*shape).contiguous()), weights


# ------------------------------------------------------------------------ the recorded widths on a dense tree


def bert_head_widths(attn: nn.Module) -> tuple[int, int]:
    """(Q/K, V) head width of a BERT ``attention.self``, pruned or dense."""
    if isinstance(attn, PrunedSelfAttention):
        return attn.qk_dim, attn.v_dim
    return attn.attention_head_size, attn.attention_head_size


def bert_attention_at(attn: nn.Module, qk_dim: int, v_dim: int) -> PrunedSelfAttention:
    """An unfilled ``PrunedSelfAttention`` with ``attn``'s heads, dense scale, device, dtype and mode."""
    new = PrunedSelfAttention(attn.config, attn.num_attention_heads, qk_dim, v_dim, float(attn.scaling))
    return new.train(attn.training).to(attn.query.weight.device, attn.query.weight.dtype)


def bert_widths(layers: Sequence[nn.Module], entries: Sequence[dict[str, Any]]) -> None:
    """BERT-family layers (``encoder.layer``) at the recorded widths, unfilled."""
    for block, widths in zip(layers, entries, strict=True):
        up, down = block.intermediate.dense, block.output.dense
        if widths["mlp_hidden"] != up.out_features:
            block.intermediate.dense = linear_like(up, up.in_features, widths["mlp_hidden"])
            block.output.dense = linear_like(down, widths["mlp_hidden"], down.out_features)
        attn, qk, v = block.attention.self, widths["qk_dim"], widths["v_dim"]
        if (qk, v) != bert_head_widths(attn):
            proj = block.attention.output.dense
            block.attention.self = bert_attention_at(attn, qk, v)
            block.attention.output.dense = linear_like(proj, attn.num_attention_heads * v, proj.out_features)


def opt_head_widths(attn: nn.Module) -> tuple[int, int]:
    """(Q/K, V) head width of an OPT ``self_attn``, pruned or dense."""
    return (attn.qk_dim, attn.v_dim) if isinstance(attn, PrunedOptAttention) else (attn.head_dim, attn.head_dim)


def opt_attention_at(attn: nn.Module, qk_dim: int, v_dim: int) -> PrunedOptAttention:
    """An unfilled ``PrunedOptAttention`` with ``attn``'s heads, layer index, dense scale, device, dtype and mode."""
    new = PrunedOptAttention(attn.config, attn.layer_idx, attn.num_heads, qk_dim, v_dim, float(attn.scaling))
    return new.train(attn.training).to(attn.q_proj.weight.device, attn.q_proj.weight.dtype)


def opt_widths(layers: Sequence[nn.Module], entries: Sequence[dict[str, Any]]) -> None:
    """OPT layers (``decoder.layers``) at the recorded widths, unfilled."""
    for block, widths in zip(layers, entries, strict=True):
        if widths["mlp_hidden"] != block.fc1.out_features:
            block.fc1 = linear_like(block.fc1, block.fc1.in_features, widths["mlp_hidden"])
            block.fc2 = linear_like(block.fc2, widths["mlp_hidden"], block.fc2.out_features)
        if (widths["qk_dim"], widths["v_dim"]) != opt_head_widths(block.self_attn):
            block.self_attn = opt_attention_at(block.self_attn, widths["qk_dim"], widths["v_dim"])


def llama_v_dim(attn: nn.Module) -> int:
    """V channels per head of a Llama ``self_attn``, pruned or dense."""
    return attn.v_dim if isinstance(attn, PrunedLlamaAttention) else attn.head_dim


def llama_attention_at(attn: nn.Module, v_dim: int, proj_bias: bool) -> PrunedLlamaAttention:
    """An unfilled ``PrunedLlamaAttention`` with ``attn``'s config, layer index, device, dtype and mode."""
    new = PrunedLlamaAttention(attn.config, attn.layer_idx, v_dim, proj_bias)
    return new.train(attn.training).to(attn.q_proj.weight.device, attn.q_proj.weight.dtype)


def llama_widths(layers: Sequence[nn.Module], entries: Sequence[dict[str, Any]]) -> None:
    """Llama layers (``model.layers``) at the recorded widths and folded biases, unfilled."""
    for block, widths in zip(layers, entries, strict=True):
        mlp, hidden, mlp_bias = block.mlp, widths["mlp_hidden"], bool(widths.get("mlp_bias"))
        if hidden != mlp.down_proj.in_features or mlp_bias != (mlp.down_proj.bias is not None):
            mlp.gate_proj = linear_like(mlp.gate_proj, mlp.gate_proj.in_features, hidden)
            mlp.up_proj = linear_like(mlp.up_proj, mlp.up_proj.in_features, hidden)
            mlp.down_proj = linear_like(mlp.down_proj, hidden, mlp.down_proj.out_features, mlp_bias)
        attn, proj_bias = block.self_attn, bool(widths.get("proj_bias"))
        if widths["v_dim"] != llama_v_dim(attn) or proj_bias != (attn.o_proj.bias is not None):
            block.self_attn = llama_attention_at(attn, widths["v_dim"], proj_bias)


def layers_of(model: nn.Module) -> Sequence[nn.Module]:
    """The transformer layers of a BERT-family, OPT or Llama model (a base model or one with a head)."""
    base = model.base_model
    if hasattr(base, "encoder"):
        return base.encoder.layer
    return base.decoder.layers if hasattr(base, "decoder") else base.layers


WIDTHS = {"bert": bert_widths, "roberta": bert_widths, "opt": opt_widths, "llama": llama_widths}
"""``config.model_type`` -> what rebuilds its layers at recorded widths."""


def apply_widths(model: nn.Module, entries: Sequence[dict[str, Any]]) -> None:
    """``model``'s layers at the recorded widths (``corp.json``'s ``structure``, config.json's ``corp_layers``)."""
    WIDTHS[model.config.model_type](layers_of(model), entries)


# ------------------------------------------------------------------------ the classes a remote-code folder names


def _rebuild(model: nn.Module) -> None:
    """The layers of a freshly built remote-code model at its config's widths (the weights load next)."""
    apply_widths(model, getattr(model.config, WIDTHS_KEY))


class CorpBertModel(BertModel):
    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        _rebuild(self)


class CorpRobertaModel(RobertaModel):
    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        _rebuild(self)


class CorpOPTModel(OPTModel):
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        _rebuild(self)


class CorpOPTForCausalLM(OPTForCausalLM):
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        _rebuild(self)


class CorpLlamaModel(LlamaModel):
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        _rebuild(self)


class CorpLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        _rebuild(self)


AUTO_MAP = {
    "bert": {"AutoModel": CorpBertModel},
    "roberta": {"AutoModel": CorpRobertaModel},
    "opt": {"AutoModel": CorpOPTModel, "AutoModelForCausalLM": CorpOPTForCausalLM},
    "llama": {"AutoModel": CorpLlamaModel, "AutoModelForCausalLM": CorpLlamaForCausalLM},
}
"""``config.model_type`` -> the ``auto_map`` of its remote-code folder (Auto class -> the class in this file)."""
