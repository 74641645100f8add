"""One command for a GPU machine: every CUDA path tested and measured, written as three files.

    python -m tools.gpu_suite --out DIR                        # every section (about 5 min on one H200)
    python -m tools.gpu_suite --out DIR --only tests,prune     # split over calls on a slow machine
    python -m tools.gpu_suite --out DIR --smoke --device cpu   # every code path on a tiny model, seconds (CI)
    python -m tools.gpu_suite --ingest DIR [DIR ...]           # fold the records into docs/BENCHMARKS.md

Runs from the repository root, which puts the checkout's ``corp_deploy`` on the path: nothing is installed on
the GPU machine (it has no network). Sections
(``registry.SECTIONS``) run in order, each timed and each failing alone: its traceback goes to the
log and the others still run; a time budget skips what would not finish before the machine's
command limit. DIR gets ``suite.json`` (environment, plan, per-section status and records),
``summary.md`` and ``suite.log``; ``suite.json`` is rewritten after every section, so a command
killed at its limit still returns what it measured. Wheels the GPU image lacks travel in
``.gpu-wheels/`` (``make gpu-wheels``; ``wheels.py`` says how).
"""
