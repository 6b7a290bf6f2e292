"""Every position the control plane's arrays are read at, named once.

The kernels (:mod:`hiermem.core.plan`, :mod:`~hiermem.core.victims`,
:mod:`~hiermem.core.replay`, :mod:`~hiermem.core.placement`), the store and the simulator
index plain int64 arrays; this module names their rows, slots, fields and codes, and
nothing else defines them (numba reads module-level ints as compile-time constants, so a
name costs nothing in a kernel).  The counters' public IntEnums
(:class:`hiermem.observe.stats.Stat`, :class:`~hiermem.observe.stats.IO`) are built from
the positions here, as are :class:`hiermem.types.Tier`'s first three codes (checked there).
"""

from __future__ import annotations

# -- the plan's workspace: ws, int64 [NROWS, 2 * U] (hiermem.core.plan) ----------------
(G,          # each batch row's global slot before the plan (-1: in neither slot tier)
 SLOT,       # each batch row's tier slot after it
 ONDEV,      # 1: that slot is on the device
 MI,         # positions of the device misses
 VD, VH,     # device / host victims (tier slots, smallest key first)
 DISK,       # positions of the rows read from disk (or the initialiser)
 FOUND,      # 1: disk row j was found in LMDB (set by the caller between decide and commit)
 WB,         # dirty victims to write down (global slots)
 UP_SRC, UP_DST,  # host -> device copies (tier slots)
 DN_SRC, DN_DST,  # device -> host copies (tier slots)
 NEW_DST,    # the global slot of disk row j
 ENTRY,      # saved index entries of rows changing tier (scratch before)
 MOVED,      # 1: the row came up to the device (scratch before)
 SV_T, SV_K, SV_DIRTY, SV_PINS, SV_KEY, SV_SCORE, SV_USES,  # saved slot state of rows changing tier
 RH,         # each batch row's 64-bit hash (set by the backing before decide: hiermem.store.placing)
 ) = range(24)
NROWS = 24

# -- the plan's counts: res, int64 [NRES] -----------------------------------------------
(STATUS, M, N_MOVE, NA, NB, NC, NE, N_VD, N_SKIP, N_VH, N_DISK, N_WB, N_UP, N_DN, DEV_EV, HOST_EV) = range(16)
NRES = 16
OK, CAPACITY = 0, 1  # res[STATUS]

# -- a slot tier's state tuple (hiermem.tiers.SlotTier.state) and its tmeta ------------
T_KT, T_KK, T_DIRTY, T_PINS, T_FREE, T_META, T_MARK = range(7)
NFREE, NPINNED, CAP, BASE = 0, 1, 2, 3  # tmeta fields

# -- a policy's state tuple (hiermem.core.policies.Policy.state) ------------------------
P_KEY, P_SCORE, P_USES, P_PARAMS, P_RM, P_RUN_S, P_RUN_K, P_HEAP_K, P_HEAP_S, P_SCRATCH_K, P_SCRATCH_S = range(11)
# params (float64 [4]): the policy's code, then its parameters
PARAM_CODE, PARAM_HALF_LIFE, PARAM_ADMIT, PARAM_BASE = 0, 1, 2, 3  # PARAM_BASE: lookahead's base policy code
# the victim search's rmeta (int64 [RM_SIZE], hiermem.core.victims)
RM_VALID, RM_TAU, RM_POS, RM_RLEN, RM_HLEN, RM_BUILDS, RM_SCANS, RM_SCAN_ONLY = range(8)
RM_SIZE = 8

# -- policy codes (params[PARAM_CODE]) --------------------------------------------------
LRU, LFU, LFU_DECAY, LOOKAHEAD = 0, 1, 2, 3
# queue policies (hiermem.core.queues): victims from linked lists over the slots, not keys
SIEVE, S3FIFO, ARC, WTINYLFU = 4, 5, 6, 7
FIRST_QUEUE = SIEVE
# their state past the victim search's rmeta (rm[RM_SIZE:Q_RMSIZE]): capacity; each
# queue's head (newest), tail (oldest) and size; the SIEVE hand; ARC's p and ghost-hit
# flags; the small / window and main / protected targets; the ghosts' two rings and hash
# table (in hs: offsets, sizes, live counts); the frequency sketch (in hs)
(Q_C, Q_HEAD, _Q_H1, _Q_H2, _Q_H3, Q_TAIL, _Q_T1, _Q_T2, _Q_T3, Q_SIZE, _Q_S1, _Q_S2, _Q_S3, Q_HAND, Q_P, Q_FLAG,
 Q_PRE, Q_EVICTED, Q_SMALL, Q_MAIN, Q_PROT, G_CAP, _G_CAP1, G_LO, _G_LO1, G_HI, _G_HI1, G_LIVE, _G_LIVE1, G_RSZ,
 G_TH, G_USED, G_RING, G_TABLE, K_OFF, K_W, K_ADDS, K_SAMPLE, Q_LA) = range(RM_SIZE, RM_SIZE + 39)
Q_RMSIZE = RM_SIZE + 39  # Q_LA: 1 when the policy is lookahead's base (next uses at hk[3C:4C])
Q_NONE, Q_GONE = -1, 8  # qid of a slot in no queue; qid >= Q_GONE: taken as a victim (q + Q_GONE)
Q_ADM = 3  # the queue of rows the admission filter refused (the first victims; no policy uses queue 3)

# -- the admission filter (hiermem.core.admission), rm[Q_RMSIZE:RM_ALL] of every policy --
# on (its code below); where the per-slot row hashes and the sketch start in hs, the
# sketch's width per row, increments since the last halving, and the halving period
A_ON, A_HASH, A_SK, A_W, A_ADDS, A_SAMPLE = range(Q_RMSIZE, Q_RMSIZE + 6)
RM_ALL = Q_RMSIZE + 6  # every policy's rm has this many entries
ADMIT_OFF, ADMIT_TINYLFU = 0, 1  # rm[A_ON]: admission codes

# -- counters: table x tier x stat (hiermem.observe.stats.Counters.table) ---------------
C_DEVICE, C_HOST, C_DISK = 0, 1, 2  # hiermem.types.Tier codes
NSTAT_TIERS = 3
LOOKUPS, HITS, MISSES, EVICTIONS, WRITEBACKS = range(5)
NSTATS = 5

# -- store-wide counters (hiermem.observe.stats.IO) -------------------------------------
(IO_BYTES_HOST_TO_DEVICE, IO_BYTES_DEVICE_TO_HOST, IO_BYTES_DISK_TO_HOST, IO_BYTES_HOST_TO_DISK,
 IO_FLUSHES, IO_FLUSHED_ROWS, IO_UPDATES, IO_UPDATED_ROWS, IO_PREFETCHED_ROWS, IO_PREFETCH_HITS,
 IO_LATE_PREFETCHES, IO_PREFETCH_DEGRADED, IO_PREFETCHED_BATCHES, IO_PREFETCH_REVOKED,
 IO_PREFETCH_REQUESTS, IO_PREFETCH_PINNED_ROWS) = range(16)
NIO = 16

# -- the key index's meta (int64 [4], hiermem.core.index) -------------------------------
IX_KIND, IX_SIZE, IX_TOMB, IX_MASK = range(4)
DIRECT, HASH = 0, 1  # meta[IX_KIND]
