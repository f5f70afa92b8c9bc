"""`models.yaml`: profiles of components, their weights, runtime options and latency budgets.

Three kinds of configuration are kept apart: model dimensions (saved with the weights),
frozen runtime options (this file), and per-session deltas (`SessionOptions.with_overrides`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from duplex.base.paths import REPO_ROOT

#: how a relay draft is checked: the slow model reads it ("exact"), the learned verifier commits its first
#: words ("verifier"), or the verifier and only the words that restate the caller ("grounded")
RELAY_CHECKS = ("exact", "verifier", "grounded")

REPO_MODELS_YAML = REPO_ROOT / "models.yaml"


class ConfigError(ValueError):
    """models.yaml is missing, malformed, or names something that does not exist."""


@dataclass(frozen=True)
class SessionOptions:
    """Runtime options of one conversation; a client may override some per session."""

    input_sample_rate: int = 16000
    output_sample_rate: int = 24000
    vad_threshold: float = 0.5
    vad_off_threshold: float = 0.35
    min_speech_ms: int = 96
    barge_in_min_speech_ms: int = 96
    end_of_turn_silence_ms: int = 500
    #: predictive end of turn (learned turn-taking): a turn the turn head calls complete with
    #: confidence (P(take) >= the heads' calibrated `fast_take` threshold) ends after this much
    #: silence instead of `end_of_turn_silence_ms`; 0 turns it off
    fast_turn_silence_ms: int = 200
    pre_roll_ms: int = 200
    partial_interval_ms: int = 500
    playout_lead_ms: int = 120
    max_history_turns: int = 12
    max_segment_ms: int = 30000
    # -- learned turn-taking (used when the LLM stage has turn-taking heads) --
    #: silence that ends a turn the turn head judged incomplete (mid-sentence pause); complete
    #: turns end after `end_of_turn_silence_ms`
    incomplete_turn_silence_ms: int = 2000
    #: silence that ends a turn at a backchannel point (a finished sentence the user may follow
    #: with another): the service says "mm-hmm" first if allowed, then answers if they do not go on.
    #: 1.5 s, the longest mid-sentence pause the service must not take: a cut the head mistakes for
    #: such a point is then not taken over (`duplex eval eot`'s last sweep: 10 -> 5 % at 1-1.5 s
    #: pauses on held-out speech, for 8 % of complete spoken turns waiting 0.5 s longer; docs/dialogue.md)
    backchannel_turn_silence_ms: int = 1500
    #: silence that ends a turn whose words the turn head calls complete but whose voice did not sound
    #: finished (the ASR's acoustic end-of-turn cue below the heads' `acoustic_hold` threshold: often a
    #: mid-sentence pause the recogniser closed with a full stop); 0 turns the cue off
    acoustic_hold_silence_ms: int = 1500
    #: a turn whose words the turn head calls complete, less surely than its short-hangover threshold, ends
    #: after `fast_turn_silence_ms` all the same when the voice sounded finished (the cue at or above the
    #: heads' `voice_fast` threshold); false: only the head's confidence shortens the wait
    voice_fast_end: bool = True
    #: user speech over the service's answer longer than this interrupts it whatever was said;
    #: shorter speech interrupts only if the overlap head calls it an interruption, not a backchannel
    max_backchannel_ms: int = 900
    #: the service says "mm-hmm" at pauses of long user turns, at most once per interval
    backchannels: bool = True
    backchannel_min_turn_ms: int = 2500
    backchannel_interval_ms: int = 6000
    #: fast drafter + verifier start each answer (false: the slow model answers alone)
    relay: bool = True
    #: how the relay's draft is checked: one of RELAY_CHECKS (dialogue.engine.DrafterOptions);
    #: "" = the profile's drafter option
    relay_check: str = ""
    #: a streaming ASR's end-of-utterance signal (its decoder heard no word for `eou_silence_ms`)
    #: pauses the turn at the last word even where the VAD still hears sound (a hum, a noisy room)
    asr_end_of_utterance: bool = True
    #: learned turn-taking: when the turn head, reading the user's words while they still talk, is sure
    #: the turn is complete, the answer's first phrase is prepared (held) from those words; at the pause,
    #: if the final transcript says the same words, the head's verdict and the phrase are ready at once.
    #: Off by default: with Moonshine's partials every 0.5 s the last words are rarely heard before the
    #: pause (4 of 40 held-out turns), and a prepared answer that misses holds the model when the pause
    #: needs it (docs/dialogue.md#early-answers-and-the-checked-draft-ninth-session)
    early_answer: bool = False
    #: where the words end, from the voice's energy: the last 10 ms frame within this many dB of the
    #: turn's loudest. A pause is dated back to it (by at most 96 ms: Silero calls the first quiet
    #: window 60-100 ms after the last word), so end-of-turn silences count from the words' end.
    #: 0 (default): the VAD's windows alone (duplex.core.endpointing.speech_end). 35 took 23-57 ms off the
    #: onset's P90 live, but split turns at short pauses in four real-model tests: off until that is studied
    speech_end_db: int = 0
    #: the final transcript starts once the voice has been quiet (`speech_end_db`) this long, before the
    #: VAD calls the pause; a stop consonant's closure costs a transcription the user never waits on.
    #: 0 (default): at the VAD's pause (`duplex bench --compare-speech-end`: no onset gain, ~1 extra
    #: transcription per turn; docs/dialogue.md#where-the-words-end)
    early_final_ms: int = 0

    #: options a client may change with session.start / session.update
    CLIENT_SETTABLE = (
        "end_of_turn_silence_ms",
        "fast_turn_silence_ms",
        "vad_threshold",
        "barge_in_min_speech_ms",
        "partial_interval_ms",
        "incomplete_turn_silence_ms",
        "backchannel_turn_silence_ms",
        "acoustic_hold_silence_ms",
        "voice_fast_end",
        "max_backchannel_ms",
        "backchannels",
        "relay",
        "relay_check",
        "asr_end_of_utterance",
        "early_answer",
        "speech_end_db",
        "early_final_ms",
    )
    _BOOLEAN = ("backchannels", "relay", "asr_end_of_utterance", "early_answer", "voice_fast_end")

    def with_overrides(self, overrides: dict[str, Any]) -> SessionOptions:
        """Apply a client's per-session deltas; unknown or out-of-range values raise ConfigError."""
        clean: dict[str, Any] = {}
        for key, value in overrides.items():
            if key not in self.CLIENT_SETTABLE:
                raise ConfigError(
                    f"option {key!r} cannot be set by a client; settable: {', '.join(self.CLIENT_SETTABLE)}"
                )
            if key == "vad_threshold":
                if not isinstance(value, (int, float)) or not 0.05 <= float(value) <= 0.95:
                    raise ConfigError("vad_threshold must be a number in [0.05, 0.95]")
                clean[key] = float(value)
            elif key == "relay_check":
                if value not in ("", *RELAY_CHECKS):
                    raise ConfigError(
                        f'relay_check must be one of {", ".join(RELAY_CHECKS)} or "" (the profile\'s)'
                    )
                clean[key] = value
            elif key == "speech_end_db":
                if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 60:
                    raise ConfigError("speech_end_db must be an integer number of decibels in [0, 60]")
                clean[key] = value
            elif key in self._BOOLEAN:
                if not isinstance(value, bool):
                    raise ConfigError(f"{key} must be true or false")
                clean[key] = value
            else:
                if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 10_000:
                    raise ConfigError(f"{key} must be an integer number of milliseconds in [0, 10000]")
                clean[key] = value
        return dataclasses.replace(self, **clean)


