"""The pool summary an export of the streamed-Moonshine adapters records as its data provenance."""

from pathlib import Path

import numpy as np

from asr.training.train_moonshine_stream import pool_summary


def _shard(path: Path, n: int) -> None:
    lengths = np.full(n, 160)
    np.savez(path, pcm=np.zeros(lengths.sum(), np.int16), lengths=lengths, texts=np.array(["a b"] * n))


def test_counts_utterances_per_seed_and_skips_shards_being_written(tmp_path: Path) -> None:
    _shard(tmp_path / "shard-78-000000.npz", 3)
    _shard(tmp_path / "shard-78-000003.npz", 2)
    _shard(tmp_path / "shard-79-000000.npz", 4)
    _shard(tmp_path / "shard-80-000000.tmp.npz", 7)  # a shard still being written is not in the pool yet

    summary = pool_summary(tmp_path)

    assert summary is not None
    assert summary["per_seed"] == {"78": 5, "79": 4}
    assert summary["utterances"] == 9
    assert "--make-pool" in summary["made_by"]


def test_a_pool_that_is_gone_gives_none(tmp_path: Path) -> None:
    assert pool_summary(tmp_path / "elsewhere") is None
