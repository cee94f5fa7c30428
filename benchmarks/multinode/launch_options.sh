# shellcheck shell=bash
# The options both launchers take (sbatch_bench.sh passes them on to run_torchrun.sh), sourced by both.
#
# node_option OPTION [VALUE ...]: sets RDZV, RDZV_TIMEOUT_S, WALL_S, LOG_DIR, ENV_REPORT or DRY_RUN
# from OPTION and its VALUE, and OPTION_WORDS to the words it took; returns 1 for any other option.
# A value is checked with the sourcing launcher's own need_value (which fails with its own line).
# shellcheck disable=SC2034  # the variables are the sourcing launcher's
node_option() {
  OPTION_WORDS=2
  case "$1" in
    --rdzv) need_value "$@"; RDZV="$2" ;;
    --rdzv-timeout-s) need_value "$@"; RDZV_TIMEOUT_S="$2" ;;
    --wall-s) need_value "$@"; WALL_S="$2" ;;
    --log-dir) need_value "$@"; LOG_DIR="$2" ;;
    --no-env-report) ENV_REPORT=0; OPTION_WORDS=1 ;;
    --dry-run) DRY_RUN=1; OPTION_WORDS=1 ;;
    *) return 1 ;;
  esac
}
