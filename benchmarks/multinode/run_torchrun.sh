#!/usr/bin/env bash
# moe-dispatch-bench on one node of a multi-node job, through torchrun: run it once on every
# node with the same arguments (sbatch_bench.sh does that through srun; by hand, pdsh or a
# cluster scheduler works too). One process per GPU; the benchmark takes the node size from
# torchrun's LOCAL_WORLD_SIZE, so ranks [n*P, (n+1)*P) must share a host (torchrun does that).
#
#   benchmarks/multinode/run_torchrun.sh [options] [-- moe-dispatch-bench arguments]
#
#   --nnodes N          nodes in the job          (else $NNODES, $SLURM_NNODES, 1)
#   --nproc-per-node P  ranks (GPUs) on this node (else $NPROC_PER_NODE, $SLURM_GPUS_ON_NODE,
#                       $SLURM_GPUS_PER_NODE, the GPUs nvidia-smi lists, 1)
#   --node-rank R       this node, 0..N-1         (else $NODE_RANK, $SLURM_NODEID; 0 on one node)
#   --master-addr HOST  node 0's address          (else $MASTER_ADDR, the first host of
#                       $SLURM_JOB_NODELIST via scontrol; 127.0.0.1 on one node)
#   --master-port PORT  rendezvous port on node 0 (else $MASTER_PORT; 20000 + SLURM_JOB_ID % 10000
#                       in a Slurm job, so two jobs sharing a node do not collide; else 29500)
#   --rdzv static|c10d  static (default): node rank = --node-rank, as Megatron-LM's examples
#                       launch; c10d: nodes join in any order and torchrun assigns the ranks
#                       (the node rank still names this node's log and layout lines)
#   --rdzv-timeout-s S  how long the nodes wait for each other at start (default 300)
#   --wall-s S          bound on this node's whole run: SIGTERM, SIGKILL 30 s later (default 3600)
#   --log-dir DIR       node<R>-<host>.log, and bench.json unless --json is given (default
#                       bench_results/multinode)
#   --no-env-report     skip `python -m moe_dispatch.env` (versions, GPUs, NVSHMEM) at start
#   --dry-run           print the layout, the environment and the commands, run nothing, exit 0
#   -h, --help          this text
#
# After `--` come moe-dispatch-bench's arguments (--models, --num-tokens, --hidden-scale, --iters,
# ...); --timeout-s 300 (its bound on every collective) and --json are added unless given.
# $PYTHON is the interpreter (default python3). Exit status: the benchmark's (1: oracle check
# failed), 124/137 when the wall-clock bound struck, 2 for bad arguments; every failure prints
# one "FAILED on node" line naming the node, its host, the step and where its log is.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-python3}"
HOST="${HOSTNAME:-$(uname -n)}"
TAG="[run_torchrun]"
STEP="arguments"

NNODES_ARG="" NPROC_ARG="" NODE_RANK_ARG="" MASTER_ADDR_ARG="" MASTER_PORT_ARG=""
RDZV="static" RDZV_TIMEOUT_S=300 WALL_S=3600 LOG_DIR="bench_results/multinode" ENV_REPORT=1 DRY_RUN=0
BENCH_ARGS=()

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

# fail CODE MESSAGE: the one line every failure ends with (srun --label prefixes the task).
fail() {
  echo "$TAG FAILED on node ${NODE_RANK:-?}/${NNODES:-?} (host $HOST), step '$STEP': $2" >&2
  exit "$1"
}

need_value() { [[ $# -ge 2 && -n "$2" && "$2" != --* ]] || fail 2 "$1 needs a value (see --help)"; }
# shellcheck source=launch_options.sh source-path=SCRIPTDIR
source "$REPO_ROOT/benchmarks/multinode/launch_options.sh"

while [[ $# -gt 0 ]]; do
  if node_option "$@"; then shift "$OPTION_WORDS"; continue; fi
  case "$1" in
    --nnodes) need_value "$@"; NNODES_ARG="$2"; shift 2 ;;
    --nproc-per-node) need_value "$@"; NPROC_ARG="$2"; shift 2 ;;
    --node-rank) need_value "$@"; NODE_RANK_ARG="$2"; shift 2 ;;
    --master-addr) need_value "$@"; MASTER_ADDR_ARG="$2"; shift 2 ;;
    --master-port) need_value "$@"; MASTER_PORT_ARG="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; BENCH_ARGS=("$@"); break ;;
    *) fail 2 "unknown option '$1' (benchmark arguments go after --; see --help)" ;;
  esac
done

