"""The TTS stage a models.yaml `tts` component names: hibari (the packaged voice) or `flow` (the project's
own flow-matching voice on the FSQ speech codec). Each backend's packages are imported only when chosen."""

from __future__ import annotations

from typing import Any

from duplex.base.config import ComponentConfig, ConfigError

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
