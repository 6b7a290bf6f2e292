"""A flat in-memory reference: every row in a dict, the same initialiser and optimizer math."""

from __future__ import annotations

import torch

import hiermem as hm
from hiermem.store.rows import initial_records


class FlatStore:
    """What a HierarchicalStore must return, with no tiers at all."""

    def __init__(self, tables, optimizer: hm.Optimizer, seed: int = 0):
        self.tables = {s.name: (i, s) for i, s in enumerate(tables)}
        self.opt = optimizer
        self.seed = seed
        self.rows: dict[str, dict[int, torch.Tensor]] = {s.name: {} for s in tables}
        self.steps = {s.name: 0 for s in tables}

    def _rec(self, table: str, i: int) -> torch.Tensor:
        ti, spec = self.tables[table]
        r = self.rows[table].get(i)
        if r is None:
            r = initial_records(spec, ti, self.seed, self.opt, torch.tensor([i]))[0]
        return r

    def lookup(self, table: str, ids) -> torch.Tensor:
        dim = self.tables[table][1].dim
        out = [self._rec(table, int(i))[:dim] for i in ids]
        return torch.stack(out) if out else torch.empty(0, dim)

    def update(self, table: str, ids, grads: torch.Tensor) -> None:
        dim = self.tables[table][1].dim
        if len(ids) == 0:
            return
        uniq, inv = torch.unique(ids, return_inverse=True)
        g = torch.zeros(len(uniq), dim).index_add_(0, inv, grads.to(torch.float32))
        self.steps[table] += 1
        keys = uniq.tolist()
        rec = torch.stack([self._rec(table, i).clone() for i in keys])
        self.opt.apply(rec, g, dim, self.steps[table])
        for i, r in zip(keys, rec):
            self.rows[table][i] = r

    def write(self, table: str, ids, values: torch.Tensor) -> None:
        ti, spec = self.tables[table]
        for i, v in zip(ids.tolist(), values):
            r = torch.full((spec.dim + self.opt.state_width(spec.dim),), self.opt.state_init())
            r[:spec.dim] = v
            self.rows[table][i] = r
