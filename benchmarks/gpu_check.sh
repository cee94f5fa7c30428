#!/usr/bin/env bash
# One-shot GPU check, planned for the windows a GPU comes in (about 15 minutes with the machine's
# start): build the extension, run on the GPU what has never run on one, then benchmark; print a
# summary table last. Made for a single GPU machine with no network: only what is installed
# there, plus wheels handed over in a folder.
#
#   benchmarks/gpu_check.sh --out DIR [--wheels DIR] [--dry-run] [--steps LIST] [--budget-s S]
#
#   --out DIR     logs, JSON and the summary go here (created)
#   --wheels DIR  wheels to install first without an index (default: .whl if it exists);
#                 `make gpu-wheels` fills .whl with what the GPU image lacks (megatron-core)
#   --dry-run     on a CPU machine: the build, the plans' own checks and the first call's plan, every GPU
#                 test step's selection (collected, skipped without a GPU), the CPU-quick tests, and every
#                 benchmark step's command on its CPU backend (--shapes tiny appended)
#   --budget-s S  whole-script bound in seconds (default 420 for the first call, 540 with --steps,
#                 1200 for a dry run)
#   --steps LIST  instead of the first call, these steps or groups, comma-separated (wheels, build and
#                 env always run): "second" (the rest of the GPU tests and the benchmarks), "variants"
#                 (every kernel variant side by side), "profile"
#                 (Nsight Compute), "tests_rest" (the CPU suite, which CI runs), or step names to rerun
#                 what failed, e.g. --steps gpu_buffer_internode; a name this machine has no step of
#                 (a typo, an ncu step without ncu) is reported at the end and fails the run
#
# The plan. Each call's steps have limits that add up to less than its budget, so no step is ever
# cut short or skipped for the budget (the script checks this before it starts); estimates are from
# the 2026-11-30 H200 run (benchmarks/results/2026-11-30-h200-gpu-check) and the shapes of the new
# tests.
#   first call (no --steps), 420 s: what has never run on a GPU, then quick benchmarks
#     wheels 20 (~5 s), build 60 (~25 s), env 10 (~3 s)
#     gpu_intranode 60 (~30 s)        intranode kernels in loopback: header check, one ring header, l2_discard,
#                                     budget mode in a CUDA graph; one process per rank over CUDA IPC (2, 4)
#     gpu_internode 60 (~45 s)        fused and staged hierarchical pipelines in loopback, header check, budget
#                                     mode; NVSHMEM world
#     gpu_buffer_intranode 60 (~45 s) Buffer(transport="kernels") with 2, 4 and 8 processes sharing the GPU
#                                     (gloo + device="cuda", CUDA IPC): oracle, async/hook/comm-stream, budget
#                                     mode without a host sync, overflow, a MoE layer step in a CUDA graph; and
#                                     on NCCL with one rank
#     gpu_buffer_internode 45 (~30 s) the same over NVSHMEM with 2 and 4 PEs on the GPU (2x1, 2x2, 4x1); a
#                                     refusal by NVSHMEM fails those worlds with its message
#     gpu_megatron_graph 35 (~30 s)   a whole step through the Megatron manager captured in a CUDA graph
#     bench_intranode_quick 25, bench_internode_quick 25: one shape (DeepSeek-V3), 16 / 12 SMs
#   second call (--steps second), 540 s: tests_kernels 100, tests_torch_dist 60, bench_intranode 110,
#     bench_internode 60, bench_internode_chunks 40, bench_kernels 50
#   variants (--steps variants), 540 s: bench_per_sm 75, bench_variants_intranode 75,
#     bench_variants_internode 60: every kernel variant of Config side by side (issue 21's points)
#   profile (--steps profile), 540 s: ncu_dispatch 60, ncu_combine 60, ncu_rings 150, ncu_fused_dispatch 60,
#     ncu_node_dispatch 60
#
# A failing step is recorded and the script goes on, so one call always ends with the summary.
# Exit status: 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="" WHEELS="" DRY_RUN=0 BUDGET_S="" STEPS=""
# value OPTION ARGS...: the option's value, or a usage error when it has none.
value() {
  [[ $# -ge 2 && -n "$2" && "$2" != --* ]] || { echo "gpu_check.sh: $1 needs a value" >&2; exit 2; }
  printf '%s' "$2"
}
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) OUT="$(value "$@")" || exit 2; shift 2 ;;
    --wheels) WHEELS="$(value "$@")" || exit 2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --budget-s) BUDGET_S="$(value "$@")" || exit 2; shift 2 ;;
    --steps) STEPS="$(value "$@")" || exit 2; shift 2 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (expected --out DIR, --wheels DIR, --dry-run, --budget-s S, --steps LIST)" >&2
       exit 2 ;;
  esac
