"""What every ``transformers`` text family shares, and the usual layout described by names.

A family here is an ``HfText`` with its ``Names`` (where a layer keeps its q/k/v Linears,
output projection and MLP) and a few facts (decoder or encoder, which parts it can prune, what follows the last
layer). Pruning and rebuilding are the same code for all of them:

- MLP: every ``mlp_in`` Linear (``fc1``; SwiGLU's gate and up together) keeps the kept hidden channels' rows, and
  ``mlp_out`` (the reader) gets the folded weight and the compensation's constant.
- Q/K: the per-head rows of ``q`` and ``k``; the pruned attention keeps the DENSE softmax scale.
- V: the kept channels of ``v`` (per K/V head under grouped-query attention: ``value_groups`` query heads share one
  V head, so the same columns of all of them go) and the folded ``proj``.
- A bias-free reader (Llama's ``down_proj``/``o_proj``) gains a bias for the compensation's constant when it is
  non-zero (``adds_bias``); ``corp.json`` then records per layer which readers carry one (``mlp_bias``,
  ``proj_bias``).

Calibration batches are ``{"input_ids", "attention_mask"}``; padding is excluded from every statistic through
the mask (``token_mask``); MACs are counted at ``count_macs_at``'s tokens. The artifact folder is a transformers
folder (``families.hf.folder``). ``transformers`` is imported only when a model is one of these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from corp_deploy.base.deps import require
from corp_deploy.base.errors import CorpError
from corp_deploy.families.base import Adapter, QKHook

MACS_SEQ_LEN = 128
"""Tokens per sequence at which a text model's MACs are counted (``report.model_size``, budgets) unless
``count_macs_at`` set another."""
MACS_SEQ_LEN_KEY = "corp_macs_seq_len"
"""The config attribute holding a model's MACs sequence length: saved in config.json, so a reloaded artifact
counts at the length it was pruned for."""


@dataclass(frozen=True)
class Names:
    """Where a ``transformers`` family keeps what CORP prunes, as attribute paths (dotted).

    ``layers`` is read from the base model; the rest from a layer. ``attention`` is the module replaced when a
    head width changes, ``kind`` the pruned attention that replaces it (``modeling.attention_at``), ``q``,
    ``k``, ``v`` its Linears (inside ``attention``), ``proj`` the Linear reading the head outputs (inside
    ``attention`` or beside it), ``mlp_in`` the Linears producing the MLP's hidden channels (gate and up
    together) and ``mlp_out`` the one reading them; ``mlp_field`` the config field of the MLP width."""

    layers: str
    attention: str
    kind: str
    q: str
    k: str
    v: str
    proj: str
    mlp_in: tuple[str, ...]
    mlp_out: str
    mlp_field: str

    def record(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def read(cls, record: dict[str, Any]) -> Names:
        return cls(**{**record, "mlp_in": tuple(record["mlp_in"])})


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


def architecture(transformers: Any, config: Any) -> type:
    """The class named first in ``config.architectures`` (``AutoModel`` when there is none)."""
    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if names else None
    return cls if cls is not None else transformers.AutoModel._model_mapping[type(config)]


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


def reader(old: nn.Linear, in_features: int, w: Tensor, b: Tensor | None) -> nn.Linear:
    """A folded reader (the MLP's or the attention's output projection) of ``in_features`` inputs: weight ``w``;
    a bias when ``old`` had one or the compensation's constant ``b`` is non-zero (plain removal adds none)."""
    from corp_deploy.families.hf.modeling import linear_like

    bias = old.bias is not None or (b is not None and bool(b.any()))
    new = linear_like(old, in_features, w.shape[0], bias)
    new.weight.copy_(w)
    if bias:
        new.bias.copy_(b if b is not None else old.bias)
    return new


