"""Importing this module registers the train spec: the hook for torchtitan's own entry point,
`--experimental.custom_import=mhar_titan.register`, which imports a module for exactly that effect.
It is the one module of the project whose import does something."""

from mhar_titan.train_spec import train_spec

train_spec()