done
[[ -n "$OUT" ]] || { echo "gpu_check.sh: --out DIR is required" >&2; exit 2; }
[[ -z "$BUDGET_S" || "$BUDGET_S" =~ ^[1-9][0-9]*$ ]] || { echo "gpu_check.sh: --budget-s must be a whole number of seconds, got '$BUDGET_S'" >&2; exit 2; }
[[ "$STEPS" =~ ^[a-z0-9_,]*$ ]] || { echo "gpu_check.sh: --steps must be step names separated by commas, got '$STEPS'" >&2; exit 2; }

# Every step's limit in seconds, and the calls' groups (the plan above).
declare -A LIMIT=(
  [wheels]=20 [build]=60 [env]=10
  [gpu_intranode]=60 [gpu_internode]=60 [gpu_buffer_intranode]=60 [gpu_buffer_internode]=45 [gpu_megatron_graph]=35
  [bench_intranode_quick]=25 [bench_internode_quick]=25
  [tests_kernels]=100 [tests_torch_dist]=60 [bench_intranode]=110 [bench_internode]=60 [bench_internode_chunks]=40
  [bench_kernels]=50
  [bench_per_sm]=75 [bench_variants_intranode]=75 [bench_variants_internode]=60
  [ncu_dispatch]=60 [ncu_combine]=60 [ncu_rings]=150 [ncu_fused_dispatch]=60 [ncu_node_dispatch]=60
  [tests_rest]=300
  [tests]=300
)
ALWAYS="wheels,build,env"
GPU_TESTS="gpu_intranode,gpu_internode,gpu_buffer_intranode,gpu_buffer_internode,gpu_megatron_graph"
FIRST="$GPU_TESTS,bench_intranode_quick,bench_internode_quick"
SECOND="tests_kernels,tests_torch_dist,bench_intranode,bench_internode,bench_internode_chunks,bench_kernels"
PROFILE="ncu_dispatch,ncu_combine,ncu_rings,ncu_fused_dispatch,ncu_node_dispatch"
VARIANTS="bench_per_sm,bench_variants_intranode,bench_variants_internode"
BENCHES="bench_intranode_quick,bench_internode_quick,bench_intranode,bench_internode,bench_internode_chunks,bench_kernels"
BENCHES+=",$VARIANTS"
# A dry run: the GPU tests' selections (collected; they skip without a GPU), the CPU-quick tests, and
# both calls' benchmark commands on the CPU backends.
DRY="$GPU_TESTS,tests,$BENCHES"

