"""The control plane: where every row is, what moves, what is evicted, what is counted.

Compiled kernels (numba, :mod:`hiermem.core.jit`) over flat numpy arrays on the CPU,
pure functions of state + batch -> plan, shared by the store (which then executes each
plan in its data plane: torch copies on the device and host tiers, LMDB) and the
simulator (which executes none):

* :mod:`~hiermem.core.index`: the ``(table, id) -> slot`` map (direct or hashed);
* :mod:`~hiermem.core.policy`: eviction keys per slot (LRU, LFU, LFU-decay, lookahead);
* :mod:`~hiermem.core.victims`: the exact victim search (a reservoir: sorted run + heap);
* :mod:`~hiermem.core.plan`: a batch's placement, decided then committed;
* :mod:`~hiermem.core.replay`: a whole trace replayed in one compiled loop.
"""
