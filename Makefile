# The interface: install, test, demo, preflight, soak, lint, bench-kernels, bench-step, bench-data, bench-startup. `make test` and `make demo`
# each set up everything they need on a fresh machine.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_DIR := runs/tiny

.PHONY: install test demo preflight soak lint bench-kernels bench-step bench-data bench-startup clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# torch first: the CPU build from the local wheel store (CUDA users install theirs before).
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[dev]'
	touch $(STAMP)

# Test files spread over TEST_WORKERS processes, each file's tests in one (they share module fixtures),
# the slowest files first (tests/conftest.py's order; xdist's own reorder counts tests, not time).
TEST_WORKERS ?= 2

test: install
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

# The tiny pair, control then MHAR, each a 2-rank FSDP2 run (on CPU over gloo without a GPU).
# The tiny pair end to end: a corpus and tokenizer from this machine's Python docstrings, a random
# HF-format base, both arms loading it on 2 CPU FSDP ranks, then the paired comparison and the evaluation of
# every kept step of both arms (50, 100, 150; raw and EMA) with the base as step 0 (--once: the watcher's work, then exit).
DEMO_BASE := --model.flavor hf --model.hf_assets_path $(DEMO_DIR)/base --checkpoint.initial_load_in_hf \
	--data.mixture docstrings=0.7:$(DEMO_DIR)/data/corpus,code=0.3:$(DEMO_DIR)/data/code \
	--data.mixture_stages '121: docstrings=0.3 code=0.7'
# two mixture stages: the mixture's 70/30, then 30/70 over the last 30 of the 150 steps (docs/data.md, "Mixture stages")

demo: install
	rm -rf $(DEMO_DIR)
	$(PY) -m data.demo_corpus $(DEMO_DIR)/data
	$(PY) -m mhar_titan.hf init $(DEMO_DIR)/base --flavor tiny --tokenizer $(DEMO_DIR)/data --seed 0
	PYTHON=$(PY) launch/pair.sh --nproc 2 tiny configs/tiny_cpu.toml configs/tiny_cpu_mhar.toml $(DEMO_BASE)
	$(PY) -m mhar_titan.compare $(DEMO_DIR)
	$(PY) -m mhar_titan.eval $(DEMO_DIR) --once --tasks mhar_tiny_cloze
	@echo "Report: $(DEMO_DIR)/compare/report.md"
	@echo "TensorBoard: $(VENV)/bin/tensorboard --logdir $(DEMO_DIR)"

# The whole pipeline on this machine's GPUs before a long pair (docs/preflight.md): the
# marin8b pair where nvidia-smi lists a GPU, else the tiny pair on 2 CPU ranks; ARGS e.g. "--nproc 8 --tasks ...".
PREFLIGHT_CONFIGS ?= $(if $(shell nvidia-smi -L 2>/dev/null),configs/marin8b_control.toml configs/marin8b_mhar.toml,configs/tiny_cpu.toml configs/tiny_cpu_mhar.toml)

preflight: install
	$(PY) -m mhar_titan.preflight $(PREFLIGHT_CONFIGS) $(ARGS)

# The chaos soak (docs/health.md, "The soak"): the tiny pair under a real one-node Slurm on this machine's CPUs, with
# faults at random moments (a rank SIGKILLed, scancel, a requeue, the time-limit warning, a crash, a hang), round
# after round for SOAK_MINUTES; every value must equal an uninterrupted pair's. Needs root and Debian's slurmctld,
# slurmd and slurm-client (as .ci/run installs them); prints its seed (ARGS="--seed N" replays), ARGS e.g. "--steps 60".
SOAK_MINUTES ?= 20

soak: install
	$(PY) -m chaos.soak --minutes $(SOAK_MINUTES) $(ARGS)

# GPU only: the 8B-geometry routing microbatch, the fused kernels' eager path (the training step's
# path, the headline) and custom op vs torch.compile vs eager, with and without grad, and a sweep.
# Uses .venv when there is one, else the python3 on PATH (GPU machines bring their own torch).
bench-kernels:
	$(if $(wildcard $(PY)),$(PY),python3) -m benchmarks.bench_routing

# GPU only: the training step of stock torchtitan, our control, MHAR (triton) and MHAR (compiled
# routing) at the 8B width with 16 layers (8 where the arms do not fit 16, as on an 80 GB H100) and 8 MHAR blocks, side by side over 30 timed steps;
# `--ac full,selective,none` for other activation-checkpointing modes (python -m benchmarks.bench_step
# --smoke: CPU plumbing).
bench-step:
	$(if $(wildcard $(PY)),$(PY),python3) -m benchmarks.bench_step

# CPU: the parquet loader's sustained tokens/s per rank on shards of real text, for the demo tokenizer
# and a local 128k-id byte-level BPE (trained once, ~25 s, cached in ~/.cache/mhar-titan/bpe128k),
# 0 and 2 loader workers; ARGS e.g. "--tokenizer DIR --shards GLOB --no-bpe128k", or "--store local,s3
# --latency-ms 0,20,100" for the same shards on a local S3 server (moto) at each latency a request, beside local.
bench-data: install
	$(PY) -m benchmarks.bench_data $(ARGS)

# CPU: start-up of 64 simulated ranks over 2,048 shards at 50 ms a request: every rank reading every
# footer, rank 0 reading them and sharing, every rank (or rank 0) reading the shard index; ARGS=--s3: one
# job's start-up on a local S3 server (moto) at 0, 20 and 100 ms a request, with and without the index.
bench-startup: install
	$(PY) -m benchmarks.bench_startup $(ARGS)

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) runs *.egg-info
