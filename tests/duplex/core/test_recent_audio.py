"""RecentAudio keeps exactly what `np.concatenate([recent, frame])[-capacity:]` kept, for any framing."""

from __future__ import annotations

import numpy as np
import pytest

from duplex.core.recent import RecentAudio


@pytest.mark.parametrize("sizes", [[320] * 500, [1, 7, 4000, 3, 999, 12000, 5] * 20, [12000, 12001, 1]])
def test_the_window_and_its_base_match_concatenating(sizes: list[int]) -> None:
    rng = np.random.default_rng(0)
    capacity = 12000
    ring, plain, total = RecentAudio(capacity), np.zeros(0, np.float32), 0
    for n in sizes:
        x = rng.standard_normal(n).astype(np.float32)
        ring.append(x)
        plain = np.concatenate([plain, x])[-capacity:]
        total += n
        assert np.array_equal(ring.samples, plain)
        assert ring.base == total - plain.size and ring.total == total


def test_empty_frames_and_a_bad_capacity() -> None:
    ring = RecentAudio(4)
    ring.append(np.zeros(0, np.float32))
    assert ring.samples.size == 0 and ring.base == 0
    with pytest.raises(ValueError, match="capacity"):
        RecentAudio(0)
