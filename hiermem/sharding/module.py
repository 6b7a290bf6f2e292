"""ShardedEmbeddingBagCollection: a :class:`ShardingPlan` run on torch.distributed.

Each rank keeps its shards in one :class:`~hiermem.HierarchicalStore` (``cfg.path/rank<r>``);
a shard is a table of that store named ``<table>.s<k>`` whose keys are the *global* ids
of the rows it owns (row-wise: ``id % row_parts == row_part``), so unbounded tables
shard by hash with no remapping, and a shard's rows start exactly as the unsharded
table's (the initialiser is the logical table's, sliced to the shard's columns).

Forward (every rank, the same tables every step):

Collectives are device-generic (:mod:`.dist`): on NCCL the exchange buffers travel as
CUDA tensors on the rank's current device, on gloo as CPU tensors; the bookkeeping
(splits, offsets) stays on the CPU, each rank's store keeps its rows on ``cfg.device``,
and the output is on ``cfg.device``.

1. input distribution: one ``all_to_all`` of a 4-int header per rank pair (sizes,
   batch size, weighted, input valid), then one ``all_to_all`` of every shard's
   ``[bag lengths | ids | weights]`` to the shard's rank;
2. one fused ``lookup_pooled`` per local shard over the bags of all ranks;
3. output distribution: one ``all_to_all`` of pooled rows back to the bags' ranks, where
   column shards are concatenated and row-wise partial sums added (the reduce-scatter
   of RW, done as all-to-all + local sum so one collective serves every sharding);
   data-parallel tables are looked up locally.

Backward is the reverse ``all_to_all`` of pooled gradients, then ``update_pooled`` on
each shard's owning rank (fused optimizer, no dense gradient).  Column shards of a table
under an optimizer with a per-row statistic (row-wise Adagrad) all-reduce that
statistic over the table's column shards first, so CW keeps the unsharded semantics.
Data-parallel replicas all-gather their per-row gradients and apply the same summed
update, so replicas stay identical.

Thread-safety: one training loop per rank calls forward/backward; collectives follow
the table order, identical on every rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..errors import InvalidArgumentError, InvalidIdError, InvalidTypeError, NonFiniteGradientError
from ..nn.features import SparseFeatures
from ..store.rows import initial_records
from ..store.hierarchical import HierarchicalStore
from ..types import StoreConfig, TableSpec
from .dist import all_gather_varlen, all_reduce, all_to_all, comm_device
from .types import ShardingPlan, ShardingType

_ROWWISE = (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE)
#: Input errors a rank reports to the others in the header (code = index + 1).
_ERRORS = (InvalidIdError, InvalidArgumentError, InvalidTypeError, NonFiniteGradientError)
_MODES = ("sum", "mean")


@dataclass(frozen=True)
class _Shard:
    """One shard of a logical table, as every rank knows it."""

    table: int  # logical table index
    key: str  # store table name
    sharding: ShardingType
    rank: int
    row_part: int
    row_parts: int
    col_start: int
    dim: int


class ShardStore(HierarchicalStore):
    """A rank's store of shards: rows start as the logical table's rows (sliced to columns).

    Args:
        tables: the shard tables (``<table>.s<k>``, global ids, the shard's width).
        config: the store configuration.
        origin: per shard table, ``(logical spec, logical table index, first column)``.
    """

    def __init__(self, tables: Sequence[TableSpec], config: StoreConfig,
                 origin: Sequence[tuple[TableSpec, int, int]]):
        self._origin = tuple(origin)
        super().__init__(tables, config, row_init=self._shard_records)

    def _shard_records(self, ti: int, ids: torch.Tensor) -> torch.Tensor:
        spec, lti, c0 = self._origin[ti]
        full = initial_records(spec, lti, self.config.seed, self.optimizer, ids)
        d = self.tables[ti].dim
        if d == spec.dim:
            return full
        rec = torch.full((ids.numel(), self.widths[ti]), self.optimizer.state_init(), dtype=torch.float32,
                         device=ids.device)
        rec[:, :d] = full[:, c0:c0 + d]
        return rec


@dataclass
class _Ctx:
    """What backward needs from one forward."""

    B: int
    src_B: list[int]
    local: list[tuple[_Shard, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]  # shard, ids, offsets, psw
    dp: dict[int, tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]


class ShardedEmbeddingBagCollection(nn.Module):
    """Embedding-bag tables sharded over a process group by a :class:`ShardingPlan`.

    Args:
        tables: the logical tables (output columns follow this order).
        plan: a plan for exactly these tables and this group's world size.
        cfg: template of every rank's store: ``path`` is a base directory (rank ``r``
            uses ``path/rank<r>``); ``device``, ``policy``, ``optimizer`` and ``seed``
            apply to all; ``device_rows``/``host_rows`` are replaced by the sums of the
            rank's shards' ``device_rows``/``host_rows`` when the plan gives them.
        process_group: the group (default: the world).
        mode: ``"sum"`` or ``"mean"`` pooling, as ``nn.EmbeddingBag``.

    ``forward(features)`` takes this rank's :class:`~hiermem.SparseFeatures` (one key
    per table, any key order) and returns ``[B, sum(dims)]`` for this rank's samples,
    on ``cfg.device``.  The group may be gloo (CPU) or NCCL (CUDA; each rank's current
    CUDA device set before construction).

    Raises:
        InvalidTypeError, InvalidArgumentError: tables, plan and group do not match.
    """

    def __init__(self, tables: Sequence[TableSpec], plan: ShardingPlan, cfg: StoreConfig,
                 process_group: Optional[dist.ProcessGroup] = None, mode: str = "sum"):
        super().__init__()
        tables = tuple(tables)
        if not tables or not all(isinstance(t, TableSpec) for t in tables):
            raise InvalidTypeError("tables must be a non-empty sequence of TableSpec")
        if not isinstance(plan, ShardingPlan):
            raise InvalidTypeError("plan must be a hiermem.sharding.ShardingPlan")
        if not isinstance(cfg, StoreConfig):
            raise InvalidTypeError("cfg must be a hiermem.StoreConfig")
        if mode not in _MODES:
            raise InvalidArgumentError(f"mode must be one of {_MODES}, got {mode!r}")
        self.group = process_group
        backend = dist.get_backend(process_group)
        if backend == "nccl" and not torch.cuda.is_available():
            raise InvalidArgumentError("backend 'nccl' needs CUDA")
        self._comm = comm_device(process_group)  # collectives: CUDA on NCCL, CPU on gloo
        self.device = torch.device(cfg.device)
        self.rank, self.world = dist.get_rank(process_group), dist.get_world_size(process_group)
        if plan.world_size != self.world:
            raise InvalidArgumentError(f"plan is for world size {plan.world_size}, the group has {self.world}")
        self.tables, self.plan, self.mode = tables, plan, mode
        self.names = tuple(t.name for t in tables)
        self.dims = tuple(t.dim for t in tables)
        self.optimizer = cfg.optimizer
        self._shards, self._dp = self._layout(tables, plan)
        self._by_rank: list[list[_Shard]] = [[] for _ in range(self.world)]
        for shards in self._shards:
            for s in shards:
                self._by_rank[s.rank].append(s)
        self._local = self._by_rank[self.rank]
        self.store = self._make_store(cfg)
        self._cw_groups = self._make_cw_groups()

    # -- construction -------------------------------------------------------------
    def _layout(self, tables, plan) -> tuple[list[list[_Shard]], list[int]]:
        names = [t.name for t in tables]
        planned = [t.name for t in plan.tables]
        if sorted(planned) != sorted(names):
            raise InvalidArgumentError(f"plan tables {sorted(planned)} differ from the collection's {sorted(names)}")
        shards, dp = [], []
        for ti, spec in enumerate(tables):
            tp = plan.table(spec.name)
            if tp.sharding is ShardingType.DATA_PARALLEL:
                dp.append(ti)
                shards.append([])
                continue
            out = [_Shard(ti, f"{spec.name}.s{k}", tp.sharding, s.rank, s.row_part, s.row_parts, s.col_start,
                          s.col_width or spec.dim) for k, s in enumerate(tp.shards)]
            self._check_cover(spec, tp.sharding, out)
            shards.append(out)
        return shards, dp

    @staticmethod
    def _check_cover(spec: TableSpec, st: ShardingType, shards: list[_Shard]) -> None:
        """Every row and column of the table is in exactly one shard."""
        if not shards:
            raise InvalidArgumentError(f"table {spec.name}: plan has no shards")
        if st in _ROWWISE:
            n = shards[0].row_parts
            if sorted(s.row_part for s in shards) != list(range(n)) or any(s.row_parts != n for s in shards) \
                    or any(s.col_start != 0 or s.dim != spec.dim for s in shards):
                raise InvalidArgumentError(f"table {spec.name}: row-wise shards must be parts 0..n-1 of full width")
        else:
            cols = sorted((s.col_start, s.dim) for s in shards)
            pos = 0
            for c0, d in cols:
                if c0 != pos:
                    raise InvalidArgumentError(f"table {spec.name}: column shards must tile [0, {spec.dim})")
                pos += d
            if pos != spec.dim or any(s.row_parts != 1 for s in shards):
                raise InvalidArgumentError(f"table {spec.name}: column shards must tile [0, {spec.dim}) with all rows")
            if st is ShardingType.TABLE_WISE and len(shards) != 1:
                raise InvalidArgumentError(f"table {spec.name}: table-wise means one shard")

    def _make_store(self, cfg: StoreConfig) -> Optional[ShardStore]:
        specs, origin, dev, host = [], [], 0, 0
        for s in self._local:
            spec = self.tables[s.table]
            specs.append(TableSpec(s.key, spec.num_rows, s.dim, spec.bound))
            origin.append((spec, s.table, s.col_start))
        for ti in self._dp:
            spec = self.tables[ti]
            specs.append(TableSpec(f"{spec.name}.dp", spec.num_rows, spec.dim, spec.bound))
            origin.append((spec, ti, 0))
        if not specs:
            return None
        for tp in self.plan.tables:
            for s in tp.shards:
                if s.rank == self.rank:
                    dev, host = dev + s.device_rows, host + s.host_rows
        path = Path(cfg.path) / f"rank{self.rank}"
        cfg = replace(cfg, path=os.fspath(path), device_rows=max(1, dev) if dev else cfg.device_rows,
                      host_rows=max(1, host) if host else cfg.host_rows)
        return ShardStore(specs, cfg, origin)

    def _make_cw_groups(self) -> dict[int, Optional[dist.ProcessGroup]]:
        """A group per column-sharded table whose optimizer needs the row statistic."""
        groups: dict[int, Optional[dist.ProcessGroup]] = {}
        if self.optimizer.row_statistic(torch.zeros(0, 1), 1) is None:
            return groups
        for ti, shards in enumerate(self._shards):
            if not shards or shards[0].sharding is not ShardingType.COLUMN_WISE:
                continue
            ranks = sorted({s.rank for s in shards})
            if len(ranks) > 1:  # every rank creates every group, in table order
                glob = [dist.get_global_rank(self.group, r) if self.group is not None else r for r in ranks]
                g = dist.new_group(glob)
                groups[ti] = g if self.rank in ranks else None
            else:
                groups[ti] = None
        return groups

    # -- forward --------------------------------------------------------------------
    def _inputs(self, features: SparseFeatures):
        """Per logical table ``(ids, lengths [B], per-id weights or None)``, and an error."""
        if not isinstance(features, SparseFeatures):
            raise InvalidTypeError("features must be a hiermem.SparseFeatures")
        if set(features.keys) != set(self.names):
            raise InvalidArgumentError(f"features have keys {list(features.keys)}, the collection "
                                       f"{list(self.names)}")
        if self.mode == "mean" and features.weights is not None:
            raise InvalidArgumentError("weights need mode='sum' (as nn.EmbeddingBag)")
        if features.values.device.type != "cpu":  # the split bookkeeping runs on the CPU
            features = features.to("cpu")
        B = features.batch_size
        pos = {k: i for i, k in enumerate(features.keys)}
        lengths = features.lengths.to(torch.int64).view(len(features.keys), B)
        per_key = features.to_dict()
        bags, err = [], None
        for spec in self.tables:
            ids, _, w = per_key[spec.name]
            ids = ids.to(torch.int64)
            lens = lengths[pos[spec.name]]
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) > spec.max_id) and err is None:
                err = InvalidIdError(f"table {spec.name}: ids outside [0, {spec.max_id}]")
            if self.mode == "mean" and ids.numel():
                w = (1.0 / lens.clamp(min=1).to(torch.float32)).repeat_interleave(lens)
            bags.append((ids, lens, None if w is None else w.to(torch.float32)))
        weighted = features.weights is not None or self.mode == "mean"
        return bags, B, weighted, err

    def _send_ids(self, bags, B: int, weighted: bool) -> list[list[torch.Tensor]]:
        parts: list[list[torch.Tensor]] = [[] for _ in range(self.world)]
        ar = torch.arange(B, dtype=torch.int64)
        for ti, shards in enumerate(self._shards):
            if not shards:
                continue
            ids, lens, w = bags[ti]
            if w is None and weighted:
                w = torch.ones(ids.numel(), dtype=torch.float32)
            if shards[0].sharding in _ROWWISE:
                n = shards[0].row_parts
                part = torch.remainder(ids, n)
                order = torch.argsort(part, stable=True)  # stable: ids stay in bag order
                counts = torch.bincount(part, minlength=n).tolist()
                bag = ar.repeat_interleave(lens).index_select(0, order)
                sids, sbag = ids.index_select(0, order).split(counts), bag.split(counts)
                sw = w.index_select(0, order).split(counts) if w is not None else None
                for s in shards:
                    p = s.row_part
                    parts[s.rank] += [torch.bincount(sbag[p], minlength=B), sids[p]]
                    if sw is not None:
                        parts[s.rank].append(sw[p].to(torch.float64).view(torch.int64))
            else:
                for s in shards:
                    parts[s.rank] += [lens, ids]
                    if w is not None:
                        parts[s.rank].append(w.to(torch.float64).view(torch.int64))
        return parts

    def _forward(self, features: SparseFeatures, keep: bool) -> tuple[torch.Tensor, Optional[_Ctx]]:
        try:  # a rank with bad input still joins the header exchange, so every rank raises
            bags, B, weighted, err = self._inputs(features)
        except (InvalidArgumentError, InvalidTypeError) as e:
            bags, B, weighted, err = None, 0, False, e
        parts = self._send_ids(bags, B, weighted) if bags is not None else [[] for _ in range(self.world)]
        bufs = [torch.cat(p) if p else torch.zeros(0, dtype=torch.int64) for p in parts]
        code = 0 if err is None else _ERRORS.index(type(err)) + 1
        hdr = torch.tensor([[b.numel(), B, int(weighted), code] for b in bufs], dtype=torch.int64)
        rh = all_to_all(hdr.view(-1), [4] * self.world, [4] * self.world, self.group, self._comm)
        rh = rh.view(self.world, 4)
        if err is not None:
            raise err
        if bool(rh[:, 3].any()):
            bad = rh[:, 3].nonzero().squeeze(1).tolist()
            raise _ERRORS[int(rh[bad[0], 3]) - 1](f"ranks {bad} had invalid input this step; nothing was looked up")
        recv = all_to_all(torch.cat(bufs), [b.numel() for b in bufs], rh[:, 0].tolist(), self.group, self._comm)
        src_B = rh[:, 1].tolist()
        local = self._lookup_local(recv, src_B, rh[:, 2].tolist())
        pieces = self._exchange_pooled(local, src_B, B)
        out = self._assemble(pieces, bags, B)
        ctx = None
        if keep:
            ctx = _Ctx(B, src_B, [(s, ids, off, w) for s, ids, off, w, _ in local], {})
            for ti in self._dp:
                ids, lens, w = bags[ti]
                ctx.dp[ti] = (ids, torch.cumsum(lens, 0) - lens, w)
        return out, ctx

    def _lookup_local(self, recv: torch.Tensor, src_B: list[int], src_w: list[int]):
        """Parse every source's segments and look up each local shard once."""
        per = [([], [], []) for _ in self._local]
        p = 0
        for i in range(self.world):
            for j, s in enumerate(self._local):
                Bi = src_B[i]
                lens = recv[p:p + Bi]
                n = int(lens.sum()) if Bi else 0
                ids = recv[p + Bi:p + Bi + n]
                p += Bi + n
                w = None
                if src_w[i]:
                    w = recv[p:p + n].view(torch.float64).to(torch.float32)
                    p += n
                per[j][0].append(ids)
                per[j][1].append(lens)
                per[j][2].append(w)
        out = []
        any_w = any(src_w)
        for s, (ids_l, lens_l, w_l) in zip(self._local, per):
            ids, lens = torch.cat(ids_l), torch.cat(lens_l)
            w = torch.cat([x if x is not None else torch.ones(a.numel()) for x, a in zip(w_l, ids_l)]) \
                if any_w else None
            off = torch.cumsum(lens, 0) - lens
            if lens.numel():
                pooled = self.store.lookup_pooled(s.key, ids, off, "sum", w)
            else:
                pooled = torch.zeros((0, s.dim), dtype=torch.float32)
            out.append((s, ids, off, w, pooled.to("cpu")))
        return out

    def _exchange_pooled(self, local, src_B: list[int], B: int) -> dict[_Shard, torch.Tensor]:
        starts = [0]
        for b in src_B:
            starts.append(starts[-1] + b)
        send = [pooled[starts[i]:starts[i + 1]].reshape(-1) for i in range(self.world) for _, _, _, _, pooled in local]
        send_splits = [sum(src_B[i] * s.dim for s in self._local) for i in range(self.world)]
        recv_splits = [sum(B * s.dim for s in self._by_rank[r]) for r in range(self.world)]
        buf = torch.cat(send) if send else torch.zeros(0)
        recv = all_to_all(buf, send_splits, recv_splits, self.group, self._comm)
        pieces, p = {}, 0
        for r in range(self.world):
            for s in self._by_rank[r]:
                pieces[s] = recv[p:p + B * s.dim].view(B, s.dim)
                p += B * s.dim
        return pieces

    def _assemble(self, pieces, bags, B: int) -> torch.Tensor:
        cols = []
        for ti, shards in enumerate(self._shards):
            if not shards:
                ids, lens, w = bags[ti]
                off = torch.cumsum(lens, 0) - lens
                cols.append(self.store.lookup_pooled(f"{self.names[ti]}.dp", ids, off, "sum", w).to("cpu")
                            if B else torch.zeros((0, self.dims[ti])))
            elif shards[0].sharding in _ROWWISE:
                acc = pieces[shards[0]].clone()
                for s in shards[1:]:
                    acc.add_(pieces[s])
                cols.append(acc)
            else:
                cols.append(torch.cat([pieces[s] for s in sorted(shards, key=lambda s: s.col_start)], 1))
        return torch.cat(cols, 1)

    def forward(self, features: SparseFeatures) -> torch.Tensor:
        """Pooled embeddings ``[B, sum(dims)]`` of this rank's samples, in table order."""
        anchor = torch.zeros(0, requires_grad=torch.is_grad_enabled())
        return _ShardedLookup.apply(self, features, anchor)

    def split(self, out: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{table: [B, dim]}`` views of a forward output."""
        return dict(zip(self.names, torch.split(out, list(self.dims), dim=1)))

    # -- backward -------------------------------------------------------------------
    def _backward(self, ctx: _Ctx, grad: torch.Tensor) -> None:
        grad = grad.detach().to("cpu", torch.float32).contiguous()
        ok = torch.tensor([int(bool(torch.isfinite(grad).all()))], dtype=torch.int64)
        all_reduce(ok, dist.ReduceOp.MIN, self.group, self._comm)  # refuse NaN/inf on every rank
        if not int(ok):
            raise NonFiniteGradientError("a rank's gradient holds NaN or inf; no shard was updated")
        per_table = torch.split(grad, list(self.dims), dim=1)
        send = []
        for r in range(self.world):
            for s in self._by_rank[r]:
                g = per_table[s.table]
                if s.sharding is ShardingType.COLUMN_WISE:
                    g = g[:, s.col_start:s.col_start + s.dim]
                send.append(g.reshape(-1))
        send_splits = [sum(ctx.B * s.dim for s in self._by_rank[r]) for r in range(self.world)]
        recv_splits = [sum(ctx.src_B[i] * s.dim for s in self._local) for i in range(self.world)]
        recv = all_to_all(torch.cat(send) if send else torch.zeros(0), send_splits, recv_splits, self.group,
                          self._comm)
        chunks: list[list[torch.Tensor]] = [[] for _ in self._local]
        p = 0
        for i in range(self.world):
            for j, s in enumerate(self._local):
                n = ctx.src_B[i] * s.dim
                chunks[j].append(recv[p:p + n].view(ctx.src_B[i], s.dim))
                p += n
        stat_shards = []
        for (s, ids, off, w), ch in zip(ctx.local, chunks):
            g = torch.cat(ch)
            if s.table in self._cw_groups:
                stat_shards.append((s, ids, off, w, g))
            elif off.numel():
                self.store.update_pooled(s.key, ids, off, g, "sum", w)
        self._update_cw(stat_shards)
        self._update_dp(ctx, per_table)

    @staticmethod
    def _row_grads(ids, off, w, g) -> tuple[torch.Tensor, torch.Tensor]:
        """Distinct ids and their summed gradients ``[U, dim]`` from pooled gradients."""
        lens = torch.diff(off, append=torch.tensor([ids.numel()]))
        per = g.repeat_interleave(lens, dim=0)
        if w is not None:
            per = per * w.unsqueeze(1)
        uniq, inv = torch.unique(ids, sorted=True, return_inverse=True)
        return uniq, torch.zeros((uniq.numel(), g.shape[1])).index_add_(0, inv, per)

    def _update_cw(self, stat_shards) -> None:
        """Column shards with a per-row statistic: reduce it over the table's shards."""
        by_table: dict[int, list] = {}
        for s, ids, off, w, g in stat_shards:
            by_table.setdefault(s.table, []).append((s,) + self._row_grads(ids, off, w, g))
        for ti in sorted(self._cw_groups):
            mine = by_table.get(ti)
            if mine is None:
                continue
            full = self.dims[ti]
            stat = mine[0][2].new_zeros(mine[0][1].numel())
            for _, _, gu in mine:
                stat.add_(self.optimizer.row_statistic(gu, full))
            if self._cw_groups[ti] is not None:
                all_reduce(stat, dist.ReduceOp.SUM, self._cw_groups[ti], self._comm)
            for s, uniq, gu in mine:
                if uniq.numel():
                    self.store.update_with_row_stat(s.key, uniq, gu, stat)

    def _update_dp(self, ctx: _Ctx, per_table) -> None:
        """Replicas: gather every rank's row gradients, apply the same summed update."""
        for ti in self._dp:
            ids, off, w = ctx.dp[ti]
            if ctx.B:
                uniq, gu = self._row_grads(ids, off, w, per_table[ti])
            else:
                uniq, gu = torch.zeros(0, dtype=torch.int64), torch.zeros((0, self.dims[ti]))
            all_ids = torch.cat(all_gather_varlen(uniq, self.group, self._comm))
            all_g = torch.cat(all_gather_varlen(gu.contiguous(), self.group, self._comm))
            if all_ids.numel():
                self.store.update(f"{self.names[ti]}.dp", all_ids, all_g)

    # -- state --------------------------------------------------------------------------
    @torch.no_grad()
    def rows(self, table: str, ids: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
        """Current rows ``[len(ids), dim]`` of a logical table.

        A collective: every rank calls it (with its own ids, any number); each gets its
        own rows.  Ids go ``chunk`` per rank per round, so small caches stay within their
        capacity.
        """
        if table not in self.names:
            raise InvalidArgumentError(f"unknown table {table!r}")
        ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
        rounds = torch.tensor([-(-ids.numel() // chunk)], dtype=torch.int64)
        all_reduce(rounds, dist.ReduceOp.MAX, self.group, self._comm)
        out = []
        for part in range(int(rounds)):
            sub = ids[part * chunk:(part + 1) * chunk]
            n = sub.numel()
            lengths = torch.cat([torch.full((n,), int(k == table), dtype=torch.int64) for k in self.names])
            got, _ = self._forward(SparseFeatures(self.names, sub, lengths), keep=False)
            out.append(self.split(got)[table])  # bags of one id: mean == sum
        return torch.cat(out) if out else torch.zeros((0, self.dims[self.names.index(table)]))

    def flush(self) -> None:
        """Flush this rank's store."""
        if self.store is not None:
            self.store.flush()

    def close(self) -> None:
        """Flush and close this rank's store."""
        if self.store is not None:
            self.store.close()

    def stats(self) -> dict:
        """This rank's store counters (shard tables are ``<table>.s<k>``)."""
        return self.store.stats() if self.store is not None else {}


class _ShardedLookup(torch.autograd.Function):
    """Forward: distributed pooled lookup.  Backward: distributed fused update."""

    @staticmethod
    def forward(ctx, module: ShardedEmbeddingBagCollection, features: SparseFeatures, anchor: torch.Tensor):
        out, c = module._forward(features, keep=anchor.requires_grad)
        ctx.module, ctx.c = module, c
        return out.to(module.device)

    @staticmethod
    def backward(ctx, grad):
        if ctx.c is not None:
            ctx.module._backward(ctx.c, grad)
            ctx.c = None
        return None, None, None
