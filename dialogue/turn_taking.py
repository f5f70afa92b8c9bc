"""The learned turn-taking heads: when to answer, when to say "mm-hmm", when to stop talking.

While the user speaks, the dialogue engine prefills their words (the ASR partial transcript) into
the fast drafter, SmolLM2-135M-Instruct, as an *open* user message: no end marker, because the
user is still talking. The drafter's last hidden state (after the final norm) at a slice boundary
then already says a lot about whether the thought is complete, so two small heads read it:

* the **turn head** (LISTEN / BACKCHANNEL / SPEAK), asked at a pause: answer after the short
  hangover (SPEAK), wait through the pause (LISTEN, "I would like to book a table for ..."), or
  say "mm-hmm" at an inner sentence boundary of a long story (BACKCHANNEL);
* the **overlap head** (P(interruption)), asked when the user speaks while the service does:
  a backchannel ("uh-huh", "right") lets the answer go on, an interruption ("stop", "wait, what
  about Tuesday?") cuts it.

The heads are trained by `python -m dialogue.training.train_turn` on exactly the input `render_user_prefix`
builds; this module is what the engine imports, so it holds the input format, the heads and the
loader, and nothing of the training (no chatterbot, no data pipeline).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from duplex.base.errors import ModelError
from duplex.base.turn_policy import BACKCHANNEL, LABELS, LISTEN, SPEAK, TurnPolicy

__all__ = [
    "BACKCHANNEL",
    "DEFAULT_WEIGHTS",
    "LABELS",
    "LISTEN",
    "OVERLAP_LABELS",
    "SPEAK",
    "TurnHeads",
    "TurnPolicy",
    "WEIGHTS_DIR",
    "load_turn_heads",
    "normalize_user_text",
    "render_user_prefix",
]

#: overlap head classes; the head outputs P(class 1)
OVERLAP_LABELS = ("backchannel", "interruption")

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
DEFAULT_WEIGHTS = WEIGHTS_DIR / "turn_heads.safetensors"
#: fields load_turn_heads() requires in the metadata file
REQUIRED_METADATA = ("format", "hidden_size", "dim", "drafter", "thresholds")
METADATA_FORMAT = 1
#: what ends a complete message in the drafter's (ChatML) template; an open message lacks it
END_MARKER = "<|im_end|>\n"

# ASR puts a period wherever the speaker paused, so punctuation would be a false cue for the
# heads: it is stripped (apostrophes and hyphens stay, they are part of words: "don't", "uh-huh").
_STRIP = re.compile(r"[.,!?;:\"]")
_SPACES = re.compile(r"\s+")


def normalize_user_text(text: str) -> str:
    """The user's words as the heads see them: no . , ! ? ; : " and single spaces; case kept."""
    return _SPACES.sub(" ", _STRIP.sub(" ", text)).strip()


def render_user_prefix(
    tokenizer: Any, system: str, history: Sequence[Mapping[str, str]], text: str, *, normalize: bool = True
) -> list[int]:
    """Token ids of system + history + the user's words so far, as an open (unfinished) message.

    The chat template is rendered with the user message complete and its trailing end marker is
    cut off, so the ids are exactly what the engine's drafter cache holds while the user talks.
    `text` is normalised with `normalize_user_text` (pass normalize=False if it already is);
    `history` messages are rendered as they are. ValueError if the template does not end the
    message with the ChatML end marker (another drafter's template needs another cut).
    """
    content = normalize_user_text(text) if normalize else text
    msgs: list[dict[str, str]] = [{"role": "system", "content": system}]
    for m in history:
        role, body = m.get("role"), m.get("content")
        if role not in ("user", "assistant") or not isinstance(body, str):
            raise ValueError(f"bad history message {dict(m)!r}; need role user/assistant and str content")
        msgs.append({"role": role, "content": body})
    msgs.append({"role": "user", "content": content})
    rendered = str(tokenizer.apply_chat_template(msgs, tokenize=False))
    if not rendered.endswith(content + END_MARKER):
        raise ValueError(
            f"chat template does not end the user message with {END_MARKER!r}: ...{rendered[-60:]!r}"
        )
    return list(tokenizer.encode(rendered[: -len(END_MARKER)], add_special_tokens=False))


def _mlp(hidden_size: int, dim: int, out: int, dropout: float) -> nn.Sequential:
    return nn.Sequential(
        nn.LayerNorm(hidden_size),
        nn.Dropout(dropout),
        nn.Linear(hidden_size, dim),
        nn.GELU(),
        nn.Linear(dim, out),
    )


