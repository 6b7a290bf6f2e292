"""SlotIndex and DirectIndex against a dict, under inserts, removals, moves and rebuilds."""

from __future__ import annotations

import random

import pytest
import torch

from hiermem.index import DIRECT_INDEX_BYTES, DirectIndex, SlotIndex, make_index


SIZES = [500, 700, 600]


@pytest.mark.parametrize("kind", ["hash", "direct"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_dict(seed, kind):
    rng = random.Random(seed)
    cap = 300
    if kind == "hash":
        ix = SlotIndex(cap)
        big = lambda t: rng.randrange(2**62)  # noqa: E731
    else:
        ix = DirectIndex(cap, torch.tensor([0, 500, 1200]), sum(SIZES))
        big = lambda t: SIZES[t] - 1 - rng.randrange(3)  # noqa: E731  (the last rows of a table)
    ref: dict[tuple[int, int], int] = {}
    free = list(range(cap))
    for step in range(400):
        op = rng.random()
        if op < 0.5 and len(free) > 20:  # insert new keys
            keys = {(t, rng.choice([rng.randrange(500), big(t)])) for t in (rng.randrange(3) for _ in range(20))}
            keys = [k for k in keys if k not in ref]
            slots = [free.pop() for _ in keys]
            if keys:
                ix.insert(torch.tensor([k[0] for k in keys]), torch.tensor([k[1] for k in keys]), torch.tensor(slots))
                ref.update(zip(keys, slots))
        elif op < 0.75 and ref:  # remove
            gone = rng.sample(list(ref), min(len(ref), rng.randrange(1, 30)))
            ix.remove_slots(torch.tensor([ref[k] for k in gone]))
            for k in gone:
                free.append(ref.pop(k))
        elif ref and free:  # move some keys to free slots (and swap two)
            mv = rng.sample(list(ref), min(len(ref), len(free), 10))
            src = [ref[k] for k in mv]
            dst = [free.pop() for _ in mv]
            ix.move_slots(torch.tensor(src), torch.tensor(dst))
            for k, d in zip(mv, dst):
                ref[k] = d
            free.extend(src)
        # every known key resolves, plus some absent ones
        qk = list(ref) + [(t, rng.choice([rng.randrange(500), big(t)])) for t in (rng.randrange(3) for _ in range(20))]
        got = ix.find(torch.tensor([k[0] for k in qk]), torch.tensor([k[1] for k in qk])).tolist()
        assert got == [ref.get(k, -1) for k in qk]
        assert ix.size == len(ref)
        t, k, v = ix.items()
        assert dict(zip(zip(t.tolist(), k.tolist()), v.tolist())) == ref


def test_same_id_different_tables_are_distinct():
    ix = SlotIndex(4)
    ix.insert(torch.tensor([0, 1]), torch.tensor([5, 5]), torch.tensor([0, 1]))
    assert ix.find(torch.tensor([0, 1, 2]), torch.tensor([5, 5, 5])).tolist() == [0, 1, -1]


def test_memory_grows_with_capacity_not_ids():
    ix = SlotIndex(1000)
    ix.insert(torch.zeros(3, dtype=torch.int64), torch.tensor([0, 2**40, 2**62]), torch.tensor([0, 1, 2]))
    assert ix.nbytes() <= 24 * 2048 + 8 * 1000


def test_direct_index_chosen_only_when_small():
    assert isinstance(make_index(1000, [10**6, 5]), DirectIndex)
    assert isinstance(make_index(1000, [10**6, None]), SlotIndex)  # an unbounded table: hashed
    assert isinstance(make_index(1000, [DIRECT_INDEX_BYTES]), SlotIndex)  # 4 bytes a row is too much
    # as large as the hash map it replaces is fine, whatever the budget
    assert isinstance(make_index(10**7, [DIRECT_INDEX_BYTES]), DirectIndex)
    d = make_index(8, [3, 4])
    d.insert(torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([7, 0]))
    assert d.find(torch.tensor([0, 1, 1]), torch.tensor([2, 3, 0])).tolist() == [7, 0, -1]
    assert d.find(torch.tensor([0, 1, 1]), torch.tensor([2, 3, 0])).dtype == torch.int64
