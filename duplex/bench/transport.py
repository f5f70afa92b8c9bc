"""`duplex bench --transport ...`: onset latency through each transport adapter, same prompts, same run.

One connection per transport stays open for the whole run and streams 20 ms of microphone audio
every 20 ms (silence when not speaking), like a phone line. The questions are asked in rounds:
question 1 through every transport, then question 2, ... so slow drifts of the machine hit every
transport alike. Onset = from the send time of the frame carrying the last speech sample of the
question to the arrival of the first audible answer audio on that transport.

Every link here is a minimal, ideal client (it plays audio the moment it arrives); the faithful
peer simulators with jitter and playback buffers live in `duplex.peers` and drive the tests.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import struct
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from codec.g711 import float_to_ulaw, ulaw_to_float
from codec.pcm import float_to_pcm16, pcm16_to_float
from codec.resample import LowLatencyResampler
from duplex.bench.common import SR, BenchError, Mic, Progress, cancel_tasks, percentiles, trim_speech

TRANSPORTS = ("native", "twilio", "audiosocket", "realtime")
AUDIBLE_RMS = 1e-3  # answer audio below this is silence padding, not the answer starting
QUIET_S = 0.8  # no audible audio for this long: the answer has finished


@dataclass
class Arrival:
    t: float
    seconds: float
    rms: float


@dataclass
class Link:
    """One transport connection: `send(frame)` takes 20 ms of 16 kHz float audio; arrivals are logged."""

    name: str
    arrivals: list[Arrival] = field(default_factory=list)
    closed: BaseException | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def open(self) -> None:
        raise NotImplementedError

    async def send(self, frame: np.ndarray) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    def heard(self, samples: np.ndarray, rate: int) -> None:
        x = np.asarray(samples, dtype=np.float32)
        rms = float(np.sqrt(np.mean(x * x))) if x.size else 0.0
        self.arrivals.append(Arrival(asyncio.get_running_loop().time(), x.size / rate, rms))
        self.changed.set()
        self.changed = asyncio.Event()


class _WsLink(Link):
    url: str
    ws: Any = None
    rx_task: asyncio.Task[None] | None = None

    async def _connect(self) -> None:
        from websockets.asyncio.client import connect

        try:
            self.ws = await connect(self.url, max_size=2**22, compression=None, open_timeout=10)
        except (OSError, TimeoutError) as exc:
            raise BenchError(f"cannot open {self.url}: {exc}. Is `duplex serve` running?") from None
        except Exception as exc:  # an HTTP status instead of the upgrade
            raise BenchError(f"the server refused {self.url}: {exc}") from None

    def _start_rx(self) -> None:
        self.rx_task = asyncio.create_task(self._rx(), name=f"bench-rx-{self.name}")

    async def _rx(self) -> None:
        try:
            async for msg in self.ws:
                await self.on_message(msg)
        except Exception as exc:
            self.closed = exc
        finally:
            self.closed = self.closed or ConnectionError(f"{self.name}: the connection closed")
            self.changed.set()

    async def on_message(self, msg: str | bytes) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        if self.rx_task is not None:
            self.rx_task.cancel()
            with contextlib.suppress(BaseException):
                await self.rx_task
        if self.ws is not None:
            with contextlib.suppress(Exception):
                await self.ws.close()


class NativeLink(_WsLink):
    def __init__(self, base: str) -> None:
        super().__init__("native")
        self.url = f"{base}/v1/duplex"
        self.out_sr = 24000

    async def open(self) -> None:
        await self._connect()
        await self.ws.send(json.dumps({"type": "session.start", "sample_rate": SR}))
        self._start_rx()

    async def send(self, frame: np.ndarray) -> None:
        await self.ws.send(float_to_pcm16(frame))

    async def on_message(self, msg: str | bytes) -> None:
        if isinstance(msg, bytes):
            self.heard(pcm16_to_float(msg), self.out_sr)
        elif (ev := json.loads(msg)).get("type") == "session.started":
            self.out_sr = int(ev.get("output_sample_rate", 24000))


class TwilioLink(_WsLink):
    """Twilio Media Streams: mu-law 8 kHz both ways; marks echoed on arrival (played at once)."""

    def __init__(self, base: str) -> None:
        super().__init__("twilio")
        self.url = f"{base}/v1/twilio"
        self.sid = "MZ" + uuid.uuid4().hex
        self.chunk = 0
        self.down = LowLatencyResampler(SR, 8000)
        self.down_state = self.down.init_state()

    async def open(self) -> None:
        await self._connect()
        await self.ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
        await self.ws.send(
            json.dumps(
                {
                    "event": "start",
                    "sequenceNumber": "1",
                    "streamSid": self.sid,
                    "start": {
                        "streamSid": self.sid,
                        "accountSid": "AC" + "0" * 32,
                        "callSid": "CA" + uuid.uuid4().hex,
                        "tracks": ["inbound"],
                        "customParameters": {},
                        "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
                    },
                }
            )
        )
        self._start_rx()

    async def send(self, frame: np.ndarray) -> None:
        x, self.down_state = self.down.step(self.down_state, frame)
        self.chunk += 1
        await self.ws.send(
            json.dumps(
                {
                    "event": "media",
                    "streamSid": self.sid,
                    "media": {
                        "track": "inbound",
                        "chunk": str(self.chunk),
                        "timestamp": str(20 * self.chunk),
                        "payload": base64.b64encode(float_to_ulaw(x)).decode(),
                    },
                }
            )
        )

    async def on_message(self, msg: str | bytes) -> None:
        ev = json.loads(msg)
        if ev.get("event") == "media":
            self.heard(ulaw_to_float(base64.b64decode(ev["media"]["payload"])), 8000)
        elif ev.get("event") == "mark":
            await self.ws.send(
                json.dumps({"event": "mark", "streamSid": self.sid, "mark": ev.get("mark", {})})
            )

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.ws.send(json.dumps({"event": "stop", "streamSid": self.sid, "stop": {}}))
        await super().close()


class RealtimeLink(_WsLink):
    """OpenAI-Realtime-compatible endpoint: pcm16 at 24 kHz, base64 in JSON both ways."""

    def __init__(self, base: str) -> None:
        super().__init__("realtime")
        self.url = f"{base}/v1/realtime?model=duplex"
        self.up = LowLatencyResampler(SR, 24000)
        self.up_state = self.up.init_state()

    async def open(self) -> None:
        await self._connect()
        self._start_rx()

    async def send(self, frame: np.ndarray) -> None:
        x, self.up_state = self.up.step(self.up_state, frame)
        await self.ws.send(
            json.dumps(
                {"type": "input_audio_buffer.append", "audio": base64.b64encode(float_to_pcm16(x)).decode()}
            )
        )

    async def on_message(self, msg: str | bytes) -> None:
        ev = json.loads(msg)
        if ev.get("type") in ("response.output_audio.delta", "response.audio.delta"):
            self.heard(pcm16_to_float(base64.b64decode(ev["delta"])), 24000)


class AudioSocketLink(Link):
    """Asterisk AudioSocket: TCP, slin16 8 kHz frames of 320 bytes."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__("audiosocket")
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.rx_task: asyncio.Task[None] | None = None
        self.down = LowLatencyResampler(SR, 8000)
        self.down_state = self.down.init_state()

    async def open(self) -> None:
        try:
            self.reader, self.writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port), 10
            )
        except (OSError, TimeoutError) as exc:
            raise BenchError(
                f"cannot connect to AudioSocket {self.host}:{self.port}: {exc}. "
                "Start the server with `duplex serve --audiosocket HOST:PORT`"
            ) from None
        self.writer.write(b"\x01" + struct.pack(">H", 16) + uuid.uuid4().bytes)
        await self.writer.drain()
        self.rx_task = asyncio.create_task(self._rx(), name="bench-rx-audiosocket")

    async def send(self, frame: np.ndarray) -> None:
        assert self.writer is not None
        x, self.down_state = self.down.step(self.down_state, frame)
        pcm = float_to_pcm16(x)
        self.writer.write(b"\x10" + struct.pack(">H", len(pcm)) + pcm)
        await self.writer.drain()

    async def _rx(self) -> None:
        assert self.reader is not None
        try:
            while True:
                kind, length = struct.unpack(">BH", await self.reader.readexactly(3))
                payload = await self.reader.readexactly(length)
                if kind == 0x10:
                    self.heard(pcm16_to_float(payload), 8000)
                elif kind == 0x00:
                    raise ConnectionError("the server hung up")
        except Exception as exc:
            self.closed = exc
            self.changed.set()

    async def close(self) -> None:
        if self.writer is not None:
            with contextlib.suppress(Exception):
                self.writer.write(b"\x00\x00\x00")
                await self.writer.drain()
                self.writer.close()
        if self.rx_task is not None:
            self.rx_task.cancel()
            with contextlib.suppress(BaseException):
                await self.rx_task


