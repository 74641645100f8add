"""Apps: scripts that orchestrate pruning, export and measurement (the top of the house; they may import anything).

Each runs as ``python -m bench.apps.<name>`` (the Makefile targets call them); nothing below imports them.
``real`` is the real-weights setup the studies and ``corp-deploy demo`` share.
"""
