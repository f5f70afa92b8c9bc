"""`duplex talk` against an in-process server with the tone stages: file mode, errors, and live mode
on a fake sound card whose loudspeaker leaks back into its microphone."""

from __future__ import annotations

import argparse
import asyncio
import importlib.abc
import signal
import socket
import sys
import threading
import time
import types
from typing import Any

import numpy as np
import pytest
import soundfile as sf

from clients.talk import cli as talk_cli
from clients.talk.conversation import Conversation
from clients.talk.errors import TalkError
from clients.talk.file_mode import talk_files
from clients.talk.live import LiveTalk
from clients.talk.screen import Screen, unheard
from clients.talk.timeline import Timeline
from duplex.base.config import load_profile
from duplex.core.session import SR
from duplex.runtime.service import DuplexService, ServiceLimits
from duplex.testing.fakes import WORD_SECONDS, decode_tones, fake_stages, scripted_answer, tone_speech
from duplex.transports.native import DuplexServer, ServerSettings
from tests.clients.test_echo import room_response

OUT_SR = 24000
QUESTION = "what is the capital of france"
ANSWER = scripted_answer([{"role": "user", "content": QUESTION}]).split()
STORY = scripted_answer([{"role": "user", "content": "tell me a story"}]).split()


@pytest.fixture
async def server():
    service = DuplexService(
        load_profile("cpu"), fake_stages(scripted_answer), limits=ServiceLimits(max_sessions=3)
    )
    srv = DuplexServer(service, ServerSettings(host="127.0.0.1", port=0))
    await srv.start()
    yield srv
    await srv.close()
    service.close()


def url(srv: DuplexServer) -> str:
    return f"ws://127.0.0.1:{srv.port}/v1/duplex"


def silence(seconds: float, rate: int = SR) -> np.ndarray:
    return np.zeros(int(rate * seconds), np.float32)


def speech(*parts: str | float, rate: int = SR) -> np.ndarray:
    """Tone speech and pauses: strings are said, numbers are seconds of silence."""
    return np.concatenate(
        [silence(p, rate) if isinstance(p, (int, float)) else tone_speech(p, rate) for p in parts]
    )


def loud_spans(audio: np.ndarray, rate: int, floor: float = 0.02) -> list[tuple[float, float]]:
    """(start, end) seconds of the stretches with sound (gaps under 0.3 s are bridged)."""
    hop = rate // 100
    n = len(audio) // hop
    loud = np.sqrt((audio[: n * hop].reshape(n, hop) ** 2).mean(axis=1)) > floor
    spans: list[list[float]] = []
    for i in np.flatnonzero(loud):
        t = i / 100
        if spans and t - spans[-1][1] < 0.3:
            spans[-1][1] = t + 0.01
        else:
            spans.append([t, t + 0.01])
    return [(a, b) for a, b in spans]


# -- file mode ------------------------------------------------------------------------------


async def test_file_mode_answers_a_48k_stereo_question_on_the_timeline(server, tmp_path):
    q_end = 0.3 + 6 * WORD_SECONDS + 5 * 0.05
    mono = speech(0.3, QUESTION, rate=48000)
    stereo = np.stack([mono, 0.5 * mono], axis=1)  # the mono mix must still be loud enough
    sf.write(tmp_path / "q.wav", stereo, 48000)
    result = await talk_files(
        tmp_path / "q.wav", tmp_path / "a.wav", url=url(server), screen=Screen(tty=False)
    )
    assert result.exit_code == 0 and result.error is None
    audio, rate = sf.read(tmp_path / "a.wav", dtype="float32")
    assert rate == OUT_SR
    assert decode_tones(audio, rate) == ANSWER
    ((start, end),) = loud_spans(audio, rate)
    assert q_end + 0.5 <= start < q_end + 1.5  # after the question and the 500 ms end-of-turn silence
    assert end - start == pytest.approx(len(ANSWER) * 0.25, abs=0.1)  # played once, in real time
    turn = result.turns[-1]
    assert turn.you == QUESTION and turn.bot == " ".join(ANSWER) and turn.status == "completed"
    assert set(turn.stages) >= {"end_of_turn", "first_audio"}
    assert 500 <= turn.onset_ms <= 1500  # the client-side onset, from the end of speech


