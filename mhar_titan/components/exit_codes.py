"""The trainer's exit codes, which the launchers pass on to the shell and to SLURM (docs/health.md).

A module of their own so that the launcher (mhar_titan.launch) reads them without importing the trainer.
"""

REFUSED = 2  # bad input found before any work: one error line, nothing written
DATA_EXHAUSTED = 66  # EX_NOINPUT: a source read to its end under on_source_exhausted = "stop"; not requeued
LOCK_LOST = 73  # EX_CANTCREAT: another job took the run folder over; this one wrote nothing more there
REQUEUE = 75  # EX_TEMPFAIL: preempted, checkpoint written; requeue the job
HUNG = 124  # as timeout(1): no progress within the watchdog's timeout; every rank's stacks written (watchdog.py)

MEANING = {
    REFUSED: "refused before any work",
    DATA_EXHAUSTED: "a data source ran out (on_source_exhausted = stop); checkpoint written",
    LOCK_LOST: "the run folder was taken over by another job; nothing more written there",
    REQUEUE: "preempted; checkpoint written; requeue",
    HUNG: "hung: no progress within the watchdog's timeout; stacks in <dump_folder>/hangs",
}


def chosen(code: object) -> bool:
    """Whether a worker's exit code is one a job gives on purpose (sys.exit with 2 to 125: the codes above, or a hook's
    stop with a code of its own), not an uncaught exception (1) or a signal (negative)."""
    return isinstance(code, int) and 2 <= code <= 125
