#!/usr/bin/env bash
# Downloads, on the development machine (which has a package index), the
# wheels of every package in scripts/gpu_wheels.txt into .whl/ (git-ignored),
# for the GPU machine's Python (3.12, x86-64 Linux).  That folder travels with
# the GPU run and scripts/gpu_check.sh installs it before anything else:
#
#   scripts/fetch_gpu_wheels.sh            # once, here
#   scripts/gpu_check.sh "$OUT"            # there, with .whl/ carried along
#
# Without their dependencies (--no-deps): what they need beyond the image
# (torch and triton above all) never comes from here.
#
# Knobs: GPU_PYTHON_VERSION (default 3.12), PYTHON (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
dest=.whl
mkdir -p "$dest"
mapfile -t wanted < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' scripts/gpu_wheels.txt | grep .)
[ ${#wanted[@]} -gt 0 ] || { echo "fetch_gpu_wheels: nothing listed"; exit 0; }
"$PY" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
  --python-version "${GPU_PYTHON_VERSION:-3.12}" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any \
  -d "$dest" "${wanted[@]}"
echo "fetch_gpu_wheels: $(ls "$dest"/*.whl | wc -l) wheel(s) in $dest/: $(cd "$dest" && ls *.whl | paste -sd' ' -)"