class TurnHeads(nn.Module):
    """Two small MLPs on the drafter's last hidden state (LayerNorm -> Linear -> GELU -> Linear).

    Small on purpose: they run at every slice boundary of every session next to the drafter,
    and a few tens of thousands of parameters are all the labelled data supports.
    """

    def __init__(self, hidden_size: int = 576, dim: int = 64, dropout: float = 0.1) -> None:
        super().__init__()
        self.hidden_size = int(hidden_size)
        self.dim = int(dim)
        self.turn_mlp = _mlp(self.hidden_size, self.dim, 3, dropout)
        self.overlap_mlp = _mlp(self.hidden_size, self.dim, 1, dropout)

    def _check(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"turn heads expect hidden size {self.hidden_size}, got {hidden.shape[-1]}")
        return hidden.float()

    def turn_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., 3] pre-softmax scores (what the loss trains)."""
        return self.turn_mlp(self._check(hidden))

    def overlap_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [...] pre-sigmoid scores of INTERRUPTION."""
        return self.overlap_mlp(self._check(hidden)).squeeze(-1)

    def turn(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., 3] probabilities of LISTEN, BACKCHANNEL, SPEAK."""
        return torch.softmax(self.turn_logits(hidden), dim=-1)

    def overlap(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [...] P(interruption) of what the user said over the service."""
        return torch.sigmoid(self.overlap_logits(hidden))

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Both heads at once: (turn probabilities [..., 3], P(interruption) [...])."""
        return self.turn(hidden), self.overlap(hidden)


def heads_metadata_path(path: str | Path | None = None) -> Path:
    """The JSON metadata beside the heads' weights (thresholds, calibration)."""
    return (Path(path) if path is not None else DEFAULT_WEIGHTS).with_suffix(".json")


def load_turn_heads(
    path: str | Path | None = None, hidden_size: int | None = None
) -> tuple[TurnHeads, TurnPolicy, dict[str, Any]]:
    """Load (heads in eval mode, policy, metadata) from X.safetensors + X.json.

    `hidden_size`, when given (the drafter's config.hidden_size), must match the trained one:
    heads trained on another drafter's hidden states would output confident nonsense.
    """
    from safetensors.torch import load_file

    weights = Path(path) if path is not None else DEFAULT_WEIGHTS
    meta_path = weights.with_suffix(".json")
    hint = "train them with `python -m dialogue.training.train_turn` (writes both files)"
    missing = [str(p) for p in (weights, meta_path) if not p.is_file()]
    if missing:
        raise ModelError(f"turn-taking heads: missing {', '.join(missing)}; {hint}")
    try:
        meta = json.loads(meta_path.read_text())
    except ValueError as exc:
        raise ModelError(f"turn-taking heads: {meta_path} is not valid JSON ({exc}); {hint}") from exc
    absent = [k for k in REQUIRED_METADATA if k not in meta]
    if absent:
        raise ModelError(f"turn-taking heads: {meta_path} lacks {', '.join(absent)}; {hint}")
    if int(meta["format"]) != METADATA_FORMAT:
        raise ModelError(
            f"turn-taking heads: {meta_path} has format {meta['format']}, need {METADATA_FORMAT}; {hint}"
        )
    trained = int(meta["hidden_size"])
    if hidden_size is not None and int(hidden_size) != trained:
        raise ModelError(
            f"turn-taking heads: trained on hidden size {trained} ({meta['drafter'].get('name', '?')}), "
            f"but the drafter has {hidden_size}; {hint}"
        )
    th = meta["thresholds"]
    try:
        policy = TurnPolicy(
            speak_threshold=float(th["speak"]),
            backchannel_threshold=float(th["backchannel"]),
            interrupt_threshold=float(th["interrupt"]),
            take_threshold=float(th["take"]) if th.get("take") is not None else None,
            fast_take_threshold=float(th["fast_take"]) if th.get("fast_take") is not None else None,
            graded_take_threshold=float(th["graded_take"]) if th.get("graded_take") is not None else None,
            acoustic_hold_threshold=(
                float(th["acoustic_hold"]) if th.get("acoustic_hold") is not None else None
            ),
            voice_fast_threshold=float(th["voice_fast"]) if th.get("voice_fast") is not None else None,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelError(f"turn-taking heads: bad thresholds {th!r} in {meta_path}; {hint}") from exc
    for name, value in vars(policy).items():
        if value is not None and not 0.0 < value < 1.0:
            raise ModelError(f"turn-taking heads: {name} {value} in {meta_path} is not in (0, 1)")
    heads = TurnHeads(trained, dim=int(meta["dim"]))
    try:
        state = load_file(str(weights))
    except Exception as exc:  # truncated or not a safetensors file
        raise ModelError(
            f"turn-taking heads: cannot read {weights} ({type(exc).__name__}: {exc}); {hint}"
        ) from exc
    for key, tensor in state.items():
        if key.endswith("0.weight") and tensor.ndim == 1 and tensor.shape[0] != trained:
            raise ModelError(
                f"turn-taking heads: {weights} holds hidden size {tensor.shape[0]}, its metadata says {trained}; {hint}"
            )
    try:
        heads.load_state_dict(state)
    except Exception as exc:  # wrong shapes or names: one message with the fix
        raise ModelError(
            f"turn-taking heads: cannot load {weights} ({type(exc).__name__}: {exc}); {hint}"
        ) from exc
    heads.eval()
    return heads, policy, meta
