"""The web client in headless Chromium: fake microphone -> page -> server -> page -> player worklet.

Chromium plays a WAV file as its microphone; the page (clients/web) streams it to an in-process
server, shows the transcript and the answer, and plays the answer through its AudioWorklet. The
Playwright driver (tests/browser/run_browser.mjs) writes what the page saw to JSON.

Needs /usr/bin/chromium and tests/browser/node_modules/playwright-core (`make browser-deps` or
`apt-get install -y chromium && cd tests/browser && npm ci`); skipped otherwise.
Set DUPLEX_BROWSER_SHOTS=/some/dir to keep the screenshots.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import threading
import wave
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from codec.resample import resample
from duplex.base.config import load_profile
from duplex.core.session import SR
from duplex.runtime.service import DuplexService
from duplex.testing.fakes import fake_stages, scripted_answer, tone_speech
from duplex.transports.native import DuplexServer, ServerSettings

BROWSER_DIR = Path(__file__).resolve().parents[1] / "browser"
DRIVER = BROWSER_DIR / "run_browser.mjs"
CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
MIC_RATE = 48000  # the WAV's rate; Chromium converts it to its fake device's format

_missing = [
    why
    for ok, why in (
        (CHROMIUM.exists(), f"{CHROMIUM} is not installed (apt-get install -y chromium)"),
        (shutil.which("node") is not None, "node is not on PATH"),
        (
            (BROWSER_DIR / "node_modules" / "playwright-core").is_dir(),
            "tests/browser/node_modules/playwright-core is missing (cd tests/browser && npm ci)",
        ),
    )
    if not ok
]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(bool(_missing), reason="; ".join(_missing) or "ok"),
]


answer = scripted_answer


@contextlib.contextmanager
def serving(service: DuplexService, api_keys: tuple[str, ...] = ()) -> Iterator[DuplexServer]:
    """The server on a free port, in its own thread and event loop (the test itself blocks on node)."""
    loop = asyncio.new_event_loop()
    server = DuplexServer(service, ServerSettings(host="127.0.0.1", port=0, api_keys=api_keys))
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, name="duplex-server", daemon=True)
    thread.start()
    assert ready.wait(30), "server did not start"
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        service.close()


def write_wav(path: Path, audio: np.ndarray, rate: int) -> None:
    pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())


def mic_file(speech: np.ndarray, rate: int = MIC_RATE) -> np.ndarray:
    """Silence while the page connects, the question, then silence so the turn ends and the answer plays."""
    return np.concatenate(
        [np.zeros(int(0.6 * rate), np.float32), speech, np.zeros(int(4.0 * rate), np.float32)]
    )


def drive(
    server: DuplexServer,
    mic: np.ndarray,
    tmp_path: Path,
    timeout_s: float,
    answers: int = 1,
    fragment: str = "",
) -> dict:
    """Run the Playwright driver until `answers` answers ended and played out; returns what the page saw."""
    wav, out, shot = tmp_path / "mic.wav", tmp_path / "seen.json", tmp_path / "page.png"
    write_wav(wav, mic, MIC_RATE)
    url = f"http://127.0.0.1:{server.port}/{fragment}"
    cmd = ["node", str(DRIVER), url, str(wav), str(out), str(shot), str(int(timeout_s * 1000)), str(answers)]
    proc = subprocess.run(cmd, cwd=BROWSER_DIR, capture_output=True, text=True, timeout=timeout_s + 60)
    if shot.exists() and os.environ.get("DUPLEX_BROWSER_SHOTS"):
        keep = Path(os.environ["DUPLEX_BROWSER_SHOTS"])
        keep.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, keep / f"{tmp_path.name}.png")
    assert out.exists(), f"the driver wrote no result (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    seen = json.loads(out.read_text())
    summary = {k: v for k, v in seen.items() if k != "events"}
    summary["event_types"] = [e["type"] for e in seen.get("events", [])]
    assert seen["ok"], f"the page did not finish a turn: {json.dumps(summary, indent=1)}"
    assert seen["foreignRequests"] == [], "the page loaded something from outside the server"
    return seen


def events_of(seen: dict, kind: str) -> list[dict]:
    return [e for e in seen["events"] if e["type"] == kind]


def test_spoken_turn_with_tone_stages(tmp_path):
    """Deterministic and fast: tone 'speech' in, tone 'speech' out, through the real browser audio path."""
    service = DuplexService(load_profile("cpu"), fake_stages(answer))
    speech = resample(tone_speech("what is the capital of france"), SR, MIC_RATE)
    with serving(service) as server:
        seen = drive(server, mic_file(speech), tmp_path, timeout_s=30)

    assert seen["errors"] == [] and seen["closes"] == []
    assert [e["text"] for e in events_of(seen, "transcript.final")] == ["what is the capital of france"]
    assert seen["transcriptText"] == "what is the capital of france"  # shown on the page, as final
    done = events_of(seen, "response.done")
    assert done and done[0]["status"] == "completed"
    assert seen["answerText"] == "paris is the capital of france"
    assert seen["latencyRows"] == 1
    # 6 words of 250 ms at 24 kHz: ~1.5 s of answer audio actually rendered by the player worklet
    assert seen["playedSeconds"] >= 1.2, seen["playedSeconds"]
    assert seen["statusText"] == "listening"


def test_page_with_a_client_secret_when_the_server_has_keys(tmp_path):
    """With API keys set, the page opens its session with a single-use client secret (subprotocol),
    here minted by "the deployment's backend" (this test) and handed to the page as #secret=."""
    import urllib.request

    service = DuplexService(load_profile("cpu"), fake_stages(answer))
    speech = resample(tone_speech("what is the capital of france"), SR, MIC_RATE)
    with serving(service, api_keys=("sk-browser",)) as server:
        req = urllib.request.Request(
            f"http://127.0.0.1:{server.port}/v1/realtime/client_secrets",
            method="POST",
            headers={"Authorization": "Bearer sk-browser"},
        )
        with urllib.request.urlopen(req, timeout=5) as r:
            secret = json.loads(r.read())["value"]
        assert len(server.auth.secrets) == 1
        seen = drive(server, mic_file(speech), tmp_path, timeout_s=30, fragment=f"#secret={secret}")
        assert len(server.auth.secrets) == 0  # used: it cannot open another session
    assert seen["errors"] == [] and seen["closes"] == []
    assert seen["answerText"] == "paris is the capital of france"


