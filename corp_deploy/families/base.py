"""The family interface: the one place that knows where a model keeps its blocks, layers and tokens.

The CORP core (statistics, per-part pruning, allocation, sensitivity, the artifact) works on three
structures of every block and never reads a model's attribute names itself; it asks the model's
``Adapter`` (``families.adapter_for(model)``). The contract, per block:

- MLP: ``mlp_out(block)`` is the Linear that READS the hidden channels (timm ``fc2``, BERT
  ``output.dense``): its input is what the MLP statistics sum, its columns are what the compensation
  folds into. ``set_mlp`` keeps the given hidden channels of every Linear that PRODUCES them (``fc1``;
  gate and up together for SwiGLU) and installs the folded reader.
- Q/K: ``heads``, ``head_widths`` (Q/K dims, V channels per head), ``qk_weights`` (the query and key
  projections per head, however they are stored: fused ``qkv`` or separate Linears), ``on_qk`` (hooks
  that hand (q, k) of every forward as (batch, tokens, heads, d)), and ``set_qk`` (new per-head
  projections, width d'; the attention keeps the ORIGINAL softmax scale).
- V: ``proj(block)`` is the Linear that reads the concatenated head outputs; ``set_values`` keeps the
  given V channels and installs the folded ``proj``.
- ``check_parts``: what a family cannot prune, refused before any data is read.
- ``structure`` / ``apply_structure``: the per-block widths recorded in ``corp.json`` and rebuilt from it
  (keys ``block_keys``); ``write_files``: what else the artifact holds; ``name`` is the artifact's ``family``.

And per model: ``blocks``; ``run`` (one calibration forward), ``count`` (sequences or images in a batch),
``token_mask`` (which token positions count: padding is excluded from every sum, None = all of them);
``causal`` (a decoder's attention: the Q/K statistics sum over the (query, key) pairs with key <= query);
``tokens`` and ``example`` (tokens per input and one input, for MACs); ``block_call`` (block 0's input and
the rest of its call, which every block takes: the block-by-block walk and the sensitivity pass run blocks
themselves) and ``features`` (what the sensitivity pass compares).

And as a registry entry (``families.registry``): ``matches`` (is a model this family's), ``build`` (the dense tree
of an artifact, weights unfilled), ``modality`` (``image`` or ``text``: the one answer to "what does it read"),
``summary`` (what users know it as, for messages). ``value_groups`` (grouped-query attention) and ``adds_bias``
(bias-free readers) are the decoders' answers; ``genai_type`` and ``positions`` what a decode graph needs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from corp_deploy.base.errors import CorpError
from corp_deploy.families.layers import AffineBranch

QKHook = Callable[[Tensor, Tensor], None]
"""Called with (q, k), each (batch, tokens, heads, d), once per forward of an attention."""
BranchHook = Callable[[Tensor, Tensor], None]
"""Called with (x, y), each (batch, tokens, dim): a branch's input (the residual stream) and what it adds to it."""


