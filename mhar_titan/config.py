"""The project's config sections, merged into torchtitan's JobConfig.

`train_cpt.py` passes `--job.custom_config_module=mhar_titan.config` unless the
command line names another module, so every job has these sections. Each
component adds its section here next to the code that reads it.
"""

from dataclasses import dataclass


@dataclass
class JobConfig:
    pass
