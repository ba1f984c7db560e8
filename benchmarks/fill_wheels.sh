#!/usr/bin/env bash
# Fill .whl/ (git ignores it) with what benchmarks/gpu_check.sh installs offline on a GPU machine
# that has no package index: archlab itself, the pure-Python packages the device image lacks,
# fla, and mamba-ssm without its CUDA extensions (archlab calls only its Triton kernels). Run it
# where a package index is reachable, after every change to archlab, then carry .whl along.
#   bash benchmarks/fill_wheels.sh [DEVICE_PYTHON_VERSION]   # 3.12 by default
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
VERSION=${1:-3.12}
quiet() { grep -v -e "^WARNING: Location" || true; }
rm -rf .whl build
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version "$VERSION" \
    --platform manylinux2014_x86_64 -d .whl pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection \
    typing-extensions flash-linear-attention==0.6.0 fla-core==0.6.0 einops \
    optuna==5.1.0 sqlalchemy==2.1.9 alembic==1.20.1 colorlog==6.12.0 mako==1.4.3 2>&1 | quiet  # studies (the commands section)
MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE "$PY" -m pip wheel -q --disable-pip-version-check --no-deps \
    --no-build-isolation -w .whl mamba-ssm==2.3.2.post1 2>&1 | quiet
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w .whl . 2>&1 | quiet
rm -rf build
du -ch .whl/*.whl