async def test_file_mode_two_questions_two_answers_and_output_rate(server, tmp_path):
    sf.write(tmp_path / "q.wav", speech(0.2, QUESTION, 2.6, "hello how are you", rate=16000), 16000)
    lines: list[str] = []
    screen = Screen(types.SimpleNamespace(write=lines.append, flush=lambda: None), tty=False)
    result = await talk_files(
        tmp_path / "q.wav", tmp_path / "a.wav", url=url(server), output_rate=16000, screen=screen
    )
    assert result.exit_code == 0
    audio, rate = sf.read(tmp_path / "a.wav", dtype="float32")
    assert rate == 16000
    assert decode_tones(audio, rate) == [*ANSWER, "i", "am", "fine", "thanks"]
    first, second = loud_spans(audio, rate)
    assert first[1] < 0.2 + 1.45 + 2.6 < second[0]  # each answer after its own question
    assert [t.status for t in result.turns if t.status] == ["completed", "completed"]
    text = "".join(lines)
    assert f"you: {QUESTION}" in text and f"bot: {' '.join(ANSWER)}" in text and "answer began" in text


async def test_file_mode_barge_in_flushes_the_answer(server, tmp_path):
    # the story takes 14 s; the user talks over it about 1.5 s after it starts
    sf.write(tmp_path / "q.wav", speech(0.2, "tell me a story", 2.0, "stop what is two plus two"), SR)
    result = await talk_files(
        tmp_path / "q.wav", tmp_path / "a.wav", url=url(server), screen=Screen(tty=False)
    )
    assert result.exit_code == 0
    audio, rate = sf.read(tmp_path / "a.wav", dtype="float32")
    words = decode_tones(audio, rate)
    heard_story = words[: words.index("two")]
    assert 2 <= len(heard_story) < 10 and heard_story == STORY[: len(heard_story)]
    assert words[len(heard_story) :] == "two plus two is four".split()
    story, answer = loud_spans(audio, rate)
    barge_in = 0.2 + 1.0 + 2.0  # the interruption starts here; the story stops soon after
    assert barge_in < story[1] < barge_in + 0.4
    assert answer[0] > barge_in + 1.45 + 0.5  # the answer to the interruption follows it
    story_turn = next(t for t in result.turns if t.you == "tell me a story")
    # the server keeps whole words: the one cut mid-way may be missing from what it says was heard
    assert story_turn.status == "interrupted" and story_turn.heard.split() in (heard_story, heard_story[:-1])
    assert unheard(story_turn.bot, story_turn.heard).split() == STORY[len(story_turn.heard.split()) :]


async def test_file_mode_reports_silence_as_no_answer(server, tmp_path):
    sf.write(tmp_path / "q.wav", silence(0.3), SR)
    result = await talk_files(tmp_path / "q.wav", url=url(server), speed=4.0, screen=Screen(tty=False))
    assert result.exit_code == 1 and "no answer came" in result.error and "no speech" in result.error


async def test_file_mode_reports_a_server_that_goes_away(server, tmp_path):
    sf.write(tmp_path / "q.wav", speech(0.2, QUESTION, 3.0), SR)
    run = asyncio.create_task(talk_files(tmp_path / "q.wav", url=url(server), screen=Screen(tty=False)))
    await asyncio.sleep(0.5)
    await server.close()
    result = await asyncio.wait_for(run, 5)
    assert result.exit_code == 1 and "the server closed the connection (code 1001" in result.error


