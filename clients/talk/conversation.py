"""The server's events as the client keeps them, shared by live and file mode: one `Turn` per user
turn, what is still pending, and the per-answer latency line."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from clients.talk.screen import Screen

STAGE_NAMES = {
    "end_of_turn": "end of turn",
    "final_transcript": "transcript",
    "first_llm_token": "first token",
    "first_tts_chunk": "first speech",
    "first_audio": "first audio",
}


@dataclass
class Turn:
    """One user turn and the answer to it, as the client saw them."""

    turn_id: int
    you: str = ""
    bot: str = ""
    status: str = ""  # response.done status; "" while there is none
    heard: str | None = None  # played_text of an interrupted answer
    stages: dict[str, float] = field(default_factory=dict)  # turn.latency, ms from the end of speech
    speech_end: float | None = None  # local clock (s): when the user's speech ended
    first_sound: float | None = None  # local clock (s): when the answer started to be heard
    reported: bool = False

    @property
    def onset_ms(self) -> float | None:
        """Client-side latency: from the end of the user's speech to the first answer sound."""
        if self.speech_end is None or self.first_sound is None:
            return None
        return 1000.0 * (self.first_sound - self.speech_end)


class Conversation:
    """Bookkeeping of the server's events shared by live and file mode: turns, what is still
    pending, and the screen. `locate(audio_ms)` turns an input-stream position into local time."""

    def __init__(
        self, screen: Screen, locate: Callable[[int], float | None], on_interrupt: Callable[[], None]
    ) -> None:
        self.screen = screen
        self.locate = locate
        self.on_interrupt = on_interrupt
        self.turns: dict[int, Turn] = {}
        self.events: list[dict[str, Any]] = []
        self.user_speaking = False
        self.open_responses: set[int] = set()
        self.audio_turn: int | None = None  # whose audio is arriving; None after an interruption
        self.answers = 0  # answers that were completed or interrupted
        self.last_event_at = 0.0

    def turn(self, turn_id: int) -> Turn:
        return self.turns.setdefault(turn_id, Turn(turn_id))

    def idle(self) -> bool:
        """Nobody is talking and no answer is being generated (audio may still be playing)."""
        return not self.user_speaking and not self.open_responses

    def handle(self, ev: dict[str, Any], now: float) -> None:
        self.events.append(ev)
        self.last_event_at = now
        kind = ev.get("type")
        tid = ev.get("turn_id") if isinstance(ev.get("turn_id"), int) else 0
        if kind == "speech.started":
            self.user_speaking = True
        elif kind == "transcript.partial":
            self.screen.user_partial(str(ev.get("text", "")))
        elif kind == "speech.stopped":
            self.turn(tid).speech_end = self.locate(int(ev.get("audio_ms", 0)))
        elif kind == "transcript.final":
            self.user_speaking = False
            self.turn(tid).you = str(ev.get("text", ""))
            self.screen.user_final(self.turn(tid).you)
        elif kind == "response.started":
            self.open_responses.add(tid)
        elif kind == "response.text.delta":
            self.turn(tid).bot += str(ev.get("delta", ""))
            self.screen.bot_delta(str(ev.get("delta", "")))
        elif kind == "response.audio.started":
            self.audio_turn = tid
        elif kind == "turn.latency":
            self.turn(tid).stages = dict(ev.get("stages") or {})
        elif kind == "response.interrupted":
            self._interrupted(tid, str(ev.get("played_text", "")))
        elif kind == "response.done":
            self._done(tid, ev)
        elif kind == "error":
            self.screen.note(f"  server error: {ev.get('code')}: {ev.get('message')}")
        self._report(tid)

    def _interrupted(self, tid: int, heard: str) -> None:
        self.audio_turn = None
        self.on_interrupt()  # drop queued audio at once
        turn = self.turn(tid)
        turn.heard = heard
        if turn.status == "completed":  # it had finished generating and was still playing
            turn.status = "interrupted"
            self.screen.cut(turn.bot, heard)

    def _done(self, tid: int, ev: dict[str, Any]) -> None:
        self.open_responses.discard(tid)
        turn = self.turn(tid)
        turn.status = str(ev.get("status", ""))
        turn.bot = str(ev.get("text") or turn.bot).strip()
        if turn.status == "interrupted" and turn.heard is None:
            turn.heard = str(ev.get("played_text", ""))
        if turn.status in ("completed", "interrupted"):
            self.answers += 1
        self.screen.bot_done(turn.status, turn.bot, turn.heard)

    def heard_first_sound(self, tid: int, at: float) -> None:
        turn = self.turn(tid)
        if turn.first_sound is None:
            turn.first_sound = at
            self._report(tid)

    def _report(self, tid: int) -> None:
        """One latency line per answer, once the server's breakdown and the first sound are known."""
        turn = self.turns.get(tid)
        if turn is None or turn.reported or not turn.stages:
            return
        if turn.first_sound is None and not turn.status:
            return
        turn.reported = True
        server = ", ".join(
            f"{STAGE_NAMES.get(k, k)} {v:.0f}" for k, v in turn.stages.items() if isinstance(v, (int, float))
        )
        onset = turn.onset_ms
        head = f"answer began {onset:.0f} ms after you stopped" if onset is not None else "latency"
        self.screen.note(f"      [{head}; server ms from end of speech: {server}]")
