#!/usr/bin/env bash
# The first thing to run on a machine with a GPU (one GPU, under 8 minutes):
#   1. the CUDA tests (every test marked gpu: the store and the module on a CUDA device tier,
#      the data-plane exactness tests and the model-based store exactness machine with
#      device="cuda", the CUDA step path: one staging copy per batch, rows crossing
#      device/host/disk against the CPU store, steady-state steps under
#      torch.cuda.set_sync_debug_mode("error"), the deferred NaN check),
#   2. scripts/bench_store.py --quick (the CPU data plane against FBGEMM's CPU TBE),
#   3. scripts/bench_train.py --quick --device cuda (DLRM on the GPU through hiermem
#      against nn.EmbeddingBag on the GPU),
#   4. scripts/bench_pipeline.py --quick --device cuda --real-dense (the pipelined step:
#      all-device, host-backed, disk-backed, against nn.EmbeddingBag on the GPU; targets
#      host >= 0.9x, device >= 1.0x),
#   5. scripts/bench_fbgemm_cache.py --quick (the host-backed pipelined step against
#      FBGEMM's CUDA TBE at EmbeddingLocation.MANAGED_CACHING, same cache size and
#      batches, exact against it; target >= 1.0x; needs the CUDA fbgemm-gpu wheel that
#      pairs with this torch, e.g. pip install fbgemm-gpu==<torch's pairing>),
#   6. scripts/nccl_check.py (world size 1 over NCCL: every sharding type against the
#      unsharded store),
# then prints the figures.  On a machine without CUDA it says so and exits 0 (2 when the
# interpreter cannot import torch at all).
#
#   bash scripts/gpu_check.sh            (PYTHON=... to pick the interpreter)
#
# Each part has its own time limit; a part that fails or times out is reported and the
# others still run; the exit status is 1 when any part failed.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c 'import torch' 2>/dev/null; then
    echo "gpu_check: $PY cannot import torch; set PYTHON to the project's interpreter" >&2
    exit 2
fi
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing to check. Run it on a GPU machine."
    exit 0
fi

out=$(mktemp -d "${TMPDIR:-/tmp}/hiermem-gpu-check.XXXXXX")
start=$SECONDS
status=0
"$PY" -c 'import torch; print("gpu_check:", torch.cuda.get_device_name(0), "torch", torch.__version__, "CUDA", torch.version.cuda)'

run() {  # name, limit (s), command...
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    echo "== $name (limit ${limit} s)"
    timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    tail -n 5 "$out/$name.log"
    echo "== $name: exit $rc in $((SECONDS - t0)) s"
    [ $rc -eq 0 ] || status=1
}

# compiling the kernels once (cached on disk) is charged to no part in particular
# (limits add up to 460 s: the whole check stays under 8 minutes)
run compile 60 "$PY" -c 'import hiermem, hiermem.dataplane.kernels'
run cuda_tests 120 "$PY" -m pytest -q -s -rfE -m gpu -p no:cacheprovider tests
run bench_store 50 "$PY" scripts/bench_store.py --quick
run bench_train 80 "$PY" scripts/bench_train.py --quick --device cuda --png "$out/bench_train.png"
run bench_pipeline 70 "$PY" scripts/bench_pipeline.py --quick --device cuda --real-dense
run bench_fbgemm_cache 60 "$PY" scripts/bench_fbgemm_cache.py --quick
run nccl_check 20 "$PY" scripts/nccl_check.py

"$PY" - "$out" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def last_json(name):
    f = out / f"{name}.log"
    lines = f.read_text().strip().splitlines() if f.is_file() else []
    try:
        return json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None
s, t = last_json("bench_store"), last_json("bench_train")
print("\ngpu_check figures")
f = out / "cuda_tests.log"
for line in (f.read_text().splitlines() if f.is_file() else []):
    for key in ("moved bytes", "waits {"):  # the CUDA step path: bytes moved, waits that blocked
        if key in line:  # (-s prints land after pytest's progress dots)
            print("  cuda step path:", line[line.index(key):])
if s:
    for k in ("b_over_fbgemm", "criteo_b_over_fbgemm", "exact", "exact_fbgemm", "criteo_exact", "criteo_exact_fbgemm"):
        print(f"  bench_store {k}: {s.get(k)}")
else:
    print("  bench_store: no result (see its log)")
if t:
    for k in ("device_over_baseline", "steady_host_over_baseline", "steady_disk_prefetch_over_baseline",
              "criteo_steady_disk_prefetch_over_baseline", "cold_disk_prefetch_over_baseline"):
        print(f"  bench_train --device cuda {k}: {t.get(k)}")
else:
    print("  bench_train: no result (see its log)")
p, c = last_json("bench_pipeline"), last_json("bench_fbgemm_cache")
if p:
    for k in ("device_over_baseline", "host_over_baseline", "disk_prefetch_over_baseline",
              "criteo_disk_prefetch_over_baseline", "critical_path_share_host"):
        print(f"  bench_pipeline --device cuda {k}: {p.get(k)}")
else:
    print("  bench_pipeline: no result (see its log)")
if c:
    for k in ("hiermem_over_fbgemm_managed_caching", "exact", "max_abs_diff_pooled", "max_abs_diff_rows", "skipped"):
        if k in c:
            print(f"  bench_fbgemm_cache {k}: {c.get(k)}")
else:
    print("  bench_fbgemm_cache: no result (see its log)")
EOF
echo "gpu_check: logs in $out; $((SECONDS - start)) s; exit $status"
exit $status
