#!/usr/bin/env bash
# The one script a lent GPU runs: install the CUDA extras next to the machine's torch, then check.
#   bash benchmarks/gpu_check.sh OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results}
python -m venv --system-site-packages .venv-gpu
.venv-gpu/bin/pip install -q -e ".[cuda]" || .venv-gpu/bin/pip install -q -e . flash-linear-attention triton
.venv-gpu/bin/python -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
timeout 540 .venv-gpu/bin/python benchmarks/gpu_check.py --out "$OUT"
