#!/usr/bin/env bash
# The wheels a GPU machine without network access needs for tools/gpu_session.sh's compiled step, fetched where
# pip reaches PyPI (docs/gpu_benchmark.md, "Compiled rollouts"): flowrl built from this checkout, diffusers and its
# importlib_metadata, torchao for fp8:kernel=torchao, for Python 3.12 on x86-64 Linux (the machine's Python already
# holding torch >= 2.11 and flowrl's other dependencies).
#
#   tools/gpu_wheels.sh [DIR]      (default .whl; there: python3 -m pip install -q --no-index --no-deps
#                                   --target /tmp/site DIR/*.whl && export PYTHONPATH=/tmp/site)
set -eu
DIR=${1:-.whl}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
mkdir -p "$DIR"
rm -f "$DIR"/flowrl-*.whl
$PY -m pip wheel -q --no-deps --no-build-isolation -w "$DIR" "$ROOT"
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$DIR" \
  diffusers==0.42.1 importlib_metadata torchao==0.18.0
ls -l "$DIR"