def make_link(name: str, base: str, audiosocket: tuple[str, int] | None) -> Link:
    if name == "native":
        return NativeLink(base)
    if name == "twilio":
        return TwilioLink(base)
    if name == "realtime":
        return RealtimeLink(base)
    if name == "audiosocket":
        if audiosocket is None:
            raise BenchError(
                "--transport audiosocket needs --audiosocket HOST:PORT (the server's AudioSocket listener)"
            )
        return AudioSocketLink(*audiosocket)
    raise BenchError(f"unknown transport {name!r}; choose from {', '.join(TRANSPORTS)}")


async def _first_audible(link: Link, after: float, within_s: float) -> float:
    i = 0
    async with asyncio.timeout(within_s):
        while True:
            while i < len(link.arrivals):
                a = link.arrivals[i]
                if a.t >= after and a.rms >= AUDIBLE_RMS:
                    return a.t
                i += 1
            if link.closed is not None:
                raise ConnectionError(f"{link.name}: {link.closed}")
            await link.changed.wait()


async def _until_quiet(link: Link, quiet_s: float = QUIET_S, at_most_s: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + at_most_s
    while loop.time() < deadline:
        audible = [a.t for a in link.arrivals if a.rms >= AUDIBLE_RMS]
        last = audible[-1] if audible else 0.0
        if loop.time() - last >= quiet_s:
            return
        await asyncio.sleep(0.1)


async def run_transport_bench(
    base: str,
    transports: Sequence[str],
    prompts: Sequence[str],
    speech: dict[str, np.ndarray],
    *,
    audiosocket: tuple[str, int] | None = None,
    rounds: int = 1,
    turn_timeout_s: float = 30.0,
    progress: Progress | None = print,
) -> dict[str, Any]:
    """Ask every prompt through every transport (interleaved), `rounds` times; onset samples per transport."""
    say = progress or (lambda _m: None)
    loop = asyncio.get_running_loop()
    links = [make_link(name, base, audiosocket) for name in transports]
    mics: dict[str, Mic] = {}
    tasks: list[asyncio.Task[None]] = []
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in transports}
    try:
        for link in links:
            await link.open()
            mic = Mic(None, loop, send=link.send)
            mics[link.name] = mic
            tasks.append(asyncio.create_task(mic.run(), name=f"bench-mic-{link.name}"))
        await asyncio.sleep(1.0)
        for r in range(rounds):
            for k, text in enumerate(prompts):
                for link in links:
                    utt = mics[link.name].say(text, speech[text])
                    rec: dict[str, Any] = {"round": r, "prompt": text, "ok": False}
                    try:
                        t_end = await asyncio.wait_for(
                            asyncio.shield(utt.last_sent), turn_timeout_s + utt.samples / SR
                        )
                        t_audio = await _first_audible(link, t_end, turn_timeout_s)
                        rec.update(ok=True, onset_s=t_audio - t_end)
                        say(
                            f"[{r * len(prompts) + k + 1}/{rounds * len(prompts)}] {link.name:11s} {text!r}: "
                            f"onset {1000 * rec['onset_s']:.0f} ms"
                        )
                    except (TimeoutError, ConnectionError) as exc:
                        rec["error"] = str(exc) or "timed out"
                        say(
                            f"[{r * len(prompts) + k + 1}/{rounds * len(prompts)}] {link.name:11s} {text!r}: "
                            f"FAILED ({rec['error']})"
                        )
                    samples[link.name].append(rec)
                    await _until_quiet(link)
                    await asyncio.sleep(0.3)
    finally:
        await cancel_tasks(tasks)
        for link in links:
            await link.close()
    return summarise(samples)