def map_tensors(obj: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it, through tuples, lists and dicts."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj


@dataclass
class BlockCall:
    """The rest of a block's call besides its input tokens: positional and keyword arguments the model passes every
    block (an attention mask, rotary position embeddings; nothing for a timm ViT), as captured from block 0."""

    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def run(self, block: nn.Module, x: Tensor) -> Tensor:
        """``block``'s output tokens for input ``x`` (a ``transformers`` layer may return them in a tuple)."""
        out = block(x, *self.args, **self.kwargs)
        return out[0] if isinstance(out, tuple) else out

    def to(self, device: torch.device | str) -> BlockCall:
        return BlockCall(*map_tensors((self.args, self.kwargs), lambda t: t.to(device, non_blocking=True)))


class StopForward(Exception):
    """Raised by a hook once it has what it came for: the rest of the forward is not needed."""


def run_until_stopped(handles: list[RemovableHandle], forward: Callable[[], Any]) -> None:
    """Run ``forward`` until one of its hooks raises ``StopForward``; the hooks are removed however it ends."""
    try:
        forward()
    except StopForward:
        pass
    finally:
        for h in handles:
            h.remove()


class Adapter(ABC):
    """A model family's answers to the core's questions (see the module docstring)."""

    name: str
    """The artifact's ``family`` and the registry's key."""
    summary: str
    """What users know the family as, in the one line that lists the supported ones."""
    block_keys: frozenset[str]
    modality = "image"
    """What the model reads: ``image`` (a batch of images) or ``text`` (token ids and a mask)."""
    causal = False
    """A decoder: a query sees only the keys at or before it, so the Q/K moments count those pairs only."""
    genai_type: str | None = None
    """onnxruntime-genai's ``model.type`` for the family's decode graph; None: no decode graph."""
    positions = False
    """The decode graph takes ``position_ids`` (rotary positions: the caller counts them)."""
    parts: tuple[str, ...] = ("mlp", "qk", "v")
    """What the family can prune; a ``--target`` left at its default keeps to these (Llama: no Q/K under RoPE)."""
    adds_bias = False
    """A folded reader without a bias gets one for the compensation's constant (Llama's bias-free down_proj and
    o_proj); otherwise a compensated fold into a bias-free reader is refused (``check_parts``)."""

    @property
    def unit(self) -> str:
        """What one input is, in reports."""
        return "images" if self.modality == "image" else "sequences"

    @abstractmethod
    def matches(self, model: nn.Module) -> bool:
        """Whether ``model`` is one of this family's (checked without importing anything new)."""
        raise NotImplementedError

    @abstractmethod
    def build(self, meta: dict[str, Any], folder: Path) -> nn.Module:
        """The dense module tree of an artifact (its ``corp.json``, its folder), weights unfilled."""
        raise NotImplementedError

    @abstractmethod
    def blocks(self, model: nn.Module) -> Sequence[nn.Module]:
        raise NotImplementedError

    @abstractmethod
    def mlp_out(self, block: nn.Module) -> nn.Linear:
        raise NotImplementedError

    @abstractmethod
    def set_mlp(self, block: nn.Module, keep: Tensor, w: Tensor, b: Tensor | None) -> None:
        raise NotImplementedError

    @abstractmethod
    def heads(self, block: nn.Module) -> int:
        raise NotImplementedError

    @abstractmethod
    def head_widths(self, block: nn.Module) -> tuple[int, int]:
        raise NotImplementedError

    def value_groups(self, block: nn.Module) -> int:
        """Query heads that share one V head (grouped-query attention): their V channels are kept together."""
        return 1

    def dim(self, block: nn.Module) -> int:
        """The residual stream's width (the input of every projection)."""
        return self.proj(block).out_features

    mlp_projections = 2
    """D-wide projections per MLP channel: fc1 and fc2 (3 for SwiGLU: gate, up and down)."""

    def unit_macs(self, block: nn.Module, tokens: int) -> dict[str, int]:
        """MACs per input added by one unit of each width: an MLP channel, or one per-head Q/K or V dim.

        Every MAC of a block is linear in its widths (N tokens, D dim, H query heads over H/g key/value heads):
        q, k ``N D H qk (1 + 1/g)``, v ``N D H v / g``, the attention matmuls ``H N^2 (qk + v)``, the output
        projection ``N H v D`` and the MLP ``mlp_projections N D m``. That is what ``report.model_size`` counts
        (the math attention backend, keys and values repeated per query head; norms, softmax and activations are
        not MACs). Without grouping (g = 1) a Q/K dim and a V channel cost the same.
        """
        n, dim, heads = tokens, self.dim(block), self.heads(block)
        shared = heads // self.value_groups(block) * n * dim  # a key or value projection row, per K/V head
        attend = heads * (n * dim + n * n)  # the query (or output) projection and one N x N matmul, per query head
        return {"mlp": self.mlp_projections * n * dim, "qk": attend + shared, "v": attend + shared}

    @abstractmethod
    def qk_weights(self, block: nn.Module) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
        """(query weight, query bias, key weight, key bias): weights (heads, d, dim), biases (heads, d) or None."""
        raise NotImplementedError

    @abstractmethod
    def on_qk(self, block: nn.Module, fn: QKHook) -> list[RemovableHandle]:
        raise NotImplementedError

    @abstractmethod
    def set_qk(self, block: nn.Module, q_w: Tensor, q_b: Tensor | None, k_w: Tensor, k_b: Tensor | None) -> None:
        raise NotImplementedError

    @abstractmethod
    def proj(self, block: nn.Module) -> nn.Linear:
        raise NotImplementedError

    @abstractmethod
    def set_values(self, block: nn.Module, keep: Tensor, w: Tensor, b: Tensor) -> None:
        raise NotImplementedError

    def install(self, block: nn.Module, part: str, keep: Tensor, weights: tuple[Tensor | None, ...]) -> None:
        """A pruned part's folded float64 weights into ``block``, in its modules' device and dtype: ``mlp`` (kept
        channels, fc2's (w, b); b dropped where fc2 has no bias and the family adds none), ``qk`` (q_w, q_b, k_w, k_b
        per head), ``v`` (kept channels, proj's (w, b))."""
        if part == "qk":
            ref = self.qk_weights(block)[0]
            self.set_qk(block, *(None if x is None else x.to(ref.device, ref.dtype) for x in weights))
            return
        reader = self.mlp_out(block) if part == "mlp" else self.proj(block)
        dev, dtype = reader.weight.device, reader.weight.dtype
        w, b = weights
        b = None if part == "mlp" and reader.bias is None and not self.adds_bias else b.to(dev, dtype)
        (self.set_mlp if part == "mlp" else self.set_values)(block, keep.to(dev), w.to(dev, dtype), b)

    standard_parts: tuple[str, ...] = ()
    """Parts whose uniform pruning the family's own config expresses (``--layout standard``); none: no such layout."""

    mlp_out_name = "fc2"
    """What users know ``mlp_out`` as, for messages."""

    def check_parts(self, block: nn.Module, i: int, parts: Sequence[str], compensation: str | None) -> None:
        """Refuse a part this block cannot take (data-free): a compensation that folds a constant (``compensation``
        names it; None: one that folds none) needs a bias in the MLP's reader."""
        if "mlp" in parts and compensation is not None and self.mlp_out(block).bias is None and not self.adds_bias:
            raise CorpError(
                f"MLP pruning with --compensation {compensation} is not supported for block {i}: its "
                f"{self.mlp_out_name} has no bias to take the compensation's constant; use --compensation none "
                "or --target qk"
            )

    def check_depth(self, block: nn.Module, i: int) -> None:
        """Refuse, data-free, a block whose modules ``--depth`` cannot replace."""
        raise CorpError(f"--depth (replacing whole modules) does not support {self.name} models yet")

    def on_branch(self, block: nn.Module, module: str, fn: BranchHook) -> list[RemovableHandle]:
        """Hooks handing ``module``'s (``attn`` or ``mlp``) branch input and output to ``fn`` (``--depth``)."""
        raise CorpError(f"--depth (replacing whole modules) does not support {self.name} models yet")

    def replace_branch(self, block: nn.Module, module: str, branch: AffineBranch) -> None:
        """Make ``block``'s ``module`` (``attn`` or ``mlp``) branch ``branch(x)``, its norm and scale folded in."""
        raise CorpError(f"--depth (replacing whole modules) does not support {self.name} models yet")

    def structure(self, block: nn.Module) -> dict[str, int | str]:
        qk, v = self.head_widths(block)
        return {"mlp_hidden": self.mlp_out(block).in_features, "qk_dim": qk, "v_dim": v, "heads": self.heads(block)}

    @abstractmethod
    def apply_structure(self, model: nn.Module, entries: list[dict[str, Any]]) -> None:
        raise NotImplementedError

    def write_files(self, model: nn.Module, folder: Path) -> dict[str, Any]:
        """Files the artifact needs beside the weights and corp.json (a config, a tokenizer; none by default), and
        what ``corp.json`` records about them (under ``folder``; nothing by default)."""
        return {}

    def stored(self, model: nn.Module) -> nn.Module:
        """The model as the artifact stores its weights: itself, unless the family's own file format needs more
        (zero biases a standard transformers config implies)."""
        return model

    @abstractmethod
    def run(self, model: nn.Module, inputs: Any, device: torch.device | str) -> None:
        raise NotImplementedError

    @abstractmethod
    def count(self, inputs: Any) -> int:
        raise NotImplementedError

    def token_mask(self, inputs: Any, device: torch.device | str) -> Tensor | None:
        return None

    @abstractmethod
    def tokens(self, model: nn.Module) -> int:
        raise NotImplementedError

    def input_size(self, model: nn.Module) -> tuple[int, int, int]:
        """(C, H, W) of the images an image model reads (exports, noise calibration, latency)."""
        raise CorpError(f"{self.name} models read {self.unit}, not images")

    def data_config(self, model: nn.Module) -> dict[str, Any]:
        """The eval preprocessing of an image model in timm's terms (``input_size``, ``interpolation``, ``mean``,
        ``std``, ``crop_pct``, ``crop_mode``): what calibration and evaluation apply to image files."""
        raise CorpError(f"{self.name} models read {self.unit}, not images")

    @abstractmethod
    def example(self, model: nn.Module) -> Any:
        """One input of the size MACs are counted at, on the model's device and in its dtype."""
        raise NotImplementedError

    def block_call(self, model: nn.Module, inputs: Any, device: torch.device | str) -> tuple[Tensor, BlockCall]:
        """Block 0's input tokens for ``inputs`` and the rest of its call, from one forward stopped there (what the
        block-by-block walk caches). Later blocks take the same call: each block's output is the next one's input."""
        seen: list[Any] = []

        def capture(_m: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            seen[:] = [args, kwargs]
            raise StopForward

        handle = self.blocks(model)[0].register_forward_pre_hook(capture, with_kwargs=True)
        run_until_stopped([handle], lambda: self.run(model, inputs, device))
        args, kwargs = seen
        if not args:  # called by keyword (``hidden_states=``)
            kwargs = dict(kwargs)
            return kwargs.pop("hidden_states"), BlockCall((), kwargs)
        return args[0], BlockCall(tuple(args[1:]), dict(kwargs))

    def block_inputs(self, model: nn.Module, inputs: Any) -> tuple[list[Tensor], BlockCall, Tensor]:
        """Every block's input for ``inputs`` (one dense forward), the blocks' call and the final features."""
        x, call = self.block_call(model, inputs, next(model.parameters()).device)
        found = []
        for block in self.blocks(model):
            found.append(x)
            x = call.run(block, x)
        return found, call, self.features(model, x, inputs)

    def features_from(self, model: nn.Module, start: int, x: Tensor, call: BlockCall, inputs: Any) -> Tensor:
        """The final features from block ``start``'s input ``x`` on."""
        for block in self.blocks(model)[start:]:
            x = call.run(block, x)
        return self.features(model, x, inputs)

    @abstractmethod
    def features(self, model: nn.Module, x: Tensor, inputs: Any) -> Tensor:
        """What the sensitivity pass compares: the final features from the last block's output ``x``."""
        raise NotImplementedError
