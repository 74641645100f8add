"""Model families: the interface (``base``), the registry (``registry``) and one module per family.

A family is one file: its ``Adapter`` (where the model keeps its blocks, how a block is pruned and rebuilt) ending
in ``register(...)``. ``transformers`` families sharing the usual layout (separate q/k/v Linears and an output
projection, an MLP of one or two producing Linears and one reader) describe it by names (``families.hf.adapter.Names``)
and are a registration, not code: see ``mistral.py`` and ``qwen2.py``.
"""

from corp_deploy.families.base import Adapter, BlockCall
from corp_deploy.families.registry import adapter_for, decoders, for_model_type, get, register, structure, supported

__all__ = [
    "Adapter",
    "BlockCall",
    "adapter_for",
    "decoders",
    "for_model_type",
    "get",
    "register",
    "structure",
    "supported",
]
