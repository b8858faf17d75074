"""Paired comparison of the two arms of a pair: statistics (stats.py, validation.py), the report and plots
(report.py), the TensorBoard delta run and the command line (pair.py; `python -m mhar_titan.compare`)."""
