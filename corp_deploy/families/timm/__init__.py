"""timm vision transformers: ``vit`` (the family), ``models`` (names, aliases, weights), ``modules`` (the pruned
modules a timm ViT is rebuilt with)."""
