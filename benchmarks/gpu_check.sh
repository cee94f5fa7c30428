#!/usr/bin/env bash
# One-shot GPU check: build the extension, run every test (GPU tests included), run the
# kernel benchmarks, print a summary table last. Made for a single GPU machine with no network
# and a short time budget: only what is installed there, plus wheels handed over in a folder.
#
#   benchmarks/gpu_check.sh --out DIR [--wheels DIR] [--dry-run]
#
#   --out DIR     logs, JSON and the summary go here (created)
#   --wheels DIR  wheels to install first without an index (default: .whl if it exists);
#                 `make gpu-wheels` fills .whl with what the GPU image lacks (megatron-core)
#   --dry-run     build + the CPU-quick tests only: checks the script itself on a CPU machine
#   --budget-s S  whole-script bound in seconds (default 540)
#   --steps LIST  only these steps, comma-separated (wheels, build and env always run): a short
#                 rerun of what failed, e.g. --steps tests_kernels,tests_rest; a name this run
#                 has no step of (a typo, an ncu step without ncu) is reported at the end and
#                 fails the run
#
# Every step is bounded by its own limit and by what is left of the budget; a failing or
# skipped step is recorded and the script goes on, so one call always ends with the summary.
# Exit status: 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="" WHEELS="" DRY_RUN=0 BUDGET_S=540 STEPS=""
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
[[ "$BUDGET_S" =~ ^[1-9][0-9]*$ ]] || { echo "gpu_check.sh: --budget-s must be a whole number of seconds, got '$BUDGET_S'" >&2; exit 2; }
[[ "$STEPS" =~ ^[a-z0-9_,]*$ ]] || { echo "gpu_check.sh: --steps must be step names separated by commas, got '$STEPS'" >&2; exit 2; }
mkdir -p "$OUT"
[[ -z "$WHEELS" && -d .whl ]] && WHEELS=.whl
PY="${PYTHON:-python3}"
[[ -x .venv/bin/python && "$DRY_RUN" == 1 && -z "${PYTHON:-}" ]] && PY=.venv/bin/python
export PYTHONUNBUFFERED=1

SUMMARY="$OUT/summary.tsv"
printf 'step\tstatus\tseconds\tdetail\n' > "$SUMMARY"
FAILED=0
SEEN_STEPS=","  # every step this mode has, run or not: --steps names are checked against it at the end

# step NAME TIMEOUT_S COMMAND...: runs COMMAND with output to $OUT/NAME.log, records the result;
# the limit shrinks to what is left of the budget (20 s are kept for the summary).
step() {
  local name="$1" limit="$2"; shift 2
  local start=$SECONDS status=ok left=$((BUDGET_S - 20 - SECONDS))
  SEEN_STEPS+="$name,"
  case "$name" in wheels|build|env) ;; *) [[ -z "$STEPS" || ",$STEPS," == *",$name,"* ]] || return 0 ;; esac
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
  step wheels 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
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
step build 300 "$PY" setup.py -q build_ext --inplace
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
step env 60 "$PY" -m moe_dispatch.env

# Tests are selected by their markers (pyproject.toml): `gpu` needs a CUDA GPU. The kernel families'
# test files hold those and the same kernels' CPU-backend / Triton-interpreter tests: on a GPU they
# run first, and they are the dry run's selection.
KERNEL_FILES=(python_tests/test_intranode_cuda.py python_tests/test_internode_cuda.py python_tests/test_extension.py
              python_tests/test_layout.py python_tests/test_permute.py python_tests/test_quant.py)
if [[ "$DRY_RUN" == 1 ]]; then
  step tests 300 "$PY" -m pytest "${KERNEL_FILES[@]}" python_tests/test_env.py -q -x -p no:cacheprovider \
       --junitxml="$OUT/tests.xml"
  # The CPU backends of the intranode and internode protocols on tiny shapes: checks the benchmark scripts.
  step bench_intranode 120 "$PY" benchmarks/bench_intranode.py --json "$OUT/bench_intranode.json"
  step bench_internode 120 "$PY" benchmarks/bench_internode.py --json "$OUT/bench_internode.json"
