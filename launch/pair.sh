#!/usr/bin/env bash
# launch/pair.sh [--slurm] [--dry-run] [--nproc N] [--replicate SEED|same] NAME CONTROL_CONFIG MHAR_CONFIG [--k v ...]
# The schedule-matched pair under one name: runs/NAME/control and runs/NAME/mhar, same overrides for both.
# Default: control then MHAR on this node with launch/torchrun.sh (run it again to resume; exit 75 = preempted).
# --slurm: submit both with sbatch launch/slurm.sbatch (extra sbatch options in $SBATCH_ARGS, e.g. "--nodes 2").
#
# --load-step N|common: every arm resumes from its checkpoint of step N (common: the newest step every arm has
# complete), the way to apply a change to both arms at one step (with --checkpoint.allow_changes) or roll both back.
# --replicate SEED: a third arm, runs/NAME/replicate, a second control with [data] seed SEED (another data order);
# --replicate same: with the control's own seed (what GPU nondeterminism alone moves). The comparison sets MHAR's
# delta against this A/A difference (docs/pair.md, "How sure").
# NAME: letters, digits, '.', '_', '-'. The overrides must not set --job.dump_folder (the pair sets it).
# Without --slurm the arms run one after the other; the script stops at the first arm that fails or
# is preempted and exits with its code. A rerun resumes each arm from its latest checkpoint (a
# finished arm resumes and exits at once). With --slurm, SBATCH_ARGS is split on whitespace (no
# quoting); logs go to logs/NAME-control-<jobid>.out and logs/NAME-mhar-<jobid>.out.
# --dry-run prints the commands, one per line, and runs nothing. Paths are relative to the repo root.
# RUNS_DIR (default runs) is the parent folder of the pair.
set -euo pipefail

me=launch/pair.sh
usage() { sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
die() { echo "$me: $*" >&2; exit 2; }

slurm=0 dry_run=0 nproc="" replicate="" load_step=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --slurm) slurm=1; shift ;;
    --dry-run) dry_run=1; shift ;;
    --nproc)
      [[ $# -ge 2 && -n "$2" ]] || die "--nproc needs a value"
      nproc="$2"; shift 2 ;;
    --nproc=*) nproc="${1#*=}"; shift ;;
    --replicate)
      [[ $# -ge 2 && -n "$2" ]] || die "--replicate needs a seed or 'same'"
      replicate="$2"; shift 2 ;;
    --replicate=*) replicate="${1#*=}"; shift ;;
    --load-step)
      [[ $# -ge 2 && -n "$2" ]] || die "--load-step needs a step or 'common'"
      load_step="$2"; shift 2 ;;
    --load-step=*) load_step="${1#*=}"; shift ;;
    -h|--help) usage 0 ;;
    --) shift; break ;;
    -*) die "unknown option: $1" ;;
    *) break ;;
  esac
