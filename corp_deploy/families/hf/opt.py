"""``transformers`` OPT decoders (OPTForCausalLM, OPTModel): the paper's OPT-1.3B layout.

Per layer (``model.decoder.layers[i]``): MLP ``fc1 -> ReLU -> fc2``; attention ``self_attn.{q,k,v}_proj`` and
``self_attn.out_proj``, all with biases (``enable_bias``; a model built without them cannot take a compensated V
fold, refused before any data is read). Positions are learned and absolute (added to the input embedding), so the
Q/K logit compensation holds as for BERT; the attention is causal, so the Q/K statistics count the (query, key)
pairs with key <= query. OPT scales q right after ``q_proj`` by the DENSE head dim's ``scaling``; the pruned
attention (``modeling.PrunedOptAttention``, kind ``opt``) keeps that scale. Pre-LN (125m, >= 1.3b) and post-LN
(350m) layers alike: the compensation folds into ``fc2`` and ``out_proj``, whose outputs go to the residual sum
either way; 350m's ``project_in``/``project_out`` lie outside the layers and are untouched (``project_out`` is
applied after the final norm, as the model does).
"""

from corp_deploy.families.hf.adapter import HfText, Names
from corp_deploy.families.registry import register

NAMES = Names(
    layers="decoder.layers",
    attention="self_attn",
    kind="opt",
    q="q_proj",
    k="k_proj",
    v="v_proj",
    proj="self_attn.out_proj",
    mlp_in=("fc1",),
    mlp_out="fc2",
    mlp_field="ffn_dim",
)

register(
    HfText(
        "hf-opt",
        "transformers OPT decoders (model_type opt)",
        ("opt",),
        NAMES,
        final=("decoder.final_layer_norm", "decoder.project_out"),
        causal=True,
        genai_type="decoder",
    )
)