def summarise(samples: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per transport: onset n/P50/P90/P99; versus native: the P50/P90 difference and the paired median."""
    out: dict[str, Any] = {"transports": {}, "samples": samples}
    for name, recs in samples.items():
        onsets = [r["onset_s"] for r in recs if r.get("ok")]
        out["transports"][name] = {
            "onset_s": percentiles(onsets),
            "failed": sum(1 for r in recs if not r.get("ok")),
        }
    native = samples.get("native")
    if native:
        for name, recs in samples.items():
            if name == "native":
                continue
            paired = [
                b["onset_s"] - a["onset_s"]
                for a, b in zip(native, recs, strict=False)
                if a.get("ok") and b.get("ok")
            ]
            row = out["transports"][name]
            base = out["transports"]["native"]["onset_s"]
            row["vs_native"] = {
                "p50_diff_s": _diff(row["onset_s"]["p50"], base["p50"]),
                "p90_diff_s": _diff(row["onset_s"]["p90"], base["p90"]),
                "paired_diff_s": percentiles(paired),
            }
    return out


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def format_transport_table(result: dict[str, Any]) -> str:
    lines = ["transport     n   onset P50   P90     P99   | vs native: P50 diff  median of paired diffs"]
    for name, row in result["transports"].items():
        o = row["onset_s"]
        cells = [f"{name:11s}", f"{o['n']:3d}"] + [
            f"{1000 * o[k]:7.0f}" if o[k] is not None else "      -" for k in ("p50", "p90", "p99")
        ]
        vs = row.get("vs_native")
        if vs:
            pd = vs["paired_diff_s"]
            cells.append(
                f"  | {1000 * vs['p50_diff_s']:+7.0f} ms" if vs["p50_diff_s"] is not None else "  |       -"
            )
            if pd["p50"] is not None:
                cells.append(f"  {1000 * pd['p50']:+6.0f} ms")
        if row["failed"]:
            cells.append(f"  ({row['failed']} failed)")
        lines.append(" ".join(cells))
    return "\n".join(lines)


def synthesise_prompts(
    prompts: Sequence[str], synth: Callable[[str], np.ndarray], progress: Progress | None = print
) -> dict[str, np.ndarray]:
    say = progress or (lambda _m: None)
    t0 = time.perf_counter()
    speech = {}
    for text in dict.fromkeys(prompts):
        audio = trim_speech(np.asarray(synth(text), dtype=np.float32))
        if len(audio) == 0:
            raise BenchError(f"the synthesiser returned silence for {text!r}")
        speech[text] = audio
    say(f"synthesised {len(speech)} prompts in {time.perf_counter() - t0:.1f} s")
    return speech


def write_transport_outputs(result: dict[str, Any], out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench-transport.json"
    path.write_text(json.dumps(result, indent=1))
    return path


def plot_transport_results(result: dict[str, Any], path: str | Path) -> Path:
    """Onset samples per transport as a strip plot with P50/P90 ticks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["transports"])
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.6 * len(names)))
    rng = np.random.default_rng(0)
    for i, name in enumerate(names):
        ms = [1000 * r["onset_s"] for r in result["samples"][name] if r.get("ok")]
        ax.scatter(ms, i + rng.uniform(-0.15, 0.15, len(ms)), s=14, alpha=0.7)
        o = result["transports"][name]["onset_s"]
        for key, style in (("p50", "-"), ("p90", ":")):
            if o[key] is not None:
                ax.plot([1000 * o[key]] * 2, [i - 0.3, i + 0.3], style, color="k")
    ax.set_yticks(range(len(names)), [f"{n} (n={result['transports'][n]['onset_s']['n']})" for n in names])
    ax.set_xlabel("onset: end of question speech -> first answer audio (ms); | P50, : P90")
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
