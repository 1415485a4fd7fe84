#!/usr/bin/env bash
# The two entry points of the README, on a fresh machine or an existing one:
#
#   ./run.sh demo            build (if needed) and load the kernels, run every op
#   ./run.sh test [ARGS]     run the test suite (ARGS go to pytest)
#
# Each installs what it needs into the current Python environment ($PYTHON,
# default python3).  An installed torch (>= 2.10) is used as it is; with none,
# torch==$TORCHOPS_TORCH_VERSION (default 2.13.0) is installed, with
# $TORCHOPS_TORCH_PIP_ARGS passed to pip (e.g. an index of CPU-only wheels).
# torchops is built with --no-build-isolation, against that torch: pip's
# build isolation would download a second, multi-GB torch to build against.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in demo|test) ;; *) sed -n '2,13p' "$0"; exit 2 ;; esac

pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "run.sh: no torch in $("$PY" -c 'import sys; print(sys.prefix)'); installing torch==${TORCHOPS_TORCH_VERSION:-2.13.0}"
  # shellcheck disable=SC2086
  pip_install "torch==${TORCHOPS_TORCH_VERSION:-2.13.0}" ${TORCHOPS_TORCH_PIP_ARGS:-}
fi
# (torch warns at import when numpy, which it does not need here, is missing)
"$PY" -W "ignore:Failed to initialize NumPy:UserWarning" - <<'PYEOF'
import sys, torch
v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
if v < (2, 10):
    sys.exit(f"run.sh: torch {torch.__version__} is too old; torchops needs torch >= 2.10")
print(f"run.sh: using torch {torch.__version__} (CUDA {torch.version.cuda or 'none'})")
PYEOF

# Whether the editable torchops of this checkout is installed with libraries
# built from the current sources (their manifests' sources hash, torch and
# flags): pip builds an editable install from scratch in a fresh folder, so
# reinstalling unchanged sources would recompile every kernel.
installed_up_to_date() {
  "$PY" - "$cmd" <<'PYEOF'
import importlib.util, os, sys
from pathlib import Path
root = Path.cwd()
spec = importlib.util.find_spec("torchops")
if spec is None or spec.origin is None or Path(spec.origin).resolve().parent != root / "torchops":
    sys.exit(1)
if sys.argv[1] == "test" and any(
        importlib.util.find_spec(m) is None for m in ("pytest", "expecttest", "hypothesis")):
    sys.exit(1)
# By path: importing the torchops package would load (or build) its libraries.
b_spec = importlib.util.spec_from_file_location("torchops_build", root / "torchops" / "_build.py")
b = importlib.util.module_from_spec(b_spec)
sys.modules[b_spec.name] = b
b_spec.loader.exec_module(b)
reason = b.stale_prebuilt(root / "torchops", root / "csrc")
if reason is not None:
    print(f"run.sh: reinstalling torchops: {reason}")
    sys.exit(1)
PYEOF
}

if installed_up_to_date; then
  echo "run.sh: torchops is installed from this checkout and built from its sources"
else
  # Build requirements (no build isolation), then torchops itself, editable.
  pip_install "setuptools>=77" wheel ninja filelock
  extra=""
  [ "$cmd" = test ] && extra="[test]"
  pip_install --no-build-isolation -e ".${extra}"
fi

if [ "$cmd" = demo ]; then
  exec "$PY" -m torchops demo "$@"
fi
exec "$PY" -m pytest test "$@"
