"""Row optimizers applied in place to cached rows, with no dense gradient.

A row *record* is ``[weight (dim) | optimizer state (state_width(dim))]`` in one float32
vector, so a row and its state always move between tiers together.  ``update`` sums the
gradients of duplicate ids first, then calls :meth:`Optimizer.apply` once per unique row.
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, fields
from typing import ClassVar

import torch

from ..errors import InvalidArgumentError, InvalidTypeError


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise InvalidArgumentError(msg)


def _numbers(opt: "Optimizer") -> None:
    """Every hyper-parameter of a frozen optimizer dataclass is a real number."""
    for f in fields(opt):  # type: ignore[arg-type]
        v = getattr(opt, f.name)
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise InvalidTypeError(f"{type(opt).__name__}: {f.name} must be a real number, got {v!r}")


class Optimizer(ABC):
    """A row-wise optimizer.  Subclasses are frozen dataclasses of hyper-parameters."""

    name: ClassVar[str]

    @abstractmethod
    def state_width(self, dim: int) -> int:
        """Floats of optimizer state kept per row of ``dim`` weights."""

    def state_init(self) -> float:
        """Initial value of every state float."""
        return 0.0

    @abstractmethod
    def apply(self, rec: torch.Tensor, grad: torch.Tensor, dim: int, step: int) -> None:
        """Update records ``rec [n, dim + state_width]`` in place with summed ``grad [n, dim]``.

        ``step`` is the table's update count including this one (1 on the first update).
        """

    def apply_slots(self, data: torch.Tensor, slots: torch.Tensor, grad: torch.Tensor, dim: int, width: int,
                    step: int) -> None:
        """Update the records in rows ``slots`` (distinct) of a tier's ``data`` in place."""
        view = data if width == data.shape[1] else data[:, :width]
        rec = view.index_select(0, slots)
        self.apply(rec, grad, dim, step)
        view.index_copy_(0, slots, rec)

    def row_statistic(self, grad: torch.Tensor, full_dim: int) -> torch.Tensor | None:
        """This shard's part ``[n]`` of a per-row statistic over all ``full_dim`` columns.

        ``None`` (the default) when the update is column-separable, so a column shard
        needs nothing from the others.  Otherwise the parts of every column shard add up
        to the statistic, which :meth:`apply_with_row_stat` then takes.
        """
        return None

    def apply_with_row_stat(self, rec: torch.Tensor, grad: torch.Tensor, dim: int, step: int,
                            stat: torch.Tensor) -> None:
        """:meth:`apply` with the per-row statistic ``stat [n]`` given (column shards)."""
        raise InvalidArgumentError(f"optimizer {self.name} has no per-row statistic")

    def apply_slots_with_row_stat(self, data: torch.Tensor, slots: torch.Tensor, grad: torch.Tensor, dim: int,
                                  width: int, step: int, stat: torch.Tensor) -> None:
        """:meth:`apply_slots` with the per-row statistic given."""
        view = data if width == data.shape[1] else data[:, :width]
        rec = view.index_select(0, slots)
        self.apply_with_row_stat(rec, grad, dim, step, stat)
        view.index_copy_(0, slots, rec)

    def to_dict(self) -> dict:
        return {"name": self.name, **asdict(self)}  # type: ignore[call-overload]


@dataclass(frozen=True)
class SGD(Optimizer):
    """Plain SGD: ``w -= lr * g``."""

    lr: float = 0.01
    name: ClassVar[str] = "sgd"

    def __post_init__(self) -> None:
        _numbers(self)
        _check(math.isfinite(self.lr) and self.lr >= 0, f"SGD: lr must be finite and >= 0, got {self.lr}")

    def state_width(self, dim: int) -> int:
        return 0

    def apply(self, rec, grad, dim, step):
        rec[:, :dim].add_(grad, alpha=-self.lr)


