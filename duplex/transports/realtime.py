"""OpenAI Realtime API compatible endpoint: `ws://HOST:PORT/v1/realtime?model=...`.

Lets the official `openai` SDK (and other Realtime clients) talk to this service. Like
`duplex.transports.native`, it is a transport adapter: it translates and holds no dialogue logic.

- Client events -> the core: `input_audio_buffer.append` (base64 audio in the session's input
  format) -> `AudioIn` -> `SessionRunner.feed_audio`; `commit` -> `input.end`; `clear` ->
  `input.clear`; a user `input_text` item is queued and sent as `input.text` on `response.create`;
  `response.cancel` -> `response.cancel`; `conversation.item.truncate` -> `response.truncate` for
  the core turn of the named assistant item; `session.update` -> `SessionCore.configure`.
- Core outputs -> Realtime events: SpeechStarted/SpeechStopped -> `input_audio_buffer.speech_*`
  (+ `committed` and the user item); transcripts -> `conversation.item.input_audio_transcription.*`;
  ResponseStarted -> `response.created` + the assistant item and its audio part; text deltas ->
  `response.output_audio_transcript.delta`; 24 kHz PCM16 frames -> `response.output_audio.delta`
  (sent as they are for `audio/pcm`, resampled to 8 kHz G.711 for `audio/pcmu` / `audio/pcma`);
  ResponseDone -> the `.done` cascade, `interrupted` reported as `cancelled` with reason
  `turn_detected` (barge-in) or `client_cancelled` (cancel / truncate).

Ordering: events the adapter makes itself (session.updated, cleared, truncated, items the client
created) are queued as `_Deferred` outputs behind whatever the core has already queued, and built
when the writer reaches them, so every id and `previous_item_id` is assigned in the order the
client receives events. All conversation state is therefore changed by the writer; the reader only
validates, drives the core and reads that state.

See docs/realtime.md for what is and is not supported.
"""

from __future__ import annotations

import asyncio
import base64
import inspect
import logging
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from duplex.base.audio import SAMPLE_RATE as SR
from duplex.base.config import ConfigError
from duplex.core.events import (
    CLIENT_INPUT_CLEAR,
    CLIENT_INPUT_END,
    CLIENT_INPUT_TEXT,
    CLIENT_RESPONSE_CANCEL,
    CLIENT_RESPONSE_TRUNCATE,
    ErrorEvent,
    Interrupted,
    ResponseDone,
    ResponseStarted,
    ResponseTextDelta,
    ServerEvent,
    SpeechStarted,
    SpeechStopped,
    TranscriptFinal,
    TranscriptPartial,
)
from duplex.core.session import SessionCore
from duplex.runtime.runner import ClientTooSlow, Output, SessionRunner
from duplex.runtime.service import CapacityError, DuplexService
from duplex.transports.common import ClientGuard, open_session
from duplex.transports.native import DuplexServer
from duplex.transports.native_protocol import CLOSE_OVERLOAD, CLOSE_POLICY
from duplex.transports.realtime_protocol import (
    MAX_MESSAGE_BYTES,
    REALTIME_PATH,
    AudioFormat,
    RealtimeConfig,
    RealtimeError,
    append_audio,
    assistant_item,
    audio_part,
    check_event,
    check_truncate_content_index,
    client_event_id,
    encode_event,
    error_event,
    event,
    new_id,
    parse_event,
    parse_session_update,
    parse_user_text,
    response_object,
    response_status,
    session_update_body,
    truncate_request,
    user_audio_item,
    user_text_item,
)
from duplex.transports.wire_audio import AudioFormatError, AudioIn, AudioOut

log = logging.getLogger("duplex.transports.realtime")

KEEP_ITEMS = 64  # items remembered for truncate / transcripts; older ones are forgotten
# A commit right after an append may reach the core before its VAD has seen that audio: wait this
# long after the last append for the VAD to find the speech before calling the buffer empty.
COMMIT_WAIT_S = 1.0


def mount_realtime(server: DuplexServer) -> None:
    """Serve the Realtime API on `server` at REALTIME_PATH (calling it again changes nothing)."""
    if REALTIME_PATH in server.extra_routes:
        return
    service = server.service
    server.keyed_routes.add(REALTIME_PATH)

    async def handler(ws: ServerConnection) -> None:
        await RealtimeSession(service, ws).run()

    server.extra_routes[REALTIME_PATH] = handler