def test_screen_redraws_partials_and_strikes_unheard_words():
    lines: list[str] = []
    screen = Screen(types.SimpleNamespace(write=lines.append, flush=lambda: None), tty=True)
    conv = Conversation(screen, locate=lambda ms: ms / 1000, on_interrupt=lambda: None)
    for ev in [
        {"type": "transcript.partial", "turn_id": 1, "text": "tell me"},
        {"type": "transcript.partial", "turn_id": 1, "text": "tell me a story"},
        {"type": "transcript.final", "turn_id": 1, "text": "tell me a story"},
        {"type": "response.started", "turn_id": 1},
        {"type": "response.text.delta", "turn_id": 1, "delta": "once upon"},
        {"type": "response.text.delta", "turn_id": 1, "delta": " a time"},
        {"type": "turn.latency", "turn_id": 1, "stages": {"first_audio": 640.0}},
        {"type": "response.interrupted", "turn_id": 1, "played_text": "once upon"},
        {"type": "response.done", "turn_id": 1, "status": "interrupted", "text": "once upon a time"},
    ]:
        conv.handle(ev, 0.0)
    assert "".join(lines) == (
        "\r\x1b[K you: tell me ...\r\x1b[K you: tell me a story ...\r\x1b[K you: tell me a story\n"
        " bot: once upon a time\n"
        "      (interrupted; not heard: \x1b[9ma time\x1b[0m)\n"
        "      [latency; server ms from end of speech: first audio 640]\n"
    )
    assert conv.idle() and conv.answers == 1 and conv.turns[1].heard == "once upon"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli_args(**kw: Any) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    talk_cli.add_arguments(p)
    argv = []
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        argv += [flag] if v is True else [flag, str(v)]
    return p.parse_args(argv)


def test_unreachable_server_is_a_clear_error(tmp_path, capsys):
    sf.write(tmp_path / "q.wav", speech(0.1, "hello"), SR)
    dead = f"ws://127.0.0.1:{free_port()}/v1/duplex"
    code = talk_cli.run(cli_args(input_wav=tmp_path / "q.wav", output_wav=tmp_path / "a.wav", server=dead))
    err = capsys.readouterr().err
    assert code == 2
    assert f"cannot reach the server at {dead}" in err and "duplex serve" in err and "Traceback" not in err
    assert not (tmp_path / "a.wav").exists()


async def test_refused_options_and_capacity_are_clear_errors(server, tmp_path):
    sf.write(tmp_path / "q.wav", speech(0.1, "hello"), SR)
    with pytest.raises(TalkError, match="refused session.start: bad_option"):
        await talk_files(tmp_path / "q.wav", url=url(server), options={"vad_threshold": 7})
    server.service.full = lambda: True  # type: ignore[method-assign]
    with pytest.raises(TalkError, match="HTTP 503 .*capacity"):
        await talk_files(tmp_path / "q.wav", url=url(server))


def test_bad_arguments(tmp_path, capsys):
    assert talk_cli.run(cli_args(option="novalue")) == 2
    assert talk_cli.run(cli_args(output_wav=tmp_path / "a.wav")) == 2
    assert talk_cli.run(cli_args(input_wav=tmp_path / "missing.wav")) == 2
    err = capsys.readouterr().err
    assert "KEY=VALUE" in err and "--output-wav needs --input-wav" in err and "cannot read" in err
    assert talk_cli.parse_options(["end_of_turn_silence_ms=700", "vad_threshold=0.6", "x=abc"]) == {
        "end_of_turn_silence_ms": 700,
        "vad_threshold": 0.6,
        "x": "abc",
    }


def test_timeline_places_runs_and_flushes():
    tl = Timeline(rate=100, speed=1.0, t0=10.0)
    assert tl.feed(np.ones(10, np.float32), 11.0) == 1.0  # starts at its arrival
    assert tl.feed(np.ones(10, np.float32), 11.05) == 1.1  # queued behind the first frame
    tl.flush(11.15)  # a barge-in 150 ms into playback: the rest is dropped
    assert tl.feed(np.ones(10, np.float32), 11.16) == pytest.approx(1.16)  # a new answer
    out = tl.render(2.0)
    assert len(out) == 200 and out[100:115].all() and not out[115:116].any() and out[116:126].all()


# -- missing PortAudio and devices -----------------------------------------------------------


