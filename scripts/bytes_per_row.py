"""Disk and host bytes per row for a mixed-width model: one 128-dim table and twenty 8-dim.

Builds one store with all 21 tables (row-wise Adagrad by default: one state float per
row; ``--optimizer adagrad``: one per element), writes ``--rows`` rows of every table,
closes it (a flush), and reports per table width:

* the record (weights + optimizer state) in bytes: the floor;
* disk: the bytes LMDB's B-tree pages hold per row of that table (each table's keys are
  contiguous in key order, so its leaf pages hold only its rows; measured on a store of
  that table alone, same rows), and the value length LMDB stores for its rows;
* host: measured from the store's own allocations: a mixed store (all 21 tables) whose
  host tier is filled with rows of that table alone, its record storage
  (``stats()["_store"]["host_record_bytes"]``: the per-width pools as allocated) over
  the rows it holds; and the per-slot bookkeeping every host slot pays whatever its row
  (keys, dirty bit, pins, policy score, record offset and class).

Also the host bytes per row of the mixed store after writing every table (its host
tier then holds rows of all widths).

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


DEVICE_ROWS, HOST_ROWS = 1024, 4096


def build(path: Path, specs: list[hm.TableSpec], rows: int, opt, only: hm.TableSpec | None = None
          ) -> hm.HierarchicalStore:
    s = hm.HierarchicalStore(specs, hm.StoreConfig(path=path, device_rows=DEVICE_ROWS, host_rows=HOST_ROWS,
                                                   optimizer=opt))
    g = torch.Generator().manual_seed(0)
    for t in specs if only is None else [only]:
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


def host_bytes(s: hm.HierarchicalStore) -> tuple[float, float, float]:
    """Per resident host row: record bytes allocated (the pools, with their growth slack)
    and the bytes of those rows' records; bookkeeping bytes per host slot."""
    st = s.stats()
    n, alloc = st["_store"]["host_occupancy"], st["_store"]["host_record_bytes"]
    held = s._host.occupied_bytes([st[t.name]["host"]["occupancy"] for t in s.tables], s.widths)
    return alloc / max(1, n), held / max(1, n), (s._host.nbytes() - alloc) / s._host.capacity


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
        (out["mixed_host_bytes_per_row"], out["mixed_host_record_bytes_per_row"],
         out["host_slot_bookkeeping_bytes"]) = host_bytes(s)
        s.close()
        st, lens = lmdb_stats(Path(d) / "mixed")
        out["mixed_disk_bytes_per_row"] = pages_per_row(st)
        for t in (specs[0], specs[1]):
            solo = build(Path(d) / t.name, [t], a.rows, opt)
            solo.close()
            sst, _ = lmdb_stats(Path(d) / t.name)
            ti = specs.index(t)
            rec = 4 * (t.dim + opt.state_width(t.dim))
            one = build(Path(d) / f"host-{t.name}", specs, DEVICE_ROWS + HOST_ROWS, opt, only=t)
            assert one.stats()[t.name]["host"]["occupancy"] == HOST_ROWS
            host_row, _, _ = host_bytes(one)
            one.close()
            out["widths"][t.dim] = {"record_bytes": rec, "disk_value_bytes": sorted(lens[ti]),
                                    "disk_bytes_per_row": pages_per_row(sst), "host_bytes_per_row": host_row,
                                    "padded_host_bytes_per_row": 4 * max(s.widths)}
    for dim, w in out["widths"].items():
        print(f"{dim:4d}-dim: record {w['record_bytes']:5d} B | disk value {w['disk_value_bytes']} B, "
              f"{w['disk_bytes_per_row']:7.1f} B/row with LMDB's pages | host {w['host_bytes_per_row']:7.1f} B/row "
              f"(padded to the widest record: {w['padded_host_bytes_per_row']} B, "
              f"{w['padded_host_bytes_per_row'] / w['host_bytes_per_row']:.1f}x more)")
    print(f"every host slot: {out['host_slot_bookkeeping_bytes']:.0f} B of bookkeeping besides its record")
    print(f"mixed store: {out['mixed_disk_bytes_per_row']:.1f} disk B/row over all tables; over the rows its host "
          f"tier holds, {out['mixed_host_record_bytes_per_row']:.1f} B/row of their records, "
          f"{out['mixed_host_bytes_per_row']:.1f} B/row allocated (pools grow by doubling)")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
