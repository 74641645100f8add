"""Applications built on the API: the sparsity/speed sweep (``sweep``), the offline demo (``demo``) and the real
DINOv2-S model and probe task they share (``real``)."""