class _NoPortAudio(importlib.abc.MetaPathFinder):
    """Makes `import sounddevice` fail the way it does without the PortAudio library."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "sounddevice":
            raise OSError("PortAudio library not found")
        return None


def test_missing_portaudio_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.delitem(sys.modules, "sounddevice", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_NoPortAudio(), *sys.meta_path])
    for args in (cli_args(), cli_args(list_devices=True)):
        assert talk_cli.run(args) == 2
        err = capsys.readouterr().err
        assert err.strip() == (
            "duplex talk: PortAudio is not installed (sudo apt install libportaudio2 / brew "
            "install portaudio); use --input-wav/--output-wav to run from files"
        )


def test_missing_device_names_it(monkeypatch, capsys):
    room = FakeRoom(inputs=False)
    monkeypatch.setitem(sys.modules, "sounddevice", fake_sounddevice(room))
    assert talk_cli.run(cli_args(input_device="USB Mic")) == 2
    err = capsys.readouterr().err
    assert "no input device 'USB Mic'" in err and "--list-devices" in err and "Traceback" not in err
    assert talk_cli.run(cli_args(list_devices=True)) == 0
    assert "Fake Speaker" in capsys.readouterr().out


# -- live mode on a fake sound card ----------------------------------------------------------


class FakeRoom:
    """A full-duplex sound card in a room, in real time, on its own thread (like PortAudio's): each
    20 ms it asks the output callback for a block, plays it, and hands the input callback what the
    microphone heard: the user's scripted speech plus the speaker through `rir`."""

    def __init__(
        self,
        rate: int = 48000,
        rir: np.ndarray | None = None,
        out_latency_s: float = 0.03,
        inputs: bool = True,
    ) -> None:
        self.rate = rate
        self.block = rate // 50
        self.rir = rir
        self.out_latency = int(rate * out_latency_s)
        self.inputs = inputs
        self.streams: dict[str, FakeStream] = {}
        self.user = np.zeros(rate * 60, np.float32)
        self.speaker = np.zeros(rate * 60 + self.out_latency + self.block, np.float32)
        self.samples = 0  # the card's sample clock
        self.speaker_on: float | None = None  # when the speaker first played sound (s, card clock)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if rir is not None:
            self._nfft = 1 << int(np.ceil(np.log2(len(rir) + self.block)))
            self._rir_spec = np.fft.rfft(rir, self._nfft)

    def say(self, audio: np.ndarray, at_s: float) -> None:
        with self._lock:
            i = int(at_s * self.rate)
            self.user[i : i + len(audio)] += audio

    @property
    def now_s(self) -> float:
        return self.samples / self.rate

    def start(self, stream: FakeStream) -> None:
        self.streams[stream.kind] = stream
        if len(self.streams) == 2 and self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="fake-sound-card")
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2)

    def _echo(self, a: int, b: int) -> np.ndarray:
        if self.rir is None:
            return np.zeros(b - a, np.float32)
        lo = a - len(self.rir) + 1
        seg = self.speaker[max(lo, 0) : b]
        seg = np.concatenate([np.zeros(max(0, -lo), np.float32), seg])
        full = np.fft.irfft(np.fft.rfft(seg, self._nfft) * self._rir_spec, self._nfft)
        return full[len(self.rir) - 1 : len(self.rir) - 1 + (b - a)].astype(np.float32)

    def _run(self) -> None:
        t_start = time.monotonic()
        b = self.block
        while not self._stop.is_set():
            end = self.samples + b
            delay = t_start + end / self.rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            cur = time.monotonic() - t_start + 1.0  # PortAudio stream time: seconds, never 0
            out = np.zeros((b, 1), np.float32)
            dac = (end + self.out_latency) / self.rate + 1.0
            self.streams["output"].callback(
                out, b, types.SimpleNamespace(currentTime=cur, outputBufferDacTime=dac), 0
            )
            at = end + self.out_latency
            self.speaker[at : at + b] = out[:, 0]
            if self.speaker_on is None and np.abs(out).max() > 0.01:
                self.speaker_on = at / self.rate
            with self._lock:
                mic = self.user[self.samples : end] + self._echo(self.samples, end)
            adc = self.samples / self.rate + 1.0
            self.streams["input"].callback(
                np.stack([mic, mic], axis=1),
                b,
                types.SimpleNamespace(currentTime=cur, inputBufferAdcTime=adc),
                0,
            )
            self.samples = end

    def played(self) -> np.ndarray:
        return self.speaker[: self.samples + self.out_latency]


