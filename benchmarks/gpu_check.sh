#!/usr/bin/env bash
# One-shot GPU check: the GPU tests, the kernel compile check, then every GPU benchmark.
#
#   bash benchmarks/gpu_check.sh              # on a GPU box: no network, installs nothing
#   DRY_RUN=1 bash benchmarks/gpu_check.sh    # on CPU: the same steps on their --quick paths,
#                                             # results in a temporary directory
#   STEPS="bench_rejection report" bash benchmarks/gpu_check.sh   # only these steps
#   STEPS="tune_gemv" TUNE_ARGS="--formats int4" bash benchmarks/gpu_check.sh
#                                             # only the GEMV tuning (benchmarks/tune_gemv.py)
#   STEPS="compile_check ..."                 # also the sm_90 compile check (CPU-side; off by
#                                             # default: `make test` runs its --quick subset)
#
# Python: $PYTHON, else the repo's .venv if its torch sees CUDA (any .venv with DRY_RUN=1),
# else `python` (or `python3`). PYTHONPATH is set to the repo root.
# Every step runs under `timeout` (TIMEOUT_<STEP> seconds, e.g. TIMEOUT_BENCH_E2E) and the
# whole run within TOTAL_S seconds (default 560: one call of under 10 minutes): a step
# gets at most what is left, and is skipped with less than 15 s left. A failed or timed-out
# step is recorded and the next one still runs; the exit status is 1 if any step failed.
# Output goes to the terminal and to $RESULTS_DIR/<date>-gpu-check.log; the benchmarks write
# $RESULTS_DIR/<name>.json + .csv and merge into $RESULTS_DIR/<date>-<gpu>.json
# (RESULTS_DIR: benchmarks/results), whose docs/gpu.md rows the last step prints.
# With $OUT set (a device runner's output folder), the log and results are copied there.
# WHEELS=DIR: first install DIR/*.whl (no index, no dependencies) into a temporary folder put
# on PYTHONPATH, for the project's pure-Python dependencies a GPU image may lack (gguf,
# omegaconf, hydra-core, antlr4-python3-runtime; `make gpu-wheels` downloads them into .whl/).
# SPECDEC_COMMIT=<sha>: the commit the results record (benchmarks.harness.git_commit); set
# it where the tree was copied without an up-to-date .git (a device runner's copy reported a
# stale HEAD), e.g. SPECDEC_COMMIT=<sha> bash benchmarks/gpu_check.sh.
# The tests run in parallel (pytest-xdist, -n $TEST_WORKERS, default 8) where it is installed:
# on a GPU most of their time is Triton compiling kernels, which parallelises.
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
TOTAL_S=${TOTAL_S:-560}
STEPS=${STEPS:-tests tune_gemv bench_kernels bench_attention bench_rejection bench_e2e bench_streamed main_job report}
TIMEOUT_TESTS=${TIMEOUT_TESTS:-120}  # H200, 8 workers: 74 tests in 54-58 s (2026-12-04); 97 now (the Triton batch-invariant ones never ran on a GPU)
TIMEOUT_COMPILE_CHECK=${TIMEOUT_COMPILE_CHECK:-45}
TIMEOUT_BENCH_KERNELS=${TIMEOUT_BENCH_KERNELS:-150}  # H200: 58 s, 65 s with graph timing (2026-12-04); + the k-quant layout A/B
TIMEOUT_BENCH_ATTENTION=${TIMEOUT_BENCH_ATTENTION:-60}
TIMEOUT_BENCH_REJECTION=${TIMEOUT_BENCH_REJECTION:-40}
TIMEOUT_BENCH_E2E=${TIMEOUT_BENCH_E2E:-130}
TIMEOUT_BENCH_STREAMED=${TIMEOUT_BENCH_STREAMED:-60}
TIMEOUT_REPORT=${TIMEOUT_REPORT:-20}
TIMEOUT_TUNE_GEMV=${TIMEOUT_TUNE_GEMV:-150}
TIMEOUT_MAIN_JOB=${TIMEOUT_MAIN_JOB:-150}
TUNE_ARGS=${TUNE_ARGS:---formats int4 q4_1}
mkdir -p "$RESULTS_DIR"
DATE=$(date -u +%F)
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
step() { # step NAME COMMAND...: run it under its timeout, log it, record the outcome
  local name=$1
  shift
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  local var limit left
  var="TIMEOUT_$(echo "$name" | tr '[:lower:]' '[:upper:]')"
  limit=${!var}
  left=$((TOTAL_S - SECONDS))
  if [ "$left" -lt 15 ]; then
    log "== $name: SKIPPED (${left}s of TOTAL_S=${TOTAL_S}s left)"
    FAILED+=("$name")
    SUMMARY+=("$name: skipped, out of time")
    return 0
  fi
  [ "$limit" -le "$left" ] || limit=$left
  log ""
  log "== $name (timeout ${limit}s): $*"
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$LOG"
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

if [ -n "${WHEELS:-}" ]; then
  SITE=$(mktemp -d)
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    "$WHEELS"/*.whl >>"$LOG" 2>&1 || { log "installing $WHEELS/*.whl failed"; exit 1; }
  export PYTHONPATH="$PYTHONPATH:$SITE"
  log "installed $(ls "$WHEELS" | tr '\n' ' ')into $SITE"
fi
XDIST=()
if "$PYTHON" -c 'import xdist' 2>/dev/null; then XDIST=(-n "${TEST_WORKERS:-8}"); fi

log "gpu_check $DATE (DRY_RUN=$DRY_RUN), repo $REPO, commit $("$PYTHON" -c 'from benchmarks.harness import git_commit; print(git_commit())' 2>/dev/null || echo unknown)"
log "python: $PYTHON; results: $RESULTS_DIR; steps: $STEPS"
command -v nvidia-smi >/dev/null 2>&1 &&
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$LOG"
"$PYTHON" -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "cuda", torch.cuda.is_available())' 2>&1 | tee -a "$LOG"

# the embedded model for the GPU tests and main_job: parts made by `make gpu-model-parts` and
# carried in .gpucache/ are joined into $SPECDEC_CACHE first (before the tests, which skip
# the SmolLM2 checks without it)
MODEL_FILE=$("$PYTHON" -c 'from specdec.models.registry import REGISTRY, cache_file
print(cache_file(REGISTRY["smollm2-135m"]))' 2>>"$LOG")
if [ "$DRY_RUN" != 1 ] && [ -n "$MODEL_FILE" ] && [ ! -f "$MODEL_FILE" ] &&
  ls .gpucache/smollm2-135m.part-* >/dev/null 2>&1; then
  mkdir -p "$(dirname "$MODEL_FILE")" && cat .gpucache/smollm2-135m.part-* >"$MODEL_FILE.part" &&
    mv "$MODEL_FILE.part" "$MODEL_FILE" && log "joined .gpucache/smollm2-135m.part-* into $MODEL_FILE"
fi

# only the folders holding gpu-marked tests: tests/experiments needs hydra, which the GPU
# image does not have (collecting it would abort the whole run); a module that still fails
# to import is reported as an error without stopping the others
step tests "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors \
  --tb=short "${XDIST[@]}" tests/kernels tests/models tests/decode
if [ -f benchmarks/compile_check.py ]; then
  step compile_check "$PYTHON" -m benchmarks.compile_check --quick
fi
# tune the GEMV for this GPU (benchmarks/tune_gemv.py: $RESULTS_DIR/gemv-tuned.json and
# -runs.json, whole-model steps with and without the table); the later steps use the table
TUNE_S=$((TOTAL_S - SECONDS))
[ "$TUNE_S" -lt "$TIMEOUT_TUNE_GEMV" ] || TUNE_S=$TIMEOUT_TUNE_GEMV
# shellcheck disable=SC2086 # TUNE_ARGS: more options, word-split on purpose
step tune_gemv "$PYTHON" -m benchmarks.tune_gemv "${QUICK[@]}" --budget-s $((TUNE_S * 3 / 5)) \
  --table "$RESULTS_DIR/gemv-tuned.json" ${TUNE_ARGS:-}
if [ -f "$RESULTS_DIR/gemv-tuned.json" ]; then
  SPECDEC_GEMV_TUNING="$(cd "$RESULTS_DIR" && pwd)/gemv-tuned.json"
  export SPECDEC_GEMV_TUNING
  log "the following steps use the tuned GEMV table $SPECDEC_GEMV_TUNING"
fi
for bench in bench_kernels bench_attention bench_rejection; do
  step "$bench" "$PYTHON" -m "benchmarks.$bench" "${QUICK[@]}" --out "$RESULTS_DIR"
done
E2E_S=$((TOTAL_S - SECONDS)) # bench_e2e skips sections past its budget: what its step gets
[ "$E2E_S" -lt "$TIMEOUT_BENCH_E2E" ] || E2E_S=$TIMEOUT_BENCH_E2E
step bench_e2e "$PYTHON" -m benchmarks.bench_e2e "${QUICK[@]}" --out "$RESULTS_DIR" \
  --budget-s $((E2E_S - 25))
step bench_streamed "$PYTHON" -m benchmarks.bench_streamed "${QUICK[@]}" --out "$RESULTS_DIR"
# the main job on the embedded model (README's `make run`) on this GPU, in bf16: needs the
# model in $SPECDEC_CACHE (no network here; joined from .gpucache/ above); skipped without it
if [ "$DRY_RUN" != 1 ] && [[ " $STEPS " == *" main_job "* ]]; then
  if [ -n "$MODEL_FILE" ] && "$PYTHON" -c 'import sys
from specdec.models.registry import REGISTRY, cache_file, verify_cached
m = REGISTRY["smollm2-135m"]
sys.exit(0 if verify_cached(cache_file(m), m.sha256) else 1)' 2>>"$LOG"; then
    step main_job "$PYTHON" -m experiments.run device=cuda dtype=bfloat16 \
      "hydra.run.dir=$RESULTS_DIR/main-job-cuda"
  else
    log "== main_job: SKIPPED (the embedded model is not in the cache, ${MODEL_FILE:-?}, or its sha256 differs)"
    SUMMARY+=("main_job: skipped, no model")
  fi
fi
COMBINED=$(ls -t "$RESULTS_DIR"/"$DATE"-*.json 2>/dev/null | head -n 1)
if [ -n "$COMBINED" ]; then
  step report "$PYTHON" -m benchmarks.report "$COMBINED"
fi

log ""
log "== summary"
for line in "${SUMMARY[@]}"; do log "  $line"; done
ls -l "$RESULTS_DIR" | tee -a "$LOG"
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
  # a runner may take back only a few files: the log, the combined JSON, everything in a tar
  cp "$RESULTS_DIR"/"$DATE"-* "$OUT"/ 2>/dev/null
  tar -czf "$OUT/gpu-results.tar.gz" -C "$RESULTS_DIR" . 2>/dev/null
  log "copied the log, the combined results and gpu-results.tar.gz ($RESULTS_DIR) to $OUT"
fi
if [ ${#FAILED[@]} -gt 0 ]; then
  log "failed: ${FAILED[*]}"
  exit 1
fi
log "all steps passed"
