"""``transformers`` Qwen2 / Qwen2.5 decoders (Qwen2ForCausalLM): Llama's layout and names with biases on q, k and v
(kept with their rows) and per-layer sliding windows (kept by the pruned attention)."""

from corp_deploy.families.hf.adapter import HfText
from corp_deploy.families.hf.llama import NAMES, ROPE
from corp_deploy.families.registry import register

register(
    HfText("hf-qwen2", "transformers Qwen2 decoders (model_type qwen2)", ("qwen2",), NAMES, genai_type="qwen2", **ROPE)
)
