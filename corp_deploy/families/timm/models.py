"""Model names, weights and the check that a model is one CORP can prune."""

from __future__ import annotations

import contextlib
import difflib
import socket
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from corp_deploy.base.errors import CorpError

ALIASES: dict[str, str] = {
    "deit_tiny": "deit_tiny_patch16_224",
    "deit_small": "deit_small_patch16_224",
    "deit_base": "deit_base_patch16_224",
    "deit_tiny_distilled": "deit_tiny_distilled_patch16_224",
    "deit_small_distilled": "deit_small_distilled_patch16_224",
    "deit_base_distilled": "deit_base_distilled_patch16_224",
    "deit3_small": "deit3_small_patch16_224",
    "deit3_medium": "deit3_medium_patch16_224",
    "deit3_base": "deit3_base_patch16_224",
    "deit3_large": "deit3_large_patch16_224",
    "deit3_huge": "deit3_huge_patch14_224",
    "vit_tiny": "vit_tiny_patch16_224",
    "vit_small": "vit_small_patch16_224",
    "vit_base": "vit_base_patch16_224",
    "vit_large": "vit_large_patch16_224",
    "vit_huge": "vit_huge_patch14_224",
    "dinov2_small": "vit_small_patch14_dinov2",
    "dinov2_base": "vit_base_patch14_dinov2",
    "dinov2_large": "vit_large_patch14_dinov2",
}
"""Short names users type, mapped to timm model names (the paper's DeiT family first)."""

WEIGHTS = ("pretrained", "random")

SUPPORTED = (
    "timm VisionTransformer-family models whose blocks use timm's Attention (no qk_norm) and Mlp "
    "(ViT, DeiT, DeiT III, DINOv2, register-token ViTs, ...)"
)


SUPPORTED_MODULES = ["vision_transformer", "deit"]
"""timm's modules of ``VisionTransformer`` models: where an unknown name's suggestions come from."""


def resolve_name(name: str) -> str:
    """Alias or timm name -> timm name; unknown names get the closest suggestions."""
    import timm  # here, not at the top: only image models pay for timm and torchvision (~3 s of a start)

    full = ALIASES.get(name, name)
    if full in timm.list_models():
        return full
    path = Path(name).expanduser()
    if (path / "config.json").is_file():  # the CLI loads these itself; a Python caller came to the timm door
        raise CorpError(
            f"{name} is a transformers model folder and create_model builds timm models: load it with transformers "
            "(AutoModel.from_pretrained, or corp_deploy.families.hf.hub.load for the model and its tokenizer)"
        )
    if path.is_dir():
        raise CorpError(
            f"{name} is a folder without a config.json: pass a transformers model folder (its config.json and "
            "weights) or a timm model name"
        )
    if path.is_absolute() or name.startswith((".", "~")) or "/" in name:
        raise CorpError(f"no such folder: {name}; pass an existing transformers model folder or a timm model name")
    candidates = list(ALIASES) + timm.list_models(module=SUPPORTED_MODULES)  # never a name check_supported refuses
    close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else "; see `timm.list_models()` for names"
    raise CorpError(f"unknown model {name!r}{hint}")


