"""``transformers`` models: ``adapter`` (the layout every family here shares, described by names), one module per
family (``bert``, ``opt``, ``llama``, ``mistral``, ``qwen2``, ``vit``), ``modeling`` (the pruned attention and
widths; copied verbatim into remote-code folders), ``folder`` (the artifact as a transformers folder), ``hub``
(finding and loading what a user named)."""
