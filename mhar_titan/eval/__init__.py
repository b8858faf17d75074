"""Evaluation of a pair with lm-evaluation-harness (pair.py) on standard tasks or the offline demo task
(tasks.py); the command line is `python -m mhar_titan.eval`."""
