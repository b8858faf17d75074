#!/usr/bin/env bash
# One node, N processes: launch/torchrun.sh [--nproc N] [--dry-run] CONFIG [--section.key value ...]
#
# N defaults to the number of visible GPUs (2 CPU processes on a host without
# one). Extra arguments override the TOML, e.g. --training.steps 100.
set -euo pipefail

usage() { sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

nproc="" dry_run=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nproc) nproc="$2"; shift 2 ;;
    --nproc=*) nproc="${1#*=}"; shift ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage 0 ;;
    *) break ;;
  esac
done
[[ $# -ge 1 ]] || usage 2
config="$1"; shift
[[ -f "$config" ]] || { echo "launch/torchrun.sh: config file not found: $config" >&2; exit 2; }

if [[ -z "$nproc" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    nproc=$(nvidia-smi -L | wc -l)
  else
    nproc=2
  fi
fi

repo=$(cd "$(dirname "$0")/.." && pwd)
python="${PYTHON:-python}"
cmd=("$python" -m torch.distributed.run
  --standalone --nnodes=1 --nproc-per-node="$nproc"
  --local-ranks-filter=0 --role=rank --tee=3
  "$repo/train_cpt.py" --job.config_file "$config" "$@")

if [[ $dry_run -eq 1 ]]; then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
exec "${cmd[@]}"
