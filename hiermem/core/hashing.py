"""Counter-based hashing on int64 tensors (splitmix64), used by the index and initialiser."""

from __future__ import annotations

import torch


def _s64(x: int) -> int:
    """An unsigned 64-bit constant as the signed int64 torch stores."""
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _s64(0x9E3779B97F4A7C15)
_M1 = _s64(0xBF58476D1CE4E5B9)
_M2 = _s64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on an int64 tensor (wrapping arithmetic)."""
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def mix_scalar(*parts: int) -> int:
    """Hash a few Python ints into one signed int64 (same function as :func:`mix64`)."""
    h = torch.zeros((), dtype=torch.int64)
    for p in parts:
        h = mix64(h ^ _s64(p % (1 << 64)))
    return int(h)


def uniform_rows(seed_key: int, ids: torch.Tensor, dim: int, bound: float) -> torch.Tensor:
    """Deterministic ``U[-bound, bound)`` rows ``[len(ids), dim]`` float32, one per id.

    Row ``i`` depends only on ``(seed_key, ids[i])``: the same id always gets the same row,
    on any device, in any batch.  Each 64-bit hash (splitmix64 of the row, then a
    multiply-xorshift per pair of columns) yields two 24-bit uniforms.
    """
    n, half = ids.numel(), (dim + 1) // 2
    base = mix64(ids.to(torch.int64) ^ seed_key)
    z = base.unsqueeze(1) + torch.arange(1, half + 1, dtype=torch.int64, device=ids.device) * _GOLDEN
    z.bitwise_xor_(_shr(z, 32)).mul_(_M2)
    z.bitwise_xor_(_shr(z, 29))
    u = torch.empty((n, 2 * half), dtype=torch.float32, device=ids.device)
    u[:, 0::2] = _shr(z, 40).to(torch.float32)
    u[:, 1::2] = ((z >> 8) & 0xFFFFFF).to(torch.float32)
    return u[:, :dim].mul_(2 * bound / (1 << 24)).sub_(bound)
