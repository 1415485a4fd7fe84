#!/usr/bin/env bash
# The GPU check: everything that needs a GPU, in one command, in under 10 minutes.
#
#   scripts/gpu_check.sh [OUTDIR]          (default OUTDIR: gpu-check/)
#
# Steps (docs/benchmarks.md explains each):
#   wheels     installs the wheels in .whl/ (scripts/fetch_gpu_wheels.sh fetched
#              them on the development machine: what the GPU image lacks)
#   env        versions of everything involved; anything missing fails the
#              check here, before the long steps
#   build-aot  pip install --no-build-isolation --no-deps --no-index -e . with
#              TORCHOPS_CUDA=1 (CPU + CUDA libraries ahead of time), then a smoke
#              test that both load prebuilt and compute right on the GPU
#   jit-build  a fresh cache and TORCHOPS_PREBUILT=0: both libraries built just in
#              time, then the same smoke test                    } these run
#   precompile torch.compile of every benchmarked reference, once  } at the
#   tests      the GPU-side tests (-m cuda) and the gates, long    } same time
#              profile (CPU CI runs the CPU-side suite)              }
#   memcheck   compute-sanitizer memcheck on one op family's       }
#   racecheck  CUDA tests, racecheck on the shared-memory kernels  }
#   bench      python -m torchops bench --device cuda,cpu, regenerating
#              docs/performance.md
# then a summary table, printed last.  OUTDIR receives six files:
#   summary.txt  gpu_check.log (every step's output)  bench.csv  bench.json
#   bench.png (with matplotlib)  performance.md (a copy of docs/performance.md)
#
# Nothing is downloaded.  Every step must pass: a step that cannot run (a
# missing module or tool, no time left) is FAILED, and the exit status is 1.
# Environment knobs: PYTHON (default python3),
# GPU_CHECK_BUDGET (seconds for the whole check, default 570),
# GPU_CHECK_TEST_ARGS (extra pytest arguments), GPU_CHECK_MEMCHECK_K and
# GPU_CHECK_RACECHECK_K (pytest -k expressions for the sanitizer runs),
# GPU_CHECK_BENCH_ARGS (extra bench arguments, e.g. --slow), TORCHOPS_COMMIT
# (the commit to name in the reports where the checkout has no .git),
# GPU_CHECK_PART (below).
#
# GPU_CHECK_PART=tests, then GPU_CHECK_PART=bench, then
# GPU_CHECK_PART=racecheck: the check in three commands, each with the whole
# budget, for when the benchmarks and racecheck no longer fit beside the
# tests in one (every CPU row included; racecheck needs ~300 s after its own
# build on a 16-core GPU machine).  "tests" runs every
# step but racecheck and bench (its precompile fills the compile caches a
# bench on the same machine reads); "bench" runs wheels, env, build-aot
# (incremental on the same machine) and bench; "racecheck" runs wheels, env,
# jit-build (with every core) and racecheck.  The default, "all", is every
# step in one.
#
# GPU_CHECK_OPS=<families> (a comma list of the op database's families:
# basic, boxes, roi, losses, deform, masked_conv, upsample, norms, softmax,
# activations, rotary, optim, deform_attn, rotated; `python
# scripts/gpu_check_families.py --list` maps them to ops and test files):
# one family's check in one command on a fresh machine, build included.  It
# runs wheels, env, build-aot, then tests (the gates, and the family's
# CUDA-side tests: its own test file and the op database's generic tests,
# the fuzzer's included, selected with -k by op name), memcheck and
# racecheck on the family's tests, and bench on the family's rows only,
# merged into docs/performance.md (python -m torchops bench --merge-doc:
# other rows stay, each row names the run that measured it).  racecheck
# runs on the normal build, the setmaxnreg kernels uninstrumented; for the
# families whose ops run those kernels (basic, deform) a JIT build without
# setmaxnreg goes beside build-aot, each with half the cores, and racecheck
# runs on it.  GPU_CHECK_BENCH_RESERVE (default 150) is the seconds kept for
# the bench.  docs/benchmarks.md says which families a change needs.
#
# GPU_CHECK_DRY_RUN=1: print every step's command and the summary without
# running anything (no GPU needed): the plan of a configuration.
set -uo pipefail
PART=${GPU_CHECK_PART:-all}
OPS=${GPU_CHECK_OPS:-}
DRY=${GPU_CHECK_DRY_RUN:-0}
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${1:-gpu-check}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"   # this checkout's torchops, always
BUDGET=${GPU_CHECK_BUDGET:-570}
# memcheck: every op family in every dtype, forward and backward, the bad
# inputs, the deterministic backwards (test_roi.py) and every matmul path
# (test_matmul.py's sanitizer shapes, simt90's TMA-fed float32 kernel in
# big_tile_f32_sanitizer_shapes; the sm90 path's 3xTF32 mode through
# test_deform.py's 3xtf32_in_kernel).  racecheck: every op whose kernels use
# shared memory (matmul's paths, box_iou's and nms's box tiles, the focal
# loss's block reduction, carafe's and masked_conv2d's tiles, the RoI
# gather backward's output tiles), forward and backward.
MEMCHECK_K=${GPU_CHECK_MEMCHECK_K:-"correctness or grad_vs_reference or error_inputs or deterministic or gather_backward or sanitizer_shapes or 3xtf32_in_kernel"}
RACECHECK_K=${GPU_CHECK_RACECHECK_K:-"(correctness or grad_vs_reference) and (matmul or box_iou or nms or sigmoid_focal_loss or carafe or masked_conv2d or rms_norm or layer_norm or rotary_embedding or silu_and_mul or gelu_and_mul or masked_softmax) or gather_backward or sanitizer_shapes or 3xtf32_in_kernel"}
T0=$(date +%s)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
case "$PART" in
  all) STEPS=(wheels env build-aot jit-build precompile tests memcheck racecheck bench) ;;
  tests) STEPS=(wheels env build-aot jit-build precompile tests memcheck) ;;
  bench) STEPS=(wheels env build-aot bench) ;;
  racecheck) STEPS=(wheels env jit-build racecheck) ;;
  *) echo "gpu_check: GPU_CHECK_PART must be all, tests, bench or racecheck, not '$PART'" >&2
     exit 2 ;;