# plan_seconds STEPS: the sum of the limits of ALWAYS and STEPS (group names expanded).
expand() { sed "s/\bsecond\b/$SECOND/; s/\bprofile\b/$PROFILE/; s/\bvariants\b/$VARIANTS/" <<< "$1"; }
plan_seconds() {
  local total=0 name
  for name in ${ALWAYS//,/ } $(expand "$1" | tr ',' ' '); do total=$((total + ${LIMIT[$name]:-0})); done
  echo "$total"
}
# check_plan WHAT STEPS BUDGET: fails unless the limits fit the budget, 20 s kept for the summary, so
# that no step of the call is skipped for the budget.
check_plan() {
  local planned
  planned=$(plan_seconds "$2")
  if (( planned > $3 - 20 )); then
    echo "gpu_check.sh: the $1's step limits add up to ${planned} s, more than its budget of $3 s minus 20 s for the" \
         "summary: split the steps over two calls (--steps), or raise --budget-s" >&2
    exit 2
  fi
}
if [[ -z "$STEPS" ]]; then
  SELECTED=$([[ "$DRY_RUN" == 1 ]] && echo "$DRY" || echo "$FIRST")
else
  SELECTED="$(expand "$STEPS")"
fi
[[ -n "$BUDGET_S" ]] || BUDGET_S=$([[ "$DRY_RUN" == 1 ]] && echo 1200 || { [[ -z "$STEPS" ]] && echo 420 || echo 540; })
check_plan "call" "$SELECTED" "$BUDGET_S"
# The GPU calls' plans fit their default budgets (a dry run proves it before a GPU is at hand).
check_plan "first call" "$FIRST" 420
check_plan "second call" "second" 540
check_plan "profile call" "profile" 540
check_plan "variants call" "variants" 540
mkdir -p "$OUT"
[[ -z "$WHEELS" && -d .whl ]] && WHEELS=.whl
PY="${PYTHON:-python3}"
[[ -x .venv/bin/python && "$DRY_RUN" == 1 && -z "${PYTHON:-}" ]] && PY=.venv/bin/python
export PYTHONUNBUFFERED=1

SUMMARY="$OUT/summary.tsv"
printf 'step\tstatus\tseconds\tdetail\n' > "$SUMMARY"
FAILED=0
SEEN_STEPS=","  # every step this mode has, run or not: --steps names are checked against it at the end
echo "== gpu_check plan: ${ALWAYS//,/ } ${SELECTED//,/ } (limits $(plan_seconds "$SELECTED") s of the ${BUDGET_S} s" \
     "budget, dry_run=$DRY_RUN)"
# with_limits STEPS: "name limit s, ..." of ALWAYS and STEPS.
with_limits() {
  local name out=""
  for name in ${ALWAYS//,/ } $(expand "$1" | tr ',' ' '); do out+="$name ${LIMIT[$name]} s, "; done
  echo "${out%, }"
}
PLANS=""
if [[ "$DRY_RUN" == 1 ]]; then
  PLANS="the first call (no --steps, 420 s budget, limits $(plan_seconds "$FIRST") s): $(with_limits "$FIRST")
the second call (--steps second, 540 s budget, limits $(plan_seconds second) s): $(with_limits second)"
  sed 's/^/== /' <<< "$PLANS"
  if [[ -z "$WHEELS" ]] || ! ls "$WHEELS"/megatron_core-*.whl > /dev/null 2>&1; then
    echo "== note: no megatron_core wheel in ${WHEELS:-.whl}: the GPU image has no megatron-core, so gpu_megatron_graph" \
         "would skip there; run 'make gpu-wheels' (here, with network) and carry .whl"
  fi
fi

# step NAME COMMAND...: runs COMMAND with output to $OUT/NAME.log under its limit (LIMIT[NAME], or
# what is left of the budget if less), records the result. Runs only the steps this call selected.
step() {
  local name="$1"; shift
  local limit="${LIMIT[$name]}" start=$SECONDS status=ok left=$((BUDGET_S - 20 - SECONDS))
  SEEN_STEPS+="$name,"
  [[ ",$ALWAYS,$SELECTED," == *",$name,"* ]] || return 0
  if (( left < 15 )); then
    echo "== $name: skipped, the budget of ${BUDGET_S} s is spent"
    printf '%s\t%s\t%s\t%s\n' "$name" "SKIPPED(budget)" 0 "-" >> "$SUMMARY"
    FAILED=1
    return
  fi
  (( limit > left )) && limit=$left
  echo "== $name (limit ${limit} s): $*"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1 || status="FAILED($?)"
  grep -v '^[[:space:]]*$' "$OUT/$name.log" | tail -n 5 | sed 's/^/   /'
  [[ "$status" == ok ]] || FAILED=1
  # The detail: the log's last line with words in it (table rules and borders stripped).
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - start))" \
    "$(sed 's/[│┃┌┐└┘├┤┬┴┼─━]//g; s/  */ /g' "$OUT/$name.log" | grep '[[:alnum:]]' | tail -n 1 | cut -c1-100)" >> "$SUMMARY"
}

