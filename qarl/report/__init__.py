"""Reports drawn from a run's files only (metrics.jsonl), so any past run can be re-read.

`read_metrics(path)` reads a metrics.jsonl; `qarl.report.plots.plot_run` draws its curves.
This package imports nothing from `qarl.train` (the trainer imports it).
"""

from qarl.report.metrics_file import read_metrics

__all__ = ["read_metrics"]
