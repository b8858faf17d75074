"""mhar-titan: torchtitan extension for 8B mid-training with delta-MHAR.

Importing the package registers its train spec (`[model] name = "llama3_mhar"`),
so stock torchtitan can also run it with `--experimental.custom_import=mhar_titan`.
"""

from mhar_titan.train_spec import MODEL_NAME, train_spec

train_spec()

__all__ = ["MODEL_NAME", "train_spec"]
