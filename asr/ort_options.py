"""onnxruntime session options for the service's models: a fixed intra-op pool that sleeps when idle.

By default onnxruntime's intra-op threads spin for a while after every run, waiting for the next one.
On a small CPU that steals the cores from whatever runs next: with Moonshine at two threads, the turn
head's listen step right after a final transcript took 58 ms instead of 31 (P50, 12 turns, this 2-core
machine), and the transcription itself was no faster for the spinning (114 vs 110 ms). The service
always runs something else next (an LLM step, another session's job), so its pools do not spin.
"""

from __future__ import annotations

from typing import Any

SPINNING = "session.intra_op.allow_spinning"


def session_options(threads: int) -> Any:
    """`onnxruntime.SessionOptions` with `threads` intra-op threads, one inter-op thread, errors-only
    logging, and no spinning between runs."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    opts.add_session_config_entry(SPINNING, "0")
    return opts
