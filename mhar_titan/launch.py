"""torchrun for train_cpt.py that keeps the trainer's exit codes: `python -m mhar_titan.launch` takes torchrun's
arguments (launch/torchrun.sh runs it).

torchrun reports any worker's failure as exit 1, with a ChildFailedError traceback after the worker's own lines. For
the codes a job gives on purpose, with sys.exit (the trainer's own, mhar_titan.components.exit_codes: refused 2, data
exhausted 66, requeue 75; and a hook's stop with a code of its own: docs/extending.md) the job has already said why in
its log, so this exits with that code and adds nothing; any other failure (an uncaught exception: 1, a signal) is
torchrun's as before: its summary naming the rank and error file, exit 1.

SIGTERM and SIGUSR1, which a cluster sends to every process of the job, torchrun included, go on to the workers
(they checkpoint and stop) while torchrun waits for them, instead of shutting them down within 30 s
(mhar_titan.components.signals). Ctrl-C still stops everything at once.
"""

from __future__ import annotations

import logging
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.run import parse_args, run

from mhar_titan.components.exit_codes import chosen
from mhar_titan.components.signals import agent_passes_signals

AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"


class _TrainerExits(logging.Filter):
    """Drops the agent's "failed (exitcode: N) local_rank: ..." line where the job chose N: its own lines said why."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return not (msg.startswith("failed (exitcode: ") and record.args and chosen(record.args[0]))


def trainer_exit_code(error: ChildFailedError) -> int | None:
    """The first failed worker's exit code when the job chose it (the others were then stopped by the agent or
    exited alike), else None."""
    _, first = error.get_first_failure()
    return first.exitcode if chosen(first.exitcode) else None


@record
def main(argv: list[str] | None = None) -> None:
    """torch.distributed.run.main, with the trainer's exit codes passed on (follows torch/distributed/run.py)."""
    logging.getLogger(AGENT_LOGGER).addFilter(_TrainerExits())
    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.signals_to_handle = agent_passes_signals(args.signals_to_handle)
    try:
        run(args)
    except ChildFailedError as e:
        code = trainer_exit_code(e)
        if code is None:
            raise
        sys.exit(code)


if __name__ == "__main__":
    main()