@dataclass(frozen=True)
class _Deferred(ServerEvent):
    """Adapter-made events, queued in order with the core's outputs and built when sent.

    `unless_error`: skip them if the output just before is a core error whose message contains
    this text (the core refused the control that this event would confirm).
    """

    type: ClassVar[str] = "realtime.deferred"
    build: Callable[[], list[dict[str, Any]]] = list
    unless_error: str | None = None


@dataclass
class _UserItem:
    item_id: str
    start_ms: int = 0
    end_ms: int = 0
    partial_sent: str = ""  # transcript text already sent as deltas


@dataclass
class _AssistantItem:
    item_id: str
    response_id: str
    turn_id: int
    transcript: str = ""
    audio_ms: float = 0.0  # audio sent so far
    status: str = "in_progress"


@dataclass
class _Conversation:
    """What the client has been told so far; changed only by the writer, in output order."""

    user_turns: dict[int, _UserItem] = field(default_factory=dict)  # core turn id -> user audio item
    items: dict[str, _AssistantItem] = field(default_factory=dict)  # item id -> assistant item
    text_ids: set[str] = field(default_factory=set)  # user text items (not truncatable)
    last_item_id: str | None = None
    current: _AssistantItem | None = None  # the response in progress

    def add_item(self, item_id: str) -> str | None:
        """Append an item; returns its previous_item_id."""
        previous, self.last_item_id = self.last_item_id, item_id
        return previous

    def prune(self) -> None:
        for book in (self.user_turns, self.items):
            while len(book) > KEEP_ITEMS:
                del book[next(iter(book))]


