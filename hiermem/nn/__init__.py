"""torch front ends: the cached embedding module, the prefetch pipeline, sparse features,
TorchRec interop, the DLRM of the demo and benchmarks, and its data."""
