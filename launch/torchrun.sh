#!/usr/bin/env bash
# launch/torchrun.sh [--nproc N] [--nnodes N --rdzv-endpoint HOST:PORT [--rdzv-id ID]] [--launch-id ID]
#                    [--dry-run|--print-dump-folder] CONFIG [--section.key value ...]
# N processes per node (default: the visible GPUs, or 2 CPU processes without one); one node unless --nnodes > 1.
# Overrides go to the TOML (e.g. --training.steps 100). SIGTERM/SIGUSR1 -> <dump_folder>/STOP; exit 75 = requeue.
# A crash or a hang is relaunched from the last checkpoint within [job] max_restarts (docs/health.md).
#
# One node runs torchrun --standalone; with --nnodes > 1 every node runs this script with the same
# --rdzv-endpoint (a host of the allocation, any free port) and --rdzv-id, and torchrun meets over c10d.
#
# Preemption: the script runs torchrun in the background. On SIGTERM or SIGUSR1 it writes its launch id
# into <dump_folder>/STOP, so the trainer checkpoints at the next step boundary, writes
# <dump_folder>/preempted.json and exits; the script then exits 75 (requeue) when that marker is
# new since the launch, else with torchrun's own exit code. Ctrl-C reaches torchrun directly,
# as before. The dump folder is --job.dump_folder from the overrides, else [job] dump_folder from
# CONFIG, else torchtitan's default ./outputs; relative to the current directory (the repo root).
# The launch id (MHAR_LAUNCH_ID in the workers' environment) is --launch-id (slurm.sbatch passes one per
# job run, the same on every node), else made here (from the rendezvous with --nnodes > 1, so that every
# node has the same): the trainer obeys a STOP that carries it, even one written before it started, and
# removes a STOP that carries another (left by an earlier job).
#
# --dry-run prints the torchrun command on stdout (and the dump folder on stderr) and runs nothing;
# --print-dump-folder prints the dump folder only, --print-python the interpreter. The interpreter: $PYTHON if set, else the
# repository's .venv/bin/python (what `make install` creates), else python3 or python on PATH.
set -euo pipefail

me=launch/torchrun.sh
REQUEUE_EXIT_CODE=75
HUNG_EXIT_CODE=124
usage() { sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
die() { echo "$me: $*" >&2; exit 2; }
need_value() { [[ $# -ge 2 && -n "$2" && "$2" != --* ]] || die "$1 needs a value"; }
positive_int() { [[ "$2" =~ ^[1-9][0-9]*$ ]] || die "$1 must be a positive integer, got '$2'"; }

nproc="" nnodes=1 rdzv_endpoint="" rdzv_id="" launch_id="" dry_run=0 print_dump=0 print_python=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nproc|--nnodes|--rdzv-endpoint|--rdzv-id|--launch-id)
      need_value "$@"
      case "$1" in
        --nproc) nproc="$2" ;;
        --nnodes) nnodes="$2" ;;
        --rdzv-endpoint) rdzv_endpoint="$2" ;;
        --rdzv-id) rdzv_id="$2" ;;
        --launch-id) launch_id="$2" ;;
      esac
      shift 2 ;;
    --nproc=*) nproc="${1#*=}"; shift ;;
    --nnodes=*) nnodes="${1#*=}"; shift ;;
    --rdzv-endpoint=*) rdzv_endpoint="${1#*=}"; shift ;;
    --rdzv-id=*) rdzv_id="${1#*=}"; shift ;;
    --launch-id=*) launch_id="${1#*=}"; shift ;;
    --dry-run) dry_run=1; shift ;;
    --print-dump-folder) print_dump=1; shift ;;
    --print-python) print_python=1; shift ;;
    -h|--help) usage 0 ;;
    *) break ;;
  esac
