"""Pruned ``transformers`` layers at per-layer widths: corp-deploy's own, and the modeling file of every
remote-code folder it writes (copied there verbatim as ``modeling_corp.py``), so this module imports torch and
transformers only: a user loads the folder with ``from_pretrained(folder, trust_remote_code=True)`` and no
corp-deploy.

Such a folder's config.json is the family's own config (same ``model_type``: the dense layers are described as
they were) plus ``corp_layers``, one entry per layer as ``corp.json`` records it (``mlp_hidden``, ``qk_dim``,
``v_dim``; ``mlp_bias``/``proj_bias`` for bias-free readers), ``corp_names``, where the family keeps its layers,
and an ``auto_map`` naming ``Corp<Class>``: the family's ``transformers`` class whose layers are
rebuilt at the recorded widths (``apply_widths``, the same function ``load_pruned`` uses) before the weights load.
Those classes are made on request (``__getattr__``), so a family this file never names loads the same way.

The pruned attentions keep the dense layers' parameter names, call and key/value cache use, and the DENSE
softmax scale (CORP's Q/K fold reproduces the dense logits at the narrower width). Four kinds cover the layouts:
``bert`` (the output projection outside the attention module), ``opt`` (q scaled before the product),
``rope`` (rotary positions, grouped-query attention: Llama, Mistral, Qwen2) and ``plain`` (q/k/v/o_proj, no
positions or cache: the vision transformers, ViT and DINOv2).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import transformers
from torch import Tensor, nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.bert.modeling_bert import eager_attention_forward as bert_attention
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from transformers.models.llama.modeling_llama import eager_attention_forward as llama_attention
from transformers.models.opt.modeling_opt import OPTAttention
from transformers.models.opt.modeling_opt import eager_attention_forward as opt_attention
from transformers.models.vit.modeling_vit import eager_attention_forward as vit_attention

WIDTHS_KEY = "corp_layers"
"""The config attribute holding the per-layer widths in a remote-code folder."""
NAMES_KEY = "corp_names"
"""The config attribute holding where the family keeps its layers in a remote-code folder (corp-deploy's
``families.hf.adapter.Names``: ``layers``, ``attention``, ``kind``, ``q``/``k``/``v``, ``proj``, ``mlp_in``,
``mlp_out`` as attribute paths)."""


def get(module: nn.Module, path: str) -> Any:
    """``module``'s submodule at a dotted path."""
    return functools.reduce(getattr, path.split("."), module)


def put(module: nn.Module, path: str, value: nn.Module) -> None:
    """Replace ``module``'s submodule at a dotted path."""
    owner, _, name = path.rpartition(".")
    setattr(get(module, owner) if owner else module, name, value)


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


class PrunedRopeAttention(nn.Module):
    """A rotary-position, grouped-query attention (Llama, Mistral, Qwen2) whose heads carry ``v_dim`` V channels
    (Q/K keep the dense ``head_dim`` and scale) and whose o_proj may have a bias (the compensation's constant).

    Never used alone: ``pruned_class`` makes it a subclass of the dense attention's own class (so ``transformers``'
    output capture still finds it), built without that class's ``__init__`` (which makes dense-size Linears), with
    the same parameter names, call, key/value cache use (the V cache is ``kv_heads * v_dim`` wide), Linear biases
    and sliding window as the layer it replaces."""

    def __init__(self, attn: nn.Module, v_dim: int, proj_bias: bool) -> None:
        nn.Module.__init__(self)
        self.config, self.layer_idx, self.v_dim, self.head_dim = attn.config, attn.layer_idx, v_dim, attn.head_dim
        self.num_key_value_groups, self.scaling = attn.num_key_value_groups, attn.scaling
        self.attention_dropout, self.is_causal = attn.attention_dropout, True
        self.sliding_window = getattr(attn, "sliding_window", getattr(attn.config, "sliding_window", None))
        dim, kv = attn.q_proj.in_features, attn.k_proj.out_features // attn.head_dim
        self.q_proj, self.k_proj = (
            linear_like(attn.q_proj, dim, attn.q_proj.out_features),
            linear_like(attn.k_proj, dim, kv * attn.head_dim),
        )
        self.v_proj = linear_like(attn.v_proj, dim, kv * v_dim)
        self.o_proj = linear_like(
            attn.o_proj,
            attn.q_proj.out_features // attn.head_dim * v_dim,
            dim,
            attn.o_proj.bias is not None or proj_bias,
        )

    def forward(
        self,
        hidden_states: Tensor,
        position_embeddings: tuple[Tensor, Tensor] | None = None,
        attention_mask: Tensor | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor | None]:
        """The dense forward with the V heads reshaped at their own width (-1: no size baked in)."""
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
            self,
            q,
            k,
            v,
            attention_mask,
            dropout=dropout,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            **kwargs,
        )
        return self.o_proj(out.reshape(*shape).contiguous()), weights


