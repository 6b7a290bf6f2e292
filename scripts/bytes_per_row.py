"""Disk and host bytes per row for a mixed-width model: one 128-dim table and twenty 8-dim.

Builds one store with all 21 tables (row-wise Adagrad by default: one state float per
row; ``--optimizer adagrad``: one per element), writes ``--rows`` rows of every table,
closes it (a flush), and reports per table width:

* the record (weights + optimizer state) in bytes: the floor;
* disk: the bytes LMDB's B-tree pages hold per row of that table (each table's keys are
  contiguous in key order, so its leaf pages hold only its rows; measured on a store of
  that table alone, same rows), and the value length LMDB stores for its rows;
* host: the bytes one host-tier slot takes (the slot array is padded to the widest
  record, so every table's row costs the same), and what a per-width host tier would
  take (the record).

The last line is one JSON object.

    python scripts/bytes_per_row.py [--rows 20000] [--optimizer rowwise_adagrad]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import lmdb  # noqa: E402
import torch  # noqa: E402

import hiermem as hm  # noqa: E402

OPTIMIZERS = {"rowwise_adagrad": hm.RowWiseAdagrad, "adagrad": hm.Adagrad, "sgd": hm.SGD}


def tables() -> list[hm.TableSpec]:
    return [hm.TableSpec("wide", None, 128)] + [hm.TableSpec(f"narrow{i}", None, 8) for i in range(20)]


def build(path: Path, specs: list[hm.TableSpec], rows: int, opt) -> hm.HierarchicalStore:
    s = hm.HierarchicalStore(specs, hm.StoreConfig(path=path, device_rows=1024, host_rows=4096, optimizer=opt))
    g = torch.Generator().manual_seed(0)
    for t in specs:
        for i in range(0, rows, 2048):
            ids = torch.arange(i, min(rows, i + 2048)) * 7919  # spread over the id space
            s.write(t.name, ids, torch.randn(ids.numel(), t.dim, generator=g))
    return s


def lmdb_stats(path: Path) -> tuple[dict, dict[int, set[int]]]:
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=64)
    try:
        with env.begin() as txn:
            names = [k for k, _ in txn.cursor() if k != b"meta"]
        st = {k: 0 for k in ("branch_pages", "leaf_pages", "overflow_pages", "entries")}
        lens: dict[int, set[int]] = {}
        for name in names:  # format 2: a database per table, t<index>
            db = env.open_db(name, create=False, integerkey=True)
            with env.begin() as txn:
                for k, v in txn.stat(db).items():
                    if k in st:
                        st[k] += v
                for _, v in txn.cursor(db=db):
                    lens.setdefault(int(name[1:]), set()).add(len(v))
        st["psize"] = env.stat()["psize"]
    finally:
        env.close()
    return st, lens


def pages_per_row(st: dict) -> float:
    return (st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]) * st["psize"] / max(1, st["entries"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=20_000, help="rows written per table")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="rowwise_adagrad")
    a = p.parse_args(argv)
    opt = OPTIMIZERS[a.optimizer]()
    specs = tables()
    out = {"optimizer": a.optimizer, "rows_per_table": a.rows, "tables": "1 x 128-dim + 20 x 8-dim", "widths": {}}
    with tempfile.TemporaryDirectory() as d:
        s = build(Path(d) / "mixed", specs, a.rows, opt)
        host_slot = s._host.data.shape[1] * s._host.data.element_size()
        s.close()
        st, lens = lmdb_stats(Path(d) / "mixed")
        out["mixed_disk_bytes_per_row"] = pages_per_row(st)
        for t in (specs[0], specs[1]):
            solo = build(Path(d) / t.name, [t], a.rows, opt)
            solo.close()
            sst, _ = lmdb_stats(Path(d) / t.name)
            ti = specs.index(t)
            rec = 4 * (t.dim + opt.state_width(t.dim))
            out["widths"][t.dim] = {"record_bytes": rec, "disk_value_bytes": sorted(lens[ti]),
                                    "disk_bytes_per_row": pages_per_row(sst), "host_slot_bytes": host_slot,
                                    "host_bytes_per_width_pool": rec}
    for dim, w in out["widths"].items():
        print(f"{dim:4d}-dim: record {w['record_bytes']:5d} B | disk value {w['disk_value_bytes']} B, "
              f"{w['disk_bytes_per_row']:7.1f} B/row with LMDB's pages | host slot {w['host_slot_bytes']:5d} B "
              f"(per-width pool: {w['host_bytes_per_width_pool']} B, "
              f"{w['host_slot_bytes'] / w['host_bytes_per_width_pool']:.1f}x less)")
    print(f"mixed store: {out['mixed_disk_bytes_per_row']:.1f} disk B/row over all tables")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
