"""The pruning algorithm: statistics (``stats``), channel ranking (``ranking``), the closed forms (``compensation``),
one block's prune and the whole-model pass (``pruner``), block-by-block calibration (``blockwise``), data-parallel
merging (``distributed``) and label-free recovery (``recover``). It sees models only through ``families``."""