def parse_model_args(pairs: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """``["img_size=224", "num_classes=0"]`` -> kwargs for ``timm.create_model``."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise CorpError(f"--model-arg expects key=value, got {pair!r}")
        out[key] = _literal(raw)
    return out


def _literal(raw: str) -> Any:
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(raw.lower(), raw)


def create_model(
    name: str, weights: str = "pretrained", checkpoint: str | Path | None = None, model_args: dict | None = None
) -> nn.Module:
    """A supported timm model in eval mode, with weights from the hub, a checkpoint, or random init."""
    full = resolve_name(name)
    model_args = dict(model_args or {})
    if checkpoint is not None:
        model = _build(full, model_args, pretrained=False)
        load_checkpoint(model, checkpoint, full)
    elif weights == "pretrained":
        model = _pretrained(full, model_args)
    elif weights == "random":
        warnings.warn(
            "weights='random' (the CLI's --weights random): accuracy of this model is meaningless (fine for structure "
            "and latency)",
            stacklevel=2,
        )
        model = _build(full, model_args, pretrained=False)
    else:
        raise CorpError(f"unknown --weights {weights!r}; choose one of {', '.join(WEIGHTS)}")
    check_supported(model, full)
    return model.eval()


def _build(name: str, model_args: dict, pretrained: bool) -> nn.Module:
    import timm

    try:
        return timm.create_model(name, pretrained=pretrained, **model_args)
    except TypeError as e:
        raise CorpError(f"--model-arg not accepted by {name}: {e}") from None


def _pretrained(name: str, model_args: dict) -> nn.Module:
    hub_reachable = _resolves("huggingface.co")
    try:
        with _hub_offline(not hub_reachable):
            return _build(name, model_args, pretrained=True)
    except CorpError:
        raise
    except Exception as e:  # hub, cache and download errors come in many types
        where = "the model hub is unreachable and they are not in the local cache" if not hub_reachable else str(e)
        raise CorpError(
            f"cannot load pretrained weights for {name} ({where}); "
            "pass --checkpoint PATH, or --weights random for structure/latency work"
        ) from None


@contextlib.contextmanager
def _hub_offline(offline: bool) -> Iterator[None]:
    """Offline: look in the local hub cache only instead of retrying the network for a minute.

    Only for this load: the setting is the hub library's, process-wide, and is put back after.
    """
    if not offline:
        yield
        return
    import huggingface_hub.constants as hub

    saved, hub.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE, True
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE = saved


def _resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, 443)
        return True
    except OSError:
        return False


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors from .safetensors, or .pth/.pt/.bin via ``torch.load(weights_only=True)`` (never unpickles code)."""
    path = Path(path)
    if not path.is_file():
        raise CorpError(f"checkpoint {path} does not exist")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CorpError(f"cannot read checkpoint {path}: {str(e).splitlines()[0]}") from None
    for key in ("model", "state_dict", "model_ema"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
            break
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CorpError(f"checkpoint {path} holds no state dict of tensors")
    return state


def load_checkpoint(model: nn.Module, path: str | Path, name: str) -> None:
    """Load ``path`` strictly; a mismatch says how it does not fit instead of a tensor dump."""
    state = read_state_dict(path)
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    mismatched = [k for k in own if k in state and state[k].shape != own[k].shape]
    if missing or unexpected or mismatched:
        parts = []
        for label, keys in (("missing", missing), ("unexpected", unexpected), ("shape-mismatched", mismatched)):
            if keys:
                parts.append(f"{len(keys)} {label} (e.g. {keys[0]})")
        raise CorpError(
            f"checkpoint {path} does not fit {name}: {', '.join(parts)}; "
            "check the model name and --model-arg (e.g. img_size, num_classes)"
        )
    model.load_state_dict(state)


def check_supported(model: nn.Module, name: str) -> None:
    """Raise unless every block has timm's plain Attention and Mlp, which CORP's surgery assumes."""
    from timm.layers import Mlp
    from timm.models.vision_transformer import Attention, VisionTransformer

    if not isinstance(model, VisionTransformer):
        raise CorpError(f"{name} ({type(model).__name__}) is not supported; corp-deploy prunes {SUPPORTED}")
    for i, block in enumerate(model.blocks):
        attn, mlp = getattr(block, "attn", None), getattr(block, "mlp", None)
        problem = None
        if type(attn) is not Attention:
            problem = f"attention is {type(attn).__name__}"
        elif not isinstance(attn.q_norm, nn.Identity):
            problem = "attention uses qk_norm (a norm over the Q/K head dim cannot be pruned exactly)"
        elif type(mlp) is not Mlp:
            problem = f"MLP is {type(mlp).__name__} (gated/SwiGLU MLPs are not supported)"
        elif not isinstance(mlp.norm, nn.Identity):
            problem = "MLP has a norm over its hidden channels"
        if problem:
            raise CorpError(f"{name} is not supported: block {i} {problem}; corp-deploy prunes {SUPPORTED}")
