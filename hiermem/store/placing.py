"""One placement routine, two backings: the store's (LMDB) and the simulator's (a bitmap).

:func:`place` is a batch's placement over a key index and two slot tiers: the control
plane decides (:func:`hiermem.core.plan.decide`), the *backing* does the I/O that may
fail (reads the rows the plan takes from disk, writes its dirty victims down), and the
plan is committed (:func:`~hiermem.core.plan.commit`); an error in the I/O aborts the
plan and leaves everything as it was.  The store's backing is its
:class:`~hiermem.store.residency.Residency` (LMDB through the disk tier, records
through the data plane); the simulator's is :class:`WrittenRows` (a bit per row that
says "written down", records of zero width, bytes counted as a record would move them:
:mod:`hiermem.core.written`, the same code the compiled replay inlines).

A backing has ``hash_rows(bt, bk, out)`` (each row's 64-bit hash, which queue policies and
the admission filter know rows by: the store hashes its ids, the simulator looks up the
hashes of the store's ids, so both know a row by the same hash), ``fetch(b, ws, res)`` (set ``ws[FOUND, :res[N_DISK]]`` for the plan's disk
rows of batch ``b``; returns whatever the caller needs after the commit, e.g. the records
read) and ``write_victims(ws, res)`` (the dirty victims ``ws[WB, :res[N_WB]]``, global
slots, written down before their slots are reused); each is called only when it has rows.
"""

from __future__ import annotations

import numpy as np
import torch

from .placed import Placement
from ..core import plan as _plan
from ..core import sketch as _sketch
from ..core import written as _written
from ..core.names import CAPACITY, G, M, N_DISK, N_WB, ONDEV, RH, SLOT, STATUS, T_KK, T_KT
from ..errors import CapacityError


class Workspace:
    """A plan's arrays (:func:`hiermem.core.plan.workspace`), grown to a batch's rows."""

    def __init__(self, n: int = 1024):
        self.ws, self.res = _plan.workspace(n)

    def get(self, U: int) -> tuple[np.ndarray, np.ndarray]:
        if self.ws.shape[1] < 2 * U:
            self.ws, self.res = _plan.workspace(U)
        return self.ws, self.res


def place(ix, dev, host, work: Workspace, b, clock: np.ndarray, counts: np.ndarray, account: bool,
          table: np.ndarray, backing) -> tuple[np.ndarray, np.ndarray, object]:
    """Make every row of batch ``b`` (``b.t``, ``b.k``: int64 tensors) resident in
    slot tiers ``dev``/``host`` over index arrays ``ix``: decide, the backing's I/O,
    commit (counting into ``table``, the ``table x tier x Stat`` counters, when
    ``account``).  Returns ``(ws, res, fetched)``: the committed plan and what
    ``backing.fetch`` returned.

    Raises:
        CapacityError: the tiers cannot hold the batch beside their pinned rows (nothing changed).
    """
    bt, bk = b.t.cpu().numpy(), b.k.cpu().numpy()
    U = bk.size
    ws, res = work.get(U)
    if dev.policy.hashes or host.policy.hashes:
        backing.hash_rows(bt, bk, ws[RH, :U])
    _plan.decide(ix, dev.state, dev.policy.state, host.state, host.policy.state, bt, bk, ws, res)
    if res[STATUS] == CAPACITY:
        raise CapacityError(f"batch needs {U} rows resident at once; device ({dev.capacity}) and host "
                            f"({host.capacity}) tiers cannot hold them with their pinned rows")
    try:
        fetched = backing.fetch(b, ws, res) if res[N_DISK] else None
        if res[N_WB]:
            backing.write_victims(ws, res)
    except BaseException:
        _plan.abort(dev.policy.state, host.policy.state)
        raise
    _plan.commit(ix, dev.state, dev.policy.state, host.state, host.policy.state, bt, bk, clock, counts,
                 account, ws, res, table)
    return ws, res, fetched


def hash_rows(bt: np.ndarray, bk: np.ndarray, out: np.ndarray) -> None:
    """The store's row hashes: :func:`hiermem.core.sketch.rowhash` of each ``(table, id)``."""
    _sketch.row_hashes(bt, bk, out)


def placement(ws: np.ndarray, res: np.ndarray, U: int, D: int) -> Placement:
    """The :class:`Placement` of a committed plan of ``U`` rows (device tier of ``D`` slots)."""
    slot = torch.from_numpy(ws[SLOT, :U].copy())
    if res[M] == 0:  # every row was on the device, and stays
        return Placement(None, slot)
    ondev = torch.from_numpy(ws[ONDEV, :U] != 0)
    was_dev = torch.from_numpy((ws[G, :U] >= 0) & (ws[G, :U] < D))
    return Placement(None if bool(ondev.all()) else ondev, slot, was_dev)


def placed_at(g: torch.Tensor, D: int) -> Placement:
    """The placement of resident rows at global slots ``g`` (all ``>= 0``; a device tier of ``D`` slots)."""
    on_dev = g < D
    if bool(on_dev.all()):
        return Placement(None, g)
    return Placement(on_dev, torch.where(on_dev, g, g - D))


class WrittenRows:
    """The simulator's backing: LMDB as a bit per dense row (``written``, uint8), records
    of ``row_bytes`` counted into ``io`` (the ``IO`` counters) as they would move.

    Args:
        dev, host: the slot tiers (their keys name a victim's row).
        row_base: the first dense row of each table (key ``(t, k)`` is row ``row_base[t] + k``).
        written: uint8 per dense row, set once a row is written down.
        io: the ``IO`` counters (int64 numpy).
        row_bytes: bytes of one record.
        row_hash: int64 per dense row, the store's hash of its table and id (read where a
            policy uses hashes).
    """

    def __init__(self, dev, host, row_base: np.ndarray, written: np.ndarray, io: np.ndarray, row_bytes: int,
                 row_hash: np.ndarray):
        self.dev, self.host = dev, host
        self.row_base, self.written, self.io, self.row_bytes = row_base, written, io, int(row_bytes)
        self.row_hash = row_hash

    def hash_rows(self, bt: np.ndarray, bk: np.ndarray, out: np.ndarray) -> None:
        _written.row_hashes(bt, bk, self.row_base, self.row_hash, out)

    def fetch(self, b, ws: np.ndarray, res: np.ndarray) -> None:
        _written.fetch(ws, res, b.t.numpy(), b.k.numpy(), self.row_base, self.written, self.io, self.row_bytes)

    def write_victims(self, ws: np.ndarray, res: np.ndarray) -> None:
        dev, host = self.dev, self.host
        _written.write_back(ws, res, dev.state[T_KT], dev.state[T_KK], host.state[T_KT], host.state[T_KK],
                            dev.capacity, host.base, self.row_base, self.written, self.io, self.row_bytes)

    def place(self, ix, work: Workspace, b, clock: np.ndarray, counts: np.ndarray, account: bool,
              table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:func:`place` with this backing; the bytes the plan copies between the tiers counted."""
        ws, res, _ = place(ix, self.dev, self.host, work, b, clock, counts, account, table, self)
        _written.moved(res, self.io, self.row_bytes)
        return ws, res