# -- resolve the layout: flag, then environment, then Slurm, then a default ------------------
STEP="layout"
positive_int() {
  if ! [[ "$2" =~ ^[0-9]+$ ]] || (( 10#$2 < $3 )); then fail 2 "$1 must be an integer >= $3, got '$2'"; fi
}

if [[ -n "$NNODES_ARG" ]]; then NNODES="$NNODES_ARG" NNODES_SRC="--nnodes"
elif [[ -n "${NNODES:-}" ]]; then NNODES_SRC="NNODES"
elif [[ -n "${SLURM_NNODES:-}" ]]; then NNODES="$SLURM_NNODES" NNODES_SRC="SLURM_NNODES"
else NNODES=1 NNODES_SRC="default"
fi
positive_int nnodes "$NNODES" 1

gpus_listed() { command -v nvidia-smi > /dev/null && timeout 20 nvidia-smi -L 2> /dev/null | grep -c '^GPU' || true; }
if [[ -z "$NPROC_ARG" && -z "${NPROC_PER_NODE:-}" && -z "${SLURM_GPUS_ON_NODE:-}" && -z "${SLURM_GPUS_PER_NODE:-}" ]]; then
  LISTED="$(gpus_listed)"
fi
if [[ -n "$NPROC_ARG" ]]; then NPROC="$NPROC_ARG" NPROC_SRC="--nproc-per-node"
elif [[ -n "${NPROC_PER_NODE:-}" ]]; then NPROC="$NPROC_PER_NODE" NPROC_SRC="NPROC_PER_NODE"
elif [[ -n "${SLURM_GPUS_ON_NODE:-}" ]]; then NPROC="$SLURM_GPUS_ON_NODE" NPROC_SRC="SLURM_GPUS_ON_NODE"
elif [[ -n "${SLURM_GPUS_PER_NODE:-}" ]]; then
  NPROC="${SLURM_GPUS_PER_NODE##*:}" NPROC_SRC="SLURM_GPUS_PER_NODE"  # "[type:]count", e.g. h100:8
elif [[ "${LISTED:-0}" -gt 0 ]]; then NPROC="$LISTED" NPROC_SRC="nvidia-smi -L"
else NPROC=1 NPROC_SRC="default (no GPU found)"
fi
positive_int nproc-per-node "$NPROC" 1

if [[ -n "$NODE_RANK_ARG" ]]; then NODE_RANK="$NODE_RANK_ARG" NODE_RANK_SRC="--node-rank"
elif [[ -n "${NODE_RANK:-}" ]]; then NODE_RANK_SRC="NODE_RANK"
elif [[ -n "${SLURM_NODEID:-}" ]]; then NODE_RANK="$SLURM_NODEID" NODE_RANK_SRC="SLURM_NODEID"
elif (( NNODES == 1 )); then NODE_RANK=0 NODE_RANK_SRC="default"
else fail 2 "--node-rank (or NODE_RANK, SLURM_NODEID) is needed with $NNODES nodes"
fi
positive_int node-rank "$NODE_RANK" 0
(( NODE_RANK < NNODES )) || fail 2 "node rank $NODE_RANK is not below the node count $NNODES"

SLURM_HOSTS=()
if [[ -n "$MASTER_ADDR_ARG" ]]; then MASTER_ADDR="$MASTER_ADDR_ARG" MASTER_ADDR_SRC="--master-addr"
elif [[ -n "${MASTER_ADDR:-}" ]]; then MASTER_ADDR_SRC="MASTER_ADDR"
elif [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then
  command -v scontrol > /dev/null || fail 2 "SLURM_JOB_NODELIST is set but scontrol is not on PATH: pass --master-addr"
  # mapfile, not `| head -n1`: under pipefail, head closing the pipe early can fail the pipeline.
  mapfile -t SLURM_HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  [[ ${#SLURM_HOSTS[@]} -gt 0 && -n "${SLURM_HOSTS[0]}" ]] ||
    fail 2 "scontrol show hostnames '$SLURM_JOB_NODELIST' gave no host: pass --master-addr"
  MASTER_ADDR="${SLURM_HOSTS[0]}" MASTER_ADDR_SRC="first host of SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST"
elif (( NNODES == 1 )); then MASTER_ADDR=127.0.0.1 MASTER_ADDR_SRC="default (one node)"
else fail 2 "--master-addr (or MASTER_ADDR, or a Slurm allocation) is needed with $NNODES nodes"
fi

if [[ -n "$MASTER_PORT_ARG" ]]; then MASTER_PORT="$MASTER_PORT_ARG" MASTER_PORT_SRC="--master-port"
elif [[ -n "${MASTER_PORT:-}" ]]; then MASTER_PORT_SRC="MASTER_PORT"
elif [[ -n "${SLURM_JOB_ID:-}" ]]; then
  MASTER_PORT=$((20000 + SLURM_JOB_ID % 10000)) MASTER_PORT_SRC="20000 + SLURM_JOB_ID % 10000"
else MASTER_PORT=29500 MASTER_PORT_SRC="default"
fi
positive_int master-port "$MASTER_PORT" 1
(( 10#$MASTER_PORT <= 65535 )) || fail 2 "master-port must be a TCP port (1..65535), got '$MASTER_PORT'"
positive_int rdzv-timeout-s "$RDZV_TIMEOUT_S" 1
positive_int wall-s "$WALL_S" 1
[[ "$RDZV" == static || "$RDZV" == c10d ]] || fail 2 "--rdzv must be static or c10d, got '$RDZV'"

WORLD_SIZE=$((NNODES * NPROC))
export MASTER_ADDR MASTER_PORT PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's moe_dispatch, installed or not

# -- the benchmark's arguments: its collective timeout and where its JSON goes --------------
has_arg() { local a; for a in "${BENCH_ARGS[@]}"; do [[ "$a" == "$1" || "$a" == "$1="* ]] && return 0; done; return 1; }
has_arg --timeout-s || BENCH_ARGS+=(--timeout-s 300)
has_arg --json || BENCH_ARGS+=(--json "$LOG_DIR/bench.json")
arg_value() {  # the last value given to option $1 ("--opt v" or "--opt=v")
  local a prev="" value=""
  for a in "${BENCH_ARGS[@]}"; do
    [[ "$prev" == "$1" ]] && value="$a"
    [[ "$a" == "$1="* ]] && value="${a#*=}"
    prev="$a"
  done
  echo "$value"
}

TORCHRUN=("$PY" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$NPROC" --max-restarts 0)
if [[ "$RDZV" == static ]]; then
  # Node 0 hosts the store; every other node connects to it within the rendezvous timeout.
  TORCHRUN+=(--node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
             --rdzv-conf "timeout=$RDZV_TIMEOUT_S")
else
  TORCHRUN+=(--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${SLURM_JOB_ID:-moe-dispatch-bench}"
             --rdzv-conf "join_timeout=$RDZV_TIMEOUT_S,read_timeout=$RDZV_TIMEOUT_S")
fi
TORCHRUN+=(-m moe_dispatch.tools.bench "${BENCH_ARGS[@]}")
# timeout(1) bounds the whole node; torchrun passes its SIGTERM on to the ranks.
CMD=(timeout --kill-after=30 "$WALL_S" "${TORCHRUN[@]}")
ENV_CMD=(timeout 120 "$PY" -m moe_dispatch.env)
LOG="$LOG_DIR/node${NODE_RANK}-${HOST}.log"

quoted() { printf '%q ' "$@" | sed 's/ $//'; }
comm_env() {  # what changes the transports: printed by every node, so a mismatch between nodes shows
  env | LC_ALL=C sort | grep -E '^(NCCL_|NVSHMEM_|GLOO_|TORCH_NCCL_|TORCH_DISTRIBUTED_|CUDA_DEVICE_MAX_CONNECTIONS=|CUDA_VISIBLE_DEVICES=|OMP_NUM_THREADS=|MASTER_(ADDR|PORT)=)' ||
    true
}

header() {
  local first=$((NODE_RANK * NPROC)) slurm="no Slurm job"
  [[ -n "${SLURM_JOB_ID:-}" ]] && slurm="Slurm job $SLURM_JOB_ID, nodes ${SLURM_JOB_NODELIST:-?}"
  echo "$TAG node $NODE_RANK/$NNODES on $HOST ($slurm), $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "$TAG resolved: NNODES=$NNODES NPROC_PER_NODE=$NPROC NODE_RANK=$NODE_RANK MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT WORLD_SIZE=$WORLD_SIZE RDZV=$RDZV"
  echo "$TAG from: nnodes <- $NNODES_SRC; nproc-per-node <- $NPROC_SRC; node-rank <- $NODE_RANK_SRC;" \
       "master-addr <- $MASTER_ADDR_SRC; master-port <- $MASTER_PORT_SRC"
  if [[ "$RDZV" == static ]]; then
    echo "$TAG ranks on this node: $first-$((first + NPROC - 1)) of $WORLD_SIZE"
  else
    echo "$TAG ranks on this node: a block of $NPROC of $WORLD_SIZE, assigned by the c10d rendezvous"
  fi
  echo "$TAG timeouts: rendezvous ${RDZV_TIMEOUT_S} s (--rdzv-timeout-s), each collective" \
       "$(arg_value --timeout-s) s (moe-dispatch-bench --timeout-s), whole node ${WALL_S} s (--wall-s; SIGKILL 30 s later)"
  echo "$TAG communication environment:"
  comm_env | sed "s/^/$TAG   /"
  [[ -n "$(comm_env)" ]] || echo "$TAG   (no NCCL_/NVSHMEM_/GLOO_ variable set: library defaults)"
}

if [[ "$DRY_RUN" == 1 ]]; then
  header
  (( ENV_REPORT )) && echo "$TAG would run: $(quoted "${ENV_CMD[@]}")"
  echo "$TAG would run: $(quoted "${CMD[@]}")"
  echo "$TAG log: $LOG"
  exit 0
fi

STEP="log"
mkdir -p "$LOG_DIR" || fail 2 "cannot create the log folder $LOG_DIR"
: > "$LOG" || fail 2 "cannot write $LOG"
header 2>&1 | tee -a "$LOG"

if (( ENV_REPORT )); then
  STEP="env report"
  echo "$TAG running: $(quoted "${ENV_CMD[@]}")" | tee -a "$LOG"
  # Diagnostics only: a broken report must not stop the benchmark, so its failure is a warning.
  "${ENV_CMD[@]}" 2>&1 | tee -a "$LOG" || echo "$TAG warning: the env report failed (exit ${PIPESTATUS[0]})" | tee -a "$LOG"
fi

STEP="torchrun"
echo "$TAG running: $(quoted "${CMD[@]}")" | tee -a "$LOG"
start=$SECONDS
# torchrun in the background with a trap, so Ctrl-C or scancel's SIGTERM reaches it and its ranks
# (timeout(1) puts them in a process group of their own) instead of leaving them behind; its
# output goes through a FIFO to tee, which is waited for, so the log is complete when read below.
FIFO_DIR="$(mktemp -d)"
mkfifo "$FIFO_DIR/out"
tee -a "$LOG" < "$FIFO_DIR/out" &
tee_pid=$!
"${CMD[@]}" > "$FIFO_DIR/out" 2>&1 &
child=$!
INTERRUPTED=""
trap 'INTERRUPTED=1; kill -TERM "$child" 2> /dev/null || true' INT TERM
rc=0
wait "$child" || rc=$?
while kill -0 "$child" 2> /dev/null; do  # interrupted: the forwarded signal ends it (bounded by --kill-after)
  rc=0
  wait "$child" || rc=$?
done
trap - INT TERM
wait "$tee_pid" || true
rm -rf "$FIFO_DIR"
elapsed=$((SECONDS - start))

if (( rc == 0 )); then
  echo "$TAG node $NODE_RANK/$NNODES ($HOST): done in ${elapsed} s; log $LOG" | tee -a "$LOG"
  exit 0
fi
# Name the step that failed from what torchrun and the benchmark printed (most specific first).
if [[ -n "$INTERRUPTED" ]]; then
  STEP="torchrun"; why="interrupted by SIGINT/SIGTERM (Ctrl-C, scancel or the Slurm time limit)"
elif (( rc == 124 || rc == 137 )); then
  STEP="torchrun"; why="the wall-clock bound of ${WALL_S} s struck (--wall-s)"
elif grep -q 'CommError' "$LOG"; then
  STEP="benchmark collective"; why="a moe_dispatch collective failed or timed out (CommError above names the rank, operation and peers)"
elif grep -q 'ORACLE CHECK FAILED' "$LOG"; then
  STEP="oracle check"; why="results differ from moe_dispatch.reference (MISMATCH lines above)"
elif grep -qE 'Rendezvous(Timeout|Closed|Connection)Error|DistNetworkError|DistStoreError|client socket has timed out|Connection refused|failed to connect' "$LOG"; then
  STEP="rendezvous"; why="nodes did not meet at $MASTER_ADDR:$MASTER_PORT within ${RDZV_TIMEOUT_S} s: check that node 0 started, that this node reaches it, and that every node got the same --nnodes, --master-port and --rdzv"
else
  STEP="benchmark"; why="see torchrun's error summary above (it names the failing rank, host and exit code)"
fi
echo "$TAG FAILED on node $NODE_RANK/$NNODES (host $HOST), step '$STEP' after ${elapsed} s (exit $rc): $why; log $LOG" |
  tee -a "$LOG" >&2
exit "$rc"