def test_barge_in_flushes_the_player(tmp_path):
    """Talking over the answer: the page flushes its player at once and the next turn is answered."""
    service = DuplexService(load_profile("cpu"), fake_stages(answer))
    sr = MIC_RATE
    ask = resample(tone_speech("tell me a story"), SR, sr)
    stop = resample(tone_speech("stop"), SR, sr)
    # the ~13 s story starts ~0.5 s after the question; "stop" comes ~1.5 s into it
    mic = mic_file(np.concatenate([ask, np.zeros(int(2.0 * sr), np.float32), stop]))
    with serving(service) as server:
        seen = drive(server, mic, tmp_path, timeout_s=40, answers=2)

    assert seen["errors"] == [] and seen["closes"] == []
    assert [e["status"] for e in events_of(seen, "response.done")] == ["interrupted", "completed"]
    interrupted = events_of(seen, "response.interrupted")[0]
    assert interrupted["played_text"].startswith("once upon")
    assert seen["interruptedLines"] == 1
    assert seen["transcriptText"] == "tell me a story stop"
    assert seen["answerText"] == interrupted["played_text"] + " i am fine thanks"  # unplayed words struck out
    # the server had sent ~120 ms ahead when the user barged in: that much was dropped, not played
    assert seen["flushedSamples"] > 0
    # much less than the whole story was played: the queue was dropped, not played out
    assert 0.5 < seen["playedSeconds"] < 5.0, seen["playedSeconds"]


@pytest.mark.integration
def test_spoken_turn_with_real_models(tmp_path):
    """The real `cpu` profile: synthesised speech asks, the page shows the words and plays the answer."""
    from tests.speech import synthesize

    service = DuplexService.load("cpu", progress=False)
    speech = synthesize("What is the capital of France?", sample_rate=MIC_RATE)
    with serving(service) as server:
        seen = drive(server, mic_file(speech), tmp_path, timeout_s=90)

    heard = seen["transcriptText"].lower()
    assert "capital" in heard and "france" in heard, heard
    assert "paris" in seen["answerText"].lower(), seen["answerText"]
    assert events_of(seen, "response.done")[0]["status"] == "completed"
    assert seen["playedSeconds"] >= 0.5, seen["playedSeconds"]
