"""Trains small stores through the compiled data plane and prints a digest of every
pooled output and final record.

``tests/test_dataplane.py`` runs it twice, compiled and with ``NUMBA_DISABLE_JIT=1``
(every kernel as plain Python over the same arrays), and compares the digests: the
kernels compute bit for bit what their Python source says.

    python tests/dataplane_parity_driver.py OPTIMIZER DIR
"""

from __future__ import annotations

import hashlib
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
warnings.filterwarnings("ignore", category=RuntimeWarning)  # interpreted kernels: inf * 0, int64 hashing wraps

import hiermem as hm  # noqa: E402

OPTS = {"sgd": hm.SGD(lr=0.3), "adagrad": hm.Adagrad(lr=0.2, initial_accumulator_value=0.1),
        "rowwise_adagrad": hm.RowWiseAdagrad(lr=0.2), "adam": hm.Adam(lr=0.05, beta1=0.8, beta2=0.95)}


def main(opt_name: str, root: str) -> None:
    h = hashlib.sha256()
    tables = [hm.TableSpec("a", 60, 8), hm.TableSpec("u", None, 4)]
    for mode, weighted in (("sum", False), ("mean", False), ("sum", True)):
        store = hm.HierarchicalStore(tables, hm.StoreConfig(path=Path(root) / f"{mode}{weighted}", device_rows=14,
                                                            host_rows=30, optimizer=OPTS[opt_name]))
        assert store.data_plane == "compiled"
        g = torch.Generator().manual_seed(0)
        for _ in range(5):
            lengths = torch.randint(0, 5, (12,), generator=g)
            t = torch.repeat_interleave(torch.repeat_interleave(torch.arange(2), 6), lengths)
            k = (torch.rand(t.numel(), generator=g) ** 2 * 40).long() * torch.where(t == 1, 2**40, 1)
            offsets = torch.cat((torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]))
            psw = torch.rand(k.numel(), generator=g) + 0.5 if weighted else None
            h.update(store.lookup_bags(t, k, offsets, mode, psw).numpy().tobytes())
            store.update_bags(t, k, offsets, torch.randn(12, 8, generator=g), mode, psw)
        for s in tables:
            ids, rec = store.export(s.name)
            h.update(ids.numpy().tobytes() + rec.numpy().tobytes())
        store.close()
    print(h.hexdigest())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
