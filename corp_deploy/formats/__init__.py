"""What goes in and comes out: the prune artifact (``artifact``), images and text as a model takes them (``data``,
``text``), calibration and held-out inputs (``calibration``), evaluation (``evaluation``, ``perplexity``), model
sources (``sources``), the run folder ``prune-export`` writes and ``bench`` reads (``run_folder``: its file names and
sidecars) and the packaged offline weights and datasets (``offline``). The exporters and the bench read
the core only through this floor and ``families``."""
