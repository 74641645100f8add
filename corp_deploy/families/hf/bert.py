"""``transformers`` BERT-family encoders (BertModel, RobertaModel and their task heads).

Per layer (``encoder.layer[i]``): MLP ``intermediate.dense -> act -> output.dense``; attention
``attention.self.{query,key,value}`` (separate Linears with biases) and ``attention.output.dense`` beside it
reading the head outputs. Post-LN: ``output.dense`` and ``attention.output.dense`` feed ``LayerNorm(x +
residual)``, so folding the compensation into them is exact. Positions are learned and absolute (added to the
input), so the Q/K logit compensation applies unchanged. A pruned ``attention.self`` is
``modeling.PrunedSelfAttention`` (kind ``bert``): same parameter names, Q/K and V head widths of its own, the
dense softmax scale.
"""

from corp_deploy.families.hf.adapter import HfText, Names
from corp_deploy.families.registry import register

NAMES = Names(
    layers="encoder.layer",
    attention="attention.self",
    kind="bert",
    q="query",
    k="key",
    v="value",
    proj="attention.output.dense",
    mlp_in=("intermediate.dense",),
    mlp_out="output.dense",
    mlp_field="intermediate_size",
)

register(HfText("hf-bert", "transformers BERT-family encoders (model_type bert, roberta)", ("bert", "roberta"), NAMES))