done
[[ $# -ge 3 ]] || usage 2
name="$1" control="$2" mhar="$3"; shift 3
cd "$(dirname "$0")/.."  # the repo root: configs and runs/ are relative to it

[[ "$name" =~ ^[A-Za-z0-9._-]+$ && "$name" != . && "$name" != .. ]] \
  || die "bad NAME '$name': use letters, digits, '.', '_' and '-'"
[[ -f "$control" ]] || die "control config not found: $control"
[[ -f "$mhar" ]] || die "MHAR config not found: $mhar"
[[ -z "$replicate" || "$replicate" == same || "$replicate" =~ ^[0-9]+$ ]] \
  || die "--replicate takes a data-order seed (a non-negative integer) or 'same', got '$replicate'"
[[ -z "$load_step" || "$load_step" == common || "$load_step" =~ ^[0-9]+$ ]] \
  || die "--load-step takes a step (a non-negative integer) or 'common', got '$load_step'"
if [[ -n "$nproc" ]]; then
  [[ "$nproc" =~ ^[1-9][0-9]*$ ]] || die "--nproc must be a positive integer, got '$nproc'"
  [[ $slurm -eq 0 ]] || die "--nproc is for local runs; with --slurm pass SBATCH_ARGS='--gpus-per-node N'"
fi
for arg in "$@"; do
  case "$arg" in
    --job.dump_folder|--job.dump_folder=*|--job.dump-folder|--job.dump-folder=*)
      die "$arg: the pair sets the dump folders itself (runs/$name/control, runs/$name/mhar)" ;;
  esac
done

# A checkpoint folder outside the run folder (an absolute path or a store URL, e.g. --checkpoint.folder s3://b/runs/x)
# would be one folder for both arms: each arm gets its own below it (s3://b/runs/x/control, .../mhar).
own_folder() { case "$1" in /*|*://*) printf '%s/%s' "${1%/}" "$2" ;; *) printf '%s' "$1" ;; esac; }
split_folder=""
arm_overrides() {  # ARM OVERRIDES... -> the array arm_args
  local arm="$1"; shift
  arm_args=()
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --checkpoint.folder)
        [[ $# -ge 2 && -n "$2" ]] || die "--checkpoint.folder needs a value"
        arm_args+=("$1" "$(own_folder "$2" "$arm")")
        if [[ "$2" != "$(own_folder "$2" "$arm")" ]]; then split_folder="$2"; fi
        shift 2 ;;
      --checkpoint.folder=*)
        arm_args+=("--checkpoint.folder=$(own_folder "${1#*=}" "$arm")")
        if [[ "${1#*=}" != "$(own_folder "${1#*=}" "$arm")" ]]; then split_folder="${1#*=}"; fi
        shift ;;
      *) arm_args+=("$1"); shift ;;
    esac
  done
}
overridden=0
for arg in "$@"; do [[ "$arg" != --checkpoint.folder && "$arg" != --checkpoint.folder=* ]] || overridden=1; done
if [[ $overridden -eq 0 ]]; then
  # Both configs naming one folder outside their run folders: refused before either arm starts.
  python=$(launch/torchrun.sh --print-python "$control")
  folders=$("$python" -c '
import sys, tomllib
for path in sys.argv[1:]:
    with open(path, "rb") as f:
        print(tomllib.load(f).get("checkpoint", {}).get("folder", "checkpoint"))
' "$control" "$mhar") || die "cannot read [checkpoint] folder from $control and $mhar with $python"
  mapfile -t folders <<<"$folders"
  if [[ "${folders[0]}" == "${folders[1]}" && "${folders[0]}" != "$(own_folder "${folders[0]}" x)" ]]; then
    die "$control and $mhar both checkpoint to ${folders[0]}: one folder for two runs; give each its own, or pass --checkpoint.folder ${folders[0]} to split it per arm"
  fi
fi

runs="${RUNS_DIR:-runs}/$name"  # RUNS_DIR: another parent folder (absolute, or relative to the repo root)
arms=(control mhar)
declare -A config_of=([control]="$control" [mhar]="$mhar" [replicate]="$control")
[[ -z "$replicate" ]] || arms+=(replicate)
if [[ "$load_step" == common ]]; then  # the newest step complete (.metadata written last) in every arm's run folder
  load_step=""
  for meta in $(ls -d "$runs/control/checkpoint"/step-*/.metadata 2>/dev/null | sed 's|.*/step-\([0-9]*\)/.metadata|\1|' | sort -rn); do
    every=1
    for arm in "${arms[@]}"; do [[ -f "$runs/$arm/checkpoint/step-$meta/.metadata" ]] || every=0; done
    if [[ $every -eq 1 ]]; then load_step="$meta"; break; fi
  done
  [[ -n "$load_step" ]] || die "--load-step common: no checkpoint step is complete in every arm (${arms[*]}) under $runs"
fi

cmds=()  # one shell-quoted command per arm
# W&B (when enabled): project mhar-titan (or $WANDB_PROJECT), the pair's name as the group, one run
# per arm named control / mhar, each resumed on restart (launch/torchrun.sh derives its id from the
# arm's folder; sbatch passes this environment on to the job).
export WANDB_PROJECT="${WANDB_PROJECT:-mhar-titan}" WANDB_RUN_GROUP="$name"
unset WANDB_RUN_ID WANDB_RUN_NAME  # one per arm, not one for both
for arm in "${arms[@]}"; do
  arm_overrides "$arm" "$@"
  if [[ $arm == replicate && $replicate != same ]]; then arm_args+=(--data.seed "$replicate"); fi  # last: it wins
  if [[ -n "$load_step" ]]; then arm_args+=(--checkpoint.load_step "$load_step"); fi
  if [[ $slurm -eq 1 ]]; then
    read -ra sbatch_args <<<"${SBATCH_ARGS:-}"
    cmd=(sbatch --job-name "$name-$arm" ${sbatch_args[@]+"${sbatch_args[@]}"}
      launch/slurm.sbatch "${config_of[$arm]}" --job.dump_folder "$runs/$arm" ${arm_args[@]+"${arm_args[@]}"})
  else
    cmd=(launch/torchrun.sh ${nproc:+--nproc "$nproc"}
      "${config_of[$arm]}" --job.dump_folder "$runs/$arm" ${arm_args[@]+"${arm_args[@]}"})
  fi
  cmds+=("$(printf '%q ' "${cmd[@]}")")
done

info() {
  local again="the control again, data seed $replicate"
  [[ "$replicate" != same ]] || again="the control again, its own data seed"
  echo "# runs: $runs/control and $runs/mhar${replicate:+, and $runs/replicate ($again)}"
  [[ -z "$load_step" ]] || echo "# every arm resumes from its checkpoint of step $load_step"
  [[ -z "$split_folder" ]] || echo "# checkpoints: ${split_folder%/}/control and ${split_folder%/}/mhar (one folder an arm)"
  [[ $slurm -eq 0 ]] || echo "# logs: logs/$name-control-<jobid>.out and logs/$name-mhar-<jobid>.out"
  echo "# TensorBoard: tensorboard --logdir $runs"
  echo "# compare: python -m mhar_titan.compare $runs"
}

if [[ $dry_run -eq 1 ]]; then
  printf '%s\n' "${cmds[@]}"
  info >&2
  exit 0
fi

info >&2
if [[ $slurm -eq 1 ]]; then
  mkdir -p logs  # sbatch does not create the folder of --output (a checkout has it: logs/.gitignore)
  # A request no node can satisfy would wait in the queue for ever (PartitionConfig): ask the scheduler first.
  read -ra sbatch_args <<<"${SBATCH_ARGS:-}"
  if ! answer=$(sbatch --test-only ${sbatch_args[@]+"${sbatch_args[@]}"} launch/slurm.sbatch "$control" 2>&1); then
    answer=$(printf '%s' "$answer" | tr '\n' ' ')
    die "no node can run the arms as asked (sbatch --test-only ${SBATCH_ARGS:-}: ${answer% }); on nodes without GPUs: SBATCH_ARGS=--gpus-per-node=0"
  fi
fi

# SIGTERM/SIGUSR1 go on to the running arm (torchrun.sh turns them into a checkpoint and exit 75);
# Ctrl-C reaches it directly (same process group).
child=""
forward() { [[ -z "$child" ]] || kill -s "$1" "$child" 2>/dev/null || true; }
trap 'forward TERM' TERM
trap 'forward USR1' USR1
trap ':' INT
for i in "${!arms[@]}"; do
  echo "$me: ${cmds[i]}" >&2
  ( trap - INT QUIT; eval "exec ${cmds[i]}" ) &
  child=$!
  while :; do
    if wait "$child"; then rc=0; else rc=$?; fi
    kill -0 "$child" 2>/dev/null || break
  done
  if wait "$child"; then rc=0; else rc=$?; fi
  child=""
  if [[ $rc -ne 0 ]]; then
    if [[ $rc -eq 75 ]]; then
      echo "$me: the ${arms[i]} arm was preempted (checkpointed); rerun the same command to resume" >&2
    else
      echo "$me: the ${arms[i]} arm failed (exit $rc); stopping" >&2
    fi
    exit "$rc"
  fi
done
if [[ $slurm -eq 0 ]]; then
  echo "$me: all ${#arms[@]} arms done; python -m mhar_titan.compare $runs" >&2
fi
