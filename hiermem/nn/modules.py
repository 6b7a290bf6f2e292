"""CachedEmbeddingBagCollection: many embedding-bag tables over one hierarchical store.

The forward looks up every table of a batch in one op (the store dedups the whole batch
over its linearised id space and gathers and pools straight from the device tier); the
autograd backward hands the pooled gradient to the store, which applies its optimizer
to the cached rows in place (FBGEMM's fused backward-optimizer).  No gradient tensor for
the tables is ever returned to autograd: they have no ``.grad``, and dense layers train
beside them with any torch optimizer.  Per-id gradients exist only transiently inside
the store's update, as ``[distinct rows, dim]``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from ..dataplane.batch import repeat
from ..errors import InvalidArgumentError, InvalidTypeError
from .features import SparseFeatures
from ..store.rows import initial_records
from ..store.hierarchical import HierarchicalStore
from .torchrec import TorchRecLayout
from ..types import StoreConfig, TableSpec

_MODES = ("sum", "mean")
#: What ``forward`` returns: a tensor ``[B, sum(dims)]``, ``{name: [B, dim]}``, or a
#: ``torchrec.KeyedTensor``.
_OUTPUTS = ("tensor", "dict", "keyed")


class _PooledLookup(torch.autograd.Function):
    """Forward: ``store.lookup_bags``; backward: ``store.update_bags`` (optimizer fused)."""

    @staticmethod
    def forward(ctx, anchor, module, tables, ids, offsets, weights, pending, samples):  # noqa: D417
        ticket = pending.ticket() if pending is not None else None
        out = module.store.lookup_bags(tables, ids, offsets, module.mode, weights, ticket=ticket, samples=samples)
        if pending is not None:
            pending.looked_up()
        ctx.module, ctx.pending, ctx.ticket, ctx.samples = module, pending, ticket, samples
        ctx.args = (tables, ids, offsets, weights)
        return out

    @staticmethod
    def backward(ctx, grad):
        tables, ids, offsets, weights = ctx.args
        module = ctx.module
        t0 = time.perf_counter()
        gate = ctx.pending.pipe._gate if ctx.pending is not None else None
        shut = gate is not None and gate.close()
        try:
            module.store.update_bags(tables, ids, offsets, grad if grad.is_contiguous() else grad.contiguous(),
                                     module.mode, weights, ticket=ctx.ticket, stepped=module._all_tables,
                                     samples=ctx.samples, grad_owned=True)
        finally:
            if ctx.pending is not None:
                ctx.pending.release()
            if shut:
                gate.open()
            ctx.args = None
            module.thread_seconds["backward"] += time.perf_counter() - t0
        return (None,) * 8


class CachedEmbeddingBagCollection(nn.Module):
    """Embedding-bag tables larger than device memory, over a :class:`HierarchicalStore`.

    Args:
        tables: the tables; each reads the feature of the same name.
        config: the store's configuration (tiers, policy, optimizer, path).
        mode: pooling, ``"sum"`` or ``"mean"`` (as ``nn.EmbeddingBag``).
        store: an open store to use instead of creating one from ``config``.
        output: ``"tensor"`` (default), ``"dict"`` or ``"keyed"`` (a TorchRec
            ``KeyedTensor``; needs torchrec).

    Input is :class:`SparseFeatures` (or a torchrec ``KeyedJaggedTensor``) with one key
    per table, in any order; output ``[B, sum(dims)]`` in table order, or a dict per
    table with ``as_dict=True``.  Per-sample weights (``SparseFeatures.weights``) scale
    ids in ``"sum"`` mode and are treated as constants.

    Thread-safety: calls go through the store's lock; a :class:`PrefetchPipeline` may
    prefetch on its thread while the module trains on the caller's.
    """

    def __init__(self, tables: Sequence[TableSpec], config: StoreConfig | None = None, mode: str = "sum",
                 store: HierarchicalStore | None = None, output: str = "tensor"):
        super().__init__()
        if mode not in _MODES:
            raise InvalidArgumentError(f"mode must be one of {_MODES}, got {mode!r}")
        if output not in _OUTPUTS:
            raise InvalidArgumentError(f"output must be one of {_OUTPUTS}, got {output!r}")
        if output == "keyed":
            from .torchrec import _require

            _require()
        if (store is None) == (config is None):
            raise InvalidArgumentError("give exactly one of config and store")
        self.store = store if store is not None else HierarchicalStore(tables, config)
        self.tables = tuple(self.store.tables)
        if [s.to_dict() for s in self.tables] != [s.to_dict() for s in tables]:
            raise InvalidArgumentError("the store's tables differ from the tables given")
        self.mode = mode
        self.dims = [s.dim for s in self.tables]
        self.names = [s.name for s in self.tables]
        self._pending: dict[int, object] = {}  # id(features) -> a PrefetchPipeline's handle
        #: seconds the calling (training) thread spent in this module's forward and in its
        #: backward (the fused update, and the prefetch pipeline's release): its share of
        #: the step's critical path
        self.thread_seconds = {"forward": 0.0, "backward": 0.0}
        self._cols: dict[tuple, torch.Tensor] = {}
        # the lookup's autograd input, so that its output requires grad (one tensor for
        # all steps: its own gradient is never formed)
        self._anchor = torch.empty(0, requires_grad=True)
        self._all_tables = list(range(len(self.tables)))
        self._table_of = {n: i for i, n in enumerate(self.names)}
        self.output = output
        self._set_layout(TorchRecLayout.identity(self.tables, mode))

    # -- construction ---------------------------------------------------------------
    @classmethod
    def from_embedding_bags(cls, bags: Mapping[str, nn.EmbeddingBag], config: StoreConfig,
                            chunk_rows: int = 1 << 20) -> "CachedEmbeddingBagCollection":
        """Convert ``{name: nn.EmbeddingBag}`` (same mode) into a collection with their weights."""
        if not bags:
            raise InvalidArgumentError("no embedding bags given")
        modes = {b.mode for b in bags.values()}
        if len(modes) != 1 or not modes <= set(_MODES):
            raise InvalidArgumentError(f"every bag needs the same mode, sum or mean; got {sorted(modes)}")
        for name, b in bags.items():
            if not isinstance(b, nn.EmbeddingBag):
                raise InvalidTypeError(f"{name}: expected nn.EmbeddingBag, got {type(b).__name__}")
        tables = [TableSpec(n, b.num_embeddings, b.embedding_dim) for n, b in bags.items()]
        m = cls(tables, config, mode=modes.pop())
        m._import_weights({name: b.weight.detach() for name, b in bags.items()}, chunk_rows)
        return m

    @classmethod
    def from_torchrec(cls, ebc, config: StoreConfig, output: str = "keyed",
                      chunk_rows: int = 1 << 20) -> "CachedEmbeddingBagCollection":
        """A drop-in for a TorchRec ``EmbeddingBagCollection``, with its current weights.

        Tables, names, dims, pooling (one of SUM/MEAN for all tables) and weighting come
        from ``ebc``'s ``EmbeddingBagConfig``s; each table reads the features in its
        config's ``feature_names`` and each feature's output is named as TorchRec names
        it (``feature``, or ``feature@table`` when tables share a feature name).  The
        result takes a ``KeyedJaggedTensor`` and, with ``output="keyed"``, returns a
        ``KeyedTensor``; ``embedding_bag_configs()`` and ``is_weighted()`` answer as the
        EBC's do, so TorchRec models (e.g. ``torchrec.models.dlrm.DLRM``) accept it.
        Tables of an EBC on the ``meta`` device start from hiermem's initialiser.

        Raises:
            InvalidTypeError: ``ebc`` is not a TorchRec ``EmbeddingBagCollection``.
            InvalidArgumentError: torchrec is not importable; mixed or unsupported
                pooling; a feature read by two tables; non-FP32 tables.
        """
        from .torchrec import ebc_weights, layout_of

        layout = layout_of(ebc)
        if output not in _OUTPUTS:
            raise InvalidArgumentError(f"output must be one of {_OUTPUTS}, got {output!r}")
        m = cls(layout.tables, config, mode=layout.mode, output=output)
        m._set_layout(layout)
        m._import_weights(ebc_weights(ebc), chunk_rows)
        return m

    def _import_weights(self, weights: Mapping[str, torch.Tensor], chunk_rows: int) -> None:
        """Set every row of each named table to ``weights[name]`` (optimizer state reset)."""
        st = self.store
        for name, w in weights.items():
            width = st.widths[st.table_index(name)]
            for i in range(0, w.shape[0], chunk_rows):
                part = w[i:i + chunk_rows]
                rec = torch.full((part.shape[0], width), st.optimizer.state_init(), dtype=torch.float32)
                rec[:, :part.shape[1]] = part
                st.import_records(name, torch.arange(i, i + part.shape[0]), rec)

    def _set_layout(self, layout: TorchRecLayout) -> None:
        """Route features to tables and name outputs as ``layout`` says."""
        self._layout = layout
        self._table_of = layout.table_of
        self._cols = {}
        self.output_names = [o.name for o in layout.outputs]
        self.output_dims = [self.tables[o.table].dim for o in layout.outputs]

    def embedding_bag_configs(self) -> list:
        """TorchRec ``EmbeddingBagConfig``s of the tables (as TorchRec's EBC answers)."""
        from .torchrec import configs_for

        return configs_for(self._layout)

    def is_weighted(self) -> bool:
        """Whether per-id weights of the input are used (TorchRec's ``is_weighted``)."""
        return self._layout.weighted

    def table_rows(self, table: str, chunk_rows: int = 1 << 20) -> torch.Tensor:
        """Every row ``[num_rows, dim]`` of a bounded table, from whichever tier holds it.

        Rows never written are their initial values.  Not a hot path: flushes, then
        reads the written rows from LMDB in one pass; the cache is left as it was.
        """
        st = self.store
        ti = st.table_index(table)
        spec = self.tables[ti]
        if spec.num_rows is None:
            raise InvalidArgumentError(f"table {table} is unbounded (hashed ids): it has no dense row range")
        out = torch.empty((spec.num_rows, spec.dim), dtype=torch.float32)
        for i in range(0, spec.num_rows, chunk_rows):
            ids = torch.arange(i, min(i + chunk_rows, spec.num_rows))
            out[i:i + ids.numel()] = initial_records(spec, ti, st.config.seed, st.optimizer, ids)[:, :spec.dim]
        ids, rec = st.export(table)
        if ids.numel():
            out.index_copy_(0, ids.to(torch.int64).cpu(), rec[:, :spec.dim].to("cpu", torch.float32))
        return out

    def to_torchrec(self, device=None, weighted: bool | None = None):
        """A plain TorchRec ``EmbeddingBagCollection`` with the current weights of every
        table (all tiers), e.g. for serving.  Same configs, names and weighting (for a
        collection not made by :meth:`from_torchrec`, ``weighted`` defaults to False).

        Raises:
            InvalidArgumentError: torchrec is not importable, or a table is unbounded.
        """
        from .torchrec import export_ebc

        return export_ebc(self._layout, self.table_rows, device, weighted)

    @classmethod
    def restore(cls, checkpoint: str | os.PathLike, path: str | os.PathLike, mode: str = "sum",
                **overrides) -> "CachedEmbeddingBagCollection":
        """A collection over a copy of the store checkpoint ``checkpoint``, placed at ``path``."""
        store = HierarchicalStore.restore(checkpoint, path, **overrides)
        return cls(store.tables, mode=mode, store=store)

    def checkpoint(self, dest: str | os.PathLike) -> Path:
        """A consistent snapshot of every table across all tiers (see ``HierarchicalStore.checkpoint``)."""
        return self.store.checkpoint(dest)

    # -- prefetch hand-off (a PrefetchPipeline's) --------------------------------------------
    def expect(self, features, handle) -> None:
        """The next ``forward(features)`` (this very object) uses ``handle``'s prefetch:
        its ticket, then its release after the backward."""
        self._pending[id(features)] = handle

    def forget(self, features) -> None:
        """Drop the prefetch handle :meth:`expect` left for ``features`` (never looked up)."""
        self._pending.pop(id(features), None)

    # -- forward ------------------------------------------------------------------------
    def as_features(self, features) -> SparseFeatures:
        """``features`` (:class:`SparseFeatures` or a torchrec ``KeyedJaggedTensor``) as the
        :class:`SparseFeatures` of this collection's tables (validated)."""
        return self._features(features)

    def _features(self, features) -> SparseFeatures:
        if isinstance(features, SparseFeatures):
            f = features
        elif hasattr(features, "keys") and hasattr(features, "lengths") and hasattr(features, "values"):
            f = SparseFeatures.from_kjt(features)  # torchrec.KeyedJaggedTensor
        else:
            raise InvalidTypeError(f"expected SparseFeatures or a KeyedJaggedTensor, got {type(features).__name__}")
        want = self._table_of
        if set(f.keys) != set(want):
            missing = set(want) - set(f.keys)
            if missing or not self._layout.configs:  # a TorchRec drop-in ignores other features
                raise InvalidArgumentError(f"features {sorted(f.keys)} do not match tables {sorted(want)}")
            from .torchrec import select_features

            f = select_features(f, tuple(want))
        return f

    def id_tables(self, f: SparseFeatures) -> torch.Tensor:
        """The table index of every id of ``f`` (int64, on the CPU)."""
        key_t = torch.tensor([self._table_of[k] for k in f.keys], dtype=torch.int64)
        lengths = f.lengths.cpu()
        if lengths.dtype == torch.int64 and lengths.numel() == len(f.keys) * f.batch_size:  # one compiled pass
            return torch.from_numpy(repeat(key_t.numpy(), lengths.contiguous().numpy(), f.batch_size))
        return torch.repeat_interleave(key_t, f.key_lengths().cpu())

    def lookup_tensors(self, features) -> tuple:
        """``(tables, ids, offsets, weights)`` of the store's ``lookup_bags`` for
        ``features`` (validated).  Ids, tables and offsets are the control plane's: the
        store reads them on the CPU, so they stay where the loader put them (moving CPU
        ids to a GPU would only make the store copy them back, and wait for it)."""
        f = self._features(features)
        ids = f.values.to(torch.int64)
        tables = self.id_tables(f)
        offsets = f.offsets()[:-1]
        weights = None if f.weights is None or not self._layout.weighted else \
            f.weights.to(self.store.device, torch.float32, non_blocking=True)
        return tables, ids, offsets, weights

    def lookup_samples(self, f: SparseFeatures) -> int | None:
        """The ``samples`` of this module's ``lookup_bags`` of features ``f`` (its batch
        size, when the output's columns are the tables' in order: the store then pools
        straight into the output's layout), else None."""
        return f.batch_size if f.batch_size > 0 and self._columns(f.keys) is None else None

    def _columns(self, keys: tuple[str, ...]) -> torch.Tensor | None:
        """Columns of ``[B, len(keys) * max_dim]`` that form the output in table order."""
        ck = keys
        if ck not in self._cols:
            D = self.store.max_dim
            pos = {k: i for i, k in enumerate(keys)}
            cols = [torch.arange(d) + pos[o.feature] * D for o, d in zip(self._layout.outputs, self.output_dims)]
            c = torch.cat(cols)
            same = c.numel() == len(keys) * D and bool((c == torch.arange(c.numel())).all())
            self._cols[ck] = None if same else c.to(self.store.device)
        return self._cols[ck]

    def forward(self, features, as_dict: bool = False):
        """Pooled embeddings ``[B, sum(dims)]`` (table order), or ``{table: [B, dim]}``
        (``as_dict`` or ``output="dict"``), or a ``KeyedTensor`` (``output="keyed"``)."""
        t0 = time.perf_counter()
        try:
            return self._forward(features, as_dict)
        finally:
            self.thread_seconds["forward"] += time.perf_counter() - t0

    def _forward(self, features, as_dict: bool):
        pending = self._pending.pop(id(features), None)
        gate = pending.pipe._gate if pending is not None else None
        shut = gate is not None and gate.close(take_over=True)
        try:
            return self._forward_in(features, as_dict, pending)
        finally:
            if shut:
                gate.open()

    def _forward_in(self, features, as_dict: bool, pending):
        ready = pending.ready() if pending is not None else None
        if ready is not None:  # formed ahead, off this thread, by the pipeline
            f = pending.sf
            tables, ids, offsets, weights = ready
        else:
            f = self._features(features)
            tables, ids, offsets, weights = self.lookup_tensors(f)
        B, T = f.batch_size, len(f.keys)
        cols = self._columns(f.keys)
        # with the output's columns in table order, the store pools straight into the
        # [B, T * D] layout (and takes the gradient in it): no transposing copy either way
        samples = self.lookup_samples(f)
        pooled = _PooledLookup.apply(self._anchor, self, tables, ids, offsets, weights, pending, samples)
        if pending is not None and not pooled.requires_grad:  # no backward will run: unpin now
            pending.release()
        D = self.store.max_dim
        flat = pooled if samples is not None else pooled.view(T, B, D).transpose(0, 1).reshape(B, T * D)
        out = flat if cols is None else flat.index_select(1, cols)
        if as_dict or self.output == "dict":
            return dict(zip(self.output_names, torch.split(out, self.output_dims, dim=1)))
        if self.output == "keyed":
            from .torchrec import keyed_tensor

            return keyed_tensor(self.output_names, self.output_dims, out)
        return out

    # -- state ---------------------------------------------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for s in self.tables:
            ids, rec = self.store.export(s.name)
            destination[f"{prefix}{s.name}.ids"] = ids
            destination[f"{prefix}{s.name}.weight"] = rec[:, :s.dim].clone()
            destination[f"{prefix}{s.name}.optimizer_state"] = rec[:, s.dim:].clone()
            destination[f"{prefix}{s.name}.step"] = torch.tensor(self.store.table_step(s.name))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        parts = ("ids", "weight", "optimizer_state", "step")
        want = {f"{prefix}{s.name}.{p}" for s in self.tables for p in parts}
        missing = sorted(want - set(state_dict))
        if missing:
            missing_keys.extend(missing)
            return
        for s in self.tables:
            ids, w, st = (state_dict[f"{prefix}{s.name}.{p}"] for p in parts[:3])
            sw = self.store.widths[self.store.table_index(s.name)] - s.dim
            if w.dim() != 2 or w.shape[1] != s.dim or st.shape != (w.shape[0], sw) or ids.shape != (w.shape[0],):
                error_msgs.append(f"{prefix}{s.name}: shapes ids {tuple(ids.shape)}, weight {tuple(w.shape)}, "
                                  f"optimizer_state {tuple(st.shape)} do not fit dim {s.dim} + state {sw}")
        if error_msgs:
            return
        self.store.clear()
        for s in self.tables:
            ids, w, st, step = (state_dict[f"{prefix}{s.name}.{p}"] for p in parts)
            self.store.import_records(s.name, ids.to(torch.int64), torch.cat((w, st), 1).to(torch.float32))
            self.store.set_table_step(s.name, int(step))
        self.store.flush()

    def extra_repr(self) -> str:
        return f"tables={self.names}, mode={self.mode}, store={self.store!r}"
