"""TorchRec interop: the layout of an ``EmbeddingBagCollection`` and conversions both ways.

A TorchRec ``EmbeddingBagCollection`` is a list of ``EmbeddingBagConfig`` (table name,
rows, dim, pooling, the feature names that read it).  A table may serve several
features; each feature's pooled output is named by TorchRec's rule: the feature name,
or ``feature@table`` when two tables read the same feature.  :class:`TorchRecLayout`
is that wiring as a frozen value, which a
:class:`~hiermem.CachedEmbeddingBagCollection` applies to route features to tables
and to name its outputs.  torchrec itself is imported only by the functions that need
it (:func:`layout_of`, :func:`keyed_tensor`, :func:`export_ebc`), so hiermem works
without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..errors import InvalidArgumentError, InvalidTypeError
from ..types import TableSpec

#: TorchRec's PoolingType values that hiermem pools the same way.
_POOLING = {"SUM": "sum", "MEAN": "mean"}


def torchrec_available() -> bool:
    """Whether ``torchrec`` can be imported here."""
    try:
        import torchrec  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return False
    return True


def _require():
    try:
        import torchrec
    except Exception as e:  # noqa: BLE001
        raise InvalidArgumentError(f"torchrec is not importable here ({type(e).__name__}: {e}); "
                                   "install hiermem[test] or torchrec") from e
    return torchrec


@dataclass(frozen=True)
class Output:
    """One pooled output: its name (TorchRec's embedding name), input feature, table index."""

    name: str
    feature: str
    table: int


@dataclass(frozen=True)
class TorchRecLayout:
    """How features map to tables and outputs are named, TorchRec style.

    Args:
        tables: the tables, in the collection's order.
        outputs: one per (table, feature) in table order, then feature order.
        mode: ``"sum"`` or ``"mean"`` (one pooling for every table).
        weighted: per-id weights of the input are used (TorchRec's ``is_weighted``);
            when False they are ignored, as TorchRec does.
        configs: the ``EmbeddingBagConfig`` objects, when made from TorchRec.
    """

    tables: tuple[TableSpec, ...]
    outputs: tuple[Output, ...]
    mode: str = "sum"
    weighted: bool = False
    configs: tuple = ()

    def __post_init__(self) -> None:
        feats: dict[str, int] = {}
        for o in self.outputs:
            if feats.setdefault(o.feature, o.table) != o.table:
                raise InvalidArgumentError(f"feature {o.feature!r} is read by two tables; hiermem looks each "
                                           "feature up in one table")
        if len({o.name for o in self.outputs}) != len(self.outputs):
            raise InvalidArgumentError("output names must be distinct")
        if not all(0 <= o.table < len(self.tables) for o in self.outputs):
            raise InvalidArgumentError("an output names a table outside the layout")

    @property
    def table_of(self) -> dict[str, int]:
        """Table index of every input feature."""
        return {o.feature: o.table for o in self.outputs}

    @classmethod
    def identity(cls, tables: Sequence[TableSpec], mode: str) -> "TorchRecLayout":
        """Each table reads the feature of its own name (hiermem's default wiring)."""
        return cls(tuple(tables), tuple(Output(t.name, t.name, i) for i, t in enumerate(tables)), mode, True)


def layout_of(ebc) -> TorchRecLayout:
    """The layout of a TorchRec ``EmbeddingBagCollection`` (configs, pooling, weighting).

    Raises:
        InvalidTypeError: ``ebc`` is not an ``EmbeddingBagCollection``.
        InvalidArgumentError: pooling other than SUM/MEAN, mixed pooling, non-FP32
            tables, a feature read by two tables, or a config hiermem cannot honour.
    """
    torchrec = _require()
    if not isinstance(ebc, torchrec.EmbeddingBagCollection):
        raise InvalidTypeError(f"expected torchrec.EmbeddingBagCollection, got {type(ebc).__name__}")
    from torchrec.modules.embedding_modules import get_embedding_names_by_table
    from torchrec.types import DataType

    configs = list(ebc.embedding_bag_configs())
    if not configs:
        raise InvalidArgumentError("the EmbeddingBagCollection has no tables")
    modes = {c.pooling.value for c in configs}
    if not modes <= set(_POOLING) or len(modes) != 1:
        raise InvalidArgumentError(f"hiermem pools every table the same way, SUM or MEAN; got {sorted(modes)}")
    mode = _POOLING[modes.pop()]
    tables = []
    for c in configs:
        if c.data_type != DataType.FP32:
            raise InvalidArgumentError(f"table {c.name}: data type {c.data_type} (hiermem stores float32)")
        if not c.feature_names:
            raise InvalidArgumentError(f"table {c.name}: no feature_names")
        tables.append(TableSpec(c.name, int(c.num_embeddings), int(c.embedding_dim)))
    names = get_embedding_names_by_table(configs)
    outputs = tuple(Output(n, f, ti) for ti, (c, ns) in enumerate(zip(configs, names))
                    for f, n in zip(c.feature_names, ns))
    return TorchRecLayout(tuple(tables), outputs, mode, bool(ebc.is_weighted()), tuple(configs))


def ebc_weights(ebc) -> dict[str, torch.Tensor]:
    """``{table: weight [rows, dim]}`` of a TorchRec ``EmbeddingBagCollection`` (detached,
    CPU); tables on the ``meta`` device have no weights and are left out."""
    return {name: bag.weight.detach().to("cpu", torch.float32) for name, bag in ebc.embedding_bags.items()
            if bag.weight.device.type != "meta"}


def keyed_tensor(keys: Sequence[str], dims: Sequence[int], values: torch.Tensor):
    """A ``torchrec.KeyedTensor`` over ``values [B, sum(dims)]``."""
    from torchrec.sparse.jagged_tensor import KeyedTensor

    return KeyedTensor(keys=list(keys), length_per_key=list(dims), values=values, key_dim=1)


def configs_for(layout: TorchRecLayout) -> list:
    """``EmbeddingBagConfig`` objects for a layout (the original ones when it has them)."""
    if layout.configs:
        return list(layout.configs)
    _require()
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

    pooling = PoolingType.SUM if layout.mode == "sum" else PoolingType.MEAN
    out = []
    for ti, t in enumerate(layout.tables):
        if t.num_rows is None:
            raise InvalidArgumentError(f"table {t.name} is unbounded (hashed ids): a TorchRec table needs a row "
                                       "count")
        feats = [o.feature for o in layout.outputs if o.table == ti]
        out.append(EmbeddingBagConfig(num_embeddings=t.num_rows, embedding_dim=t.dim, name=t.name,
                                      feature_names=feats, pooling=pooling))
    return out


def export_ebc(layout: TorchRecLayout, rows, device=None, weighted: bool | None = None):
    """A plain TorchRec ``EmbeddingBagCollection`` with the given rows.

    Args:
        layout: the collection's wiring.
        rows: callable ``table name -> weight [rows, dim]`` (every row, all tiers).
        device: the EBC's device (default CPU).
        weighted: the EBC's ``is_weighted`` (default: the TorchRec original's, or False
            for a collection made from hiermem tables).
    """
    torchrec = _require()
    configs = configs_for(layout)
    for c in configs:
        spec = next(t for t in layout.tables if t.name == c.name)
        if spec.num_rows is None:
            raise InvalidArgumentError(f"table {spec.name} is unbounded (hashed ids): it has no TorchRec equivalent")
    if weighted is None:
        weighted = layout.weighted if layout.configs else False
    ebc = torchrec.EmbeddingBagCollection(tables=configs, is_weighted=bool(weighted),
                                          device=torch.device(device or "cpu"))
    with torch.no_grad():
        for c in configs:
            w = rows(c.name)
            ebc.embedding_bags[c.name].weight.copy_(w.to(ebc.embedding_bags[c.name].weight.device))
    return ebc


def select_features(f, keys: Sequence[str]):
    """The ``keys`` of :class:`~hiermem.SparseFeatures` ``f`` (in ``f``'s order), others dropped."""
    from .features import SparseFeatures

    keep = [i for i, k in enumerate(f.keys) if k in set(keys)]
    B = f.batch_size
    kl = f.key_lengths().tolist()
    starts = [0]
    for n in kl:
        starts.append(starts[-1] + n)
    idx = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in keep]) if keep else \
        torch.zeros(0, dtype=torch.int64)
    lengths = f.lengths.view(len(f.keys), B)[keep].reshape(-1)
    w = None if f.weights is None else f.weights.index_select(0, idx.to(f.weights.device))
    return SparseFeatures(tuple(f.keys[i] for i in keep), f.values.index_select(0, idx.to(f.values.device)),
                          lengths, w)


__all__ = ["Output", "TorchRecLayout", "configs_for", "ebc_weights", "export_ebc", "keyed_tensor", "layout_of",
           "select_features", "torchrec_available"]