class PrunedPlainAttention(nn.Module):
    """A vision transformer's attention (ViT, DINOv2: ``q_proj``/``k_proj``/``v_proj``/``o_proj``, no positions,
    no cache) with Q/K head width ``qk_dim``, V head width ``v_dim`` and the dense ``scaling``.

    Never used alone: ``pruned_class`` makes it a subclass of the dense attention's own class, built without that
    class's ``__init__`` (which makes dense-size Linears), with the same parameter names and call."""

    def __init__(self, attn: nn.Module, qk_dim: int, v_dim: int, proj_bias: bool = False) -> None:
        nn.Module.__init__(self)
        self.config, self.num_attention_heads = attn.config, attn.num_attention_heads
        self.qk_dim, self.v_dim, self.scaling = qk_dim, v_dim, attn.scaling
        self.attention_dropout, self.is_causal = attn.attention_dropout, False
        heads, dim = attn.num_attention_heads, attn.q_proj.in_features
        self.q_proj, self.k_proj = (linear_like(lin, dim, heads * qk_dim) for lin in (attn.q_proj, attn.k_proj))
        self.v_proj = linear_like(attn.v_proj, dim, heads * v_dim)
        self.o_proj = linear_like(attn.o_proj, heads * v_dim, dim, attn.o_proj.bias is not None or proj_bias)

    def forward(
        self, hidden_states: Tensor, attention_mask: Tensor | None = None, **kwargs: Any
    ) -> tuple[Tensor, Tensor | None]:
        shape = (*hidden_states.shape[:-1], self.num_attention_heads, -1)
        q, k, v = (lin(hidden_states).view(shape).transpose(1, 2) for lin in (self.q_proj, self.k_proj, self.v_proj))
        dropout = self.attention_dropout if self.training else 0.0
        out, weights = _attend(self, vit_attention)(
            self, q, k, v, attention_mask, dropout=dropout, scaling=self.scaling, **kwargs
        )
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


@functools.cache
def pruned_class(pruned: type, dense: type) -> type:
    """``pruned`` (``PrunedRopeAttention``, ``PrunedPlainAttention``) as a subclass of the dense attention class
    ``dense``, so that ``transformers``' output capture (``output_attentions``) still finds it."""
    return type(f"Pruned{dense.__name__}", (pruned, dense), {"__module__": __name__, "dense": dense})


# ------------------------------------------------------------------------ the recorded widths on a dense tree


def head_widths(attn: nn.Module, kind: str) -> tuple[int, int]:
    """(Q/K, V) head width of an attention of ``kind``, pruned or dense."""
    if isinstance(attn, (PrunedSelfAttention, PrunedOptAttention, PrunedPlainAttention)):
        return attn.qk_dim, attn.v_dim
    if isinstance(attn, PrunedRopeAttention):
        return attn.head_dim, attn.v_dim
    dense = attn.attention_head_size if kind == "bert" else attn.head_dim
    return dense, dense


def heads(attn: nn.Module, kind: str) -> int:
    """Query heads of an attention of ``kind``."""
    if kind in ("bert", "plain"):
        return attn.num_attention_heads
    return attn.num_heads if kind == "opt" else attn.q_proj.out_features // attn.head_dim


