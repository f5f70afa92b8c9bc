"""The turn heads' recipe (dialogue/training/train_turn.py): its feature cache, filled by several
processes at once (`--features-only K/N`) and read by the training run."""

from __future__ import annotations

import torch

from dialogue.training import train_turn as T
from dialogue.training import turn_data as D


def test_shards_split_the_groups_between_processes() -> None:
    groups = [f"group-{i}" for i in range(400)]
    shards = [[g for g in groups if D.shard_of(g, 2) == k] for k in range(2)]
    assert sorted(shards[0] + shards[1]) == sorted(groups)  # every group in exactly one shard
    assert 150 < len(shards[0]) < 250
    assert [D.shard_of(g, 2) for g in groups] == [D.shard_of(g, 2) for g in groups]  # no PYTHONHASHSEED


def test_stores_filled_side_by_side_are_read_as_one(tmp_path) -> None:
    a, b = T.FeatureStore(tmp_path, "sha-a", shard_size=2), T.FeatureStore(tmp_path, "sha-a", shard_size=2)
    ka, kb = a.key([1, 2, 3]), b.key([4, 5])
    a.put(ka, torch.ones(4))
    b.put(kb, torch.full((4,), 2.0))
    b.put(b.key([4, 5], "sliced"), torch.zeros(4))  # a full shard: written at once
    a.flush()
    b.flush()
    both = T.FeatureStore(tmp_path, "sha-a")
    assert torch.equal(both.get(ka), torch.ones(4)) and torch.equal(both.get(kb), torch.full((4,), 2.0))
    assert both.get(both.key([4, 5], "sliced")) is not None and both.get(both.key([9])) is None
    assert (both.hits, both.misses) == (3, 1)
    # another drafter (or adapter) never reads these
    assert T.FeatureStore(tmp_path, "sha-b").get(ka) is None
