"""The service's onnxruntime pools do not spin between runs (asr/ort_options.py)."""

from __future__ import annotations

from asr.ort_options import SPINNING, session_options


def test_session_options_have_a_sleeping_pool_of_the_given_size() -> None:
    opts = session_options(3)
    assert opts.intra_op_num_threads == 3 and opts.inter_op_num_threads == 1
    assert opts.get_session_config_entry(SPINNING) == "0"
    assert opts.log_severity_level == 3
