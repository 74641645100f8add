"""How wide each block stays: width allocation under a budget (``allocation``), measured sensitivity
(``sensitivity``), the latency table (``latency``) and the measured speed loop (``speed``), and the pruning report
(``report``)."""
