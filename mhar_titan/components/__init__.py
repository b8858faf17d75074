"""Training components, one concern per module: loss, optimizer, LR schedule, EMA, validation, checkpoints and
their checksums, the run fingerprint, preemption, worker lifetime, step metrics and routing statistics."""
