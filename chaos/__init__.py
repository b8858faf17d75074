"""The pair under faults: a real one-node Slurm, a fault schedule drawn from a seed, and the soak that runs the tiny
pair through both and checks that nothing computed changes (`make soak`, docs/health.md)."""
