#!/usr/bin/env bash
#SBATCH --job-name=moe-dispatch-bench
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --time=00:30:00
#SBATCH --exclusive
#SBATCH --output=moe-dispatch-bench-%j.out
# moe-dispatch-bench on a Slurm allocation: srun starts one task per node, each runs
# run_torchrun.sh, which starts one rank per GPU with torchrun (node rank = SLURM_NODEID,
# MASTER_ADDR = the allocation's first host), the way PyTorch and Megatron-LM jobs launch.
# Submit from the repository root (Slurm runs a copy of this file from its spool folder, so
# the checkout is found as $MOE_DISPATCH_REPO, else this file's folder, else SLURM_SUBMIT_DIR);
# options given to sbatch override the #SBATCH lines above:
#
#   sbatch [--nodes N] [--gpus-per-node G] [--partition P] [--account A] [--time T] \
#       benchmarks/multinode/sbatch_bench.sh [options] [-- moe-dispatch-bench arguments]
#
#   --rdzv static|c10d  how the nodes meet (default static; see run_torchrun.sh --help)
#   --rdzv-timeout-s S  how long the nodes wait for each other at start (default 300)
#   --wall-s S          bound on the run (default: the job's time left minus 90 s where Slurm
#                       says, else 1650); each node stops itself then and says so
#   --log-dir DIR       per-node logs and bench.json (default bench_results/multinode/job-<id>
#                       under the submit folder; a shared file system is assumed)
#   --no-env-report     skip `python -m moe_dispatch.env` on every node
#   --dry-run           print the layout, the environment, the srun command and node 0's
#                       torchrun command; run nothing; exit 0 (works inside salloc too)
#   -h, --help          this text
#
# sbatch exports the submitting shell's environment (NCCL_*, NVSHMEM_*, PYTHON, a venv's PATH)
# to every node; set the transports' variables before submitting. Exit status: srun's (0 when
# every node passed); a failure prints each node's "FAILED on node" line from its log.
set -euo pipefail

