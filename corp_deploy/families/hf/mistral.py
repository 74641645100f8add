"""``transformers`` Mistral decoders (MistralForCausalLM): Llama's layout and names, with a sliding attention
window the pruned attention keeps (``config.sliding_window``)."""

from corp_deploy.families.hf.adapter import HfText
from corp_deploy.families.hf.llama import NAMES, ROPE
from corp_deploy.families.registry import register

register(
    HfText(
        "hf-mistral",
        "transformers Mistral decoders (model_type mistral)",
        ("mistral",),
        NAMES,
        genai_type="mistral",
        **ROPE,
    )
)
