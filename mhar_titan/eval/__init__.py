"""Evaluation of a pair with lm-evaluation-harness on standard tasks, a named suite (suites.py) or the offline demo
task (tasks.py): one step (pair.py) or every kept step while the pair runs (watch.py, store.py, progress.py);
the command line is `python -m mhar_titan.eval` (cli.py)."""
