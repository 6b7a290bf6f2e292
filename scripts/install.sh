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
# torchrec (for the KeyedJaggedTensor test) pairs with the CPU torch 2.13 build only; a plain
# `pip install torchrec` would pull the CUDA fbgemm, so its dependencies go in by hand.
if [[ ",$extras," == *",test,"* ]] && "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0' or torch.version.cuda is not None)" 2>/dev/null; then
    if ! "$PY" -c "import torchrec" >/dev/null 2>&1; then
        "$PY" -m pip install --quiet "fbgemm-gpu-cpu==1.8.0" tensordict "torchmetrics==1.0.3" tqdm pyre-extensions
        "$PY" -m pip install --quiet --no-deps "torchrec==1.8.0"
    fi
fi
