"""The data plane: the math of a placed batch on the tier tensors (pooling, fused optimizer).

:mod:`~hiermem.dataplane.planes` holds the planes a store can use (compiled CPU kernels,
torch ops); :mod:`~hiermem.dataplane.kernels` the compiled kernels.
"""

from .planes import PLANES, CompiledPlane, DataPlane, PlaneView, RowGrads, TorchPlane, default_plane, plane_named

__all__ = ["PLANES", "CompiledPlane", "DataPlane", "PlaneView", "RowGrads", "TorchPlane", "default_plane", "plane_named"]