class FakeStream:
    def __init__(
        self,
        room: FakeRoom,
        kind: str,
        *,
        samplerate: int,
        blocksize: int,
        device: Any,
        channels: int,
        dtype: str,
        latency: Any,
        callback: Any,
    ) -> None:
        assert samplerate == room.rate and blocksize == room.block and dtype == "float32" and channels == 1
        self.room, self.kind, self.callback = room, kind, callback
        self.latency = 0.03
        self.closed = False

    def start(self) -> None:
        self.room.start(self)

    def stop(self) -> None:
        self.room.stop()

    def close(self) -> None:
        self.closed = True


def fake_sounddevice(room: FakeRoom) -> types.ModuleType:
    """A stand-in for the `sounddevice` module: one microphone (two channels) and one speaker."""
    sd = types.ModuleType("sounddevice")

    class PortAudioError(Exception):
        pass

    devices = [
        {
            "name": "Fake Mic",
            "max_input_channels": 2,
            "max_output_channels": 0,
            "default_samplerate": room.rate,
        },
        {
            "name": "Fake Speaker",
            "max_input_channels": 0,
            "max_output_channels": 2,
            "default_samplerate": room.rate,
        },
    ]
    if not room.inputs:
        devices = devices[1:]

    def query_devices(device: Any = None, kind: str | None = None) -> Any:
        if device is None and kind is None:
            return "\n".join(f"{i} {d['name']}" for i, d in enumerate(devices))
        for d in devices:
            if (device is None or device in d["name"]) and d[f"max_{kind}_channels"] > 0:
                return d
        raise ValueError(f"No {kind} device matching {device!r}")

    sd.PortAudioError = PortAudioError  # type: ignore[attr-defined]
    sd.query_devices = query_devices  # type: ignore[attr-defined]
    sd.InputStream = lambda **kw: FakeStream(room, "input", **kw)  # type: ignore[attr-defined]
    sd.OutputStream = lambda **kw: FakeStream(room, "output", **kw)  # type: ignore[attr-defined]
    return sd


async def converse(
    srv: DuplexServer, room: FakeRoom, echo: str, until: Any, limit_s: float = 15.0, settle: bool = True
) -> LiveTalk:
    """Run live mode on `room` until `until(talk)` holds (and, with `settle`, until it is idle), then
    stop it as Ctrl-C would."""
    live = LiveTalk(fake_sounddevice(room), url=url(srv), echo=echo, screen=Screen(tty=False))
    task = asyncio.create_task(live.run())
    try:
        async with asyncio.timeout(limit_s):
            while not (live.conversation and until(live) and (live.idle() or not settle)):
                assert not task.done(), task.result()
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)
    finally:
        live.stop()
        code = await task
    assert code == 0 and all(s.closed for s in room.streams.values())
    return live


def events(live: LiveTalk, type_: str) -> list[dict[str, Any]]:
    assert live.conversation is not None
    return [e for e in live.conversation.events if e["type"] == type_]


def answered(live: LiveTalk, n: int = 1) -> bool:
    return len(events(live, "response.done")) >= n


async def test_live_plays_the_answer_and_the_echo_canceller_keeps_the_bot_from_interrupting_itself(server):
    room = FakeRoom(rir=room_response(48000))  # the echo at -6 dB, 40 ms late, 150 ms of reverberation
    room.say(tone_speech(QUESTION, 48000), at_s=0.4)
    live = await converse(server, room, "aec", answered)
    assert decode_tones(room.played(), 48000) == ANSWER
    assert [e["text"] for e in events(live, "transcript.final")] == [QUESTION]
    assert not events(live, "response.interrupted") and len(events(live, "speech.started")) == 1
    assert events(live, "response.done")[0]["status"] == "completed"
    turn = live.conversation.turns[1]
    assert turn.onset_ms is not None and 400 < turn.onset_ms < 1500


