"""The TTS stage a models.yaml `tts` component names: hibari (the packaged voice) or `flow` (the project's
own flow-matching voice on the FSQ speech codec). Each backend's packages are imported only when chosen."""

from __future__ import annotations

from typing import Any

from duplex.base.config import ComponentConfig, ConfigError
from duplex.base.messages import TtsChunk, TtsInput
from duplex.base.stage import IncrementalStage

BACKENDS = ("hibari", "flow")


def load_tts(cfg: ComponentConfig) -> Any:
    """Build the TTS stage (`init_state/step/step_batch`, `segmenter`, `sample_rate`) for `cfg`."""
    if cfg.backend == "flow":
        from tts.flow_tts import load_flow_tts_stage

        return load_flow_tts_stage(cfg)
    if cfg.backend == "hibari":
        from tts.hibari_tts import load_tts_stage

        return load_tts_stage(cfg)
    raise ConfigError(
        f"component {cfg.name!r}: unknown TTS backend {cfg.backend!r} (known: {', '.join(BACKENDS)})"
    )


def step_all(stage: Any, state: Any, chunk: TtsInput) -> tuple[list[TtsChunk], Any]:
    """One step, then (for a stage that hands back chunk by chunk) empty steps until it owes nothing: all the
    audio this input makes ready, as the session core collects it over several jobs."""
    out, state = stage.step(state, chunk)
    out = list(out)
    while isinstance(stage, IncrementalStage) and stage.pending(state):
        more, state = stage.step(state, TtsInput("", chunk.final))
        out += more
    return out, state
