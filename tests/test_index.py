"""The compiled key index (hashed and direct layouts) against a dict, under inserts,
removals, moves and rebuilds."""

from __future__ import annotations

import random

import pytest
import torch

from hiermem.core.index import DIRECT_INDEX_BYTES, KeyIndex, make_index


SIZES = [500, 700, 600]


@pytest.mark.parametrize("kind", ["hash", "direct"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_dict(seed, kind):
    rng = random.Random(seed)
    cap = 300
    if kind == "hash":
        ix = KeyIndex(cap, [None])
        big = lambda t: rng.randrange(2**62)  # noqa: E731
    else:
        ix = KeyIndex(cap, SIZES, direct=True)
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
    ix = KeyIndex(4, [None])
    ix.insert(torch.tensor([0, 1]), torch.tensor([5, 5]), torch.tensor([0, 1]))
    assert ix.find(torch.tensor([0, 1, 2]), torch.tensor([5, 5, 5])).tolist() == [0, 1, -1]


def test_memory_grows_with_capacity_not_ids():
    ix = KeyIndex(1000, [None])
    ix.insert(torch.zeros(3, dtype=torch.int64), torch.tensor([0, 2**40, 2**62]), torch.tensor([0, 1, 2]))
    assert ix.nbytes() <= 24 * 2048 + 8 * 1000


def test_direct_index_chosen_only_when_small():
    assert make_index(1000, [10**6, 5]).direct
    assert not make_index(1000, [10**6, None]).direct  # an unbounded table: hashed
    assert not make_index(1000, [DIRECT_INDEX_BYTES]).direct  # 4 bytes a row is too much
    # as large as the hash map it replaces is fine, whatever the budget
    assert make_index(10**7, [DIRECT_INDEX_BYTES]).direct
    d = make_index(8, [3, 4])
    d.insert(torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([7, 0]))
    assert d.find(torch.tensor([0, 1, 1]), torch.tensor([2, 3, 0])).tolist() == [7, 0, -1]
    assert d.find(torch.tensor([0, 1, 1]), torch.tensor([2, 3, 0])).dtype == torch.int64


def test_rehash_keeps_every_key_under_churn():
    """Insert/remove cycles fill the table with tombstones; rehashes keep every key."""
    ix = KeyIndex(64, [None])
    live = {}
    rng = random.Random(3)
    for step in range(2000):
        if len(live) < 64 and (not live or rng.random() < 0.55):
            k = rng.randrange(2**40)
            if (0, k) in live:
                continue
            s = next(x for x in range(64) if x not in live.values())
            ix.insert(torch.tensor([0]), torch.tensor([k]), torch.tensor([s]))
            live[(0, k)] = s
        else:
            key = rng.choice(list(live))
            ix.remove_slots(torch.tensor([live.pop(key)]))
    keys = list(live)
    got = ix.find(torch.tensor([0] * len(keys)), torch.tensor([k for _, k in keys])).tolist()
    assert got == [live[k] for k in keys]
    assert ix.size == len(live)
