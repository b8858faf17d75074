"""Benchmarks: routing kernels, compile report, the training step (with a stock torchtitan arm and a trace
summary), the data loader, checkpoint checksums, and the HF load and export checks."""