class RealtimeSession:
    """One Realtime WebSocket connection = one session core."""

    def __init__(self, service: DuplexService, ws: ServerConnection) -> None:
        self.service = service
        self.ws = ws
        self.defaults = service.profile.session
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(ws.request.path if ws.request else "").query)
        asr = service.profile.components.get("asr")
        self.config = RealtimeConfig.initial(
            query.get("model", ["duplex"])[0], self.defaults, asr.backend if asr else "asr"
        )
        self.session_id = ""
        self.conv = _Conversation()
        self._runner: SessionRunner | None = None
        self._guard: ClientGuard | None = None
        self._audio_in = AudioIn(self.config.input_format.rate, self.config.input_format.encoding)
        self._audio_out: AudioOut | None = None  # None: the core's PCM16 goes out as it is
        # client-request bookkeeping (reader side)
        self._pending_texts: list[tuple[str, str]] = []  # (item id, text) awaiting response.create
        self._requested = False  # response.create sent input.text; its ResponseStarted is queued
        self._unrequested_turn: int | None = None  # a committed turn answered without response.create
        self._claimed_turns: set[int] = set()
        self._client_stop_turn: int | None = None  # the turn the client cancelled / truncated
        self._prev_output: Output | None = None
        self._last_append = 0.0  # loop time of the last input_audio_buffer.append
        self._handlers: dict[str, Callable[[dict[str, Any]], Awaitable[None] | None]] = {
            "session.update": self._on_session_update,
            "input_audio_buffer.append": self._on_append,
            "input_audio_buffer.commit": self._on_commit,
            "input_audio_buffer.clear": self._on_clear,
            "conversation.item.create": self._on_item_create,
            "conversation.item.truncate": self._on_truncate,
            "response.create": self._on_response_create,
            "response.cancel": self._on_response_cancel,
        }
        self._translators: dict[type, Callable[[Any], list[dict[str, Any]]]] = {
            SpeechStarted: self._speech_started,
            TranscriptPartial: self._transcript_partial,
            SpeechStopped: self._speech_stopped,
            TranscriptFinal: self._transcript_final,
            ResponseStarted: self._response_started,
            ResponseTextDelta: self._text_delta,
            Interrupted: self._interrupted,
            ResponseDone: self._response_done,
            ErrorEvent: self._core_error,
        }

    # -- connection ------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve the connection until the client leaves; the session is freed on exit."""
        self.ws.protocol.max_message_size = MAX_MESSAGE_BYTES

        async def terminate(code: int, reason: str) -> None:
            await self.ws.close(code, reason)

        try:
            async with open_session(
                self.service, self._send, transport="realtime", terminate=terminate
            ) as runner:
                self._runner = runner
                self._guard = ClientGuard(runner, self.service.limits, self.service.metrics)
                self.session_id = f"sess_{runner.core.session_id}"
                self._set_output(self.config.output_format)
                initial = self.config.to_wire(self.session_id)
                self._defer(lambda: [event("session.created", session=initial)])
                log.info("realtime session %s opened from %s", self.session_id, self.ws.remote_address)
                await self._read()
        except CapacityError as exc:
            await self.ws.close(CLOSE_OVERLOAD, str(exc))
        log.info("realtime session %s closed", self.session_id)

    async def _read(self) -> None:
        runner = self._live()
        try:
            async for message in self.ws:
                await self.handle(message)
                if isinstance(runner.failed, ClientTooSlow):
                    await self.ws.close(CLOSE_POLICY, "client too slow: output not read")
                    return
        except ConnectionClosed:
            pass

    @property
    def core(self) -> SessionCore:
        return self._live().core

    def _live(self) -> SessionRunner:
        if self._runner is None:
            raise RuntimeError("the session has not started")
        return self._runner

    # -- client events (reader) ------------------------------------------------------------

    async def handle(self, message: str | bytes) -> None:
        """One client message; a refused one becomes an `error` event and the session goes on.

        Handled in arrival order: a handler that waits (commit) holds back the events after it.
        """
        event_id: str | None = None
        try:
            ev = parse_event(message)
            event_id = client_event_id(ev)
            kind = check_event(ev, len(message))
            if kind != "input_audio_buffer.append" and self._guard is not None and not self._guard.control():
                return  # dropped: the guard sent rate_limited (or ended a flood)
            handler = self._handlers[kind]
            result = handler(ev)
            if inspect.isawaitable(result):
                await result
        except RealtimeError as exc:
            err = error_event(exc.code, str(exc), param=exc.param, kind=exc.kind, client_event_id=event_id)
            self._defer(lambda: [err])
        except Exception:  # a bug must end no session: report it and go on
            log.exception("realtime session %s: event not handled", self.session_id)
            err = error_event(
                "server_error",
                "the server could not handle this event",
                kind="server_error",
                client_event_id=event_id,
            )
            self._defer(lambda: [err])

    def _on_session_update(self, ev: dict[str, Any]) -> None:
        session = session_update_body(ev)
        new = parse_session_update(session, self.config, self.defaults)
        try:
            self.core.configure(new.core_overrides(self.defaults))
        except ConfigError as exc:  # parse_session_update keeps values in range; this is a safety net
            raise RealtimeError("invalid_value", str(exc), "session") from None
        if new.input_format != self.config.input_format:
            self._audio_in = AudioIn(new.input_format.rate, new.input_format.encoding)
        if new.output_format != self.config.output_format:
            self._set_output(new.output_format)
        self.config = new
        self._defer(lambda: [event("session.updated", session=new.to_wire(self.session_id))])

    def _on_append(self, ev: dict[str, Any]) -> Awaitable[None] | None:
        payload = append_audio(ev)
        try:
            samples = self._audio_in.decode(payload)
        except AudioFormatError as exc:
            raise RealtimeError("invalid_value", str(exc), "audio") from None
        self._live().feed_audio(samples)
        self._last_append = asyncio.get_running_loop().time()
        if self._guard is not None:
            return self._guard.audio(len(samples) / SR)
        return None

    async def _on_commit(self, ev: dict[str, Any]) -> None:
        loop, deadline = asyncio.get_running_loop(), self._last_append + COMMIT_WAIT_S
        while True:  # the core has no "VAD caught up" signal: poll, briefly
            if self.core.endpointer.in_speech or loop.time() >= deadline:
                break
            await asyncio.sleep(0.01)
        if not self.core.endpointer.in_speech:
            raise RealtimeError(
                "input_audio_buffer_commit_empty",
                "nothing to commit: no speech in the input audio buffer since the last turn",
            )
        # a committed turn is answered at once; the response.create that should follow is absorbed
        self._unrequested_turn = self.core.turn_id
        self._live().control({"type": CLIENT_INPUT_END})

    def _on_clear(self, ev: dict[str, Any]) -> None:
        self._live().control({"type": CLIENT_INPUT_CLEAR})
        self._defer(lambda: [event("input_audio_buffer.cleared")])

    def _on_item_create(self, ev: dict[str, Any]) -> None:
        item_id, text = parse_user_text(ev.get("item"), self.service.limits.max_text_chars)
        if item_id is None:
            item_id = new_id("item")
        elif (
            item_id in self.conv.items
            or item_id in self.conv.text_ids
            or item_id in dict(self._pending_texts)
        ):
            raise RealtimeError("invalid_value", f"an item with id {item_id!r} already exists", "item.id")
        self._pending_texts.append((item_id, text))
        self._defer(lambda: self._text_item_added(item_id, text))

    def _on_truncate(self, ev: dict[str, Any]) -> None:
        item_id, audio_end_ms = truncate_request(ev)
        item = self.conv.items.get(item_id)
        if item is None:
            what = (
                "a user item"
                if item_id in self.conv.text_ids
                else "no assistant audio item the server remembers"
            )
            raise RealtimeError(
                "item_truncate_invalid_item_id", f"cannot truncate {item_id!r}: it is {what}", "item_id"
            )
        check_truncate_content_index(ev)
        played_ms = min(audio_end_ms, int(item.audio_ms))  # cannot have heard more than was sent
        if self.conv.current is item:
            self._client_stop_turn = item.turn_id
        self._live().control(
            {"type": CLIENT_RESPONSE_TRUNCATE, "played_ms": played_ms, "turn_id": item.turn_id}
        )
        truncated = event(
            "conversation.item.truncated", item_id=item_id, content_index=0, audio_end_ms=played_ms
        )
        self._defer(lambda: [truncated], unless_error="truncate")

    def _on_response_create(self, ev: dict[str, Any]) -> None:
        if self._claim_unrequested():
            return
        current = self.conv.current
        if current is not None or self._requested:
            rid = current.response_id if current is not None else "being created"
            raise RealtimeError(
                "conversation_already_has_active_response",
                f"Conversation already has an active response in progress: {rid}. Wait until the "
                "response is finished before creating a new one.",
            )
        if not self._pending_texts:
            raise RealtimeError(
                "no_input_to_respond_to",
                "nothing new to answer: commit speech or create a user "
                "input_text item first (this server does not speak unprompted)",
            )
        text = "\n".join(t for _, t in self._pending_texts)
        self._pending_texts.clear()
        # a typed turn: the core opens a new turn id with no SpeechStarted, so the writer has no
        # user audio item for it and announces no transcription (the item was announced at creation)
        self._live().control({"type": CLIENT_INPUT_TEXT, "text": text})
        self._requested = True

    def _claim_unrequested(self) -> bool:
        """A turn the core answers by itself (after a commit, or without create_response): the
        response.create that asks for it is no error and starts nothing new."""
        turn = self._unrequested_turn
        if turn is None or turn in self._claimed_turns:
            return False
        self._claimed_turns.add(turn)
        return True

    def _on_response_cancel(self, ev: dict[str, Any]) -> None:
        current = self.conv.current
        if current is None and not self._requested:
            raise RealtimeError("response_cancel_not_active", "there is no response in progress to cancel")
        rid = ev.get("response_id")
        if current is not None and rid is not None and rid != current.response_id:
            raise RealtimeError(
                "invalid_value", f"response {rid!r} is not the one in progress", "response_id"
            )
        self._client_stop_turn = current.turn_id if current is not None else self.core.turn_id
        self._live().control({"type": CLIENT_RESPONSE_CANCEL})

    def _defer(self, build: Callable[[], list[dict[str, Any]]], unless_error: str | None = None) -> None:
        core = self.core
        self._live().emit(
            _Deferred(
                session_id=core.session_id,
                turn_id=core.turn_id,
                t=core.clock(),
                build=build,
                unless_error=unless_error,
            )
        )

    def _set_output(self, fmt: AudioFormat) -> None:
        source = self.core.out_sr
        passthrough = fmt.encoding == "pcm16" and fmt.rate == source
        self._audio_out = None if passthrough else AudioOut(source, fmt.rate, fmt.encoding)

    # -- core outputs (writer) -------------------------------------------------------------

    async def _send(self, item: Output) -> None:
        """The runner's transport callback: every core output, in order, as Realtime events."""
        try:
            payloads = self._translate(item)
        except Exception:  # a bug here must not end the session: log it and go on
            log.exception("realtime session %s: cannot translate %r", self.session_id, type(item).__name__)
            payloads = []
        self._prev_output = item
        for payload in payloads:
            await self.ws.send(encode_event(payload))

    def _translate(self, item: Output) -> list[dict[str, Any]]:
        if isinstance(item, bytes):
            return self._audio_delta(item)
        if isinstance(item, _Deferred):
            prev = self._prev_output
            if item.unless_error and isinstance(prev, ErrorEvent) and item.unless_error in prev.message:
                return []
            return item.build()
        translate = self._translators.get(type(item))
        return translate(item) if translate is not None else []  # latency, audio started, ...: not in the API

    def _speech_started(self, ev: SpeechStarted) -> list[dict[str, Any]]:
        user = _UserItem(new_id("item"), start_ms=ev.audio_ms)
        self.conv.user_turns[ev.turn_id] = user
        self.conv.prune()
        if self.config.manual:
            return []
        return [event("input_audio_buffer.speech_started", audio_start_ms=ev.audio_ms, item_id=user.item_id)]

    def _transcript_partial(self, ev: TranscriptPartial) -> list[dict[str, Any]]:
        user = self.conv.user_turns.get(ev.turn_id)
        # deltas can only grow a transcript: a revised partial is skipped, the completed event has the truth
        if user is None or not ev.text.startswith(user.partial_sent) or ev.text == user.partial_sent:
            return []
        delta, user.partial_sent = ev.text[len(user.partial_sent) :], ev.text
        return [
            event(
                "conversation.item.input_audio_transcription.delta",
                item_id=user.item_id,
                content_index=0,
                delta=delta,
            )
        ]

    def _speech_stopped(self, ev: SpeechStopped) -> list[dict[str, Any]]:
        user = self.conv.user_turns.get(ev.turn_id)
        if user is None:
            return []
        user.end_ms = ev.audio_ms
        td = self.config.turn_detection
        if (td is None or not td.create_response) and ev.turn_id not in self._claimed_turns:
            self._unrequested_turn = ev.turn_id
        previous = self.conv.add_item(user.item_id)
        out = (
            []
            if td is None
            else [event("input_audio_buffer.speech_stopped", audio_end_ms=ev.audio_ms, item_id=user.item_id)]
        )
        return out + [
            event("input_audio_buffer.committed", item_id=user.item_id, previous_item_id=previous),
            event(
                "conversation.item.added", item=user_audio_item(user.item_id, None), previous_item_id=previous
            ),
        ]

    def _transcript_final(self, ev: TranscriptFinal) -> list[dict[str, Any]]:
        user = self.conv.user_turns.get(ev.turn_id)
        if user is None:
            return []  # a typed turn: its item was announced when it was created
        seconds = max(user.end_ms - user.start_ms, 0) / 1000
        out = [
            event(
                "conversation.item.input_audio_transcription.completed",
                item_id=user.item_id,
                content_index=0,
                transcript=ev.text,
                usage={"type": "duration", "seconds": round(seconds, 3)},
            ),
            event(
                "conversation.item.done", item=user_audio_item(user.item_id, ev.text), previous_item_id=None
            ),
        ]
        if not ev.text.strip():  # noise: the core will not answer
            out += self._no_answer(ev.turn_id)
        return out

    def _no_answer(self, turn: int) -> list[dict[str, Any]]:
        """A claimed turn that turned out to be noise still gets the (empty) response it asked for."""
        if self._unrequested_turn == turn:
            self._unrequested_turn = None
        if turn not in self._claimed_turns:
            return []
        rid, fmt = new_id("resp"), self.config.output_format
        return [
            event("response.created", response=response_object(rid, "in_progress", [], fmt)),
            event("response.done", response=response_object(rid, "completed", [], fmt)),
        ]

    def _response_started(self, ev: ResponseStarted) -> list[dict[str, Any]]:
        item = _AssistantItem(new_id("item"), new_id("resp"), ev.turn_id)
        self.conv.current = item
        self.conv.items[item.item_id] = item
        self.conv.prune()
        self._requested = False
        self._client_stop_turn = None
        if self._audio_out is not None:
            self._audio_out.reset()
        previous = self.conv.add_item(item.item_id)
        ids = {
            "response_id": item.response_id,
            "item_id": item.item_id,
            "output_index": 0,
            "content_index": 0,
        }
        announced = assistant_item(item.item_id, "in_progress")
        return [
            event(
                "response.created",
                response=response_object(item.response_id, "in_progress", [], self.config.output_format),
            ),
            event("response.output_item.added", response_id=item.response_id, output_index=0, item=announced),
            event("conversation.item.added", item=announced, previous_item_id=previous),
            event("response.content_part.added", **ids, part=audio_part("")),
        ]

    def _text_delta(self, ev: ResponseTextDelta) -> list[dict[str, Any]]:
        item = self.conv.current
        if item is None or item.turn_id != ev.turn_id or not ev.delta:
            return []
        item.transcript += ev.delta
        return [
            event(
                "response.output_audio_transcript.delta",
                response_id=item.response_id,
                item_id=item.item_id,
                output_index=0,
                content_index=0,
                delta=ev.delta,
            )
        ]

    def _audio_delta(self, frame: bytes) -> list[dict[str, Any]]:
        item = self.conv.current
        if item is None:
            return []
        item.audio_ms += 1000 * len(frame) / 2 / self.core.out_sr
        data = frame if self._audio_out is None else self._audio_out.encode(frame)
        if not data:
            return []
        return [
            event(
                "response.output_audio.delta",
                response_id=item.response_id,
                item_id=item.item_id,
                output_index=0,
                content_index=0,
                delta=base64.b64encode(data).decode("ascii"),
            )
        ]

    def _interrupted(self, ev: Interrupted) -> list[dict[str, Any]]:
        # the core stops the audio; a response in progress ends with the ResponseDone that follows
        if self._audio_out is not None:
            self._audio_out.reset()
        return []

    def _response_done(self, ev: ResponseDone) -> list[dict[str, Any]]:
        item = self.conv.current
        if item is None or item.turn_id != ev.turn_id:
            return []
        self.conv.current = None
        if self._unrequested_turn == ev.turn_id:
            self._unrequested_turn = None
        status, details = self._final_status(ev)
        item.status = "completed" if status == "completed" else "incomplete"
        ids = {
            "response_id": item.response_id,
            "item_id": item.item_id,
            "output_index": 0,
            "content_index": 0,
        }
        final = assistant_item(item.item_id, item.status, item.transcript)
        return [
            event("response.output_audio.done", **ids),
            event("response.output_audio_transcript.done", **ids, transcript=item.transcript),
            event("response.content_part.done", **ids, part=audio_part(item.transcript)),
            event("conversation.item.done", item=final, previous_item_id=None),
            event("response.output_item.done", response_id=item.response_id, output_index=0, item=final),
            event(
                "response.done",
                response=response_object(
                    item.response_id, status, [final], self.config.output_format, details
                ),
            ),
        ]

    def _final_status(self, ev: ResponseDone) -> tuple[str, dict[str, Any] | None]:
        """The core's completed / interrupted / cancelled / failed as Realtime status and status_details."""
        if ev.status in ("completed", "failed"):
            return response_status(ev.status, by_client=False)
        by_client = ev.status == "cancelled" or self._client_stop_turn == ev.turn_id
        self._client_stop_turn = None
        return response_status(ev.status, by_client)

    def _core_error(self, ev: ErrorEvent) -> list[dict[str, Any]]:
        if "truncate" in ev.message:
            return [
                error_event(
                    "item_truncate_invalid_item_id",
                    "nothing left to truncate: only the latest answer can be truncated",
                    param="item_id",
                )
            ]
        kind = "server_error" if ev.code == "stage_failed" else "invalid_request_error"
        return [error_event(ev.code, ev.message, kind=kind)]

    def _text_item_added(self, item_id: str, text: str) -> list[dict[str, Any]]:
        self.conv.text_ids.add(item_id)
        previous = self.conv.add_item(item_id)
        item = user_text_item(item_id, text)
        return [
            event("conversation.item.added", item=item, previous_item_id=previous),
            event("conversation.item.done", item=item, previous_item_id=previous),
        ]
