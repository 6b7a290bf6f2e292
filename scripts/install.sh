#!/usr/bin/env bash
# Install hiermem (editable) and what it needs on a fresh machine.
#   bash scripts/install.sh          # library + CLI
#   bash scripts/install.sh test     # + test dependencies
#   bash scripts/install.sh bench    # + the FBGEMM CPU build used by scripts/bench_store.py
# A machine that already has a torch build keeps it; otherwise the CPU build 2.13.0 is
# installed first, so pip never resolves `torch` to a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install --quiet "torch==2.13.0"
fi
extras=""
for e in "$@"; do extras="${extras:+$extras,}$e"; done
if [ -n "$extras" ]; then
    "$PY" -m pip install --quiet -e ".[$extras]"
else
    "$PY" -m pip install --quiet -e .
fi