@dataclass(frozen=True)
class Adagrad(Optimizer):
    """Element-wise Adagrad, as ``torch.optim.Adagrad`` on a sparse gradient (lr_decay=0).

    Per touched row, element-wise: ``acc += g*g``; ``w -= lr * g / (sqrt(acc) + eps)``.
    ``acc`` starts at ``initial_accumulator_value``.
    """

    lr: float = 0.01
    eps: float = 1e-10
    initial_accumulator_value: float = 0.0
    name: ClassVar[str] = "adagrad"

    def __post_init__(self) -> None:
        _numbers(self)
        _check(math.isfinite(self.lr) and self.lr >= 0, "Adagrad: lr must be finite and >= 0")
        _check(self.eps >= 0 and self.initial_accumulator_value >= 0, "Adagrad: eps and accumulator must be >= 0")

    def state_width(self, dim: int) -> int:
        return dim

    def state_init(self) -> float:
        return self.initial_accumulator_value

    def apply(self, rec, grad, dim, step):
        w, acc = rec[:, :dim], rec[:, dim : 2 * dim]
        acc.addcmul_(grad, grad)
        w.addcdiv_(grad, acc.sqrt().add_(self.eps), value=-self.lr)


@dataclass(frozen=True)
class RowWiseAdagrad(Optimizer):
    """Row-wise Adagrad as in FBGEMM's ``EXACT_ROWWISE_ADAGRAD``: one accumulator per row.

    Per touched row: ``acc += mean(g*g)``; ``w -= lr * g / (sqrt(acc) + eps)``.
    """

    lr: float = 0.01
    eps: float = 1e-8
    name: ClassVar[str] = "rowwise_adagrad"

    def __post_init__(self) -> None:
        _numbers(self)
        _check(math.isfinite(self.lr) and self.lr >= 0, "RowWiseAdagrad: lr must be finite and >= 0")
        _check(self.eps >= 0, "RowWiseAdagrad: eps must be >= 0")

    def state_width(self, dim: int) -> int:
        return 1

    def apply(self, rec, grad, dim, step):
        acc = rec[:, dim : dim + 1]
        acc.add_(grad.square().mean(dim=1, keepdim=True))
        rec[:, :dim].addcdiv_(grad, acc.sqrt().add_(self.eps), value=-self.lr)

    def row_statistic(self, grad, full_dim):
        return grad.square().sum(dim=1).div_(full_dim)  # parts of mean(g*g) over the full row

    def apply_with_row_stat(self, rec, grad, dim, step, stat):
        acc = rec[:, dim : dim + 1]
        acc.add_(stat.unsqueeze(1))
        rec[:, :dim].addcdiv_(grad, acc.sqrt().add_(self.eps), value=-self.lr)


@dataclass(frozen=True)
class Adam(Optimizer):
    """Adam with the semantics of ``torch.optim.SparseAdam``, restricted to touched rows.

    ``step`` counts the table's updates (as SparseAdam's per-parameter step).  Per touched
    row: ``m = b1*m + (1-b1)*g``; ``v = b2*v + (1-b2)*g*g``;
    ``w -= lr * sqrt(1 - b2**step) / (1 - b1**step) * m / (sqrt(v) + eps)``.
    """

    lr: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    name: ClassVar[str] = "adam"

    def __post_init__(self) -> None:
        _numbers(self)
        _check(math.isfinite(self.lr) and self.lr >= 0, "Adam: lr must be finite and >= 0")
        _check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "Adam: betas must be in [0, 1)")
        _check(self.eps >= 0, "Adam: eps must be >= 0")

    def state_width(self, dim: int) -> int:
        return 2 * dim

    def apply(self, rec, grad, dim, step):
        w, m, v = rec[:, :dim], rec[:, dim : 2 * dim], rec[:, 2 * dim : 3 * dim]
        m.add_(grad.sub(m).mul_(1 - self.beta1))
        v.add_(grad.square().sub_(v).mul_(1 - self.beta2))
        step_size = self.lr * math.sqrt(1 - self.beta2**step) / (1 - self.beta1**step)
        w.add_(m.div(v.sqrt().add_(self.eps)), alpha=-step_size)


OPTIMIZERS: dict[str, type[Optimizer]] = {c.name: c for c in (SGD, Adagrad, RowWiseAdagrad, Adam)}


def optimizer_from_dict(d: dict) -> Optimizer:
    d = dict(d)
    cls = OPTIMIZERS.get(d.pop("name", None))
    if cls is None:
        raise InvalidArgumentError(f"unknown optimizer {d!r}")
    return cls(**d)