if [[ -n "$WHEELS" ]]; then
  # --target keeps the machine's own packages untouched; PYTHONPATH puts the wheels first.
  step wheels "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
       --target /tmp/moe_dispatch_site "$WHEELS"/*.whl
  export PYTHONPATH="/tmp/moe_dispatch_site${PYTHONPATH:+:$PYTHONPATH}"
fi

# Build in place (no install into the machine's environment): the extension lands beside the
# package sources, which PYTHONPATH then exposes.
# On the GPU: only the architecture at hand (sm_90 on an H200), half the compile time of the
# default list. A dry run keeps the default list: its in-place build replaces the checkout's own.
if [[ "$DRY_RUN" == 0 ]]; then
  export MOE_DISPATCH_REQUIRE_CUDA=1 MOE_DISPATCH_CUDA_ARCHS="${MOE_DISPATCH_CUDA_ARCHS:-90}"
fi
step build "$PY" setup.py -q build_ext --inplace
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
step env "$PY" -m moe_dispatch.env

# Tests are selected by their markers (pyproject.toml): `gpu` needs a CUDA GPU. One process per
# step: a kernel fault poisons its CUDA context, and the next step still runs in a fresh one. -v names
# a test that hangs; --timeout bounds each test.
PYTEST=("$PY" -m pytest -v -p no:cacheprovider -rs)
# A machine without InfiniBand devices: NVSHMEM stays on NVLink / the local GPU instead of failing to
# open a NIC (a cluster's own setting, when exported, wins).
if [[ -z "$(ls /sys/class/infiniband 2>/dev/null)" ]]; then export NVSHMEM_REMOTE_TRANSPORT="${NVSHMEM_REMOTE_TRANSPORT:-none}"; fi
# The kernel families' test files: their CPU-backend / Triton-interpreter tests are the dry run's selection.
KERNEL_FILES=(python_tests/test_intranode_cuda.py python_tests/test_internode_cuda.py python_tests/test_extension.py
              python_tests/test_layout.py python_tests/test_permute.py python_tests/test_quant.py)

# -- the first call: what has never run on a GPU (on a CPU machine: collected, then skipped) ---------
step gpu_intranode "${PYTEST[@]}" --timeout 60 python_tests/test_intranode_cuda.py -m gpu \
     --junitxml="$OUT/gpu_intranode.xml"
step gpu_internode "${PYTEST[@]}" --timeout 60 python_tests/test_internode_cuda.py -m gpu \
     --junitxml="$OUT/gpu_internode.xml"
# Processes sharing the GPU through a gloo group with device="cuda" (NCCL refuses two ranks on one GPU).
step gpu_buffer_intranode "${PYTEST[@]}" --timeout 120 python_tests/test_kernel_path.py python_tests/test_gpu_torch_dist.py \
     -m gpu -k "kernels_gpu_shared and 1x or kernel_transport" --junitxml="$OUT/gpu_buffer_intranode.xml"
step gpu_buffer_internode "${PYTEST[@]}" --timeout 120 python_tests/test_kernel_path.py -m gpu -k "kernels_gpu_shared and not 1x" \
     --junitxml="$OUT/gpu_buffer_internode.xml"
step gpu_megatron_graph "${PYTEST[@]}" --timeout 120 python_tests/test_megatron.py -m gpu \
     --junitxml="$OUT/gpu_megatron_graph.xml"
if [[ "$DRY_RUN" == 1 ]]; then
  # The kernels' CPU backends and the Triton kernels under the interpreter.
  step tests "$PY" -m pytest "${KERNEL_FILES[@]}" python_tests/test_env.py -q -x -p no:cacheprovider \
       --junitxml="$OUT/tests.xml"
fi
# The benchmarks' commands; a dry run runs each on its CPU backend at the tiny shape (the last
# --shapes wins), which checks every argument the GPU calls pass.
TINY=()
[[ "$DRY_RUN" == 1 ]] && TINY=(--shapes tiny)
# The variant sweep on the CPU backend: 4 ranks, one ring shape (its 8-rank GPU grid would take minutes).
SMALL=()
[[ "$DRY_RUN" == 1 ]] && SMALL=(--world-sizes 4 --rings 32x8 --l2-discard off)
# Quick benchmarks: DeepSeek-V3 (4096 tokens, H 7168, top-8 of 256), one SM budget, loopback.
step bench_intranode_quick "$PY" benchmarks/bench_intranode.py --shapes deepseek-v3 --num-sms 16 --rings 32x8 \
     --l2-discard off on --warmup 2 --iters 10 --json "$OUT/bench_intranode_quick.json" "${TINY[@]}"
step bench_internode_quick "$PY" benchmarks/bench_internode.py --shapes deepseek-v3 --worlds 2x4 --num-sms 12 \
     --warmup 2 --iters 5 --json "$OUT/bench_internode_quick.json" "${TINY[@]}"

# -- the second call (--steps second): the rest of the GPU tests and the benchmarks -------------------
# The routing-layout CUDA kernel and the Triton kernels (layout, permute, fp8 quantisation) natively.
step tests_kernels "${PYTEST[@]}" --timeout 60 python_tests/test_extension.py python_tests/test_layout.py \
     python_tests/test_permute.py python_tests/test_quant.py --junitxml="$OUT/tests_kernels.xml"
# torch_dist on NCCL with the communication stream; Megatron's GPU tests (EP >= 2 ones skip on one GPU).
step tests_torch_dist "${PYTEST[@]}" --timeout 60 python_tests/test_gpu_torch_dist.py python_tests/test_megatron_overlap.py \
     -m gpu -k "not kernel_transport" --junitxml="$OUT/tests_torch_dist.xml"
# Loopback: 8 simulated ranks on this GPU, num_sms 4/8/16/24, rings 32x8 and 4x2, each without and
# with l2_discard, vs a d2d copy in the same run.
step bench_intranode "$PY" benchmarks/bench_intranode.py --json "$OUT/bench_intranode.json" "${TINY[@]}"
# Loopback of the hierarchical kernels: 2x4 and 4x2 simulated nodes x ranks on this GPU, the fused
# and the staged pipeline side by side (a fused/staged table); cross-node bytes against the de-dup
# lower bound, payload GB/s vs a d2d copy, per-rank cross-node GB/s.
step bench_internode "$PY" benchmarks/bench_internode.py --num-sms 6 12 --json "$OUT/bench_internode.json" "${TINY[@]}"
# Deeper rings and bigger chunks for the node stage (the staged pipeline's warps waited at its
# per-chunk group barriers; the fused one's RDMA warps put their own chunks).
step bench_internode_chunks "$PY" benchmarks/bench_internode.py --shapes deepseek-v3 --worlds 2x4 4x2 \
     --num-sms 12 --slots 128 --chunk 32 "${TINY[@]}"
step bench_kernels "$PY" benchmarks/bench_kernels.py --sweep --json "$OUT/bench_kernels.json" "${TINY[@]}"

# -- variants (--steps variants): every kernel variant side by side (GB/s per SM, against the current
# kernels and a d2d copy, the cost model's prediction / measurement) -------------------------------
# What is kept only to be timed here (the variants, the staged pipeline) sits behind
# moe_dispatch/transport/kernels/experimental.py, off the default path.
# 4 simulated ranks at 2 and 4 SMs each, DeepSeek-V3 and Qwen3: the per-SM goal (25 GB/s per SM).
step bench_per_sm "$PY" benchmarks/bench_intranode.py --world-sizes 4 --num-sms 2 4 --shapes deepseek-v3 qwen3 \
     --rings 32x8 --l2-discard off --variants all --warmup 2 --iters 8 --json "$OUT/bench_per_sm.json" "${TINY[@]}"
# 8 ranks at 16 SMs: rings 32x8 (the two-hop HBM bound) and 4x2 (in L2), without and with l2_discard.
step bench_variants_intranode "$PY" benchmarks/bench_intranode.py --world-sizes 8 --num-sms 16 --shapes deepseek-v3 \
     --rings 32x8 4x2 --l2-discard off on --variants all --warmup 2 --iters 8 \
     --json "$OUT/bench_variants_intranode.json" "${TINY[@]}" "${SMALL[@]}"
# The hierarchical kernels, 2x4 at 12 SMs: the fused pipeline's variants and the staged pipeline.
step bench_variants_internode "$PY" benchmarks/bench_internode.py --worlds 2x4 --num-sms 12 --shapes deepseek-v3 \
     --variants all --warmup 2 --iters 8 --json "$OUT/bench_variants_internode.json" "${TINY[@]}"

if [[ "$DRY_RUN" == 0 ]]; then
  # -- profile (--steps profile): where the time goes, Nsight Compute ----------------------------------
  if command -v ncu > /dev/null; then
    # One dispatch and one combine launch (DeepSeek-V3, EP8, 16 SMs per rank): memory throughput
    # against the peak, stall reasons, occupancy.
    for kernel in dispatch combine; do
      step "ncu_$kernel" ncu -k "regex:${kernel}_kernel" --launch-skip 2 --launch-count 1 \
           --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
           "$PY" benchmarks/bench_intranode.py --shapes deepseek-v3 --num-sms 16 --rings 32x8 --l2-discard off \
           --warmup 1 --iters 3
    done
    # Does a shallow ring keep the ring hop in L2, and does discarding consumed slots (Config.l2_discard)
    # spare HBM the write-back? DRAM bytes of one dispatch launch per ring depth, without and with the
    # discard (the 32x8 profile of 2026-11-30 read and wrote 4 bytes per payload byte: x, slot, slot,
    # recv_x; 2 is the copy's). Log: one ncu report per configuration, in the order of the loop.
    step ncu_rings bash -c 'for rings in 2x1 4x2 8x4 32x8; do for discard in off on; do
         echo "== rings $rings l2_discard $discard"; ncu -k "regex:^dispatch_kernel" --launch-skip 2 --launch-count 1 \
         --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct \
         "$0" benchmarks/bench_intranode.py --shapes deepseek-v3 --num-sms 16 --rings "$rings" --l2-discard "$discard" \
         --warmup 1 --iters 3 || exit 1; done; done' "$PY"
    # One launch of each hierarchical pipeline's dispatch kernel, 2x4, 12 SMs.
    for kernel in fused_dispatch node_dispatch; do
      pipeline=$([[ "$kernel" == fused_dispatch ]] && echo fused || echo staged)
      step "ncu_$kernel" ncu -k "regex:${kernel}_kernel" --launch-skip 2 --launch-count 1 \
           --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
           "$PY" benchmarks/bench_internode.py --shapes deepseek-v3 --worlds 2x4 --num-sms 12 --pipelines "$pipeline" \
           --warmup 1 --iters 3
    done
  fi
fi
# The CPU-world rest of the suite (CI runs it; --steps tests_rest on a GPU machine).
step tests_rest "$PY" -m pytest python_tests -q -p no:cacheprovider -rs --timeout 120 -m "not gpu" \
     "${KERNEL_FILES[@]/#/--ignore=}" --junitxml="$OUT/tests_rest.xml"

for name in ${SELECTED//,/ }; do
  if [[ "$SEEN_STEPS" != *",$name,"* ]]; then
    echo "gpu_check.sh: --steps names '$name', which this run has not (dry_run=$DRY_RUN, this machine's tools):" \
         "${SEEN_STEPS:1:-1}" >&2
    printf '%s\t%s\t%s\t%s\n' "$name" "UNKNOWN" 0 "no such step in this run" >> "$SUMMARY"
    FAILED=1
  fi
done

{
  echo
  echo "== gpu_check summary ($(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), dry_run=$DRY_RUN)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no GPU visible"
  column -t -s $'\t' "$SUMMARY" 2>/dev/null || cat "$SUMMARY"  # no column(1) on some images
  [[ -n "$PLANS" ]] && echo "$PLANS"
  for log in tests gpu_intranode gpu_internode gpu_buffer_intranode gpu_buffer_internode gpu_megatron_graph tests_kernels \
             tests_torch_dist tests_rest; do
    grep -E "passed|failed" "$OUT/$log.log" 2>/dev/null | tail -n 1 | sed "s/^/$log: /"
  done
  grep -h -E "^(goal:|best |model:)" "$OUT/bench_intranode.log" "$OUT/bench_intranode_quick.log" "$OUT/bench_per_sm.log" \
       "$OUT/bench_variants_intranode.log" 2>/dev/null | sed 's/^/intranode /'
  awk '/^l2_discard: time on/ {on = 1; next} on == 1 && $1 == "shape" {on = 2; next} on == 2 && NF == 0 {on = 0}
       on == 2 && $4 == 16 {if (!shown++) print "intranode l2_discard, time on / time off, 16 SMs:"
                            sub(/[ \t]+$/, ""); print "intranode  " $0}' "$OUT/bench_intranode.log" 2>/dev/null
  grep -h -E "^== rings|dram__bytes|gpu__time_duration|hit_rate" "$OUT/ncu_rings.log" 2>/dev/null | sed 's/^ */ncu_rings /'
  grep -h "^goal:" "$OUT/bench_internode.log" "$OUT/bench_internode_quick.log" 2>/dev/null | sed 's/^/internode /'
  if [[ -z "$STEPS" && "$DRY_RUN" == 0 ]]; then
    echo "the rest: benchmarks/gpu_check.sh --out ${OUT}-second --steps second, then --steps variants, then --steps profile where ncu is installed"
  fi
} | tee "$OUT/summary.txt"
exit "$FAILED"
