"""Validation of a caller's table names and ids, shared by the store and its read-only
readers: a clear, typed error, before anything changes."""

from __future__ import annotations

import numpy as np
import torch

from ..dataplane.batch import minmax
from ..dataplane.staging import to_host
from ..errors import InvalidArgumentError, InvalidIdError, InvalidTypeError, NonFiniteGradientError, UnknownTableError
from ..types import StoreConfig, TableSpec

INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)  # the ids a caller may give
_INT_DTYPES = INT_DTYPES


def table_index(index: dict[str, int], table: str) -> int:
    """``index[table]`` (table name -> position).

    Raises:
        UnknownTableError: no table of that name.
    """
    try:
        return index[table]
    except (KeyError, TypeError):
        raise UnknownTableError(f"unknown table {table!r}; tables are {list(index)}") from None


def int_vector(name: str, v, kinds: str = "a torch.Tensor") -> None:
    """Check that ``v`` (the caller's ``name``) is a 1-D integer tensor.

    Raises:
        InvalidTypeError: not a tensor (``kinds``: what the caller accepts), or not integers.
        InvalidArgumentError: not 1-D.
    """
    if not isinstance(v, torch.Tensor):
        raise InvalidTypeError(f"{name} must be {kinds}, got {type(v).__name__}")
    if v.dtype not in _INT_DTYPES:
        raise InvalidTypeError(f"{name} must have an integer dtype, got {v.dtype}")
    if v.dim() != 1:
        raise InvalidArgumentError(f"{name} must be 1-D, got shape {tuple(v.shape)}")


def check_ids(spec: TableSpec, ids) -> torch.Tensor:
    """``ids`` of table ``spec`` (a 1-D integer tensor or numpy array) as int64 on the CPU,
    where the control plane reads them (the one inherent device-to-host copy of a step
    when the caller's ids are on a GPU).

    Raises:
        InvalidTypeError: not a tensor or array, or not integers.
        InvalidArgumentError: not 1-D.
        InvalidIdError: an id is negative or past the table's rows.
    """
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind not in "iu":
            raise InvalidTypeError(f"ids must be integers, got numpy {ids.dtype}")
        if ids.dtype == np.uint64 and ids.size and ids.max() > np.iinfo(np.int64).max:
            raise InvalidIdError(f"table {spec.name}: ids above 2**63-1")
        ids = torch.from_numpy(ids.astype(np.int64, copy=False))
    int_vector("ids", ids, "a torch.Tensor or numpy array")
    ids = to_host(ids, "ids").to(torch.int64)
    if ids.numel():
        lo, hi = minmax(ids.contiguous().numpy())
        if lo < 0 or hi > spec.max_id:
            bad = lo if lo < 0 else hi
            rng = f"[0, {spec.num_rows})" if spec.num_rows is not None else "[0, 2**63)"
            raise InvalidIdError(f"table {spec.name}: id {bad} outside {rng}")
    return ids


def check_values(spec: TableSpec, n: int, values, what: str, device: torch.device,
                 check_finite: bool = True) -> torch.Tensor:
    """``values`` (weights or gradients of ``n`` rows of table ``spec``, ``[n, dim]``
    floating point) as float32 on ``device``.

    Raises:
        InvalidTypeError: not a floating-point tensor.
        InvalidArgumentError: not of shape ``[n, dim]``.
        NonFiniteGradientError: NaN or inf (with ``check_finite``).
    """
    if not isinstance(values, torch.Tensor):
        raise InvalidTypeError(f"{what} must be a torch.Tensor, got {type(values).__name__}")
    if not values.is_floating_point():
        raise InvalidTypeError(f"{what} must be floating point, got {values.dtype}")
    if tuple(values.shape) != (n, spec.dim):
        raise InvalidArgumentError(f"{what} of table {spec.name} must have shape {(n, spec.dim)}, "
                                   f"got {tuple(values.shape)}")
    values = values.detach().to(device, torch.float32)
    if check_finite and n and not bool(torch.isfinite(values).all()):
        raise NonFiniteGradientError(f"{what} of table {spec.name} contain NaN or inf; nothing changed")
    return values


def check_row_stat(spec: TableSpec, n: int, row_stat, device: torch.device) -> torch.Tensor:
    """``row_stat`` (a per-row optimizer statistic of ``n`` rows of table ``spec``,
    ``[n]`` floating point) as float32 on ``device``.

    Raises:
        InvalidArgumentError: not a floating-point tensor of shape ``[n]``.
        NonFiniteGradientError: NaN or inf.
    """
    if not isinstance(row_stat, torch.Tensor) or not row_stat.is_floating_point() or tuple(row_stat.shape) != (n,):
        raise InvalidArgumentError(f"row_stat must be a float tensor of shape ({n},)")
    row_stat = row_stat.detach().to(device, torch.float32)
    if not bool(torch.isfinite(row_stat).all()):
        raise NonFiniteGradientError(f"row_stat of table {spec.name} contains NaN or inf; nothing changed")
    return row_stat


def check_store_args(tables, config) -> tuple[TableSpec, ...]:
    """A store's ``tables`` (a non-empty sequence of :class:`TableSpec` of distinct
    names) as a tuple, after checking ``config`` is a :class:`StoreConfig`.

    Raises:
        InvalidTypeError: ``config`` is not a StoreConfig.
        InvalidArgumentError: no tables, a table that is not a TableSpec, or a name twice.
    """
    if not isinstance(config, StoreConfig):
        raise InvalidTypeError("config must be a hiermem.StoreConfig")
    tables = tuple(tables)
    if not tables or not all(isinstance(s, TableSpec) for s in tables):
        raise InvalidArgumentError("tables must be a non-empty sequence of TableSpec")
    names = [s.name for s in tables]
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"duplicate table names in {names}")
    return tables


def store_device(name) -> torch.device:
    """The device a store's ``config.device`` names (``cuda`` as ``cuda:N``, the current one).

    Raises:
        InvalidArgumentError: CUDA is asked for but not available.
    """
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgumentError("device='cuda' but CUDA is not available")
        if device.index is None:  # tensors report cuda:N; compare like with like
            device = torch.device("cuda", torch.cuda.current_device())
    return device
