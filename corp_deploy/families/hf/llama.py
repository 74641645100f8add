"""``transformers`` Llama decoders (LlamaForCausalLM, LlamaModel; SmolLM2, TinyLlama, Llama 2/3), and the layout
Mistral and Qwen2 share (``ROPE``).

Per layer (``model.layers[i]``): SwiGLU MLP ``down_proj(act(gate_proj x) * up_proj x)``: hidden channel j is
``act(gate_j) * up_j``, so gate_proj's and up_proj's row j and down_proj's column j go together, and the MLP
statistics are down_proj's input. Attention ``self_attn.{q,k,v,o}_proj`` with grouped-query attention:
``num_key_value_heads`` K/V heads, each shared by ``num_key_value_groups`` query heads, so V channels are ranked and
kept per K/V head. RMSNorm before each sub-layer needs nothing: every fold is at a reader's input.

Biases: the readers have none, but the compensation has a constant (``x_P ~ B x_S + c``): a folded reader gets a
bias of its own when its constant is non-zero (``adds_bias``). Llama's config can say so in its own format
(``mlp_bias``/``attention_bias``, which give every Linear of the MLP / attention a bias: zero where CORP folded
none); Mistral's and Qwen2's cannot (their folders are remote code then).

Q/K: RoPE rotates q and k by the position, so ``q_S M k_S^T ~ q_P k_P^T`` with one M for all positions (the logit
compensation) does not hold; Q/K pruning is refused before any data is read. The pruned attention is
``modeling.PrunedRopeAttention`` (kind ``rope``) made a subclass of the family's own attention class.
"""

from typing import Any

from corp_deploy.families.hf.adapter import HfText, Names
from corp_deploy.families.registry import register

NAMES = Names(
    layers="layers",
    attention="self_attn",
    kind="rope",
    q="q_proj",
    k="k_proj",
    v="v_proj",
    proj="self_attn.o_proj",
    mlp_in=("mlp.gate_proj", "mlp.up_proj"),
    mlp_out="mlp.down_proj",
    mlp_field="intermediate_size",
)
ROPE: dict[str, Any] = {
    "final": ("norm",),
    "causal": True,
    "adds_bias": True,
    "refused": {"qk": "rotary positions (RoPE) break the logit compensation"},
    "positions": True,
}
"""What a rotary, SwiGLU, bias-free-reader decoder family says besides its names."""
BIAS_FLAGS = {
    "mlp_bias": ("mlp_bias", ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")),
    "proj_bias": ("attention_bias", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")),
}

register(
    HfText(
        "hf-llama",
        "transformers Llama decoders (model_type llama)",
        ("llama",),
        NAMES,
        bias_flags=BIAS_FLAGS,
        genai_type="llama",
        **ROPE,
    )
)
