"""The session core: one conversation as a state machine, with no I/O and an injected clock.

Inputs: `receive_audio` (16 kHz float32 frames), `receive_control` (client events),
`on_result` / `on_failure` (a stage job finished), `tick` (time passed).
Outputs: `take_jobs()` (stage steps for the device executor), `take_outputs()` (typed events and
PCM16 audio frames for the transport), `next_wakeup()` (when to call `tick` next).

The core is the single owner of turn state. Every stage's per-session state lives here and is
lent to at most one in-flight job per stage; a job always hands the state back, even when its
output is stale (the response it served was interrupted), so caches are never lost.

Turn flow: VAD windows -> Endpointer edges. At the first pause the open segment is transcribed
speculatively and the LLM starts on that transcript while the end-of-turn hangover runs; if the
user goes on, the speculation is dropped (the LLM cache is rolled back on the next step). When
the hangover ends the response is committed: its held text and audio are released, and audio
is paced by the playout clock. Speech during a response interrupts it; the history keeps only
the words the listener heard.
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from codec.pcm import float_to_pcm16
from duplex.base.audio import SAMPLE_RATE as SR
from duplex.base.config import ConfigError, Profile, SessionOptions
from duplex.base.cues import is_bare_cue
from duplex.base.messages import (
    AsrChunk,
    AsrResult,
    ListenOutput,
    ListenStep,
    OverlapOutput,
    OverlapStep,
    RespondOutput,
    RespondStep,
    TtsInput,
)
from duplex.base.phrases import first_phrase_ready
from duplex.base.stage import IncrementalStage, RestartableStage
from duplex.base.turn_policy import LABELS
from duplex.core.endpointing import Edge, Endpointer, speech_end
from duplex.core.events import (
    CLIENT_INPUT_CLEAR,
    CLIENT_INPUT_END,
    CLIENT_INPUT_TEXT,
    CLIENT_PLAYOUT,
    CLIENT_RESPONSE_CANCEL,
    CLIENT_RESPONSE_TRUNCATE,
    CLIENT_SESSION_UPDATE,
    LATENCY_STAGES,
    Backchannel,
    ErrorEvent,
    Interrupted,
    ResponseAudioStarted,
    ResponseDone,
    ResponseStarted,
    ResponseTextDelta,
    ServerEvent,
    SessionUpdated,
    SpeechStarted,
    SpeechStopped,
    TranscriptFinal,
    TranscriptPartial,
    TurnDecision,
    TurnLatency,
)
from duplex.core.jobs import Job
from duplex.core.playout import Playout, heard_within
from duplex.core.recent import RecentAudio
from duplex.core.stages import Stages
from duplex.core.turns import Response, Segment

log = logging.getLogger("duplex.core.session")


FRAME_SECONDS = 0.04  # output audio frame length
MAX_BACKDATE_MS = 96  # a pause dated back to the voice's end moves by at most this (Silero's lag, measured)


class SessionCore:
    """One conversation. Drive it with audio, control events, job results and ticks."""

    def __init__(
        self,
        session_id: str,
        profile: Profile,
        stages: Stages,
        clock: Callable[[], float],
        options: SessionOptions | None = None,
    ) -> None:
        self.session_id = session_id
        self.profile = profile
        self.options = options or profile.session
        self.stages = stages
        #: the TTS may hand back its first chunk and owe the rest (stepped again until it owes nothing)
        self._tts_incremental = isinstance(stages.tts, IncrementalStage)
        self.clock = clock
        self.turn_taking = stages.policy is not None
        self.budgets = {
            "vad": profile.component("vad").budget("step", 30),
            "asr.partial": profile.component("asr").budget("partial", 400),
            "asr.final": profile.component("asr").budget("final", 600),
            "llm.first": profile.component("llm").budget("first", 900),
            "llm.step": profile.component("llm").budget("step", 400),
            "tts": profile.component("tts").budget("chunk", 250),
        }
        llm_opts = profile.component("llm").options
        self.first_step_tokens = int(llm_opts.get("first_step_tokens", 4))
        self.step_tokens = int(llm_opts.get("step_tokens", 4))
        self.first_phrase_words = int(profile.component("tts").options.get("first_phrase_words", 3))
        self.out_sr = self.options.output_sample_rate
        self.playout = Playout(
            self.out_sr, self.options.playout_lead_ms / 1000.0, int(self.out_sr * FRAME_SECONDS)
        )
        self.endpointer = self._new_endpointer()
        self.history: list[dict[str, str]] = []
        self.turn_id = 0
        self._rids = itertools.count(1)
        self._sids = itertools.count(1)
        self._jobs: list[Job] = []
        self._outputs: list[ServerEvent | bytes] = []
        # stage state, lent to at most one job per stage at a time
        self._vad_state: Any = stages.vad.init_state()
        self._vad_pending: list[np.ndarray] = []
        self._llm_state: Any = stages.llm.init_state()
        self._busy: dict[str, Any] = {}  # stage -> tag of the in-flight job
        # input audio timeline
        self.samples_in = 0
        self._arrivals: list[tuple[int, float]] = []  # (sample index at end of a frame, arrival time)
        self._recent_audio = RecentAudio(int(SR * 3))  # last few seconds of input, for pre-roll
        self.segment: Segment | None = None
        self.response: Response | None = None
        self._finished_response: Response | None = None  # still playing out after completion
        # the client's latest playout report: (turn id, ms heard, clock time of the report)
        self._playout_report: tuple[int, float, float] | None = None
        # the last answer that reached the history: (turn id, its audio timeline, its history entry)
        self._last_spoken: tuple[int, list[tuple[float, str]], dict[str, str] | None] | None = None
        self.closed = False
        #: LLM tokens generated for this session's answers (the service sums them for /stats: tokens/s)
        self.llm_tokens = 0
        # learned turn-taking: what the LLM slot should do when it is free (besides answering)
        self._want_listen: tuple[int, str, int, bool] | None = None  # (segment, text, covered, at pause)
        self._want_overlap: tuple[int, str, int] | None = None  # (segment, text, covered)
        self._last_backchannel = -1e9
        self._bc_ids = itertools.count(1)
        if self.turn_taking:
            self.endpointer.end_silence = int(SR * self.options.incomplete_turn_silence_ms / 1000)

    # -- inputs --------------------------------------------------------------------------

    def receive_audio(self, samples: np.ndarray) -> None:
        """A frame of user audio at 16 kHz (float32, any length), arriving now."""
        x = np.asarray(samples, dtype=np.float32).reshape(-1)
        if x.size == 0:
            return
        now = self.clock()
        self.samples_in += x.size
        self._arrivals.append((self.samples_in, now))
        if len(self._arrivals) > 4000:
            del self._arrivals[:2000]
        self._recent_audio.append(x)
        if self.segment is not None and not self.segment.ended:
            self.segment.audio.append(x)
            self.segment.pending.append(x)
            self.segment.total_samples += x.size
        self._vad_pending.append(x)
        seg = self.segment
        if seg is not None and not seg.ended and seg.total_samples > SR * self.options.max_segment_ms / 1000:
            # an endless turn (a monologue, music, steady noise) would make every transcription slower
            for edge in self.endpointer.force_end():
                self._on_edge(edge)
        self._submit_vad()
        self._maybe_partial()

    def receive_control(self, event: dict[str, Any]) -> None:
        """A client control event (already JSON-decoded and validated for type)."""
        kind = event.get("type")
        if kind == CLIENT_RESPONSE_CANCEL:
            if self.response is not None and self.response.committed:
                self._interrupt(status="cancelled")
        elif kind == CLIENT_SESSION_UPDATE:
            self.update_options(event.get("options") or {})
        elif kind == CLIENT_INPUT_END:
            for edge in self.endpointer.force_end():
                self._on_edge(edge)
        elif kind == CLIENT_PLAYOUT:
            played_ms = _ms(event.get("played_ms"))
            if played_ms is None:
                self._error("bad_event", "playout.position needs a number played_ms >= 0")
                return
            self._playout_report = (int(event.get("turn_id", self.turn_id)), played_ms, self.clock())
        elif kind == CLIENT_RESPONSE_TRUNCATE:
            played_ms = _ms(event.get("played_ms"))
            if played_ms is None:
                self._error("bad_event", "response.truncate needs a number played_ms >= 0")
                return
            self.truncate(played_ms / 1000.0, event.get("turn_id"))
        elif kind == CLIENT_INPUT_CLEAR:
            self.clear_input()
        elif kind == CLIENT_INPUT_TEXT:
            text = event.get("text")
            if not isinstance(text, str) or not text.strip():
                self._error("bad_event", "input.text needs a non-empty string text")
                return
            self.respond_to_text(text.strip())
        else:
            self._error("unknown_event", f"unknown event type {kind!r}")

    def truncate(self, played_s: float, turn_id: Any = None) -> None:
        """The client stopped playing the last answer after `played_s` seconds: stop sending its
        audio, if any is left, and keep only the words heard in the history."""
        turn = self._last_spoken[0] if self._last_spoken else None
        playing = (
            self.response
            if self.response is not None and self.response.committed
            else self._finished_response
        )
        if playing is not None and (turn_id is None or turn_id == playing.turn_id):
            self._interrupt(status="interrupted", cap=played_s)
            return
        if self._last_spoken is None or (turn_id is not None and turn_id != turn):
            self._error("bad_event", f"nothing to truncate for turn {turn_id!r}")
            return
        _, timeline, entry = self._last_spoken
        _, words = heard_within(timeline, played_s)
        if entry is not None and any(item is entry for item in self.history):
            index = next(i for i, item in enumerate(self.history) if item is entry)
            if words:
                self.history[index] = {"role": "assistant", "content": words}
                self._last_spoken = (turn or 0, timeline, self.history[index])
            else:
                del self.history[index]
                self._last_spoken = (turn or 0, timeline, None)

    def clear_input(self) -> None:
        """Forget the user's unfinished turn (its audio and any answer being prepared for it)."""
        if self.segment is not None and not self.segment.ended:
            self.segment = None
        self._drop_speculation()
        self.endpointer = self._new_endpointer()

    def respond_to_text(self, text: str) -> None:
        """A typed user turn: answer it now, as if it had been spoken and transcribed."""
        self.clear_input()
        self.turn_id += 1
        now = self.clock()
        self._emit(TranscriptFinal, text=text)
        resp = self._start_response(self.turn_id, text, committed=False)
        resp.marks.update({"speech_end": now, "end_of_turn": now, "final_transcript": now})
        self._commit_response(resp)

    def configure(self, overrides: dict[str, Any]) -> None:
        """Apply a client's per-session option deltas; raises ConfigError and changes nothing if bad."""
        self.options = self.options.with_overrides(overrides)
        self.endpointer.threshold = self.options.vad_threshold
        self.endpointer.end_silence = int(SR * self._hangover_ms() / 1000)
        self.endpointer.max_backdate = self._max_backdate()

    def update_options(self, overrides: dict[str, Any]) -> None:
        """`session.update`: apply the deltas, answer with session.updated or an error event."""
        try:
            self.configure(overrides)
        except ConfigError as exc:
            self._error("bad_option", str(exc))
            return
        self._emit(
            SessionUpdated, options={k: getattr(self.options, k) for k in SessionOptions.CLIENT_SETTABLE}
        )

    def tick(self) -> None:
        """Time passed: release due audio frames, finish responses that have played out."""
        now = self.clock()
        frames = self.playout.due_frames(now)
        if frames:
            resp = self.response
            if resp is not None and not resp.audio_started:
                resp.audio_started = True
                resp.marks["first_audio"] = now
                self._emit(ResponseAudioStarted, turn_id=resp.turn_id)
                self._emit_latency(resp)
            for frame in frames:
                self._outputs.append(float_to_pcm16(frame))
        self._maybe_complete()

    def next_wakeup(self) -> float | None:
        return self.playout.next_due()

    def on_result(self, job: Job, out: Any, state: Any) -> None:
        """A job finished: take the stage state back, then use the output if still current."""
        self._busy.pop(_slot(job), None)
        if self.closed:
            return
        handler = {"vad": self._on_vad, "asr": self._on_asr, "llm": self._on_llm, "tts": self._on_tts}[
            job.stage
        ]
        handler(job, out, state)
        self._maybe_complete()

    def on_failure(self, job: Job, exc: BaseException) -> None:
        """A job raised: report it, reset that stage's state, keep the session alive."""
        self._busy.pop(_slot(job), None)
        log.error("session %s: %s job failed: %s", self.session_id, job.label, exc)
        self._error("stage_failed", f"{job.label} failed: {exc}")
        if job.stage == "vad":
            self._vad_state = self.stages.vad.init_state()
            self._submit_vad()
        elif job.stage == "asr":
            seg = self.segment
            if seg is not None and job.tag[0] == seg.sid and job.label == "asr.partial":
                seg.asr_state = self.stages.asr.init_state()
                seg.pending = list(seg.audio)
        elif job.stage == "llm":
            self._llm_state = self.stages.llm.init_state()
            if self.response is not None:
                self._finish_response("failed")
        elif job.stage == "tts" and self.response is not None:
            self._finish_response("failed")

    def close(self) -> None:
        """The transport went away: drop everything; in-flight results will be ignored."""
        self.closed = True
        self.response = None
        self.playout.reset()

    # -- outputs -------------------------------------------------------------------------

    def take_jobs(self) -> list[Job]:
        jobs, self._jobs = self._jobs, []
        return jobs

    def take_outputs(self) -> list[ServerEvent | bytes]:
        out, self._outputs = self._outputs, []
        return out

    # -- VAD and endpointing -------------------------------------------------------------

    def _hangover_ms(self) -> int:
        """The endpointer's own hangover: with learned turn-taking it is the long one, and the
        core ends complete turns earlier (`_maybe_end_early`)."""
        o = self.options
        if self.turn_taking:
            return max(o.incomplete_turn_silence_ms, o.end_of_turn_silence_ms)
        return o.end_of_turn_silence_ms

    def _new_endpointer(self) -> Endpointer:
        o = self.options
        return Endpointer(
            threshold=o.vad_threshold,
            off_threshold=o.vad_off_threshold,
            min_speech=int(SR * o.min_speech_ms / 1000),
            end_silence=int(SR * self._hangover_ms() / 1000),
            max_backdate=self._max_backdate(),
        )

    def _max_backdate(self) -> int:
        return int(SR * MAX_BACKDATE_MS / 1000) if self.options.speech_end_db > 0 else 0

    def _voice_end(self, window_end: int) -> int | None:
        """Where the voice's energy ended in the open segment, up to `window_end` (None: no segment,
        the option is off, or the audio is gone from the recent buffer)."""
        seg, db = self.segment, self.options.speech_end_db
        if seg is None or seg.ended or db <= 0 or not self.endpointer.in_speech or self.endpointer.paused:
            return None
        recent = self._recent_audio
        return speech_end(recent.samples, recent.base, seg.start_sample, window_end, db)

    def _maybe_early_final(self, window_end: int, voice_end: int | None) -> None:
        """The voice has been quiet for `early_final_ms` though the VAD still hears speech: start the
        final transcript now (once per quiet stretch), so it is ready when the VAD calls the pause."""
        seg, ms = self.segment, self.options.early_final_ms
        if ms <= 0 or voice_end is None or seg is None or seg.ended or self.endpointer.paused:
            return
        if window_end - voice_end < SR * ms / 1000:
            return
        if seg.early_final_at is not None and seg.early_final_at >= voice_end:
            return  # this quiet stretch has had its transcription
        seg.early_final_at = voice_end
        self._submit_final(seg)

    def _submit_vad(self) -> None:
        if "vad" in self._busy or not self._vad_pending or self.closed:
            return
        chunk = np.concatenate(self._vad_pending)
        self._vad_pending = []
        self._submit("vad", "vad", self._vad_state, chunk, self.budgets["vad"], tag=None)

    def _on_vad(self, job: Job, out: Any, state: Any) -> None:
        self._vad_state = state
        window = 512
        for window_end, prob in out:
            # only a window that may declare a pause needs it (or the early final, when on)
            quiet = prob < self.endpointer.off_threshold or self.options.early_final_ms > 0
            voice_end = self._voice_end(int(window_end)) if quiet else None
            for edge in self.endpointer.feed(int(window_end), float(prob), window, voice_end):
                self._on_edge(edge)
            self._maybe_early_final(int(window_end), voice_end)
            if self.endpointer.in_speech and not self.endpointer.paused:
                self._check_barge_in()
        self._maybe_end_early()
        self._submit_vad()

    def _on_edge(self, edge: Edge) -> None:
        if edge.kind == "start":
            self._start_segment(edge.sample)
        elif edge.kind == "pause":
            if self.segment is not None:
                self.segment.pause_at = edge.sample - self.segment.start_sample
            self._speculate()
            seg = self.segment
            if self.turn_taking and seg is not None and not seg.ended and seg.spec_valid():
                self._at_pause(seg)
        elif edge.kind == "resume":
            self._drop_speculation()
            if self.segment is not None:
                self.segment.decision, self.segment.confident_end = None, False
                self.segment.end_wait_share, self.segment.acoustic_hold = 1.0, False
                if self.segment.overlap_class == "backchannel":
                    self.segment.overlap_class = None  # they went on: judge the whole thing again
        elif edge.kind == "end":
            self._end_segment(edge.sample)

    def _check_barge_in(self) -> None:
        resp = self.response
        if resp is None or not resp.committed:
            resp = None
        finished = self._finished_response if self.playout.playing(self.clock()) else None
        if resp is None and finished is None:
            return
        if self.endpointer.speech_samples < SR * self.options.barge_in_min_speech_ms / 1000:
            return
        seg = self.segment
        if seg is not None and seg.overlap and seg.overlap_class == "noise":
            return  # the decoder heard no word in it (see _decoder_end_of_utterance)
        if self.turn_taking and seg is not None and seg.overlap and seg.overlap_class != "interruption":
            # a backchannel must not end the answer: hold its audio at once (what was sent still
            # plays) and let the overlap head decide, unless the user has talked longer than any
            # backchannel would last
            if self.endpointer.speech_samples < SR * self.options.max_backchannel_ms / 1000:
                if not self.playout.held:
                    self.playout.hold(self.clock())
                return
            seg.overlap_class = "interruption"
        self._interrupt(status="interrupted")

    # -- user segment and ASR ------------------------------------------------------------

    def _start_segment(self, start_sample: int) -> None:
        self.turn_id += 1
        if self.response is not None and not self.response.committed:
            self.response = None  # a speculation from before; the user is talking again
        recent = self._recent_audio
        first = max(start_sample - int(SR * self.options.pre_roll_ms / 1000), recent.base)
        audio = recent.samples[first - recent.base :].copy()
        seg = Segment(
            sid=next(self._sids),
            turn_id=self.turn_id,
            start_sample=first,
            asr_state=self.stages.asr.init_state(),
        )
        seg.audio.append(audio)
        seg.pending.append(audio)
        seg.total_samples = audio.size
        seg.overlap = self.turn_taking and self._speaking()
        if seg.overlap:
            log.info(
                "session %s turn %d: user speech over the answer; holding its audio until the overlap head "
                "decides",
                self.session_id,
                seg.turn_id,
            )
        self.segment = seg
        self._emit(SpeechStarted, audio_ms=int(1000 * start_sample / SR))

    def _maybe_partial(self) -> None:
        seg = self.segment
        if seg is None or seg.ended or "asr" in self._busy:
            return
        if self.endpointer.paused and self.endpointer.decoder_quiet_since is None:
            return  # a pause the VAD hears: nothing new to transcribe (in a decoder's pause the VAD
            # still hears sound, and only the decoder can tell if words follow)
        # keep partials to about a quarter of real time so a final rarely waits behind one
        interval = max(self.options.partial_interval_ms / 1000, 4.0 * seg.last_partial_cost)
        if seg.total_samples - seg.last_transcribed >= SR * interval:
            self._submit_partial(seg)

    def _submit_partial(self, seg: Segment) -> None:
        """Partials feed the segment's incremental ASR state with the audio since the last one."""
        chunk = np.concatenate(seg.pending) if seg.pending else np.zeros(0, dtype=np.float32)
        seg.pending = []
        seg.last_transcribed = seg.total_samples
        self._submit(
            "asr",
            "asr.partial",
            seg.asr_state,
            AsrChunk(chunk, transcribe=True, final=False),
            self.budgets["asr.partial"],
            tag=(seg.sid, False, seg.total_samples),
        )

    def _submit_final(self, seg: Segment) -> None:
        """Finals run on a fresh state over the whole segment, in their own slot, so they never
        wait behind a partial that is still in flight (with two bulk workers they overlap)."""
        if "asr.final" in self._busy:
            return  # _on_asr asks again when the one in flight returns, if it does not cover enough
        if self.stages.asr_streaming:
            # a streaming ASR finishes from the partials' state: only the audio since the last partial
            # and the flush. Its state is not kept (partials go on from the pre-final state and the
            # pending audio is not consumed), so a user who goes on after a speculative final loses nothing.
            if "asr" in self._busy:
                return  # the partial in flight carries the state; _on_asr asks again when it returns
            chunk = np.concatenate(seg.pending) if seg.pending else np.zeros(0, dtype=np.float32)
            self._submit(
                "asr",
                "asr.final",
                seg.asr_state,
                AsrChunk(chunk, transcribe=True, final=True),
                self.budgets["asr.final"],
                tag=(seg.sid, True, seg.total_samples),
            )
            return
        audio = np.concatenate(seg.audio) if seg.audio else np.zeros(0, dtype=np.float32)
        asr = self.stages.asr
        # the partials' last transcript (of a shorter prefix) is the final's draft where the stage takes one
        fresh = asr.restart_state(seg.asr_state) if isinstance(asr, RestartableStage) else asr.init_state()
        self._submit(
            "asr",
            "asr.final",
            fresh,
            AsrChunk(audio, transcribe=True, final=True),
            self.budgets["asr.final"],
            tag=(seg.sid, True, seg.total_samples),
        )

    def _speculate(self) -> None:
        """The user paused: transcribe now so the answer can start before the hangover ends."""
        seg = self.segment
        if seg is None or seg.ended or seg.spec_valid():
            return
        self._submit_final(seg)

    def _drop_speculation(self) -> None:
        if self.response is not None and not self.response.committed:
            self.response = None

    def _on_asr(self, job: Job, out: AsrResult | None, state: Any) -> None:
        seg_id, final, covered = job.tag
        seg = self.segment
        if seg is None or seg.sid != seg_id:
            self._maybe_partial()  # stale: the segment was answered already
            return
        if not final:
            seg.asr_state = state
        text = (out.text or "").strip() if out is not None else ""
        if out is not None and out.heard_seconds is not None and not final:
            # a streaming partial has heard only the chunks it encoded: it covers no more than those
            covered = min(covered, int(round(out.heard_seconds * SR)))
        if covered > seg.spec_at and (final or covered >= seg.pause_at > 0 or seg.ended):
            # any transcript that covers the audio up to the pause can serve as the final one,
            # so a partial that returns after the user stopped is not transcribed twice
            seg.spec_final, seg.spec_at, seg.spec_ready = text, covered, self.clock()
            seg.spec_p_complete = out.p_complete if out is not None else None
        if not final:
            seg.last_partial_cost = out.compute_seconds if out is not None else 0.0
            self._decoder_end_of_utterance(seg, out)
            if text and text != seg.partial_text and not seg.ended:
                seg.partial_text = text
                self._drop_early_answer(text)
                self._emit(TranscriptPartial, turn_id=seg.turn_id, text=text)
                if self.turn_taking and not self.endpointer.paused:
                    self._listen(seg, text, covered, at_pause=False)
        if seg.ended:
            if seg.spec_valid():
                self._commit_turn(seg)
            else:
                self._submit_final(seg)
        elif self.endpointer.paused:
            if not seg.spec_valid():
                self._submit_final(seg)
            elif self.turn_taking:
                self._at_pause(seg)
            elif self.response is None and seg.spec_final:
                self._start_response(seg.turn_id, seg.spec_final, committed=False)
        else:
            self._maybe_partial()

    def _decoder_end_of_utterance(self, seg: Segment, out: AsrResult | None) -> None:
        """A streaming ASR's end-of-utterance signal, alongside the VAD: once its decoder has heard
        no word for `eou_silence_ms` the turn pauses at the last word, even where the VAD still hears
        sound; the decoder's next words resume it (see duplex.core.endpointing)."""
        if not (self.options.asr_end_of_utterance and self.stages.asr_streaming) or seg.ended or out is None:
            return
        words = out.words
        if seg.overlap:
            if out.no_words and seg.overlap_class is None:
                # sound over the answer with no word in it (a hum, a noisy room): not a barge-in
                log.info(
                    "session %s turn %d: %.0f ms of sound over the answer with no word in it: the answer "
                    "goes on",
                    self.session_id,
                    seg.turn_id,
                    out.trailing_silence_ms,
                )
                seg.overlap_class = "noise"
                self._resume_playout()
                return
            if words and seg.overlap_class == "noise":
                seg.overlap_class = None  # words after all: the talk over the answer starts with them
                self.endpointer.speech_samples = 0
        if out.eou and words:
            if self.endpointer.decoder_silence(seg.start_sample + int(SR * float(words[-1].end))):
                log.info(
                    "session %s turn %d: the ASR decoder heard no word for %.0f ms after %r while the VAD "
                    "still hears sound: pausing the turn at the last word",
                    self.session_id,
                    seg.turn_id,
                    out.trailing_silence_ms,
                    words[-1].word,
                )
        elif not out.eou and words and self.endpointer.decoder_quiet_since is not None:
            for edge in self.endpointer.decoder_words(seg.start_sample + int(SR * float(words[-1].start))):
                self._on_edge(edge)

    def _end_segment(self, end_sample: int) -> None:
        seg = self.segment
        if seg is None:
            return
        seg.ended = True
        seg.pause_at = end_sample - seg.start_sample
        seg.marks = {"speech_end": self._arrival_time(end_sample), "end_of_turn": self.clock()}
        self._emit(SpeechStopped, turn_id=seg.turn_id, audio_ms=int(1000 * end_sample / SR))
        if seg.spec_valid():
            self._commit_turn(seg)
        else:
            self._submit_final(seg)

    def _commit_turn(self, seg: Segment) -> None:
        text = (seg.spec_final or "").strip()
        if self.turn_taking and seg.overlap and seg.overlap_class in (None, "noise") and text:
            if self._speaking():
                self._classify_overlap(seg)  # decided when the overlap head answers
                return
            seg.overlap_class = "interruption"  # the answer ended meanwhile: an ordinary turn
        if self.turn_taking and seg.overlap and seg.overlap_class == "backchannel":
            self.segment = None
            self._resume_playout()
            self._emit(Backchannel, turn_id=seg.turn_id, text=text, source="user")
            return
        self.segment = None
        if not text:
            self._resume_playout()
        marks = dict(seg.marks)
        marks["final_transcript"] = seg.spec_ready
        self._emit(TranscriptFinal, turn_id=seg.turn_id, text=text)
        resp = self.response
        if not text:
            if resp is not None and not resp.committed:
                self.response = None
            return  # noise, a cough: nothing to answer
        if resp is None or resp.committed or resp.user_text != text or resp.turn_id != seg.turn_id:
            resp = self._start_response(seg.turn_id, text, committed=False)
        resp.marks.update(marks)
        self._commit_response(resp)

    # -- response: LLM -> TTS -> playout -------------------------------------------------

    def _start_response(self, turn_id: int, user_text: str, committed: bool) -> Response:
        if self.response is not None and self.response.committed:
            self._interrupt(status="interrupted")  # a new turn never silently drops the old one
        resp = Response(rid=next(self._rids), turn_id=turn_id, user_text=user_text, committed=committed)
        resp.tts_state = self.stages.tts.init_state()
        self.response = resp
        self._submit_llm()
        return resp

    def _commit_response(self, resp: Response) -> None:
        resp.committed = True
        self._remember_user(resp.user_text)
        self._finished_response = None
        self.playout.reset()
        self._emit(ResponseStarted, turn_id=resp.turn_id)
        for delta in resp.held_text:
            self._emit(ResponseTextDelta, turn_id=resp.turn_id, delta=delta)
        resp.held_text.clear()
        for chunk in resp.held_audio:
            self.playout.enqueue(self.clock(), chunk.audio, chunk.text)
        resp.held_audio.clear()
        self._submit_llm()
        self._submit_tts()
        self.tick()

    def _needs_first_phrase(self, resp: Response) -> bool:
        """The text so far is not yet a speakable first phrase (too few complete words)."""
        return not first_phrase_ready(resp.text, resp.llm_done, self.first_phrase_words)

    def _messages_for(self, resp: Response) -> list[dict[str, str]]:
        msgs = list(self.history)
        if not resp.committed:
            msgs.append({"role": "user", "content": resp.user_text})
        return msgs

    def _submit_llm(self) -> None:
        """Give the session's LLM slot its next job: classify overlapping speech first (the answer
        may have to stop), then the answer, then the turn head's listening."""
        if "llm" in self._busy or self.closed:
            return
        if self._want_overlap is not None:
            sid, text, covered = self._want_overlap
            self._want_overlap = None
            self._submit(
                "llm",
                "llm.overlap",
                self._llm_state,
                OverlapStep(text),
                self.budgets["llm.step"],
                tag=("overlap", sid, covered),
            )
            return
        resp = self.response
        if (
            resp is None
            or resp.llm_done
            or (resp.llm_started and not resp.committed and not self._needs_first_phrase(resp))
        ):
            # no answer needs the model (a speculative one stops once its first phrase can be spoken)
            if self._want_listen is not None and (resp is None or resp.llm_done or not resp.committed):
                sid, text, covered, at_pause = self._want_listen
                self._want_listen = None
                # at a pause the decision is urgent: only the drafter reads; the slow model catches up
                # in the answer's first step (while they talk, both read slice by slice)
                self._submit(
                    "llm",
                    "llm.listen",
                    self._llm_state,
                    ListenStep(list(self.history), text, not at_pause, self.options.relay),
                    self.budgets["llm.step"],
                    tag=("listen", sid, covered, at_pause, text),
                )
            return
        if not resp.llm_started:
            step = RespondStep(
                self._messages_for(resp),
                self.first_step_tokens,
                self.options.relay,
                phrase_words=self.stages.phrase_words,
                relay_check=self.options.relay_check or None,
            )
            label = "llm.first"
        else:
            step = RespondStep(None, self.step_tokens)
            label = "llm.step"
        budget = self.budgets[label]
        if label == "llm.step" and resp.committed:
            # due when the audio already queued runs out, less the voice's time for the new words: a step of
            # an answer seconds ahead yields to other sessions' first steps and to answers about to run dry
            budget = max(budget, self.playout.buffered(self.clock()) - self.budgets["tts"])
        resp.llm_started = True
        self._submit("llm", label, self._llm_state, step, budget, tag=resp.rid)

    def _on_llm(self, job: Job, out: ListenOutput | OverlapOutput | RespondOutput, state: Any) -> None:
        self._llm_state = state
        if isinstance(job.tag, tuple) and job.tag[0] == "listen":
            self._on_listen(job, out)
            self._submit_llm()
            return
        if isinstance(job.tag, tuple) and job.tag[0] == "overlap":
            self._on_overlap(job, out)
            self._submit_llm()
            return
        resp = self.response
        if resp is None or resp.rid != job.tag:
            self._submit_llm()  # stale: a newer response may be waiting for the LLM
            return
        assert isinstance(out, RespondOutput), type(out)
        self.llm_tokens += int(out.n_tokens or 0)
        delta = out.text
        if job.label == "llm.first":
            timings = out.timings
            log.info(
                "session %s turn %d: llm prefill %s tokens in %.0f ms, first step %.0f ms, queued %.0f ms",
                self.session_id,
                resp.turn_id,
                out.prefill_tokens,
                1000 * timings.get("prefill_s", 0.0),
                1000 * timings.get("total_s", 0.0),
                1000 * (self.clock() - job.submitted) - 1000 * timings.get("total_s", 0.0),
            )
        relay = out.relay
        if relay is not None and job.label == "llm.first":
            resp.relay = {
                "committed": bool(relay.committed),
                "p": round(float(relay.p_accept), 3),
                "threshold": round(relay.threshold, 3),
                "veto": relay.veto,
                "draft": relay.draft,
                "draft_ms": round(1000 * relay.draft_s, 1),
            }
        if delta:
            resp.marks.setdefault("first_llm_token", self.clock())
            resp.text += delta
            resp.tts_pending += delta
            if resp.committed:
                self._emit(ResponseTextDelta, turn_id=resp.turn_id, delta=delta)
            else:
                resp.held_text.append(delta)
        if out.done:
            resp.llm_done = True
        self._submit_llm()
        self._submit_tts()

    def _tts_owes(self, state: Any) -> bool:
        return self._tts_incremental and bool(self.stages.tts.pending(state))  # type: ignore[attr-defined]

    def _submit_tts(self) -> None:
        resp = self.response
        if resp is None or "tts" in self._busy or self.closed:
            return
        owes = self._tts_owes(resp.tts_state)
        if resp.tts_final_sent and not owes:
            return
        final = resp.llm_done
        if not resp.tts_pending and not final and not owes:
            return
        budget = self.budgets["tts"]
        if owes and not resp.tts_pending and resp.committed:
            # only what the stage owes: due when the audio already queued runs out, so that other sessions'
            # first chunks (earlier deadlines) run first
            budget = max(budget, self.playout.buffered(self.clock()) - budget)
        text, resp.tts_pending = resp.tts_pending, ""
        resp.tts_final_sent = final
        self._submit("tts", "tts", resp.tts_state, TtsInput(text, final), budget, tag=(resp.rid, final))

    def _on_tts(self, job: Job, out: Any, state: Any) -> None:
        if job.tag[0] == "bc":
            self._on_backchannel_audio(out)
            self._submit_tts()
            return
        rid, final = job.tag
        resp = self.response
        if resp is None or resp.rid != rid:
            self._submit_tts()  # stale: a newer response may be waiting for the TTS
            return
        resp.tts_state = state
        now = self.clock()
        for chunk in out or []:
            if len(chunk.audio) == 0:
                continue
            resp.marks.setdefault("first_tts_chunk", now)
            if resp.committed:
                self.playout.enqueue(now, chunk.audio, chunk.text)
            else:
                resp.held_audio.append(chunk)
        if final and not self._tts_owes(state):
            resp.tts_done = True
        self._submit_tts()
        if resp.committed:
            self.tick()

    def _maybe_complete(self) -> None:
        resp = self.response
        if resp is None or not resp.committed or not (resp.llm_done and resp.tts_done):
            return
        if self.playout.pending():
            return
        self._finish_response("completed")

    def _finish_response(self, status: str) -> None:
        resp = self.response
        if resp is None:
            return
        self.response = None
        text = resp.text.strip()
        if resp.committed:
            if text and status == "completed":
                entry = {"role": "assistant", "content": text}
                self.history.append(entry)
                self._last_spoken = (resp.turn_id, self.playout.timeline(), entry)
                self._trim_history()
            self._finished_response = resp if status == "completed" else None
            self._emit(
                ResponseDone,
                turn_id=resp.turn_id,
                status=status,
                text=text,
                played_text=text if status == "completed" else "",
            )
            if not resp.audio_started:
                self._emit_latency(resp)

    def _interrupt(self, status: str, cap: float | None = None) -> None:
        """Barge-in or cancel: stop audio now, keep only the words that were heard.

        What was heard comes from the playout clock, bounded by `cap` seconds or by the client's
        latest playout report (what it had played then, plus the time since)."""
        now = self.clock()
        resp = self.response if self.response is not None and self.response.committed else None
        target = resp or self._finished_response
        if target is None:
            return
        report = self._playout_report
        if report is not None and report[0] == target.turn_id:
            bound = report[1] / 1000.0 + (now - report[2])
            cap = bound if cap is None else min(cap, bound)
        timeline = self.playout.timeline()
        played_s, played_text = self.playout.played(now, cap)
        self.playout.reset()
        self._playout_report = None
        self._emit(
            Interrupted, turn_id=target.turn_id, played_ms=int(1000 * played_s), played_text=played_text
        )
        entry: dict[str, str] | None = None
        if resp is not None:
            self.response = None
            self._emit(
                ResponseDone,
                turn_id=resp.turn_id,
                status=status,
                text=resp.text.strip(),
                played_text=played_text,
            )
            if played_text:
                entry = {"role": "assistant", "content": played_text}
                self.history.append(entry)
        else:
            # the response had finished generating but was still playing: truncate its history entry
            if self.history and self.history[-1]["role"] == "assistant":
                if played_text:
                    entry = self.history[-1] = {"role": "assistant", "content": played_text}
                else:
                    self.history.pop()
        self._last_spoken = (target.turn_id, timeline, entry)
        self._finished_response = None
        self._trim_history()

    # -- helpers ---------------------------------------------------------------------------

    def _remember_user(self, text: str) -> None:
        self.history.append({"role": "user", "content": text})
        self._trim_history()

    def _trim_history(self) -> None:
        # Dropping the oldest turn changes the start of the prompt, so the LLM's KV cache no
        # longer matches and the whole remaining history is prefilled again. Trim rarely and in
        # bulk: past the limit, keep only the newer half.
        limit = 2 * self.options.max_history_turns
        if len(self.history) > limit:
            del self.history[: len(self.history) - limit // 2]
            while self.history and self.history[0]["role"] != "user":
                del self.history[0]

    def _submit(self, stage: str, label: str, state: Any, chunk: Any, budget: float, tag: Any) -> None:
        now = self.clock()
        job = Job(
            stage=stage,
            label=label,
            session_id=self.session_id,
            turn_id=self.turn_id,
            state=state,
            chunk=chunk,
            deadline=now + budget,
            tag=tag,
        )
        self._busy[_slot(job)] = tag
        self._jobs.append(job)

    def _emit(self, cls: type[ServerEvent], turn_id: int | None = None, **fields: Any) -> None:
        self._outputs.append(
            cls(
                session_id=self.session_id,
                turn_id=self.turn_id if turn_id is None else turn_id,
                t=self.clock(),
                **fields,
            )
        )

    def _error(self, code: str, message: str) -> None:
        self._emit(ErrorEvent, code=code, message=message)

    def _arrival_time(self, sample: int) -> float:
        """Clock time at which input sample `sample` arrived (the frame that carried it)."""
        i = bisect.bisect_right(self._arrivals, sample, key=_sample_of)
        if i >= len(self._arrivals):
            return self._arrivals[-1][1] if self._arrivals else self.clock()
        return self._arrivals[i][1]

    def _emit_latency(self, resp: Response) -> None:
        base = resp.marks.get("speech_end")
        if base is None:
            return
        stages = {k: round(1000 * (resp.marks[k] - base), 1) for k in LATENCY_STAGES if k in resp.marks}
        self._emit(TurnLatency, turn_id=resp.turn_id, stages=stages, relay=dict(resp.relay), early=resp.early)

    # -- learned turn-taking ---------------------------------------------------------------

    def _speaking(self) -> bool:
        """An answer is being sent or is still playing at the listener."""
        if self.response is not None and self.response.committed:
            return True
        return self._finished_response is not None and self.playout.playing(self.clock())

    def _listen(self, seg: Segment, text: str, covered: int, at_pause: bool) -> None:
        """Ask the turn head about the user's words so far (prefilling them on the way)."""
        if not text.strip() or (seg.overlap and seg.overlap_class != "interruption"):
            return
        if not at_pause and text == seg.listened:
            return
        self._want_listen = (seg.sid, text, covered, at_pause)
        self._submit_llm()

    def _at_pause(self, seg: Segment) -> None:
        """The user paused and the transcript up to the pause is known."""
        text = seg.spec_final or ""
        self._drop_early_answer(text)
        if seg.overlap and not text.strip():
            self._resume_playout()  # a cough or a breath over the answer: no words, go on
        if seg.overlap and seg.overlap_class is None:
            if self._speaking():
                self._classify_overlap(seg)
                return
            seg.overlap_class = "interruption"
        if seg.decision is None:
            if seg.slice_probs is not None and seg.slice_probs[0] == text:
                # the head read these very words while they talked (and the models hold them): its verdict
                # stands, and no listen step stands between the pause and the answer
                resp = self.response
                log.info(
                    "session %s turn %d: the final transcript says what the head read last while they talked%s",
                    self.session_id,
                    seg.turn_id,
                    " (and the early answer was prepared from)" if resp is not None and resp.early else "",
                )
                self._decide_turn(seg, text, seg.slice_probs[1])
            else:
                self._listen(seg, text, seg.spec_at, at_pause=True)

    def _classify_overlap(self, seg: Segment) -> None:
        if not self.turn_taking or not (seg.spec_final or "").strip():
            return
        self._want_overlap = (seg.sid, seg.spec_final or "", seg.spec_at)
        self._submit_llm()

    def _on_listen(self, job: Job, out: ListenOutput | OverlapOutput | RespondOutput) -> None:
        assert isinstance(out, ListenOutput), type(out)
        _, sid, covered, at_pause, text = job.tag
        seg = self.segment
        if seg is None or seg.sid != sid:
            return
        seg.listened = text
        p_listen, p_bc, p_speak = (float(p) for p in out.probs)
        probs = (p_listen, p_bc, p_speak)
        if not at_pause:
            # a slice while they talk: the prefill mattered, and the head's verdict on these words may
            # let the answer start now
            seg.slice_probs = (text, probs)
            self._maybe_answer_early(seg)
            return
        if seg.ended or not self.endpointer.paused or covered < seg.pause_at:
            return
        timings = out.timings
        log.info(
            "session %s turn %d: turn head at pause %.0f ms after it (transcript %.0f ms, listen %.0f ms "
            "+ queue %.0f ms): %s",
            self.session_id,
            seg.turn_id,
            1000 * (self.clock() - self._arrival_time(seg.start_sample + seg.pause_at)),
            1000 * (seg.spec_ready - self._arrival_time(seg.start_sample + seg.pause_at)),
            1000 * timings.get("total_s", 0.0),
            1000 * (self.clock() - job.submitted) - 1000 * timings.get("total_s", 0.0),
            probs,
        )
        self._decide_turn(seg, text, probs)

    def _decide_turn(self, seg: Segment, text: str, probs: tuple[float, float, float]) -> None:
        """The turn head's verdict at a pause: speak, backchannel or listen on."""
        p_listen, p_bc, p_speak = probs
        assert self.stages.policy is not None  # listen jobs run only with turn-taking
        seg.acoustic_hold = False
        if is_bare_cue(text):
            seg.decision, seg.confident_end, seg.end_wait_share = "listen", False, 1.0
        else:
            policy = self.stages.policy
            p_voice = seg.spec_p_complete if text == (seg.spec_final or "") else None
            seg.decision = LABELS[policy.decide_turn(probs)]
            # the words and the voice both say the turn is over: the short hangover
            fast_voice = p_voice if self.options.voice_fast_end else None
            seg.confident_end = policy.confident_end(probs, fast_voice)
            seg.end_wait_share = policy.end_wait_share(probs, fast_voice)
            # the words sound finished, the voice does not: a recogniser often closes a sentence
            # cut off mid-way with a full stop ("what is the capital of" -> "What is the capital?")
            if self.options.acoustic_hold_silence_ms > 0 and policy.acoustic_hold(probs, p_voice):
                seg.acoustic_hold, seg.confident_end = True, False
        shown = {"listen": round(p_listen, 3), "backchannel": round(p_bc, 3), "speak": round(p_speak, 3)}
        if seg.spec_p_complete is not None:
            shown["complete_voice"] = round(seg.spec_p_complete, 3)
        self._emit(TurnDecision, turn_id=seg.turn_id, decision=seg.decision, text=text, probs=shown)
        if seg.decision == "speak":
            if self.response is None and seg.spec_final and not self._speaking():
                self._start_response(seg.turn_id, seg.spec_final, committed=False)
            self._maybe_end_early()
        elif seg.decision == "backchannel":
            self._maybe_backchannel(seg)
            if self.response is None and seg.spec_final and not self._speaking():
                self._start_response(seg.turn_id, seg.spec_final, committed=False)  # if they stop here
            self._maybe_end_early()

    def _maybe_answer_early(self, seg: Segment) -> None:
        """Prepare the answer (speculative, held) from the words so far when the turn head is sure they
        end the turn, so that at the pause the answer is ready if the final transcript agrees."""
        if not self.options.early_answer or self.stages.policy is None or seg.slice_probs is None:
            return
        text, probs = seg.slice_probs
        if seg.ended or seg.overlap or text != seg.partial_text or not text.strip() or is_bare_cue(text):
            return
        if self.response is not None or self._speaking() or self.endpointer.paused:
            return  # at a pause the usual path (final transcript, turn head) is already under way
        policy = self.stages.policy
        if LABELS[policy.decide_turn(probs)] != "speak" or not policy.confident_end(probs):
            return
        log.info(
            "session %s turn %d: preparing the answer to %r while they talk",
            self.session_id,
            seg.turn_id,
            text,
        )
        self._start_response(seg.turn_id, text, committed=False).early = True

    def _drop_early_answer(self, text: str) -> None:
        """Newer words than the early answer was prepared from: it answers the wrong question."""
        resp = self.response
        if resp is not None and resp.early and not resp.committed and resp.user_text != text:
            self.response = None

    def _on_overlap(self, job: Job, out: ListenOutput | OverlapOutput | RespondOutput) -> None:
        assert isinstance(out, OverlapOutput), type(out)
        _, sid, covered = job.tag
        seg = self.segment
        if seg is None or seg.sid != sid or seg.overlap_class is not None:
            return
        interrupt = out.interrupt
        log.info(
            "session %s turn %d: overlap %r -> %s (p=%.2f)",
            self.session_id,
            seg.turn_id,
            seg.spec_final,
            "interruption" if interrupt else "backchannel",
            out.p_interrupt,
        )
        if interrupt:
            seg.overlap_class = "interruption"
            if self._speaking():
                self._interrupt(status="interrupted")
            if seg.ended:
                self._commit_turn(seg)
            elif self.endpointer.paused and seg.spec_valid():
                self._listen(seg, seg.spec_final or "", seg.spec_at, at_pause=True)
        else:
            seg.overlap_class = "backchannel"
            self._resume_playout()
            if seg.ended:
                self._commit_turn(seg)

    def _resume_playout(self) -> None:
        """A held answer goes on (the user only backchanneled, coughed, or nothing was said)."""
        if self.playout.held:
            self.playout.resume(self.clock())
            self.tick()

    def _maybe_end_early(self) -> None:
        """End a turn the turn head called complete once the short hangover has passed (or, at a
        backchannel point, the medium one: they may go on with another sentence)."""
        seg = self.segment
        if not self.turn_taking or seg is None or seg.ended or seg.decision not in ("speak", "backchannel"):
            return
        if not self.endpointer.paused:
            return
        if self.endpointer.run >= SR * self._turn_wait_ms(seg) / 1000:
            for edge in self.endpointer.force_end():
                self._on_edge(edge)

    def _turn_wait_ms(self, seg: Segment) -> int:
        """Silence after the last word before a turn the head judged over is taken (predictive end
        of turn): short when the head is confident, the usual hangover when it is less so, longer at
        a backchannel point (they may go on). `duplex eval eot` draws the trade-off."""
        o = self.options
        if seg.acoustic_hold:  # the words sound finished, the voice did not
            hangover = (
                o.backchannel_turn_silence_ms if seg.decision == "backchannel" else o.end_of_turn_silence_ms
            )
            return max(o.acoustic_hold_silence_ms, hangover)
        if seg.decision == "backchannel":
            return o.backchannel_turn_silence_ms
        if 0 < o.fast_turn_silence_ms < o.end_of_turn_silence_ms:
            if seg.confident_end:
                return o.fast_turn_silence_ms
            # graded: a less sure "complete" waits between the short and the full hangover
            span = o.end_of_turn_silence_ms - o.fast_turn_silence_ms
            return o.fast_turn_silence_ms + round(min(1.0, max(0.0, seg.end_wait_share)) * span)
        return o.end_of_turn_silence_ms

    def _maybe_backchannel(self, seg: Segment) -> None:
        o = self.options
        now = self.clock()
        if not o.backchannels or self._speaking() or "tts" in self._busy:
            return
        if seg.pause_at < SR * o.backchannel_min_turn_ms / 1000:
            return
        if now - self._last_backchannel < o.backchannel_interval_ms / 1000:
            return
        self._last_backchannel = now
        self._submit(
            "tts",
            "tts",
            self.stages.tts.init_state(),
            TtsInput(self.stages.backchannel_text, True, whole=True),
            self.budgets["tts"],
            tag=("bc", next(self._bc_ids)),
        )

    def _on_backchannel_audio(self, out: Any) -> None:
        seg = self.segment
        if (
            (self.response is not None and self.response.committed)
            or self._speaking()
            or seg is None
            or not self.endpointer.paused
        ):
            return  # too late: the user went on or an answer started
        now = self.clock()
        for chunk in out or []:
            if len(chunk.audio):
                self.playout.enqueue(now, chunk.audio, chunk.text)
        self._emit(Backchannel, turn_id=seg.turn_id, text=self.stages.backchannel_text, source="service")
        self.tick()


def _ms(value: Any) -> float | None:
    """A non-negative number of milliseconds from a client event, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        return None
    return float(value)


def _slot(job: Job) -> str:
    """In-flight slots: one job per stage per session, except final transcriptions (own slot)."""
    return "asr.final" if job.label == "asr.final" else job.stage


def _sample_of(arrival: tuple[int, float]) -> int:
    return arrival[0]
