#!/usr/bin/env bash
# The one script a lent GPU runs: install archlab and the kernel packages beside the machine's
# torch, then check (benchmarks/gpu_check.py).
#   bash benchmarks/gpu_check.sh OUT_DIR [gpu_check.py options]
# Where .whl/ exists (fill it with benchmarks/fill_wheels.sh, where an index is reachable), its
# wheels are installed offline, and the checkout itself comes first on the path: the archlab
# measured is this tree's, whatever wheel of it .whl/ holds (the wheel adds its entry points).
# Without .whl/, `pip install -e .[cuda]` goes into a venv that sees the system's torch.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results}
shift || true
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv
if [ -d .whl ]; then
    tag=$(python3 -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
    if ! ls .whl/pydantic_core-*-"$tag"-*.whl >/dev/null 2>&1; then
        echo "gpu_check: .whl/ holds no wheels for this machine's Python ($tag): fill it with" \
             "bash benchmarks/fill_wheels.sh ${tag:2:1}.${tag:3}" >&2
        exit 2
    fi
    # --upgrade: a second call on a warm machine takes the wheels carried now, not the last call's
    python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/archlab-site .whl/*.whl
    export PYTHONPATH="$PWD:/tmp/archlab-site"
    if [ -d /tmp/archlab-site/mamba_ssm ] && ! python3 -c "import selective_scan_cuda" 2>/dev/null; then
        # mamba-ssm's package imports Mamba1's CUDA scan, which archlab never calls and a build
        # without extensions lacks: a stand-in lets the Triton kernels load
        echo '"""Stand-in for mamba-ssm'"'"'s Mamba1 CUDA scan, not built here."""' > /tmp/archlab-site/selective_scan_cuda.py
    fi
    PY=python3
else
    echo "gpu_check: no .whl/ here, so the extras come from a package index (a machine without one: fill .whl/ with" \
         "benchmarks/fill_wheels.sh and carry it along)" >&2
    python3 -m venv --system-site-packages .venv-gpu
    .venv-gpu/bin/pip install -q --retries 1 --timeout 20 -e ".[cuda]" || .venv-gpu/bin/pip install -q --retries 1 --timeout 20 -e . "flash-linear-attention==0.6.0" triton
    PY=.venv-gpu/bin/python
fi
$PY -c "import torch; from archlab.environment import describe, environment; print(describe(environment(torch.device('cuda'))))"
PYTHONUNBUFFERED=1 $PY benchmarks/gpu_check.py --out "$OUT" "$@"