class HfText(Adapter):
    """A ``transformers`` text family of the usual layout, described by ``names`` (see the module docstring)."""

    modality = "text"
    standard_parts = ("mlp",)
    """A transformers config has one MLP width, and one head width for Q, K and V (``folder.layout``)."""

    def __init__(
        self,
        name: str,
        summary: str,
        model_types: tuple[str, ...],
        names: Names,
        *,
        final: tuple[str, ...] = (),
        causal: bool = False,
        adds_bias: bool = False,
        bias_flags: Mapping[str, tuple[str, tuple[str, ...]]] | None = None,
        refused: Mapping[str, str] | None = None,
        genai_type: str | None = None,
        positions: bool = False,
    ) -> None:
        """``final``: what the base model applies after its last layer (paths,
        None-valued ones skipped); ``bias_flags``: the config flags that give a folded reader's bias in the
        family's own format (``corp.json`` key -> (config flag, the Linears of a layer it gives a bias));
        ``refused``: parts the family cannot prune -> why."""
        self.name, self.summary, self.model_types, self.names = name, summary, model_types, names
        self.final_paths, self.causal, self.adds_bias = final, causal, adds_bias
        self.bias_flags = dict(bias_flags or {})
        self.refused = dict(refused or {})
        self.parts = tuple(p for p in ("mlp", "qk", "v") if p not in self.refused)
        self.genai_type, self.positions = genai_type, positions
        self.mlp_projections = len(names.mlp_in) + 1
        self.mlp_out_name = names.mlp_out.removeprefix("mlp.")
        keys = {"heads", "mlp_hidden", "qk_dim", "v_dim"}
        self.block_keys = frozenset(keys | ({"mlp_bias", "proj_bias"} if adds_bias else set()))

    # ------------------------------------------------------------------ registry

    def matches(self, model: nn.Module) -> bool:
        if not type(model).__module__.startswith("transformers"):
            return False
        if getattr(getattr(model, "config", None), "model_type", None) not in self.model_types:
            return False
        base = getattr(model, "base_model", None)
        return base is not None and hasattr(base, self.names.layers.split(".")[0])

    def build(self, meta: dict[str, Any], folder: Path) -> nn.Module:
        """The dense model of the folder's config.json; a standard folder's config holds the pruned MLP width, so the
        dense values ``corp.json`` recorded beside it (``folder.DENSE_CONFIG``) are put back first."""
        from corp_deploy.families.hf.folder import DENSE_CONFIG

        transformers = require("transformers", "loading a pruned transformers model")
        config = transformers.AutoConfig.from_pretrained(str(folder))
        for key, value in meta.get("folder", {}).get(DENSE_CONFIG, {}).items():
            setattr(config, key, value)
        config._attn_implementation = "sdpa"
        return architecture(transformers, config)(config)

    # ------------------------------------------------------------------ where things are

    def _get(self, module: nn.Module, path: str) -> Any:
        from corp_deploy.families.hf.modeling import get

        return get(module, path)

    def blocks(self, model: nn.Module) -> Sequence[nn.Module]:
        return self._get(model.base_model, self.names.layers)

    def attention(self, block: nn.Module) -> nn.Module:
        return self._get(block, self.names.attention)

    def final(self, model: nn.Module, x: Tensor) -> Tensor:
        """What the stack applies after its last block (post-LN BERT: nothing)."""
        for path in self.final_paths:
            layer = self._get(model.base_model, path)
            x = x if layer is None else layer(x)
        return x

    def mlp_out(self, block: nn.Module) -> nn.Linear:
        return self._get(block, self.names.mlp_out)

    def proj(self, block: nn.Module) -> nn.Linear:
        return self._get(block, self.names.proj)

    def heads(self, block: nn.Module) -> int:
        from corp_deploy.families.hf.modeling import heads

        return heads(self.attention(block), self.names.kind)

    def value_groups(self, block: nn.Module) -> int:
        """Query heads per K/V head: k's output is one head width per K/V head."""
        attn = self.attention(block)
        k = self._get(attn, self.names.k)
        return self.heads(block) * self.head_widths(block)[0] // k.out_features

    def head_widths(self, block: nn.Module) -> tuple[int, int]:
        from corp_deploy.families.hf.modeling import head_widths

        return head_widths(self.attention(block), self.names.kind)

    # ------------------------------------------------------------------ pruning

    def check_parts(self, block: nn.Module, i: int, parts: Sequence[str], compensation: str | None) -> None:
        for part in parts:
            if part in self.refused:
                allowed = ",".join(self.parts)
                raise CorpError(
                    f"{part} pruning is not supported for {self.name} models: {self.refused[part]}; "
                    f"prune {' and '.join(self.parts)} (--target {allowed})"
                )
        super().check_parts(block, i, parts, compensation)
        proj = self.proj(block)
        if "v" in parts and compensation is not None and proj.bias is None and not self.adds_bias:
            others = ",".join(p for p in self.parts if p != "v")
            raise CorpError(
                f"V pruning is not supported for layer {i}: its {self.names.proj.rpartition('.')[2]} has no bias to "
                f"take the compensation's constant; use --compensation none or --target {others}"
            )

    @torch.no_grad()
    def set_mlp(self, block: nn.Module, keep: Tensor, w: Tensor, b: Tensor | None) -> None:
        from corp_deploy.families.hf.modeling import linear_like, put

        for path in self.names.mlp_in:
            old = self._get(block, path)
            new = linear_like(old, old.in_features, keep.numel())
            new.weight.copy_(old.weight[keep])
            if old.bias is not None:
                new.bias.copy_(old.bias[keep])
            put(block, path, new)
        put(block, self.names.mlp_out, reader(self.mlp_out(block), keep.numel(), w, b))

    def qk_weights(self, block: nn.Module) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
        attn, heads = self.attention(block), self.heads(block)
        q, k = self._get(attn, self.names.q), self._get(attn, self.names.k)
        per_head = lambda t: None if t is None else t.unflatten(0, (heads, -1))  # noqa: E731
        return per_head(q.weight), per_head(q.bias), per_head(k.weight), per_head(k.bias)

    def on_qk(self, block: nn.Module, fn: QKHook) -> list[RemovableHandle]:
        """q as its Linear outputs it (OPT's scaling comes after: the scale stays the dense one, outside the fold)."""
        attn = self.attention(block)
        return qk_hooks(self._get(attn, self.names.q), self._get(attn, self.names.k), self.heads(block), fn)

    def _replace_attention(self, block: nn.Module, qk_dim: int, v_dim: int) -> tuple[nn.Module, nn.Module]:
        """(old, new): an unfilled pruned attention at the widths installed in ``block``; q, k, v and (inside
        the attention) proj still to fill."""
        from corp_deploy.families.hf.modeling import attention_at, put

        old = self.attention(block)
        new = attention_at(old, self.names.kind, qk_dim, v_dim)
        put(block, self.names.attention, new)
        return old, new

    @torch.no_grad()
    def set_qk(self, block: nn.Module, q_w: Tensor, q_b: Tensor | None, k_w: Tensor, k_b: Tensor | None) -> None:
        proj = self.proj(block)
        old, new = self._replace_attention(block, q_w.shape[1], self.head_widths(block)[1])
        n = self.names
        for path, w, b in ((n.q, q_w, q_b), (n.k, k_w, k_b)):
            lin = self._get(new, path)
            lin.weight.copy_(w.flatten(0, 1))
            if b is not None:
                lin.bias.copy_(b.flatten())
        self._get(new, n.v).load_state_dict(self._get(old, n.v).state_dict())
        if n.proj.startswith(n.attention + "."):
            self.proj(block).load_state_dict(proj.state_dict())

    @torch.no_grad()
    def set_values(self, block: nn.Module, keep: Tensor, w: Tensor, b: Tensor) -> None:
        """``keep`` indexes proj's input (all query heads); v keeps one query head's rows per K/V head."""
        from corp_deploy.families.hf.modeling import put

        heads, group, (qk, d) = self.heads(block), self.value_groups(block), self.head_widths(block)
        kept, proj = keep.numel() // heads, self.proj(block)
        old, new = self._replace_attention(block, qk, kept)
        n = self.names
        for path in (n.q, n.k):
            self._get(new, path).load_state_dict(self._get(old, path).state_dict())
        per_head = keep.view(heads, kept)[::group]
        rows = (per_head % d + d * torch.arange(per_head.shape[0], device=keep.device)[:, None]).flatten()
        v_old, v_new = self._get(old, n.v), self._get(new, n.v)
        v_new.weight.copy_(v_old.weight[rows])
        if v_old.bias is not None:
            v_new.bias.copy_(v_old.bias[rows])
        put(block, n.proj, reader(proj, keep.numel(), w, b))

    def structure(self, block: nn.Module) -> dict[str, int | str]:
        entry = super().structure(block)
        if self.adds_bias:
            entry |= {
                "mlp_bias": int(self.mlp_out(block).bias is not None),
                "proj_bias": int(self.proj(block).bias is not None),
            }
        return entry

    def apply_structure(self, model: nn.Module, entries: list[dict[str, Any]]) -> None:
        """Unfilled layers of the recorded widths (``load_pruned``; weights load next): the same rebuild a
        remote-code folder's own classes run (``modeling.apply_widths``)."""
        from corp_deploy.families.hf.modeling import apply_widths

        apply_widths(model, self.names, entries)

    # ------------------------------------------------------------------ the artifact folder

    def mlp_config(self, config: Any, width: int) -> dict[str, Any] | None:
        """The family config's values that give every layer MLP width ``width`` (the standard form of
        ``families.hf.folder``); None when the config cannot say it exactly."""
        return {self.names.mlp_field: width}

    def write_files(self, model: nn.Module, folder: Path) -> dict[str, Any]:
        """The artifact folder as a transformers folder (``families.hf.folder``: standard or remote-code form)."""
        from corp_deploy.families.hf.folder import write

        return write(model, folder)

    def stored(self, model: nn.Module) -> nn.Module:
        from corp_deploy.families.hf import folder

        return folder.stored(model)

    # ------------------------------------------------------------------ inputs

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

    def tokens(self, model: nn.Module) -> int:
        """The length ``count_macs_at`` set (else ``MACS_SEQ_LEN``), or the model's positions when it has fewer."""
        return min(getattr(model.config, MACS_SEQ_LEN_KEY, MACS_SEQ_LEN), max_positions(model.config))

    def example(self, model: nn.Module) -> dict[str, Tensor]:
        """One sequence of ``tokens`` tokens (what MACs are counted on)."""
        device = next(model.parameters()).device
        ids = torch.zeros(1, self.tokens(model), dtype=torch.long, device=device)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