done
[[ $# -ge 1 ]] || usage 2
config="$1"; shift
[[ -f "$config" ]] || die "config file not found: $config"
[[ -z "$nproc" ]] || positive_int --nproc "$nproc"
positive_int --nnodes "$nnodes"
[[ -z "$launch_id" || "$launch_id" =~ ^[A-Za-z0-9._:-]+$ ]] \
  || die "--launch-id must be letters, digits, '.', '_', ':' or '-', got '$launch_id'"
if [[ $nnodes -gt 1 ]]; then
  [[ -n "$rdzv_endpoint" ]] || die "--nnodes $nnodes needs --rdzv-endpoint HOST:PORT (the same on every node)"
  [[ "$rdzv_endpoint" =~ ^[^:[:space:]]+:[0-9]+$ ]] || die "--rdzv-endpoint must be HOST:PORT, got '$rdzv_endpoint'"
fi

repo=$(cd "$(dirname "$0")/.." && pwd)
if [[ -n "${PYTHON:-}" ]]; then
  python="$PYTHON"
elif [[ -x "$repo/.venv/bin/python" ]]; then
  python="$repo/.venv/bin/python"
elif command -v python3 >/dev/null 2>&1; then
  python=python3
elif command -v python >/dev/null 2>&1; then
  python=python
else
  die "no Python: no \$PYTHON, no $repo/.venv (make install creates it) and no python3 or python on PATH; set PYTHON=/path/to/python (the environment with torch and mhar-titan installed)"
fi
[[ "${MARKER_WAIT_S:-10}" =~ ^[0-9]+$ ]] || die "MARKER_WAIT_S must be a whole number of seconds, got '$MARKER_WAIT_S'"
if [[ $print_python -eq 1 ]]; then
  printf '%s\n' "$python"
  exit 0
fi

# The dump folder, as the trainer will see it: the last --job.dump_folder override wins.
dump=""
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    --job.dump_folder|--job.dump-folder)
      [[ $((i + 1)) -lt ${#args[@]} ]] || die "${args[i]} needs a value"
      dump="${args[i + 1]}" ;;
    --job.dump_folder=*|--job.dump-folder=*) dump="${args[i]#*=}" ;;
  esac
done
if [[ -z "$dump" ]]; then
  dump=$("$python" -c '
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    print(tomllib.load(f).get("job", {}).get("dump_folder", ""))
' "$config") || die "cannot read [job] dump_folder from $config with $python (set PYTHON, or pass --job.dump_folder)"
  dump="${dump:-./outputs}"
fi

if [[ $print_dump -eq 1 ]]; then
  printf '%s\n' "$dump"
  exit 0
fi

if [[ -z "$nproc" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    nproc=$(nvidia-smi -L | wc -l)
  else
    nproc=2
  fi
fi

if [[ $nnodes -gt 1 ]]; then
  rdzv=(--rdzv-backend=c10d --rdzv-endpoint="$rdzv_endpoint" --nnodes="$nnodes")
  [[ -z "$rdzv_id" ]] || rdzv+=(--rdzv-id="$rdzv_id")
else
  rdzv=(--standalone --nnodes=1)
fi
cmd=("$python" -m mhar_titan.launch
  "${rdzv[@]}" --nproc-per-node="$nproc"
  --local-ranks-filter=0 --role=rank --tee=3
  "$repo/train_cpt.py" --job.config_file "$config" "$@")

# W&B (when [metrics] enable_wandb): one run per dump folder, resumed on every restart, named after
# the folder; launch/pair.sh adds the pair's group. A WANDB_* variable set beforehand wins.
case "$dump" in /*) abs_dump="$dump" ;; *) abs_dump="$PWD/$dump" ;; esac
export WANDB_PROJECT="${WANDB_PROJECT:-mhar-titan}"
run_name="${abs_dump%/}" && run_name="${run_name##*/}"
sum=$(printf '%s' "$abs_dump" | cksum) && sum="${sum%% *}"
export WANDB_RUN_NAME="${WANDB_RUN_NAME:-$run_name}"
export WANDB_RUN_ID="${WANDB_RUN_ID:-${run_name//[^A-Za-z0-9_-]/_}-$sum}"
export WANDB_RESUME="${WANDB_RESUME:-allow}"
if [[ -z "$launch_id" && $nnodes -gt 1 ]]; then
  launch_id="rdzv-${rdzv_id:-0}-$rdzv_endpoint"  # the same on every node: any node's launcher may write STOP
fi
launch_id="${launch_id:-$(hostname)-$$-$(date +%s)}"
export MHAR_LAUNCH_ID="$launch_id"

if [[ $dry_run -eq 1 ]]; then
  printf '%q ' "${cmd[@]}"; echo
  echo "# dump_folder: $dump" >&2
  echo "# W&B, if enabled: project $WANDB_PROJECT, group ${WANDB_RUN_GROUP:-(none)}, run $WANDB_RUN_NAME, id $WANDB_RUN_ID" >&2
  echo "# launch id: $launch_id" >&2
  echo "# on SIGTERM/SIGUSR1: write the launch id to $dump/STOP; exit $REQUEUE_EXIT_CODE if $dump/preempted.json is new, else torchrun's code" >&2
  exit 0
fi

# Identity of the marker before the launch: a marker left by an older job must not count.
marker="$dump/preempted.json"
marker_id() { stat -c '%i %y %s' "$marker" 2>/dev/null || echo none; }
marker_before=$(marker_id)
marker_is_new() { [[ -f "$marker" && "$(marker_id)" != "$marker_before" ]]; }

# A STOP left in the folder is not removed here: the trainer, once it holds the run folder's lock,
# removes one written by another launch and obeys one written by this one.
# shellcheck disable=SC2329  # called from the traps below
stopping=0  # a signal asked the job to stop: it is not restarted
request_stop() {
  stopping=1
  echo "$me: got SIG$1; asking the trainer to checkpoint and stop ($dump/STOP)" >&2
  { mkdir -p "$dump" && printf '%s\n' "$launch_id" >"$dump/.STOP.$$" && mv -f "$dump/.STOP.$$" "$dump/STOP"; } \
    || echo "$me: could not write $dump/STOP" >&2
}
trap 'request_stop TERM' TERM
trap 'request_stop USR1' USR1
trap ':' INT  # Ctrl-C reaches torchrun itself (same process group); keep waiting for it to finish

while :; do
  launched=$(date +%s)
  # The child gets default signal dispositions (a plain `cmd &` would ignore SIGINT).
  ( trap - INT QUIT; exec "${cmd[@]}" ) &
  child=$!

  # `wait` returns early when a trapped signal arrives: wait until the child has really exited.
  while :; do
    if wait "$child"; then rc=0; else rc=$?; fi
    kill -0 "$child" 2>/dev/null || break
  done
  if wait "$child"; then rc=0; else rc=$?; fi  # the child's own status, even if the last wait was interrupted

  # With several nodes the marker is written by global rank 0, maybe on another node: give a shared
  # file system up to MARKER_WAIT_S seconds (default 10) to show it.
  if [[ $rc -ne 0 && $nnodes -gt 1 ]] && ! marker_is_new; then
    for ((waited = 0; waited < ${MARKER_WAIT_S:-10}; waited++)); do
      ls "$dump" >/dev/null 2>&1 || true
      marker_is_new && break
      sleep 1
    done
  fi
  if marker_is_new; then
    echo "$me: the trainer checkpointed and stopped ($marker); exit $REQUEUE_EXIT_CODE to requeue" >&2
    exit "$REQUEUE_EXIT_CODE"
  fi
  # A crash (1) or a hang (124): recorded, and started again from the last checkpoint within [job] max_restarts
  # (python -m mhar_titan.restarts says whether and when); under SLURM the job is requeued instead (slurm.sbatch).
  if [[ ($rc -eq 1 || $rc -eq $HUNG_EXIT_CODE) && $stopping -eq 0 && "${MHAR_RESTARTS_BY:-}" != slurm ]]; then
    decision=$("$python" -m mhar_titan.restarts "$rc" "$launched" "$config" "$@") || decision=stop
    if [[ "$decision" == restart\ * ]]; then
      sleep "${decision#restart }" & wait $! || true  # a signal meanwhile stops here
      [[ $stopping -eq 0 ]] || exit "$rc"
      marker_before=$(marker_id)
      continue
    fi
  fi
  exit "$rc"
done