esac
FAMILY_SETMAXNREG=0
if [ -n "$OPS" ]; then
  if [ "$PART" != all ]; then
    echo "gpu_check: GPU_CHECK_OPS runs the family's whole check; leave GPU_CHECK_PART unset" >&2
    exit 2
  fi
  PLAN=$("$PY" scripts/gpu_check_families.py --shell "$OPS") || exit 2
  eval "$PLAN"
  if [ "$FAMILY_SETMAXNREG" = 1 ]; then
    STEPS=(wheels env jit-build build-aot tests memcheck racecheck bench)
  else
    STEPS=(wheels env build-aot tests memcheck racecheck bench)
  fi
  PART="ops $FAMILY_NAMES"
  # The family's share of the sanitizer runs: their usual selection, on the
  # family's tests (its own file, and its ops' ids in test_ops.py).
  MEMCHECK_K="($MEMCHECK_K) and ($FAMILY_K)"
  RACECHECK_K="($RACECHECK_K) and ($FAMILY_K)"
fi
has_step() { [[ " ${STEPS[*]} " == *" $1 "* ]]; }
rm -f "$OUT"/{summary.txt,gpu_check.log,bench.csv,bench.json,bench.png,performance.md}

say() { echo "[gpu_check $(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
# min(a, b), at least 1
cap() { local v=$(( $1 < $2 ? $1 : $2 )); echo $(( v < 1 ? 1 : v )); }

# step NAME LIMIT CMD...: run CMD with a time limit; output to $TMP/NAME.log;
# exit status and seconds to $TMP/NAME.rc and $TMP/NAME.secs.
step() {
  local name=$1 limit=$2
  shift 2
  local t0
  t0=$(date +%s)
  echo "\$ $*" > "$TMP/$name.log"
  if [ "$DRY" = 1 ]; then
    printf '[dry run] %s (limit %s s):' "$name" "$limit"; printf ' %q' "$@"; echo
    echo 0 > "$TMP/$name.rc"
  else
    timeout -k 20 "$limit" "$@" >> "$TMP/$name.log" 2>&1
    echo $? > "$TMP/$name.rc"
  fi
  echo $(( $(date +%s) - t0 )) > "$TMP/$name.secs"
  echo "$limit" > "$TMP/$name.limit"
}
# A step that could not run is a failure, never a skip.
cannot() { echo "cannot" > "$TMP/$1.rc"; echo 0 > "$TMP/$1.secs"; echo "$2" > "$TMP/$1.note"; }
status() {
  local rc
  rc=$(cat "$TMP/$1.rc" 2>/dev/null || echo "not run")
  case "$rc" in
    0) echo ok ;;
    124|137) echo TIMEOUT ;;
    cannot) echo "FAILED(cannot run)" ;;
    "not run") echo "FAILED(not run)" ;;
    *) echo "FAILED($rc)" ;;
  esac
}
finished() {  # report a step as it ends, with the end of its log when it failed
  local st
  st=$(status "$1")
  say "$1: $st ($(cat "$TMP/$1.secs" 2>/dev/null || echo '?') s)"
  if [ "$st" != ok ] && [ -f "$TMP/$1.log" ]; then tail -n 25 "$TMP/$1.log" | sed 's/^/    /'; fi
}

