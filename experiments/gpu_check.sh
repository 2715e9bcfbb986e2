#!/usr/bin/env bash
# One-shot GPU check: the GPU tests, then the kernel, end-to-end and streamed benchmarks.
#
#   bash experiments/gpu_check.sh              # on a GPU box: no network, installs nothing
#   DRY_RUN=1 bash experiments/gpu_check.sh    # on CPU: the same steps on their --quick paths,
#                                              # results in a temporary directory
#
# Python: $PYTHON, else the repo's .venv if its torch sees CUDA (any .venv with DRY_RUN=1),
# else `python` (or `python3`). PYTHONPATH is set to the repo root.
# Every step runs under `timeout` (TIMEOUT_TESTS, TIMEOUT_KERNELS, TIMEOUT_E2E,
# TIMEOUT_STREAMED seconds; the defaults add up to under 8 minutes). A failed or timed-out
# step is recorded and the next one still runs; the exit status is 1 if any step failed.
# Output goes to the terminal and to $RESULTS_DIR/<date>-gpu-check.log; the benchmarks merge
# their results into $RESULTS_DIR/<date>-<gpu>.json (RESULTS_DIR: benchmarks/results).
# With $OUT set (a device runner's output folder), the log and results are copied there.
set -u
cd "$(dirname "$0")/.."
REPO=$(pwd)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
DRY_RUN=${DRY_RUN:-0}
if [ "$DRY_RUN" = 1 ]; then
  RESULTS_DIR=${RESULTS_DIR:-$(mktemp -d)}
  QUICK=(--quick)
else
  RESULTS_DIR=${RESULTS_DIR:-benchmarks/results}
  QUICK=()
fi
TIMEOUT_TESTS=${TIMEOUT_TESTS:-100}
TIMEOUT_KERNELS=${TIMEOUT_KERNELS:-170}
TIMEOUT_E2E=${TIMEOUT_E2E:-140}
TIMEOUT_STREAMED=${TIMEOUT_STREAMED:-65}
mkdir -p "$RESULTS_DIR"
DATE=$(date +%F)
LOG="$RESULTS_DIR/$DATE-gpu-check.log"

if [ -z "${PYTHON:-}" ]; then
  PYTHON=python
  command -v python >/dev/null 2>&1 || PYTHON=python3
  if [ -x .venv/bin/python ]; then
    if [ "$DRY_RUN" = 1 ] ||
      .venv/bin/python -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
      PYTHON=.venv/bin/python
    fi
  fi
fi

log() { echo "$*" | tee -a "$LOG"; }

FAILED=()
SUMMARY=()
step() { # step NAME LIMIT_S COMMAND...: run it under timeout, log it, record the outcome
  local name=$1 limit=$2
  shift 2
  log ""
  log "== $name (timeout ${limit}s): $*"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  local took=$((SECONDS - t0))
  local what="ok"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    what="TIMED OUT"
  elif [ "$rc" -ne 0 ]; then
    what="FAILED (exit $rc)"
  fi
  [ "$what" = ok ] || FAILED+=("$name")
  SUMMARY+=("$name: $what in ${took}s")
  log "== $name: $what in ${took}s"
}

log "gpu_check $DATE (DRY_RUN=$DRY_RUN), repo $REPO, commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
log "python: $PYTHON; results: $RESULTS_DIR"
command -v nvidia-smi >/dev/null 2>&1 &&
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$LOG"
"$PYTHON" -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "cuda", torch.cuda.is_available())' 2>&1 | tee -a "$LOG"

# only the folders holding gpu-marked tests: tests/experiments needs hydra, which the GPU
# image does not have (collecting it would abort the whole run)
step tests "$TIMEOUT_TESTS" "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider \
  tests/kernels tests/models tests/decode
step bench_kernels "$TIMEOUT_KERNELS" "$PYTHON" -m experiments.bench_kernels "${QUICK[@]}" --out "$RESULTS_DIR"
step bench_e2e "$TIMEOUT_E2E" "$PYTHON" -m experiments.bench_e2e "${QUICK[@]}" --out "$RESULTS_DIR" \
  --budget-s $((TIMEOUT_E2E - 25))
if [ -f experiments/bench_streamed.py ]; then
  step bench_streamed "$TIMEOUT_STREAMED" "$PYTHON" -m experiments.bench_streamed "${QUICK[@]}" --out "$RESULTS_DIR"
fi

log ""
log "== summary"
for line in "${SUMMARY[@]}"; do log "  $line"; done
ls -l "$RESULTS_DIR" | tee -a "$LOG"
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
  cp "$RESULTS_DIR"/"$DATE"-* "$OUT"/ && log "copied results to $OUT"
fi
if [ ${#FAILED[@]} -gt 0 ]; then
  log "failed: ${FAILED[*]}"
  exit 1
fi
log "all steps passed"