async def test_live_without_echo_handling_the_bot_interrupts_itself(server):
    room = FakeRoom(rir=room_response(48000))
    room.say(tone_speech(QUESTION, 48000), at_s=0.4)
    live = await converse(
        server, room, "off", lambda t: bool(events(t, "response.interrupted")), limit_s=10, settle=False
    )
    assert events(live, "response.interrupted")[0]["turn_id"] == 1  # cut by its own echo


async def test_live_barge_in_gets_through_the_echo_canceller(server):
    room = FakeRoom(rir=room_response(48000))
    room.say(tone_speech("tell me a story", 48000), at_s=0.4)
    interrupted = False

    def until(live: LiveTalk) -> bool:
        nonlocal interrupted
        if room.speaker_on is not None and not interrupted:  # talk over the story 1 s into it
            room.say(tone_speech("stop what is two plus two", 48000), at_s=room.now_s + 1.0)
            interrupted = True
        return any(e["status"] == "completed" for e in events(live, "response.done"))

    live = await converse(server, room, "aec", until, limit_s=20)
    finals = [e["text"] for e in events(live, "transcript.final")]
    statuses = [e["status"] for e in events(live, "response.done")]
    words = decode_tones(room.played(), 48000)
    context = (finals, statuses, words)  # what to look at if this ever fails again
    assert finals == ["tell me a story", "stop what is two plus two"], context
    assert statuses == ["interrupted", "completed"], context
    assert "two" in words, context
    assert 2 <= words.index("two") < 12 and words[words.index("two") :] == "two plus two is four".split(), (
        context
    )


async def test_live_reports_a_lost_server(server):
    room = FakeRoom()
    live = LiveTalk(fake_sounddevice(room), url=url(server), echo="aec", screen=Screen(tty=False))
    task = asyncio.create_task(live.run())
    while room.samples < room.rate // 2:  # talking for half a second
        assert not task.done()
        await asyncio.sleep(0.05)
    await server.close()
    assert await asyncio.wait_for(task, 5) == 1
    assert all(s.closed for s in room.streams.values())


@pytest.fixture
def threaded_server():
    """The tone server on its own thread and loop, for tests that call the synchronous `run()`."""
    service = DuplexService(
        load_profile("cpu"), fake_stages(scripted_answer), limits=ServiceLimits(max_sessions=2)
    )
    srv = DuplexServer(service, ServerSettings(host="127.0.0.1", port=0))
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def serve() -> None:
        loop.run_until_complete(srv.start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10)
    yield srv
    asyncio.run_coroutine_threadsafe(srv.close(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    service.close()


def test_ctrl_c_in_live_mode_closes_everything_and_exits_0(threaded_server, monkeypatch, capsys):
    room = FakeRoom(rir=room_response(48000))
    room.say(tone_speech(QUESTION, 48000), at_s=0.3)
    monkeypatch.setitem(sys.modules, "sounddevice", fake_sounddevice(room))

    def press_ctrl_c() -> None:  # while the answer plays
        deadline = time.monotonic() + 10
        while room.speaker_on is None and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)
        signal.raise_signal(signal.SIGINT)

    threading.Thread(target=press_ctrl_c, daemon=True).start()
    code = talk_cli.run(cli_args(server=url(threaded_server), option="end_of_turn_silence_ms=400"))
    out, err = capsys.readouterr()
    assert code == 0 and err == "" and "Traceback" not in out
    assert room.speaker_on is not None and all(s.closed for s in room.streams.values())
    assert f"you: {QUESTION}" in out and "bot: paris" in out


def test_the_latency_stages_shown_are_the_servers() -> None:
    """The client names every stage of `turn.latency` (clients may not import the core: compare here)."""
    from clients.talk.conversation import STAGE_NAMES
    from duplex.core.events import LATENCY_STAGES

    assert tuple(STAGE_NAMES) == LATENCY_STAGES