# --- wheels -------------------------------------------------------------------------------
# The GPU machine has no network: what its image lacks travels as wheels in
# .whl/ (scripts/fetch_gpu_wheels.sh), installed into a private folder.
SITE="$TMP/site"
if compgen -G "$ROOT/.whl/*.whl" > /dev/null; then
  step wheels 120 "$PY" -m pip install --disable-pip-version-check -q --no-index --no-deps \
    --no-compile --target "$SITE" "$ROOT"/.whl/*.whl
  [ "$(cat "$TMP/wheels.rc")" = 0 ] && echo "installed: $(cd "$ROOT/.whl" && ls *.whl | paste -sd' ' -)" \
    > "$TMP/wheels.note"
else
  echo "\$ (no .whl/ folder: nothing carried)" > "$TMP/wheels.log"
  echo 0 > "$TMP/wheels.rc"; echo 0 > "$TMP/wheels.secs"
  echo "none carried (scripts/fetch_gpu_wheels.sh makes .whl/)" > "$TMP/wheels.note"
fi
export PYTHONPATH="$PYTHONPATH:$SITE"
finished wheels

# --- env ----------------------------------------------------------------------------------
SANITIZER=$(command -v compute-sanitizer)
for d in "${CUDA_HOME:-/usr/local/cuda}/bin" "$(dirname "$(command -v nvcc || echo /x/nvcc)")"; do
  [ -z "$SANITIZER" ] && [ -x "$d/compute-sanitizer" ] && SANITIZER=$d/compute-sanitizer
done
SANITIZER=${SANITIZER:-compute-sanitizer}
step env 60 env PY="$PY" SANITIZER="$SANITIZER" bash -c '
  echo "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader)"
  echo "cpus: $(nproc)"
  "$PY" -c "import sys, torch; print(\"python\", sys.version.split()[0]); print(\"torch\", torch.__version__, \"CUDA\", torch.version.cuda, \"GPU available:\", torch.cuda.is_available())"
  "$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null || echo "MISSING: a CUDA GPU that torch can use"
  for m in torchvision matplotlib expecttest hypothesis pytest ninja setuptools filelock; do
    "$PY" -c "import $m; print(\"$m\", getattr($m, \"__version__\", \"?\"))" 2>/dev/null || echo "MISSING: $m"
  done
  # Optional: without it the bench skips its Liger peers (a note per row).
  "$PY" -c "import importlib.metadata as m; v = m.version(\"liger_kernel\"); import liger_kernel.transformers.functional; print(\"liger_kernel\", v)" 2>&1 | tail -n 1 | sed "s/^/liger_kernel (optional, bench peers): /"
  echo "nvcc: $(command -v nvcc) $(nvcc --version 2>/dev/null | grep -o "release [0-9.]*")"
  command -v nvcc > /dev/null || echo "MISSING: nvcc"
  echo "compute-sanitizer: $SANITIZER"; command -v "$SANITIZER" > /dev/null || echo "MISSING: compute-sanitizer"
  echo "checkout: ${TORCHOPS_COMMIT:-$(git log -1 --oneline 2>/dev/null)}"'
# Anything missing fails the check now, before minutes go into steps that
# would fail for that reason (or, worse, pass without testing).
grep -q '^MISSING: ' "$TMP/env.log" && echo 1 > "$TMP/env.rc"
ENV_NOTE=$(grep '^MISSING: ' "$TMP/env.log" | sed 's/MISSING: //' | sort -u | paste -sd, -)
[ -n "$ENV_NOTE" ] && echo "missing: $ENV_NOTE (Python packages: add them to scripts/gpu_wheels.txt, run scripts/fetch_gpu_wheels.sh, carry .whl/)" > "$TMP/env.note"
finished env

# The steps that need a complete environment (a function, so a failed env
# step can skip straight to the summary, marking them as failed).
run_steps() {
# The JIT build is also racecheck's library: built without setmaxnreg, on
# which racecheck's instrumented kernels deadlock (csrc/cuda/matmul/tma.cuh).
JIT_ENV=(TORCHOPS_PREBUILT=0 TORCHOPS_CUDA=1 TORCHOPS_CACHE_DIR="$TMP/jit-cache"
         TORCHOPS_TESTING_NO_SETMAXNREG=1)
# The sanitizers' test files: every family's, or the named families' own.
SAN_FILES=(test/test_ops.py test/test_roi.py test/test_matmul.py test/test_deform.py
           test/test_masked_conv2d.py test/test_upsample.py)
RACE_FILES=(test/test_ops.py test/test_matmul.py test/test_roi.py test/test_deform.py)
if [ -n "$OPS" ]; then
  read -r -a SAN_FILES <<< "test/test_ops.py $FAMILY_OWN_FILES"
  RACE_FILES=("${SAN_FILES[@]}")
fi
# run_racecheck LIMIT: racecheck on the JIT build, or why it cannot run.  A
# family whose ops never run the setmaxnreg kernels racechecks the normal
# build instead, those kernels left uninstrumented (they cannot deadlock
# racecheck then, and are not the family's).
run_racecheck() {
  local on=("${JIT_ENV[@]}") skip=()
  if [ -n "$OPS" ] && [ "$FAMILY_SETMAXNREG" = 0 ]; then
    on=(TORCHOPS_CUDA=1)
    skip=(--kernel-name-exclude "kns=$SETMAXNREG_KERNELS")
  elif [ "$(cat "$TMP/jit-build.rc" 2>/dev/null)" != 0 ]; then
    cannot racecheck "no JIT build to run (the jit-build step failed or ran out of time)"
    return
  fi
  step racecheck "$1" env "${on[@]}" \
    "$SANITIZER" --tool racecheck --kernel-name kns=torchops "${skip[@]}" --error-exitcode 99 \
    --print-limit 20 "$PY" -m pytest "${RACE_FILES[@]}" -q -p no:cacheprovider -m cuda \
    -k "$RACECHECK_K"
}
# What has compute-sanitizer (a dry run needs none).
have_sanitizer() { [ "$DRY" = 1 ] || command -v "$SANITIZER" > /dev/null; }

if [ "$PART" = racecheck ]; then
  say "jit-build: the racecheck build, every core ..."
  step jit-build "$(cap 300 "$(left)")" env "${JIT_ENV[@]}" MAX_JOBS="$(nproc)" \
    "$PY" scripts/smoke.py --expect jit-built
  finished jit-build
  if ! have_sanitizer; then
    cannot racecheck "compute-sanitizer not found"
  else
    say "racecheck (at most $(( $(left) - 10 ))s) ..."
    run_racecheck "$(cap 99999 "$(( $(left) - 10 ))")"
  fi
  finished racecheck
  return 0
fi

# --- build-aot ------------------------------------------------------------------------------
# A family run that racechecks the JIT build makes both builds at once, each
# with half the cores: the longest translation units, not the core count,
# bound either build.
AOT_JOBS=$(nproc)
JIT_PID=
if [ -n "$OPS" ] && has_step jit-build; then
  AOT_JOBS=$(( $(nproc) / 2 > 1 ? $(nproc) / 2 : 1 ))
  say "jit-build: the racecheck build, beside build-aot ..."
  ( step jit-build "$(cap 330 "$(left)")" env "${JIT_ENV[@]}" MAX_JOBS="$AOT_JOBS" \
      "$PY" scripts/smoke.py --expect jit-built ) &
  JIT_PID=$!
fi
say "build-aot: pip install -e . (CPU + CUDA libraries) ..."
step build-aot "$(cap 300 "$(left)")" env TORCHOPS_CUDA=1 MAX_JOBS="$AOT_JOBS" bash -c \
  "'$PY' -m pip install --disable-pip-version-check --no-build-isolation --no-deps --no-index -e . \
   && '$PY' scripts/smoke.py --expect prebuilt"
finished build-aot

if has_step tests; then
# --- jit-build, tests, memcheck + racecheck: at the same time -----------------------------------
# The benchmarks need the machine to themselves afterwards: keep ~200 s for
# them (when this command runs them).
RESERVE=10
has_step bench && RESERVE=$([ -n "$OPS" ] && echo "${GPU_CHECK_BENCH_RESERVE:-150}" || echo 200)
WINDOW=$(( $(left) - RESERVE ))
[ "$WINDOW" -lt 60 ] && WINDOW=60
say "$(has_step precompile && echo 'jit-build, precompile, ')tests, memcheck+racecheck in parallel (at most ${WINDOW}s) ..."
WSTART=$(date +%s)
if [ -z "$OPS" ]; then
( step jit-build "$(cap 300 "$WINDOW")" env "${JIT_ENV[@]}" MAX_JOBS=8 \
    "$PY" scripts/smoke.py --expect jit-built ) &
JIT_PID=$!
fi
PRE_PID=
RACE_PID=
if has_step precompile; then
# Fill torch.compile's on-disk caches (inductor's FX graph cache, Triton's and
# the C++ kernels') with every compiled variant the benchmarks will time, so
# the bench step below compiles from them instead of spending its budget.
# shellcheck disable=SC2086
# Its own --time-budget, inside the step's limit: rows it has no time for are
# "not run" (the bench step compiles them itself), not a failed step.
PRE_LIMIT=$(cap 300 "$WINDOW")
( step precompile "$PRE_LIMIT" "$PY" -m torchops bench --device cuda,cpu \
    --compile-only --time-budget $(( PRE_LIMIT > 60 ? PRE_LIMIT - 40 : PRE_LIMIT / 2 )) \
    ${GPU_CHECK_BENCH_ARGS:-} ) &
PRE_PID=$!
fi
if have_sanitizer; then
  (
    # No caching allocator: an out-of-bounds access lands outside any
    # allocation instead of inside a cached block.
    # Only torchops's kernels are instrumented (kns: a substring of the kernel
    # name; all of them live in namespace torchops): faster, and no reports
    # about PyTorch's own kernels.
    step memcheck "$(cap 240 "$WINDOW")" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SANITIZER" \
      --tool memcheck --kernel-name kns=torchops --error-exitcode 99 --print-limit 20 \
      "$PY" -m pytest "${SAN_FILES[@]}" -q -p no:cacheprovider -m cuda -k "$MEMCHECK_K"
    # racecheck ("all" only) runs the JIT build (above), once it is there.
    if has_step racecheck && [ -z "$OPS" ]; then
      while [ ! -f "$TMP/jit-build.rc" ] && [ "$(left)" -gt 10 ]; do sleep 2; done
      run_racecheck "$(cap 300 "$(( WINDOW - ($(date +%s) - WSTART) ))")"
    fi
  ) &
  SAN_PID=$!
  # A family's racecheck goes beside its memcheck: both are short, and the
  # window is the build's remainder.
  if [ -n "$OPS" ]; then
    (
      while has_step jit-build && [ ! -f "$TMP/jit-build.rc" ] && [ "$(left)" -gt 10 ]; do
        sleep 2
      done
      run_racecheck "$(cap 330 "$(( WINDOW - ($(date +%s) - WSTART) ))")"
    ) &
    RACE_PID=$!
  fi
else
  cannot memcheck "compute-sanitizer not found"
  has_step racecheck && cannot racecheck "compute-sanitizer not found"
  SAN_PID=
fi
# The GPU-side suite: every test marked cuda (the opdb tests on the GPU, the
# CUDA-only properties, export and compile of the CUDA kernels) in the long
# profile, plus the files that read the loaded libraries (the gates, the
# loader, the model).  The CPU-side tests are CPU CI's job on every landing:
# run here too they doubled the step and pushed it past its window.
# pytest-xdist (in the GPU image) spreads the tests over 4 processes (8
# starved the steps running beside it of the 16 cores).
XDIST=""
"$PY" -c "import xdist" 2> /dev/null && XDIST="-n ${GPU_CHECK_TEST_WORKERS:-4} --dist loadgroup"
TESTS_LIMIT=$(cap 330 "$WINDOW")
# A family's CUDA side: its own file whole, the generic files' tests of its
# ops (-k matches the module name and the test ids, which name the op).
CUDA_SIDE="test --ignore test/test_loader_cache.py"
[ -n "$OPS" ] && CUDA_SIDE="$FAMILY_TEST_FILES -k '$FAMILY_K'"
# shellcheck disable=SC2086
step tests "$TESTS_LIMIT" env TORCHOPS_TEST_PROFILE=full bash -c "
  '$PY' -m pytest test/test_gates.py test/test_loader.py test/test_model.py -q -p no:cacheprovider \
    -rfEs -m 'not slow' ${GPU_CHECK_TEST_ARGS:-} && echo &&
  '$PY' -m pytest $CUDA_SIDE -q -p no:cacheprovider -rfEs --durations=15 -m 'cuda and not slow' \
    $XDIST ${GPU_CHECK_TEST_ARGS:-}"
finished tests
if [ -n "$JIT_PID" ]; then wait "$JIT_PID"; finished jit-build; fi
if [ -n "$PRE_PID" ]; then wait "$PRE_PID"; finished precompile; fi
if [ -n "$SAN_PID" ]; then
  wait "$SAN_PID"; finished memcheck
  if [ -n "$RACE_PID" ]; then wait "$RACE_PID"; fi
  has_step racecheck && finished racecheck
fi
fi
has_step bench || return 0

# --- bench ------------------------------------------------------------------------------------
BENCH_LIMIT=$(( $(left) - 10 ))
if [ "$BENCH_LIMIT" -lt 30 ]; then
  cannot bench "no time left of the ${BUDGET}s budget"
else
  say "bench: cuda then cpu (at most ${BENCH_LIMIT}s) ..."
  # A family's rows only, merged into the report (the other rows stay).
  FAMILY_BENCH=()
  [ -n "$OPS" ] && FAMILY_BENCH=(--op "$FAMILY_OPS" --merge-doc)
  # shellcheck disable=SC2086
  step bench "$BENCH_LIMIT" "$PY" -m torchops bench --device cuda,cpu --out "$OUT" \
    --write-doc docs/performance.md --time-budget $(( BENCH_LIMIT - 60 )) --strict \
    "${FAMILY_BENCH[@]}" ${GPU_CHECK_BENCH_ARGS:-}
  finished bench
  [ -f docs/performance.md ] && cp docs/performance.md "$OUT/performance.md"
fi

}

if [ "$(status wheels)" = ok ] && [ "$(status env)" = ok ]; then
  run_steps
else
  for s in "${STEPS[@]:2}"; do
    cannot "$s" "the wheels or env step failed"
  done
fi

# --- log and summary -----------------------------------------------------------------------------
note() {  # the line of a step's log that says how it went
  [ -f "$TMP/$1.note" ] && { cat "$TMP/$1.note"; return; }
  case "$1:$(cat "$TMP/$1.rc" 2>/dev/null)" in
    tests:5|memcheck:5|racecheck:5) echo "pytest selected no tests"; return ;;
  esac
  [ -f "$TMP/$1.log" ] || return 0
  case "$1" in
    tests) grep -E '(passed|failed|error)' "$TMP/$1.log" | grep -E ' in [0-9.]+s' | tail -n 2 | tr -d '=' \
             | sed 's/^ *//; s/ *$//' | paste -sd';' - | sed 's/;/; then /' ;;
    memcheck|racecheck) grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$TMP/$1.log" | tail -n 1 | sed 's/^=* *//' ;;
    bench) grep -E '^bench: [0-9]+ rows' "$TMP/$1.log" | tail -n 1 ;;
    precompile) grep -E '^bench: compiled' "$TMP/$1.log" | tail -n 1 ;;
    build-aot) grep -E 'smoke ok|SMOKE FAILED|error:|Error' "$TMP/$1.log" | tail -n 1 | cut -c1-150 ;;
    # The CUDA library's own build time too: the step also builds the CPU
    # library, with 8 jobs, beside the tests and sanitizers.
    jit-build) { grep -E 'smoke ok|SMOKE FAILED|error:|Error' "$TMP/$1.log" | tail -n 1 | cut -c1-150
                 grep -oE 'built torchops_cuda in [0-9]+ s' "$TMP/$1.log" | tail -n 1
               } | paste -sd';' - | sed 's/;/; /' ;;
  esac | grep . || grep . "$TMP/$1.log" | tail -n 1 | cut -c1-150
}
{
  for s in "${STEPS[@]}"; do
    echo "=================== $s: $(status "$s") ($(cat "$TMP/$s.secs" 2>/dev/null || echo 0) s of at most $(cat "$TMP/$s.limit" 2>/dev/null || echo -) s) ==================="
    cat "$TMP/$s.log" 2>/dev/null || echo "(no log: $(cat "$TMP/$s.note" 2>/dev/null))"
    echo
  done
} > "$OUT/gpu_check.log"

TOTAL=$(( $(date +%s) - T0 ))
FAILED=0
{
  echo "GPU check$([ "$PART" = all ] || echo " (part $PART)") of ${TORCHOPS_COMMIT:-$(git -C "$ROOT" log -1 --format='%h %s' 2>/dev/null | cut -c1-70)} on" \
       "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1): ${TOTAL}s (budget ${BUDGET}s)"
  printf '%-10s %-11s %7s  %s\n' step status seconds note
  for s in "${STEPS[@]}"; do
    st=$(status "$s")
    [ "$st" = ok ] || FAILED=1
    printf '%-10s %-11s %7s  %s\n' "$s" "$st" "$(cat "$TMP/$s.secs" 2>/dev/null || echo -)" "$(note "$s")"
  done
  echo "files: $(cd "$OUT" && ls | paste -sd' ' -) (in $OUT)"
} > "$OUT/summary.txt"
echo
cat "$OUT/summary.txt"
exit $FAILED
