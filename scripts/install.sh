#!/usr/bin/env bash
# Install hiermem (editable) and what it needs on a fresh machine. Run it inside a virtual
# environment (python3 -m venv .venv && . .venv/bin/activate).
#   bash scripts/install.sh          # library + CLI (matplotlib included: the demo's demo.png)
#   bash scripts/install.sh test     # + test dependencies (pytest, hypothesis; torchrec
#                                    #   1.8 on the CPU torch 2.13 build, for the KeyedJaggedTensor test)
#   bash scripts/install.sh peers    # + libcachesim (the simulator's cross-check; pulls the AWS SDK)
#   bash scripts/install.sh bench    # + the FBGEMM CPU build used by scripts/bench_store.py
#   bash scripts/install.sh native   # + liblmdb-dev (apt-get, as root) and the C build of the disk
#                                    #   tier's I/O process (hiermem/tiers/lmdb_server.c); without
#                                    #   it the I/O process is py-lmdb's, ~2x the cost per row
# torch, chosen once and printed:
#   * a torch already installed is always kept (whatever its build);
#   * an NVIDIA GPU (nvidia-smi lists one): torch==2.13.0 from PyPI, the CUDA build;
#   * no NVIDIA GPU: torch==2.13.0+cpu, from the index pip is configured with when it
#     serves that build (a local wheel mirror), else from PyTorch's CPU wheel index, so pip
#     never pulls a multi-GB CUDA build (and its nvidia-* wheels) onto a CPU-only machine.
# HIERMEM_INSTALL_DRY_RUN=1 prints the choice and the pip commands without running them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=2.13.0
CPU_INDEX=https://download.pytorch.org/whl/cpu
DRY=${HIERMEM_INSTALL_DRY_RUN:-0}

pip_install() {
    if [ "$DRY" = "1" ]; then
        echo "would run: $PY -m pip install $*"
    else
        "$PY" -m pip install --quiet "$@"
    fi
}

if [ -z "${VIRTUAL_ENV:-}" ] && [ -z "${CONDA_PREFIX:-}" ]; then
    echo "install.sh: note: no virtual environment is active; packages go to $("$PY" -c 'import sys; print(sys.prefix)' 2>/dev/null || echo "$PY")'s site-packages" >&2
fi

if "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "install.sh: torch: keeping the installed $("$PY" -c 'import torch; print(torch.__version__, "(CUDA " + torch.version.cuda + ")" if torch.version.cuda else "(CPU build)")')"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q "^GPU"; then
    echo "install.sh: torch: an NVIDIA GPU is present ($(nvidia-smi -L | head -n 1)): installing the CUDA build torch==$TORCH_VERSION"
    pip_install "torch==$TORCH_VERSION"
else
    spec="torch==$TORCH_VERSION+cpu"
    if [ "$DRY" != "1" ] && "$PY" -m pip install --dry-run --quiet --no-deps "$spec" >/dev/null 2>&1; then
        echo "install.sh: torch: no NVIDIA GPU: installing the CPU build $spec (served by pip's configured index)"
        pip_install "$spec"
    else
        echo "install.sh: torch: no NVIDIA GPU: installing the CPU build $spec from $CPU_INDEX"
        pip_install "$spec" --extra-index-url "$CPU_INDEX"
    fi
fi

extras=""
native=0
for e in "$@"; do
    if [ "$e" = "native" ]; then native=1; continue; fi  # not a pip extra: a system library
    extras="${extras:+$extras,}$e"
done
if [ -n "$extras" ]; then
    pip_install -e ".[$extras]"
else
    pip_install -e .
fi
# torchrec (for the KeyedJaggedTensor test) pairs with the CPU torch 2.13 build only; a plain
# `pip install torchrec` would pull the CUDA fbgemm, so its dependencies go in by hand.
if [ "$DRY" != "1" ] && [[ ",$extras," == *",test,"* ]] && "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION' or torch.version.cuda is not None)" 2>/dev/null; then
    if ! "$PY" -c "import torchrec" >/dev/null 2>&1; then
        pip_install "fbgemm-gpu-cpu==1.8.0" tensordict "torchmetrics==1.0.3" tqdm pyre-extensions
        pip_install --no-deps "torchrec==1.8.0"
    fi
fi

# The C I/O process of the disk tier: liblmdb's headers, then one build (cached; the store
# would build it on first use anyway, this says at once whether it can).
if [ "$native" = "1" ]; then
    if [ ! -e /usr/include/lmdb.h ] && command -v apt-get >/dev/null 2>&1; then
        if [ "$(id -u)" = "0" ]; then
            if [ "$DRY" = "1" ]; then
                echo "would run: apt-get update && apt-get install -y liblmdb-dev"
            else
                echo "install.sh: native: installing liblmdb-dev (apt-get)"
                apt-get update -qq && apt-get install -y -qq liblmdb-dev >/dev/null
            fi
        else
            echo "install.sh: native: liblmdb-dev is missing; run: sudo apt-get install liblmdb-dev" >&2
        fi
    fi
    if [ "$DRY" != "1" ]; then
        "$PY" -c "from hiermem.tiers import native; exe, why = native.build(); print('install.sh: native: the C LMDB I/O process:', exe or 'not built: ' + why)"
    fi
fi
