"""The OpenAI-Realtime-compatible endpoint (/v1/realtime) over a real socket, with the tiny tone stages.

Every server event is validated against the `openai` package's own pydantic types (strict, and
with no field the type does not declare), so a client built on the SDK parses all of them.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import types
import typing
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pydantic
import pytest
from openai import AsyncOpenAI
from openai.types.realtime import RealtimeServerEvent
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from codec.g711 import alaw_to_float, float_to_ulaw, ulaw_to_float
from codec.pcm import float_to_pcm16, pcm16_to_float
from duplex.base.config import load_profile
from duplex.core.session import SessionCore
from duplex.runtime.service import DuplexService, ServiceLimits
from duplex.testing.fakes import decode_tones, fake_stages, scripted_answer, tone_speech
from duplex.transports.native import DuplexServer, ServerSettings
from duplex.transports.realtime import RealtimeSession, mount_realtime
from duplex.transports.realtime_protocol import CLIENT_EVENTS, REALTIME_PATH

RATE = 24000
QUESTION = "what is the capital of france"
ANSWER = "paris is the capital of france"

# -- validation against the SDK's types ------------------------------------------------------

_SERVER_TYPES: dict[str, type[pydantic.BaseModel]] = {
    typing.get_args(cls.model_fields["type"].annotation)[0]: cls
    for cls in typing.get_args(typing.get_args(RealtimeServerEvent)[0])
}
# fields OpenAI itself sends on a session that the SDK's request-shaped type does not declare
_ALLOWED_EXTRA = {"object", "id", "expires_at"}


def _extras(model: Any, path: str = "") -> list[str]:
    """Field names the SDK type does not declare (a typo would land here), recursively."""
    if isinstance(model, list):
        return [e for i, m in enumerate(model) for e in _extras(m, f"{path}[{i}]")]
    if not isinstance(model, pydantic.BaseModel):
        return []
    found = [f"{path}.{k}" for k in (model.model_extra or {}) if k not in _ALLOWED_EXTRA]
    for name in type(model).model_fields:
        found += _extras(getattr(model, name), f"{path}.{name}")
    return found


def validate(raw: str | bytes) -> dict[str, Any]:
    """Parse one server message and check it against the SDK's model for its type (strict)."""
    ev = json.loads(raw)
    cls = _SERVER_TYPES.get(ev.get("type"))
    assert cls is not None, f"{ev.get('type')!r} is not a Realtime server event type"
    model = cls.model_validate_json(raw, strict=True)
    assert not _extras(model), (ev["type"], _extras(model))
    return ev


# -- fixtures and a small raw-WebSocket client ----------------------------------------------


@pytest.fixture
async def server():
    service = DuplexService(
        load_profile("cpu"), fake_stages(scripted_answer), limits=ServiceLimits(max_sessions=3)
    )
    srv = DuplexServer(service, ServerSettings(host="127.0.0.1", port=0))
    mount_realtime(srv)
    await srv.start()
    yield srv
    await srv.close()
    service.close()