TAG="[sbatch_bench]"
fail() { echo "$TAG FAILED (job ${SLURM_JOB_ID:-?}, batch host ${HOSTNAME:-?}), step '$1': $2" >&2; exit "${3:-2}"; }
usage() { sed -n '/^# moe-dispatch-bench on a Slurm/,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

RDZV="static" RDZV_TIMEOUT_S=300 WALL_S="" LOG_DIR="" ENV_REPORT=1 DRY_RUN=0
BENCH_ARGS=()
need_value() { [[ $# -ge 2 && -n "$2" ]] || fail arguments "$1 needs a value (see --help)"; }
[[ "${1:-}" == -h || "${1:-}" == --help ]] && { usage; exit 0; }  # before the checkout is needed

# -- the checkout ----------------------------------------------------------------------------
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ -n "${MOE_DISPATCH_REPO:-}" ]]; then REPO="$MOE_DISPATCH_REPO"
elif [[ -f "$SCRIPT_DIR/run_torchrun.sh" ]]; then REPO="$(cd "$SCRIPT_DIR/../.." && pwd)"
else REPO="${SLURM_SUBMIT_DIR:-$PWD}"
fi
LAUNCHER="$REPO/benchmarks/multinode/run_torchrun.sh"
[[ -f "$LAUNCHER" ]] || fail checkout "no $LAUNCHER: submit from the repository root or set MOE_DISPATCH_REPO"
# shellcheck source=launch_options.sh source-path=SCRIPTDIR
source "$REPO/benchmarks/multinode/launch_options.sh"

while [[ $# -gt 0 ]]; do
  if node_option "$@"; then shift "$OPTION_WORDS"; continue; fi
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --) shift; BENCH_ARGS=("$@"); break ;;
    *) fail arguments "unknown option '$1' (benchmark arguments go after --; see --help)" ;;
  esac
done

# -- the allocation --------------------------------------------------------------------------
NNODES="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-}}"
[[ -n "$NNODES" && -n "${SLURM_JOB_NODELIST:-}" ]] ||
  fail allocation "not inside a Slurm allocation (no SLURM_JOB_NUM_NODES / SLURM_JOB_NODELIST): submit with sbatch, or run inside salloc"
if [[ -n "${SLURM_GPUS_ON_NODE:-}" ]]; then GPUS="$SLURM_GPUS_ON_NODE"
elif [[ -n "${SLURM_GPUS_PER_NODE:-}" ]]; then GPUS="${SLURM_GPUS_PER_NODE##*:}"  # "[type:]count"
else fail allocation "the job has no GPUs per node (SLURM_GPUS_ON_NODE / SLURM_GPUS_PER_NODE unset): submit with --gpus-per-node"
fi
[[ "$GPUS" =~ ^[1-9][0-9]*$ ]] || fail allocation "cannot read a GPU count from '$GPUS'"
command -v scontrol > /dev/null || fail allocation "scontrol is not on PATH"
mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
[[ ${#HOSTS[@]} -gt 0 && -n "${HOSTS[0]}" ]] || fail allocation "scontrol show hostnames '$SLURM_JOB_NODELIST' gave no host"
(( ${#HOSTS[@]} == NNODES )) || fail allocation "SLURM_JOB_NODELIST has ${#HOSTS[@]} hosts but the job has $NNODES nodes"
MASTER_ADDR="${HOSTS[0]}"  # the batch script runs on the first node, which hosts the rendezvous
MASTER_PORT="${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-9500} % 10000))}"
export MASTER_ADDR MASTER_PORT

# Time left in the job, where Slurm exports its end (SLURM_JOB_END_TIME, epoch seconds).
LEFT_S=""
[[ "${SLURM_JOB_END_TIME:-}" =~ ^[0-9]+$ ]] && LEFT_S=$((SLURM_JOB_END_TIME - $(date +%s)))
if [[ -z "$WALL_S" ]]; then
  if [[ -n "$LEFT_S" ]]; then WALL_S=$((LEFT_S - 90)); else WALL_S=1650; fi
fi
if ! [[ "$WALL_S" =~ ^[0-9]+$ ]] || (( WALL_S < 60 )); then
  fail arguments "--wall-s must be >= 60 s, got '$WALL_S' (time left in the job: ${LEFT_S:-unknown} s)"
fi
LOG_DIR="${LOG_DIR:-${SLURM_SUBMIT_DIR:-$PWD}/bench_results/multinode/job-${SLURM_JOB_ID:-local}}"

NODE_ARGS=(--nnodes "$NNODES" --nproc-per-node "$GPUS" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
           --rdzv "$RDZV" --rdzv-timeout-s "$RDZV_TIMEOUT_S" --wall-s "$WALL_S" --log-dir "$LOG_DIR")
(( ENV_REPORT )) || NODE_ARGS+=(--no-env-report)
# One task per node with all of its CPUs (since Slurm 22.05 a step does not inherit the job's
# CPUs per task, and torchrun's ranks would share one core); --kill-on-bad-exit stops every node
# when one fails instead of leaving the others waiting for their timeouts; --label tags each line
# with the task (= node) number.
SRUN=(srun --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 --label)
[[ -n "${SLURM_CPUS_ON_NODE:-}" ]] && SRUN+=(--cpus-per-task="$SLURM_CPUS_ON_NODE")
SRUN+=(bash "$LAUNCHER" "${NODE_ARGS[@]}" -- "${BENCH_ARGS[@]}")
# srun itself is bounded too (a node that never starts its task would hold it), after the nodes' own bound.
CMD=(timeout --kill-after=30 $((WALL_S + 60)) "${SRUN[@]}")

quoted() { printf '%q ' "$@" | sed 's/ $//'; }
echo "$TAG job ${SLURM_JOB_ID:-?} (${SLURM_JOB_NAME:-?}, partition ${SLURM_JOB_PARTITION:-?}) on ${HOSTNAME:-?}, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "$TAG resolved: NNODES=$NNODES GPUS_PER_NODE=$GPUS WORLD_SIZE=$((NNODES * GPUS)) MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT RDZV=$RDZV"
echo "$TAG nodes: ${HOSTS[*]} (node i = SLURM_NODEID i runs ranks [i*$GPUS, (i+1)*$GPUS))"
echo "$TAG timeouts: rendezvous ${RDZV_TIMEOUT_S} s, whole run ${WALL_S} s (time left in the job: ${LEFT_S:-unknown} s)"
echo "$TAG checkout: $REPO; logs: $LOG_DIR"
echo "$TAG environment exported to every node (each node prints its own again, with moe_dispatch.env):"
env | LC_ALL=C sort | grep -E '^(NCCL_|NVSHMEM_|GLOO_|TORCH_NCCL_|CUDA_DEVICE_MAX_CONNECTIONS=|PYTHON=)' | sed "s/^/$TAG   /" ||
  echo "$TAG   (no NCCL_/NVSHMEM_/GLOO_ variable set: library defaults)"
if [[ "$DRY_RUN" == 1 ]]; then
  echo "$TAG would run: $(quoted "${CMD[@]}")"
  echo "$TAG node 0 would run (node i: the same with SLURM_NODEID=i, hence --node-rank i):"
  SLURM_NODEID=0 bash "$LAUNCHER" "${NODE_ARGS[@]}" --dry-run -- "${BENCH_ARGS[@]}" | sed 's/^/  /'
  exit 0
fi

mkdir -p "$LOG_DIR" || fail logs "cannot create $LOG_DIR"
echo "$TAG running: $(quoted "${CMD[@]}")"
start=$SECONDS
rc=0
"${CMD[@]}" || rc=$?
if (( rc == 0 )); then
  echo "$TAG done in $((SECONDS - start)) s: every node passed; figures in $LOG_DIR/bench.json"
  exit 0
fi
# Each node's launcher ends its log with a "FAILED on node" line naming the step; collect them.
echo "$TAG job ${SLURM_JOB_ID:-?} FAILED after $((SECONDS - start)) s (exit $rc); what each node reported:" >&2
shopt -s nullglob
logs=("$LOG_DIR"/node*.log)
reports=""
if (( ${#logs[@]} )); then reports="$(grep -h "FAILED on node" "${logs[@]}" || true)"; fi
if [[ -n "$reports" ]]; then
  while IFS= read -r line; do echo "$TAG   $line"; done <<< "$reports" >&2
else
  echo "$TAG   no node reported a failure: srun itself failed or a node never started (see above;" \
       "check sinfo, the partition, and that $LAUNCHER is on a file system every node mounts)" >&2
fi
if (( rc == 124 || rc == 137 )); then echo "$TAG   srun was stopped by the whole-run bound of $((WALL_S + 60)) s" >&2; fi
exit "$rc"