@dataclass(frozen=True)
class ComponentConfig:
    """One component of a profile: which backend, where its weights are, options, budgets."""

    name: str
    backend: str
    weights: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    budget_ms: dict[str, float] = field(default_factory=dict)

    def budget(self, key: str, default: float = 1000.0) -> float:
        """Latency budget in seconds for one job kind of this component."""
        return float(self.budget_ms.get(key, default)) / 1000.0


@dataclass(frozen=True)
class Profile:
    """A named, complete set of components plus the session defaults."""

    name: str
    description: str
    session: SessionOptions
    components: dict[str, ComponentConfig]

    def component(self, name: str) -> ComponentConfig:
        try:
            return self.components[name]
        except KeyError:
            raise ConfigError(
                f"profile {self.name!r} has no component {name!r} (has: {', '.join(self.components)})"
            ) from None


def load_profile(name: str | None = None, path: str | os.PathLike[str] | None = None) -> Profile:
    """Read one profile from models.yaml (default: the repository's, or $DUPLEX_MODELS_YAML)."""
    yaml_path = Path(path or os.environ.get("DUPLEX_MODELS_YAML") or REPO_MODELS_YAML)
    try:
        doc = yaml.safe_load(yaml_path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{yaml_path} not found") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{yaml_path} is not valid YAML: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("profiles"), dict):
        raise ConfigError(f"{yaml_path} must have a top-level 'profiles' mapping")
    name = name or doc.get("default_profile") or next(iter(doc["profiles"]))
    raw = doc["profiles"].get(name)
    if raw is None:
        raise ConfigError(f"no profile {name!r} in {yaml_path} (has: {', '.join(doc['profiles'])})")
    session_fields = {f.name for f in dataclasses.fields(SessionOptions)}
    session_raw = raw.get("session") or {}
    unknown = set(session_raw) - session_fields
    if unknown:
        raise ConfigError(f"profile {name!r}: unknown session options {sorted(unknown)}")
    components: dict[str, ComponentConfig] = {}
    for cname, craw in (raw.get("components") or {}).items():
        if not isinstance(craw, dict) or "backend" not in craw:
            raise ConfigError(f"profile {name!r}: component {cname!r} needs a 'backend'")
        components[cname] = ComponentConfig(
            name=cname,
            backend=str(craw["backend"]),
            weights=dict(craw.get("weights") or {}),
            options=dict(craw.get("options") or {}),
            budget_ms={k: float(v) for k, v in (craw.get("budget_ms") or {}).items()},
        )
    return Profile(
        name=name,
        description=str(raw.get("description", "")),
        session=SessionOptions(**session_raw),
        components=components,
    )