def silence(seconds: float, rate: int = RATE) -> np.ndarray:
    return np.zeros(int(rate * seconds), dtype=np.float32)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class Rt:
    """Raw Realtime client: sends JSON events, validates and records every server event."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.events: list[dict[str, Any]] = []
        self.times: list[float] = []  # arrival time of each event
        self.closed: ConnectionClosed | None = None
        self.failure: BaseException | None = None  # a server event that failed validation
        self._changed = asyncio.Event()
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            async for message in self.ws:
                self.events.append(validate(message))
                self.times.append(loop.time())
                self._changed.set()
        except ConnectionClosed as exc:
            self.closed = exc
        except BaseException as exc:
            self.failure = exc
            raise
        finally:
            self._changed.set()

    async def send(self, type_: str, **fields: Any) -> None:
        await self.ws.send(json.dumps({"type": type_, **fields}))

    async def speak(
        self, audio: np.ndarray, encode=float_to_pcm16, rate: int = RATE, speed: float = 4.0
    ) -> None:
        """Append audio in 20 ms events, `speed` times faster than real time."""
        step = rate // 50
        for i in range(0, len(audio), step):
            await self.send("input_audio_buffer.append", audio=b64(encode(audio[i : i + step])))
            await asyncio.sleep(0.02 / speed)

    def of(self, type_: str, **match: Any) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == type_ and all(e.get(k) == v for k, v in match.items())]

    async def wait_for(
        self, type_: str, count: int = 1, limit_s: float = 10.0, **match: Any
    ) -> dict[str, Any]:
        async with asyncio.timeout(limit_s):
            while True:
                if self.failure is not None:
                    raise self.failure
                hits = self.of(type_, **match)
                if len(hits) >= count:
                    return hits[count - 1]
                self._changed.clear()
                await self._changed.wait()

    def audio(self, response_id: str, decode=pcm16_to_float) -> np.ndarray:
        parts = [
            decode(base64.b64decode(e["delta"]))
            for e in self.of("response.output_audio.delta", response_id=response_id)
        ]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)

    def transcript(self, response_id: str) -> str:
        return "".join(
            e["delta"] for e in self.of("response.output_audio_transcript.delta", response_id=response_id)
        )

    def errors(self) -> list[str]:
        return [e["error"]["code"] for e in self.of("error")]


@contextlib.asynccontextmanager
async def realtime(srv: DuplexServer, **kwargs: Any) -> AsyncIterator[Rt]:
    async with connect(f"ws://127.0.0.1:{srv.port}{REALTIME_PATH}?model=gpt-realtime", **kwargs) as ws:
        rt = Rt(ws)
        await rt.wait_for("session.created")
        try:
            yield rt
        finally:
            rt.task.cancel()


def core_of(srv: DuplexServer, rt: Rt) -> SessionCore:
    sid = rt.of("session.created")[0]["session"]["id"].removeprefix("sess_")
    return srv.service.sessions[sid]


async def ask_text(rt: Rt, text: str) -> dict[str, Any]:
    """A typed user turn and its response.create; returns response.created."""
    n = len(rt.of("response.created"))
    await rt.send(
        "conversation.item.create",
        item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]},
    )
    await rt.send("response.create")
    return await rt.wait_for("response.created", count=n + 1)


# -- tests -------------------------------------------------------------------------------------


async def test_mount_is_idempotent(server):
    handler = server.extra_routes[REALTIME_PATH]
    mount_realtime(server)
    assert server.extra_routes[REALTIME_PATH] is handler


async def test_every_client_event_the_protocol_accepts_has_a_handler(server):
    session = RealtimeSession(server.service, types.SimpleNamespace(request=None))
    assert sorted(session._handlers) == sorted(CLIENT_EVENTS)


async def test_spoken_question_gets_the_full_event_sequence(server):
    async with realtime(server) as rt:
        assert rt.events[0]["type"] == "session.created"
        session = rt.events[0]["session"]
        assert session["model"] == "gpt-realtime"
        assert session["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
        assert session["audio"]["input"]["turn_detection"]["type"] == "server_vad"
        await rt.speak(np.concatenate([silence(0.3), tone_speech(QUESTION, RATE), silence(1.0)]))
        done = await rt.wait_for("response.done")
        await asyncio.sleep(0.3)  # anything sent after response.done would show up now

        started = rt.of("input_audio_buffer.speech_started")[0]
        stopped = rt.of("input_audio_buffer.speech_stopped")[0]
        committed = rt.of("input_audio_buffer.committed")[0]
        user_item = started["item_id"]
        assert stopped["item_id"] == committed["item_id"] == user_item
        assert 250 <= started["audio_start_ms"] < stopped["audio_end_ms"] <= 300 + 1500
        transcribed = rt.of("conversation.item.input_audio_transcription.completed")[0]
        assert transcribed["item_id"] == user_item and transcribed["transcript"] == QUESTION
        assert rt.of("conversation.item.added")[0]["item"]["id"] == user_item

        response = done["response"]
        rid, answer_item = response["id"], response["output"][0]["id"]
        assert response["status"] == "completed" and response["status_details"] is None
        assert response["output"][0]["content"][0]["transcript"] == ANSWER
        assert rt.transcript(rid) == ANSWER
        assert decode_tones(rt.audio(rid), RATE) == ANSWER.split()
        # the GA order of a response, with no audio after its response.done
        order = [
            "input_audio_buffer.speech_started",
            "input_audio_buffer.speech_stopped",
            "input_audio_buffer.committed",
            "response.created",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_audio.delta",
            "response.output_audio.done",
            "response.output_audio_transcript.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.done",
        ]
        types = [e["type"] for e in rt.events]
        assert [types.index(t) for t in order] == sorted(types.index(t) for t in order)
        assert "response.output_audio.delta" not in types[types.index("response.done") :]
        assert all(e["item_id"] == answer_item for e in rt.of("response.output_audio.delta"))
        assert rt.of("conversation.item.added")[1]["previous_item_id"] == user_item
        ids = [e["event_id"] for e in rt.events]
        assert len(ids) == len(set(ids))
        assert not rt.errors()


async def test_g711_ulaw_in_and_out_at_8khz(server):
    async with realtime(server) as rt:
        await rt.send(
            "session.update",
            session={
                "type": "realtime",
                "audio": {
                    "input": {"format": {"type": "audio/pcmu"}},
                    "output": {"format": {"type": "audio/pcmu"}},
                },
            },
        )
        updated = await rt.wait_for("session.updated")
        assert updated["session"]["audio"]["output"]["format"] == {"type": "audio/pcmu"}
        await rt.speak(
            np.concatenate([silence(0.3, 8000), tone_speech(QUESTION, 8000), silence(1.0, 8000)]),
            encode=float_to_ulaw,
            rate=8000,
        )
        done = await rt.wait_for("response.done")
        rid = done["response"]["id"]
        deltas = [base64.b64decode(e["delta"]) for e in rt.of("response.output_audio.delta", response_id=rid)]
        audio = rt.audio(rid, decode=ulaw_to_float)
        assert decode_tones(audio, 8000) == ANSWER.split()
        assert abs(len(audio) / 8000 - 6 * 0.25) < 0.1  # one byte per 8 kHz sample: 6 words of 250 ms
        assert max(len(d) for d in deltas) <= 8000 * 0.04 + 8  # 40 ms frames


async def test_beta_style_alaw_formats_and_a_text_turn(server):
    async with realtime(server) as rt:
        await rt.send(
            "session.update", session={"input_audio_format": "g711_alaw", "output_audio_format": "g711_alaw"}
        )
        updated = await rt.wait_for("session.updated")
        assert updated["session"]["audio"]["input"]["format"] == {"type": "audio/pcma"}
        created = await ask_text(rt, "two plus two")
        done = await rt.wait_for("response.done")
        rid = created["response"]["id"]
        assert done["response"]["id"] == rid and done["response"]["status"] == "completed"
        assert decode_tones(rt.audio(rid, decode=alaw_to_float), 8000) == "two plus two is four".split()


async def test_session_update_maps_turn_detection_and_refuses_bad_values(server):
    async with realtime(server) as rt:
        core = core_of(server, rt)
        await rt.send(
            "session.update",
            session={
                "type": "realtime",
                "instructions": "Be brief.",
                "audio": {
                    "input": {
                        "turn_detection": {"type": "server_vad", "silence_duration_ms": 700, "threshold": 0.6}
                    },
                    "output": {"voice": "marin"},
                },
                "some_future_field": 1,
            },
        )
        updated = await rt.wait_for("session.updated")
        td = updated["session"]["audio"]["input"]["turn_detection"]
        assert td["silence_duration_ms"] == 700 and td["threshold"] == 0.6
        assert updated["session"]["instructions"] == "Be brief."
        assert core.endpointer.end_silence == 16000 * 700 // 1000 and core.endpointer.threshold == 0.6

        await rt.send(
            "session.update", session={"type": "realtime", "audio": {"input": {"turn_detection": None}}}
        )
        updated = await rt.wait_for("session.updated", count=2)
        assert updated["session"]["audio"]["input"]["turn_detection"] is None
        assert core.options.end_of_turn_silence_ms == 10000 and core.options.barge_in_min_speech_ms == 10000

        bad = [
            {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}},
            {"audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": 2}}}},
            {"audio": {"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": "soon"}}}},
            {"audio": {"output": {"format": {"type": "audio/opus"}}}},
            {"tools": [{"type": "function", "name": "get_weather"}]},
            {"output_modalities": ["text"]},
            {"type": "transcription"},
        ]
        for i, session in enumerate(bad):
            await rt.send("session.update", session=session, event_id=f"evt_{i}")
        await rt.send("session.update", session="not an object", event_id="evt_x")
        await rt.wait_for("error", count=len(bad) + 1)
        errors = rt.of("error")
        assert [e["error"]["code"] for e in errors] == [
            "invalid_value",
            "invalid_value",
            "invalid_value",
            "invalid_value",
            "unsupported_value",
            "unsupported_value",
            "unsupported_value",
            "missing_required_parameter",
        ]
        assert [e["error"]["event_id"] for e in errors] == [f"evt_{i}" for i in range(len(bad))] + ["evt_x"]
        assert errors[0]["error"]["param"] == "session.audio.input.format"
        # nothing of a refused update was applied
        assert len(rt.of("session.updated")) == 2 and core.options.end_of_turn_silence_ms == 10000


async def test_text_item_is_answered_on_response_create(server):
    async with realtime(server) as rt:
        created = await ask_text(rt, "two plus two")
        added = rt.of("conversation.item.added")[0]
        assert added["item"]["role"] == "user" and added["item"]["content"][0]["text"] == "two plus two"
        assert rt.of("conversation.item.done")[0]["item"]["id"] == added["item"]["id"]
        await rt.send("response.create", event_id="evt_busy")  # one response at a time, as at OpenAI
        error = await rt.wait_for("error")
        assert error["error"]["code"] == "conversation_already_has_active_response"
        assert error["error"]["event_id"] == "evt_busy"
        done = await rt.wait_for("response.done")
        rid = created["response"]["id"]
        assert done["response"]["status"] == "completed"
        assert rt.transcript(rid) == "two plus two is four"
        assert decode_tones(rt.audio(rid), RATE) == "two plus two is four".split()
        assert not rt.of("conversation.item.input_audio_transcription.completed")  # a typed turn
        await rt.send("response.create")  # nothing new to answer
        await rt.send(
            "conversation.item.create",
            item={"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]},
        )
        await rt.wait_for("error", count=3)
        assert rt.errors()[1:] == ["no_input_to_respond_to", "unsupported_value"]
        assert core_of(server, rt).history[-2:] == [
            {"role": "user", "content": "two plus two"},
            {"role": "assistant", "content": "two plus two is four"},
        ]


async def test_response_cancel_mid_answer_stops_audio(server):
    async with realtime(server) as rt:
        created = await ask_text(rt, "tell me a story")
        rid = created["response"]["id"]
        await rt.wait_for("response.output_audio.delta", count=5)
        await rt.send("response.cancel")
        done = await rt.wait_for("response.done")
        n_audio = len(rt.of("response.output_audio.delta"))
        await asyncio.sleep(0.5)
        assert len(rt.of("response.output_audio.delta")) == n_audio  # nothing after response.done
        assert done["response"]["id"] == rid and done["response"]["status"] == "cancelled"
        assert done["response"]["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
        assert done["response"]["output"][0]["status"] == "incomplete"
        assert len(rt.audio(rid)) < RATE * 3  # the story is 14 s long
        await rt.send("response.cancel")
        await rt.wait_for("error")
        assert rt.errors() == ["response_cancel_not_active"]


async def test_truncate_keeps_only_the_heard_words_in_the_context(server):
    async with realtime(server) as rt:
        await ask_text(rt, QUESTION)
        done = await rt.wait_for("response.done")
        item_id = done["response"]["output"][0]["id"]
        user_item = rt.of("conversation.item.added")[0]["item"]["id"]
        for bad in (
            {"item_id": "item_nope", "content_index": 0, "audio_end_ms": 100},
            {"item_id": user_item, "content_index": 0, "audio_end_ms": 100},
            {"item_id": item_id, "content_index": 1, "audio_end_ms": 100},
            {"item_id": item_id, "content_index": 0, "audio_end_ms": -5},
        ):
            await rt.send("conversation.item.truncate", **bad)
        # each tone word is 250 ms: 600 ms heard = "paris is" and a cut-off "the"
        await rt.send("conversation.item.truncate", item_id=item_id, content_index=0, audio_end_ms=600)
        truncated = await rt.wait_for("conversation.item.truncated")
        assert truncated == {**truncated, "item_id": item_id, "content_index": 0, "audio_end_ms": 600}
        assert rt.errors() == [
            "item_truncate_invalid_item_id",
            "item_truncate_invalid_item_id",
            "invalid_value",
            "invalid_value",
        ]
        assert core_of(server, rt).history[-1] == {"role": "assistant", "content": "paris is"}


async def test_barge_in_cancels_the_answer_and_the_new_question_is_answered(server):
    async with realtime(server) as rt:
        await rt.speak(np.concatenate([silence(0.3), tone_speech("tell me a story", RATE), silence(0.8)]))
        story = await rt.wait_for("response.created")
        await rt.wait_for("response.output_audio.delta", count=15)
        t_speak = asyncio.get_running_loop().time()
        await rt.speak(np.concatenate([tone_speech(QUESTION, RATE), silence(1.0)]), speed=1.0)
        done = await rt.wait_for("response.done")
        rid = story["response"]["id"]
        story_audio = [
            t
            for t, e in zip(rt.times, rt.events, strict=True)
            if e["type"] == "response.output_audio.delta" and e["response_id"] == rid
        ]
        assert story_audio[-1] - t_speak < 0.3  # the answer stopped within 300 ms of the user talking
        assert done["response"]["id"] == rid and done["response"]["status"] == "cancelled"
        assert done["response"]["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
        types = [e["type"] for e in rt.events]
        # the user's speech is announced first, and no story audio follows the story's response.done
        assert types.index(
            "input_audio_buffer.speech_started", types.index("response.created")
        ) < types.index("response.done")
        done_at = types.index("response.done")
        assert not [e for e in rt.events[done_at:] if e.get("response_id") == rid]
        # as a client does after a barge-in: truncate the answer to what it played
        item_id = done["response"]["output"][0]["id"]
        await rt.send("conversation.item.truncate", item_id=item_id, content_index=0, audio_end_ms=500)
        await rt.wait_for("conversation.item.truncated")
        second = await rt.wait_for("response.done", count=2)
        assert second["response"]["status"] == "completed"
        assert rt.transcript(second["response"]["id"]) == ANSWER
        history = core_of(server, rt).history
        assert {"role": "assistant", "content": "once upon"} in history
        assert history[-2:] == [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": ANSWER},
        ]
        assert not rt.errors()


async def test_manual_turns_commit_then_response_create(server):
    async with realtime(server) as rt:
        await rt.send(
            "session.update", session={"type": "realtime", "audio": {"input": {"turn_detection": None}}}
        )
        await rt.wait_for("session.updated")
        await rt.send("input_audio_buffer.commit")  # nothing spoken yet
        await rt.wait_for("error")
        # the whole utterance in one 100 KB append, committed at once: the commit waits for the VAD
        speech = np.concatenate([silence(0.3), tone_speech(QUESTION, RATE), silence(0.5)])
        await rt.send("input_audio_buffer.append", audio=b64(float_to_pcm16(speech)))
        await rt.send("input_audio_buffer.commit")
        await rt.send("response.create")  # the usual manual-turn pair: this is the answer it asks for
        committed = await rt.wait_for("input_audio_buffer.committed")
        done = await rt.wait_for("response.done")
        assert done["response"]["status"] == "completed"
        assert rt.transcript(done["response"]["id"]) == ANSWER
        await asyncio.sleep(0.2)
        assert len(rt.of("response.created")) == 1
        assert not rt.of("input_audio_buffer.speech_started")  # no VAD events with turn_detection null
        transcribed = rt.of("conversation.item.input_audio_transcription.completed")[0]
        assert transcribed["item_id"] == committed["item_id"] and transcribed["transcript"] == QUESTION
        assert rt.errors() == ["input_audio_buffer_commit_empty"]


async def test_a_committed_noise_turn_still_gets_the_requested_empty_response(server):
    async with realtime(server) as rt:
        await rt.send(
            "session.update", session={"type": "realtime", "audio": {"input": {"turn_detection": None}}}
        )
        await rt.wait_for("session.updated")
        t = np.arange(int(RATE * 0.5)) / RATE
        noise = (0.3 * np.sin(2 * np.pi * 5000 * t)).astype(np.float32)  # loud, but no word of the tone ASR
        await rt.send(
            "input_audio_buffer.append", audio=b64(float_to_pcm16(np.concatenate([noise, silence(0.3)])))
        )
        await rt.send("input_audio_buffer.commit")
        await rt.send("response.create")
        done = await rt.wait_for("response.done")
        transcribed = rt.of("conversation.item.input_audio_transcription.completed")[0]
        assert transcribed["transcript"] == ""
        assert done["response"]["status"] == "completed" and done["response"]["output"] == []
        assert not rt.errors()


async def test_clear_drops_the_unfinished_turn(server):
    async with realtime(server) as rt:
        await rt.speak(np.concatenate([silence(0.2), tone_speech("hello how are you", RATE)]))
        await rt.wait_for("input_audio_buffer.speech_started")
        await rt.send("input_audio_buffer.clear")
        await rt.wait_for("input_audio_buffer.cleared")
        await rt.speak(silence(1.0))
        await asyncio.sleep(0.3)
        assert not rt.of("response.created") and not rt.of("input_audio_buffer.committed")


async def test_bad_input_gets_errors_while_a_parallel_session_works(server):
    async def good_session() -> dict[str, Any]:
        async with realtime(server) as rt:
            await rt.speak(np.concatenate([silence(0.3), tone_speech(QUESTION, RATE), silence(1.0)]), speed=2)
            return await rt.wait_for("response.done", limit_s=15)

    async def bad_session() -> list[str]:
        async with realtime(server) as rt:
            for message in [
                "{not json",
                json.dumps([1, 2]),
                json.dumps({"type": "teleport"}),
                json.dumps({"type": "conversation.item.delete", "item_id": "x"}),
                json.dumps({"type": "input_audio_buffer.append", "audio": "!!not base64!!"}),
                json.dumps({"type": "input_audio_buffer.append", "audio": b64(b"\x01\x02\x03")}),
                json.dumps({"type": "input_audio_buffer.append"}),
                json.dumps(
                    {
                        "type": "conversation.item.create",
                        "item": {
                            "type": "message",
                            "role": "user",
                            "content": [{"type": "input_text", "text": "x" * 70_000}],
                        },
                    }
                ),
                json.dumps(
                    {
                        "type": "conversation.item.create",
                        "item": {"type": "function_call_output", "call_id": "c", "output": "{}"},
                    }
                ),
                b"\x00\x01",
                json.dumps({"type": "response.cancel"}),
            ]:
                await rt.ws.send(message)
            await rt.wait_for("error", count=11)
            # the session survived all of that and still answers
            await rt.speak(
                np.concatenate([silence(0.2), tone_speech("hello how are you", RATE), silence(1.0)]), speed=2
            )
            transcribed = await rt.wait_for("conversation.item.input_audio_transcription.completed")
            assert transcribed["transcript"] == "hello how are you"
            codes = rt.errors()
        # a message over the route's 1 MiB limit closes only that connection, with 1009
        async with realtime(server) as rt:
            await rt.ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": "A" * (2 << 20)}))
            await asyncio.wait_for(rt.task, 5)
            codes.append(rt.closed.rcvd.code)
        return codes

    good, codes = await asyncio.gather(good_session(), bad_session())
    assert codes == [
        "invalid_json",
        "invalid_event",
        "invalid_value",
        "unsupported_event",
        "invalid_value",
        "invalid_value",
        "missing_required_parameter",
        "message_too_large",
        "unsupported_value",
        "invalid_event",
        "response_cancel_not_active",
        1009,
    ]
    assert good["response"]["status"] == "completed"
    await asyncio.sleep(0.2)
    assert server.service.sessions == {}  # every connection freed its session


async def test_official_openai_client(server):
    """The `openai` SDK's realtime client drives the server; it parses every event into its types."""
    from openai.types.realtime import (
        ConversationItemTruncatedEvent,
        InputAudioBufferSpeechStartedEvent,
        ResponseAudioDeltaEvent,
        ResponseDoneEvent,
        SessionCreatedEvent,
        SessionUpdatedEvent,
    )

    client = AsyncOpenAI(api_key="sk-local", websocket_base_url=f"ws://127.0.0.1:{server.port}/v1")
    async with client.realtime.connect(model="gpt-realtime") as conn:
        events: list[Any] = []
        changed = asyncio.Event()

        async def collect() -> None:
            try:
                async for ev in conn:
                    validate(ev.to_json())
                    events.append(ev)
                    changed.set()
            finally:
                changed.set()

        async def wait_for(cls: type, count: int = 1) -> Any:
            async with asyncio.timeout(10):
                while True:
                    if reader.done():
                        reader.result()  # raises what went wrong in the reader
                    hits = [e for e in events if isinstance(e, cls)]
                    if len(hits) >= count:
                        return hits[count - 1]
                    changed.clear()
                    await changed.wait()

        reader = asyncio.create_task(collect())
        try:
            await wait_for(SessionCreatedEvent)
            await conn.session.update(
                session={
                    "type": "realtime",
                    "instructions": "Be brief.",
                    "audio": {
                        "input": {
                            "format": {"type": "audio/pcm", "rate": 24000},
                            "turn_detection": {"type": "server_vad", "silence_duration_ms": 400},
                        },
                        "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "marin"},
                    },
                }
            )
            updated = await wait_for(SessionUpdatedEvent)
            assert updated.session.audio.input.turn_detection.silence_duration_ms == 400
            speech = np.concatenate([silence(0.3), tone_speech(QUESTION, RATE), silence(0.8)])
            for i in range(0, len(speech), 480):
                await conn.input_audio_buffer.append(audio=b64(float_to_pcm16(speech[i : i + 480])))
                await asyncio.sleep(0.005)
            await wait_for(InputAudioBufferSpeechStartedEvent)
            done = await wait_for(ResponseDoneEvent)
            assert done.response.status == "completed"
            assert done.response.output[0].content[0].transcript == ANSWER
            audio = np.concatenate(
                [
                    pcm16_to_float(base64.b64decode(e.delta))
                    for e in events
                    if isinstance(e, ResponseAudioDeltaEvent) and e.response_id == done.response.id
                ]
            )
            assert decode_tones(audio, RATE) == ANSWER.split()

            # a long answer, cancelled, then truncated to what was played, as an app does
            await conn.conversation.item.create(
                item={
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "tell me a story"}],
                }
            )
            await conn.response.create()
            await wait_for(
                ResponseAudioDeltaEvent,
                count=len([e for e in events if isinstance(e, ResponseAudioDeltaEvent)]) + 5,
            )
            await conn.response.cancel()
            cancelled = await wait_for(ResponseDoneEvent, count=2)
            assert cancelled.response.status == "cancelled"
            assert cancelled.response.status_details.reason == "client_cancelled"
            story_item = cancelled.response.output[0].id
            await conn.conversation.item.truncate(item_id=story_item, content_index=0, audio_end_ms=150)
            truncated = await wait_for(ConversationItemTruncatedEvent)
            assert truncated.item_id == story_item and truncated.audio_end_ms == 150
            assert not [e for e in events if e.type == "error"]
            ids = [e.event_id for e in events]
            assert len(ids) == len(set(ids))
        finally:
            reader.cancel()
