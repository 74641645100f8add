"""What goes in and comes out, and what the pruning side and the libraries both read about it: the prune artifact
(``artifact``), images and text as a model takes them (``data``, ``text``), calibration and held-out inputs
(``calibration``), the metrics computed on them (``evaluation``: a decoder's perplexity; ``repetition``: greedy
continuations that loop), model sources (``sources``), the run folder ``prune-export`` writes and ``bench`` reads
(``run_folder``: its file names and sidecars), and the downloads made offline: packaged weights, datasets and text
(``offline``). A floor of data and its measures, not of I/O alone: the exporters and the bench read the core only
through it and ``families``."""