else
  # What only a GPU can check comes first, one process per kernel family: a kernel fault poisons
  # its CUDA context, and the next family still runs in a fresh one. -v names a test that hangs;
  # --timeout bounds each test. The CPU-world rest of the suite, already run by CI, comes last.
  PYTEST=("$PY" -m pytest -v -p no:cacheprovider -rs --timeout 60)
  # A machine without InfiniBand devices: NVSHMEM stays on NVLink / the local GPU instead of
  # failing to open a NIC (a cluster's own setting, when exported, wins).
  if [[ -z "$(ls /sys/class/infiniband 2>/dev/null)" ]]; then export NVSHMEM_REMOTE_TRANSPORT="${NVSHMEM_REMOTE_TRANSPORT:-none}"; fi
  step tests_intranode 120 "${PYTEST[@]}" python_tests/test_intranode_cuda.py -m gpu --junitxml="$OUT/tests_intranode.xml"
  # Loopback: 8 simulated ranks on this GPU, num_sms 4/8/16/24, rings 32x8 and 4x2, each without and
  # with l2_discard, vs a d2d copy in the same run.
  step bench_intranode 150 "$PY" benchmarks/bench_intranode.py --json "$OUT/bench_intranode.json"
  # Where the time goes: Nsight Compute on one dispatch and one combine launch (DeepSeek-V3, EP8,
  # 16 SMs per rank): memory throughput against the peak, stall reasons, occupancy.
  if command -v ncu > /dev/null; then
    for kernel in dispatch combine; do
      step "ncu_$kernel" 60 ncu -k "regex:${kernel}_kernel" --launch-skip 2 --launch-count 1 \
           --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
           "$PY" benchmarks/bench_intranode.py --shapes deepseek-v3 --num-sms 16 --rings 32x8 --l2-discard off \
           --warmup 1 --iters 3
    done
  fi
  # Does a shallow ring keep the ring hop in L2, and does discarding consumed slots (Config.l2_discard)
  # spare HBM the write-back? DRAM bytes of one dispatch launch per ring depth, without and with the
  # discard (the 32x8 profile of 2026-11-30 read and wrote 4 bytes per payload byte: x, slot, slot,
  # recv_x; 2 is the copy's). Log: one ncu report per configuration, in the order of the loop.
  if command -v ncu > /dev/null; then
    step ncu_rings 150 bash -c 'for rings in 2x1 4x2 8x4 32x8; do for discard in off on; do
         echo "== rings $rings l2_discard $discard"; ncu -k "regex:^dispatch_kernel" --launch-skip 2 --launch-count 1 \
         --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct \
         "$0" benchmarks/bench_intranode.py --shapes deepseek-v3 --num-sms 16 --rings "$rings" --l2-discard "$discard" \
         --warmup 1 --iters 3 || exit 1; done; done' "$PY"
  fi
  step tests_internode 120 "${PYTEST[@]}" python_tests/test_internode_cuda.py -m gpu --junitxml="$OUT/tests_internode.xml"
  # Loopback of the hierarchical kernels: 2x4 and 4x2 simulated nodes x ranks on this GPU, the fused
  # and the staged pipeline side by side (a fused/staged table); cross-node bytes against the de-dup
  # lower bound, payload GB/s vs a d2d copy, per-rank cross-node GB/s.
  step bench_internode 60 "$PY" benchmarks/bench_internode.py --num-sms 6 12 --json "$OUT/bench_internode.json"
  # Deeper rings and bigger chunks for the node stage (the staged pipeline's warps waited at its
  # per-chunk group barriers; the fused one's RDMA warps put their own chunks).
  step bench_internode_chunks 45 "$PY" benchmarks/bench_internode.py --shapes deepseek-v3 --worlds 2x4 4x2 \
       --num-sms 12 --slots 128 --chunk 32
  if command -v ncu > /dev/null; then  # one launch of each pipeline's dispatch kernel, 2x4, 12 SMs
    for kernel in fused_dispatch node_dispatch; do
      pipeline=$([[ "$kernel" == fused_dispatch ]] && echo fused || echo staged)
      step "ncu_$kernel" 60 ncu -k "regex:${kernel}_kernel" --launch-skip 2 --launch-count 1 \
           --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
           "$PY" benchmarks/bench_internode.py --shapes deepseek-v3 --worlds 2x4 --num-sms 12 --pipelines "$pipeline" \
           --warmup 1 --iters 3
    done
  fi
  # The routing-layout CUDA kernel and the Triton kernels (layout, permute, fp8 quantisation) natively.
  step tests_kernels 120 "${PYTEST[@]}" python_tests/test_extension.py python_tests/test_layout.py \
       python_tests/test_permute.py python_tests/test_quant.py --junitxml="$OUT/tests_kernels.xml"
  step bench_kernels 60 "$PY" benchmarks/bench_kernels.py --sweep --json "$OUT/bench_kernels.json"
  # torch_dist on NCCL with the communication stream; Megatron's GPU tests (EP >= 2 ones skip on one GPU).
  step tests_torch_dist 120 "${PYTEST[@]}" python_tests/test_gpu_torch_dist.py python_tests/test_megatron_overlap.py \
       -m gpu --junitxml="$OUT/tests_torch_dist.xml"
  step tests_rest 300 "$PY" -m pytest python_tests -q -p no:cacheprovider -rs --timeout 120 -m "not gpu" \
       "${KERNEL_FILES[@]/#/--ignore=}" --junitxml="$OUT/tests_rest.xml"
  # Megatron's EP-overlap schedule needs EP >= 2, hence two GPUs.
  if [[ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]]; then
    step bench_megatron_overlap 300 "$PY" -m torch.distributed.run --nproc-per-node "$(nvidia-smi -L | wc -l)" \
         benchmarks/bench_megatron_overlap.py --hidden 2048 --ffn 4096 --heads 16 --experts 64 --topk 8 \
         --seq-len 2048 --micro-batch-size 1 --micro-batches 4 --vocab 32000 --json "$OUT/bench_megatron_overlap.json"
  fi
fi

for name in ${STEPS//,/ }; do
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
  for log in tests tests_intranode tests_internode tests_kernels tests_torch_dist tests_rest; do grep -E "passed|failed" "$OUT/$log.log" 2>/dev/null | tail -n 1 | sed "s/^/$log: /"; done
  grep -h -E "^(goal:|best )" "$OUT/bench_intranode.log" 2>/dev/null | sed 's/^/intranode /'
  awk '/^l2_discard: time on/ {on = 1; next} on == 1 && $1 == "shape" {on = 2; next} on == 2 && NF == 0 {on = 0}
       on == 2 && $4 == 16 {if (!shown++) print "intranode l2_discard, time on / time off, 16 SMs:"
                            sub(/[ \t]+$/, ""); print "intranode  " $0}' "$OUT/bench_intranode.log" 2>/dev/null
  grep -h -E "^== rings|dram__bytes|gpu__time_duration|hit_rate" "$OUT/ncu_rings.log" 2>/dev/null | sed 's/^ */ncu_rings /'
  grep -h "^goal:" "$OUT/bench_internode.log" 2>/dev/null | sed 's/^/internode /'
  grep -h "hidden =" "$OUT/bench_megatron_overlap.log" 2>/dev/null | sed 's/^/megatron overlap /'
} | tee "$OUT/summary.txt"
exit "$FAILED"
