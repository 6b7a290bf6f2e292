"""A small cost model: bytes moved per tier pair -> an estimated step time.

Pure functions over frozen values (as the planner's estimators): :meth:`CostModel.estimate`
returns a :class:`StepTime` whose parts add up.  The defaults were measured on the
project's 2-core CPU machine by ``python scripts/measure_costs.py`` (device = ``cpu``:
host <-> device is a row copy in RAM; disk is LMDB through :class:`~hiermem.tiers.DiskTier`);
pass your own numbers for a GPU box (e.g. PCIe H2D ~ 20e9 B/s).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import InvalidArgumentError


@dataclass(frozen=True)
class StepTime:
    """Seconds per step, by part; ``total`` is what a step costs (I/O overlapped with
    compute when prefetching)."""

    compute: float = 0.0
    host_to_device: float = 0.0
    device_to_host: float = 0.0
    disk_read: float = 0.0
    disk_write: float = 0.0
    overlapped: bool = False

    @property
    def io(self) -> float:
        return self.host_to_device + self.device_to_host + self.disk_read + self.disk_write

    @property
    def total(self) -> float:
        return max(self.compute, self.io) if self.overlapped else self.compute + self.io

    def __add__(self, other: "StepTime") -> "StepTime":
        return StepTime(*(getattr(self, f) + getattr(other, f) for f in
                          ("compute", "host_to_device", "device_to_host", "disk_read", "disk_write")),
                        overlapped=self.overlapped and other.overlapped)

    def to_dict(self) -> dict:
        return {**asdict(self), "io": self.io, "total": self.total}


@dataclass(frozen=True)
class CostModel:
    """Bandwidths (bytes/s) per tier pair and the device's lookup rate (accesses/s).

    Args:
        host_to_device: rows promoted host -> device (and disk -> device through host).
        device_to_host: rows demoted device -> host.
        disk_read: rows read from LMDB.
        disk_write: dirty rows written back to LMDB.
        device_accesses_per_s: gather + fused update of resident rows.
    """

    # measured by scripts/measure_costs.py on the 2-core CPU box (device = cpu, shared load)
    host_to_device: float = 3.3e9
    device_to_host: float = 3.4e9
    disk_read: float = 1.1e8
    disk_write: float = 2.2e8
    device_accesses_per_s: float = 4.0e5

    def __post_init__(self) -> None:
        for k, v in asdict(self).items():
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise InvalidArgumentError(f"cost model {k} must be a positive number, got {v!r}")

    def estimate(self, batches: int, accesses: int, bytes_h2d: int, bytes_d2h: int, bytes_disk_read: int,
                 bytes_disk_write: int, prefetch_depth: int = 0) -> StepTime:
        """Mean time per step of a replay that moved these bytes over ``batches`` steps.

        With ``prefetch_depth > 0`` the transfers of the next batches overlap the current
        step's compute (``total = max(compute, io)``), else they add up.
        """
        n = max(1, batches)
        return StepTime(compute=accesses / self.device_accesses_per_s / n,
                        host_to_device=bytes_h2d / self.host_to_device / n,
                        device_to_host=bytes_d2h / self.device_to_host / n,
                        disk_read=bytes_disk_read / self.disk_read / n,
                        disk_write=bytes_disk_write / self.disk_write / n,
                        overlapped=prefetch_depth > 0)
