#!/usr/bin/env bash
# The one script a lent GPU runs: install archlab and the kernel packages beside the machine's
# torch, then check (benchmarks/gpu_check.py).
#   bash benchmarks/gpu_check.sh OUT_DIR [gpu_check.py options]
# A machine with a package index gets `pip install -e .[cuda]` in a venv that sees the system's
# torch. A machine without one installs the wheels in .whl/ instead, offline: fill it beforehand
# with benchmarks/fill_wheels.sh, where an index is reachable.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results}
shift || true
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/archlab-site .whl/*.whl
    export PYTHONPATH=/tmp/archlab-site
    if [ -d /tmp/archlab-site/mamba_ssm ] && ! python3 -c "import selective_scan_cuda" 2>/dev/null; then
        # mamba-ssm's package imports Mamba1's CUDA scan, which archlab never calls and a build
        # without extensions lacks: a stand-in lets the Triton kernels load
        echo '"""Stand-in for mamba-ssm'"'"'s Mamba1 CUDA scan, not built here."""' > /tmp/archlab-site/selective_scan_cuda.py
    fi
    PY=python3
else
    python3 -m venv --system-site-packages .venv-gpu
    .venv-gpu/bin/pip install -q -e ".[cuda]" || .venv-gpu/bin/pip install -q -e . "flash-linear-attention==0.6.0" triton
    PY=.venv-gpu/bin/python
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv
$PY -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '|', torch.cuda.get_device_name())"
PYTHONUNBUFFERED=1 $PY benchmarks/gpu_check.py --out "$OUT" "$@"
