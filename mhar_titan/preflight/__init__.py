"""The preflight: the whole pipeline on the user's own GPUs (or 2 CPU ranks) before a long pair, one row per stage.

`python -m mhar_titan.preflight CONTROL.toml MHAR.toml` (cli.py). Importing the package does nothing.
"""