def attention_at(attn: nn.Module, kind: str, qk_dim: int, v_dim: int, proj_bias: bool = False) -> nn.Module:
    """An unfilled pruned attention of ``kind`` at the given head widths with ``attn``'s heads, layer, dense scale,
    device, dtype and mode; ``proj_bias``: a rope o_proj gains a bias (the compensation's constant)."""
    if kind == "bert":
        new = PrunedSelfAttention(attn.config, attn.num_attention_heads, qk_dim, v_dim, float(attn.scaling))
    elif kind == "opt":
        new = PrunedOptAttention(attn.config, attn.layer_idx, attn.num_heads, qk_dim, v_dim, float(attn.scaling))
    elif kind == "plain":
        new = pruned_class(PrunedPlainAttention, getattr(type(attn), "dense", type(attn)))(
            attn, qk_dim, v_dim, proj_bias
        )
    else:
        if qk_dim != attn.head_dim:
            raise ValueError(f"a rotary attention keeps its Q/K head width {attn.head_dim}, not {qk_dim}")
        new = pruned_class(PrunedRopeAttention, getattr(type(attn), "dense", type(attn)))(attn, v_dim, proj_bias)
    weight = (attn.query if kind == "bert" else attn.q_proj).weight
    return new.train(attn.training).to(weight.device, weight.dtype)


def layers_of(model: nn.Module, names: Any) -> Sequence[nn.Module]:
    """The transformer layers of a model (a base model or one with a head)."""
    return get(model.base_model, names.layers)


def apply_widths(model: nn.Module, names: Any, entries: Sequence[dict[str, Any]]) -> None:
    """``model``'s layers at the recorded widths and folded biases, unfilled (``corp.json``'s ``structure``,
    config.json's ``corp_layers``): a layer whose widths are the dense ones keeps its modules."""
    for block, e in zip(layers_of(model, names), entries, strict=True):
        down, hidden = get(block, names.mlp_out), e["mlp_hidden"]
        mlp_bias = down.bias is not None if "mlp_bias" not in e else bool(e["mlp_bias"])
        if hidden != down.in_features or mlp_bias != (down.bias is not None):
            for path in names.mlp_in:
                put(block, path, linear_like(get(block, path), get(block, path).in_features, hidden))
            put(block, names.mlp_out, linear_like(down, hidden, down.out_features, mlp_bias))
        attn, proj = get(block, names.attention), get(block, names.proj)
        proj_bias = proj.bias is not None if "proj_bias" not in e else bool(e["proj_bias"])
        widths = (e["qk_dim"], e["v_dim"])
        if widths != head_widths(attn, names.kind) or proj_bias != (proj.bias is not None):
            put(block, names.attention, attention_at(attn, names.kind, *widths, proj_bias))
            if not names.proj.startswith(names.attention + "."):  # the projection lives beside the attention
                put(block, names.proj, linear_like(proj, heads(attn, names.kind) * e["v_dim"], proj.out_features))


# ------------------------------------------------------------------------ the classes a remote-code folder names


@functools.cache
def corp_class(name: str) -> type:
    """``Corp<Class>``: ``transformers``' ``<Class>`` whose layers take the config's recorded widths on creation."""
    dense = getattr(transformers, name.removeprefix("Corp"))

    def __init__(self: nn.Module, config: Any, *args: Any, **kwargs: Any) -> None:
        dense.__init__(self, config, *args, **kwargs)
        apply_widths(self, SimpleNamespace(**getattr(config, NAMES_KEY)), getattr(config, WIDTHS_KEY))

    return type(name, (dense,), {"__init__": __init__, "__module__": __name__})


def __getattr__(name: str) -> type:
    """The ``auto_map``'s classes (``from_pretrained(folder, trust_remote_code=True)`` asks for them by name)."""
    if name.startswith("Corp") and hasattr(transformers, name.removeprefix("Corp")):
        return corp_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
