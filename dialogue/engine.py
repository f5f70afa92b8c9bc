"""The duplex dialogue engine: one `llm` stage that listens, decides when to speak, and answers
through a relay of a fast drafter and a slow model.

Per session it keeps two conversations in session KV caches (`dialogue.conversation`): the
drafter's (SmolLM2-135M) and the slow model's (the profile's `llm`, in-process), or a client of an
OpenAI-compatible server for the slow model. Steps (all run on the device executor, never on the
event loop):

* `ListenStep(messages, text)`: the user is talking and the ASR has `text` so far. Both caches get
  the open user message (only what changed since the last slice is prefilled; a revised partial
  rolls back to the first changed token). The turn head reads the drafter's hidden state at the
  last word: P(LISTEN), P(BACKCHANNEL), P(SPEAK).
* `OverlapStep(text)`: the user spoke while the service was speaking; the overlap head says
  backchannel (keep talking) or interruption (stop).
* `RespondStep(messages, max_tokens)`: the first step of an answer drafts up to five words with the
  drafter, the verifier scores the draft, and a committed prefix is returned at once; later steps
  (`messages=None`) continue with the slow model from the committed prefix, so the utterance is
  one answer. A discarded draft costs only the draft: the slow model answers alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from dialogue import llm_weights
from dialogue.conversation import ChatRenderer, Conversations, Piece, Track, TrackMark, pieces_for
from dialogue.fast_decoder import ACTIVATION_SCALES
from dialogue.kv_cache import CachedLM
from dialogue.llm import LlmOptions, stop_token_ids, text_delta
from duplex.base.config import RELAY_CHECKS, ComponentConfig, ConfigError
from duplex.base.devices import Threads, check_threads, torch_threads
from duplex.base.messages import (
    ListenOutput,
    ListenStep,
    OverlapOutput,
    OverlapStep,
    RelayInfo,
    RespondOutput,
    RespondStep,
)
from duplex.base.stage import SequentialBatchMixin

log = logging.getLogger("duplex.dialogue")

LISTEN, BACKCHANNEL, SPEAK = 0, 1, 2


# -- options ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlowOptions(LlmOptions):
    """Options of the slow model (the `llm` component): the LLM stage's, plus the cache's eviction step."""

    evict_chunk: int = 64
    #: sessions batched together (`DialogueStage.step_batch`) quantise their int8 activations each
    #: with its own scale: their tokens then equal one-by-one decoding's, at a cost in throughput;
    #: off, a batch shares one scale and a near-tie may decode differently than alone
    per_session_quant: bool = False
    #: how the int8 products scale their input rows: "tensor" (one scale for all the tokens read in one
    #: forward, torch's dynamic quantisation) or "token" (each token on its own scale, as a one-token
    #: decode step has it; dialogue/fast_decoder.py). Slow model only: the drafter's heads and verifier
    #: were trained on its per-tensor arithmetic
    activation_scale: str = "tensor"
    #: appended to `system_prompt` for the slow model only: the drafter, the turn-taking heads and the
    #: verifier keep the prompt they were trained with (their hidden states depend on it)
    slow_instructions: str = ""
    #: restate the caller's earlier facts about themselves in the third person on a later question about
    #: the caller, as the slow model reads it (dialogue/caller_notes.py): "What is my dog called?" was
    #: answered "You're Max!"
    caller_notes: bool = True
    #: intra-op threads for the steps the answer's onset waits on: the listen step at a pause (the
    #: drafter and the turn heads read the final transcript) and the answer's first step. The recogniser
    #: has just finished and the voice has nothing to say yet, so on a 2-core machine the other core is
    #: idle then; None: `threads` for every step. Leave it None where other sessions share the cores.
    pause_threads: Threads = None

    @property
    def slow_system_prompt(self) -> str:
        return " ".join(p for p in (self.system_prompt.strip(), self.slow_instructions.strip()) if p)

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], what: str = "llm") -> SlowOptions:
        return _options(cls, raw, what)


@dataclass(frozen=True)
class DrafterOptions:
    """Options of the `drafter` component: the fast path, the heads and the verifier."""

    dtype: str = "int8-dynamic"
    #: draft the first words of each answer; false: the slow model answers alone
    relay: bool = True
    draft_words: int = 3
    draft_tokens: int = 12
    #: layers kept + LoRA deltas over the base weights (dialogue/drafter_adapter.py): "shipped" = the
    #: distilled drafter in dialogue/weights (what the shipped heads and verifier read), a path, or
    #: null for the stock model
    adapter: str | None = "shipped"
    #: turn-taking heads and relay verifier weights; "shipped" = the files in dialogue/weights
    heads: str = "shipped"
    verifier: str = "shipped"
    #: the verifier's operating point: a name stored with its weights ("balanced": macro-F1 on the
    #: validation drafts, the default; "latency": commits enough drafts for the onset P90), or a number
    verifier_threshold: float | str | None = None
    window_tokens: int = 1024
    evict_chunk: int = 64
    #: sessions batched together (`DialogueStage.step_batch`) quantise their int8 activations each
    #: with its own scale: their tokens then equal one-by-one decoding's, at a cost in throughput;
    #: off, a batch shares one scale and a near-tie may decode differently than alone
    per_session_quant: bool = False
    #: who decides what of a draft is spoken: "exact" (the slow model reads the draft in one forward
    #: and only the tokens it would have chosen itself are kept, then it goes on from its own next
    #: token: the answer is the slow model's, started sooner), "verifier" (the learned verifier
    #: commits a draft's first words or none, and the slow model continues them) or "grounded" (the
    #: verifier, and only the draft's head that restates the caller's words is committed:
    #: `verifier.grounded_prefix`; no fact can come from the drafter, and the slow model is not waited on)
    relay_check: str = "verifier"
    #: where the drafter, the turn heads and the verifier run: "cpu", "cuda" or "cuda:N" (as `llm`'s)
    device: str = "cpu"

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], what: str = "drafter") -> DrafterOptions:
        return _options(cls, raw, what)


def _options(cls: Any, raw: Mapping[str, Any], what: str) -> Any:
    known = {f.name for f in fields(cls)}
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"{what}: unknown options {sorted(unknown)} (known: {', '.join(sorted(known))})")
    opts = cls(**dict(raw))
    if getattr(opts, "dtype", "float32") not in llm_weights.DTYPES:
        raise ConfigError(f"{what}: dtype {opts.dtype!r} is not one of {', '.join(llm_weights.DTYPES)}")
    llm_weights.check_device(opts.device, opts.dtype, what)
    for name in ("max_new_tokens", "first_step_tokens", "step_tokens", "draft_words", "draft_tokens"):
        if hasattr(opts, name) and int(getattr(opts, name)) < 1:
            raise ConfigError(f"{what}: {name} must be >= 1")
    if int(opts.window_tokens) < 128:
        raise ConfigError(f"{what}: window_tokens must be >= 128")
    for name in ("threads", "pause_threads"):
        check_threads(getattr(opts, name, None), what, name)
    if getattr(opts, "activation_scale", "tensor") not in ACTIVATION_SCALES:
        raise ConfigError(
            f"{what}: activation_scale must be one of {', '.join(ACTIVATION_SCALES)}, got {opts.activation_scale!r}"
        )
    if getattr(opts, "relay_check", "exact") not in RELAY_CHECKS:
        raise ConfigError(
            f"{what}: relay_check must be one of {', '.join(RELAY_CHECKS)}, got {opts.relay_check!r}"
        )
    return opts


# -- steps and outputs -----------------------------------------------------------------------


#: the most tokens a first step decodes while waiting for a speakable first phrase
FIRST_PHRASE_MAX_TOKENS = 16


@dataclass
class DialogueState:
    """Per-session state: the drafter's and the slow model's conversations and the answer."""

    drafter: Track | None
    slow: Track | None
    remote: Any = None  # RemoteStream of the answer in progress (slow model on a server)
    response_ids: list[int] = field(default_factory=list)
    emitted_chars: int = 0
    pending: list[int] = field(default_factory=list)  # generated, not yet fed to the slow cache
    prefix: str = ""  # committed draft, not yet given to the slow model
    #: the prefix went out with its word-ending space: drop one leading space of what follows it
    seam_space: bool = False
    messages: list[dict[str, str]] | None = None  # the answer's history (for the slow model's sync)
    done: bool = True
    #: the slow cache ends with this answer (a listen step in between moves it to the user's words)
    answer_live: bool = False


@dataclass(frozen=True)
class _AnswerMark:
    """The decoding side of a session's answer at one moment (see `DialogueStage._restore`)."""

    n_ids: int
    pending: tuple[int, ...]
    emitted_chars: int
    seam_space: bool
    done: bool

    @classmethod
    def of(cls, state: DialogueState) -> _AnswerMark:
        return cls(
            len(state.response_ids), tuple(state.pending), state.emitted_chars, state.seam_space, state.done
        )

    def restore(self, state: DialogueState) -> None:
        del state.response_ids[self.n_ids :]
        state.pending = list(self.pending)
        state.emitted_chars, state.seam_space, state.done = self.emitted_chars, self.seam_space, self.done


# -- the stage -------------------------------------------------------------------------------


class DialogueStage(SequentialBatchMixin[DialogueState, Any, Any]):
    """Listen / overlap / respond steps over a drafter and a slow model; one instance, many sessions."""

    kind = "llm"

    def __init__(
        self,
        slow_model: Any,
        slow_tokenizer: Any,
        slow_options: SlowOptions,
        drafter_model: Any = None,
        drafter_tokenizer: Any = None,
        drafter_options: DrafterOptions | None = None,
        heads: Any = None,
        policy: Any = None,
        verifier: Any = None,
        verifier_threshold: float = 0.5,
        remote: Any = None,
    ) -> None:
        self.slow_options = slow_options
        self.drafter_options = drafter_options or DrafterOptions()
        self.system_prompt = slow_options.system_prompt.strip()
        self.remote = remote
        self.slow: Conversations | None = None
        self.slow_tokenizer = slow_tokenizer
        if slow_model is not None:
            r = ChatRenderer(slow_tokenizer, slow_options.slow_system_prompt)
            lm = CachedLM(
                slow_model,
                sink_tokens=len(r.system_ids),
                window_tokens=slow_options.window_tokens,
                evict_chunk=slow_options.evict_chunk,
                act_scale=slow_options.activation_scale,
            )
            self.slow = Conversations(lm, r, per_session_quant=slow_options.per_session_quant)
            self.slow_stop = stop_token_ids(slow_tokenizer)
        self.drafter: Conversations | None = None
        self.drafter_tokenizer = drafter_tokenizer
        if drafter_model is not None:
            r = ChatRenderer(drafter_tokenizer, self.system_prompt)
            o = self.drafter_options
            lm = CachedLM(
                drafter_model,
                sink_tokens=len(r.system_ids),
                window_tokens=o.window_tokens,
                evict_chunk=o.evict_chunk,
            )
            self.drafter = Conversations(lm, r, per_session_quant=o.per_session_quant)
            self.drafter_stop = stop_token_ids(drafter_tokenizer)
        self.heads = heads
        self.policy = policy
        self.verifier = verifier
        self.verifier_threshold = verifier_threshold
        #: the verifier's metadata (named operating points, training numbers); load_dialogue_stage sets it
        self.verifier_meta: dict[str, Any] = {}
        #: a rolling operating point (verifier.RollingThreshold) replacing the fixed threshold
        self.rolling_threshold: Any = None
        if self.slow is None and self.remote is None:
            raise ValueError("the dialogue engine needs a slow model: in-process or remote")

    # -- state ------------------------------------------------------------------------------

    def init_state(self) -> DialogueState:
        with torch.inference_mode():
            return DialogueState(
                drafter=self.drafter.new_track() if self.drafter else None,
                slow=self.slow.new_track() if self.slow else None,
            )

    @property
    def listens(self) -> bool:
        """Turn-taking heads are loaded (the session core asks ListenSteps only then)."""
        return self.drafter is not None and self.heads is not None

    # -- steps ------------------------------------------------------------------------------

    def step(self, state: DialogueState, chunk: Any) -> tuple[Any, DialogueState]:
        with torch.inference_mode(), torch_threads(self.threads_for(chunk)):
            if isinstance(chunk, ListenStep):
                return self._listen(state, chunk), state
            if isinstance(chunk, OverlapStep):
                return self._overlap(chunk), state
            if _responds(chunk):
                return self._respond(state, chunk), state
        raise TypeError(f"dialogue engine: unknown step {type(chunk).__name__}")

    def step_batch(self, items: Sequence[tuple[DialogueState, Any]]) -> list[tuple[Any, DialogueState]]:
        """Several sessions' steps, the same kinds together: listen steps share the batched feeds of
        their drafter and slow-model prefills, answer continuations decode token by token with one
        batched forward per token; other steps (first steps, overlap) run one by one. Each session
        gets what `step` gives it (on an int8 model up to the batch's shared activation scale, see
        `CachedLM.feed_batch`). On an exception nothing is caught: the executor re-runs the batch
        job by job, so listen steps are idempotent and a failed decode restores its sessions."""
        if len(items) < 2 or len({id(s) for s, _ in items}) < len(items):
            return [self.step(state, chunk) for state, chunk in items]
        listen = [i for i, (_, c) in enumerate(items) if isinstance(c, ListenStep)]
        decode = [i for i, (_, c) in enumerate(items) if self._continues(c)]
        batched = set(listen) | set(decode)
        out: list[tuple[Any, DialogueState] | None] = [None] * len(items)
        with torch.inference_mode(), torch_threads(self.slow_options.threads):
            if listen:
                results = self._listen_batch([(items[i][0], items[i][1]) for i in listen])
                for i, o in zip(listen, results, strict=True):
                    out[i] = (o, items[i][0])
            for i, (state, chunk) in enumerate(items):
                if i not in batched:
                    out[i] = self.step(state, chunk)
            # last: a continuation is the one step that is not idempotent, so if anything before it
            # raises, the executor's one-by-one re-run finds it untouched
            if decode:
                decoded = self._decode_batch([(items[i][0], items[i][1]) for i in decode])
                for i, o in zip(decode, decoded, strict=True):
                    out[i] = (o, items[i][0])
        assert all(o is not None for o in out)
        return [o for o in out if o is not None]

    def threads_for(self, chunk: Any) -> Threads:
        """Intra-op threads for `chunk`: `pause_threads` for a listen step at a pause (it does not prefill
        the slow model) and an answer's first step, else `threads`."""
        o = self.slow_options
        if o.pause_threads is None:
            return o.threads
        urgent = (isinstance(chunk, ListenStep) and not chunk.prefill_slow) or (
            _responds(chunk) and chunk.messages is not None
        )
        return o.pause_threads if urgent else o.threads

    def _continues(self, chunk: Any) -> bool:
        """An answer's continuation decoded by the in-process slow model (batchable)."""
        return _responds(chunk) and chunk.messages is None and self.remote is None and self.slow is not None

    def _listen(self, state: DialogueState, step: ListenStep) -> ListenOutput:
        return self._listen_batch([(state, step)])[0]

    def _listen_batch(self, items: Sequence[tuple[DialogueState, ListenStep]]) -> list[ListenOutput]:
        from dialogue.turn_taking import normalize_user_text

        t0 = time.perf_counter()
        drafter, slow = self.drafter, self.slow
        n = len(items)
        # every target first: a bad message raises before any session moved
        turn: list[list[Piece] | None] = [None] * n
        closed: list[list[Piece] | None] = [None] * n
        slow_target: list[list[Piece] | None] = [None] * n
        for i, (state, step) in enumerate(items):
            text = normalize_user_text(step.text)
            if drafter is not None and state.drafter is not None and text:
                # the drafter reads ASR text without punctuation (the heads and the verifier were trained so)
                turn[i] = pieces_for(drafter.renderer, _normalized(step.messages), open_user=text)
                preclose = self.drafter_options.relay if step.preclose is None else step.preclose
                if preclose and self.verifier is not None:
                    # ~15 ms of the drafter per slice, off the critical path; what _draft syncs to
                    msgs = step.messages + [{"role": "user", "content": step.text}]
                    closed[i] = pieces_for(drafter.renderer, _normalized(msgs), answer_prefix="")
            if slow is not None and state.slow is not None and text and step.prefill_slow:
                # time-sliced prefill of the slow model too, so its answer starts with little left to read
                slow_target[i] = pieces_for(
                    slow.renderer, self._slow_messages(step.messages), open_user=step.text.strip()
                )
        for state, _ in items:
            self._close_remote(state)
        fed = [0] * n
        probs = [(1.0, 0.0, 0.0)] * n
        if drafter is not None:
            for i, k in self._sync_each(drafter, [s.drafter for s, _ in items], turn):
                fed[i] += k
                if self.heads is not None:
                    h = _track(items[i][0].drafter).cache.hidden
                    assert h is not None
                    p = self.heads.turn(h.float()).tolist()
                    probs[i] = (float(p[0]), float(p[1]), float(p[2]))
            for i, k in self._sync_each(drafter, [s.drafter for s, _ in items], closed):
                fed[i] += k
        t1 = time.perf_counter()
        for state, _ in items:
            state.answer_live = False
        if slow is not None:
            for i, k in self._sync_each(slow, [s.slow for s, _ in items], slow_target):
                fed[i] += k
        t2 = time.perf_counter()
        timings = {"drafter_s": t1 - t0, "slow_s": t2 - t1, "total_s": t2 - t0}
        return [ListenOutput(probs[i], fed[i], dict(timings)) for i in range(n)]

    @staticmethod
    def _sync_each(
        conv: Conversations, tracks: Sequence[Track | None], targets: Sequence[list[Piece] | None]
    ) -> list[tuple[int, int]]:
        """(index, tokens fed) of each track that has a target, synced together."""
        idx = [i for i, t in enumerate(targets) if t is not None]
        if not idx:
            return []
        fed = conv.sync_batch([_track(tracks[i]) for i in idx], [_pieces(targets[i]) for i in idx])
        return list(zip(idx, fed, strict=True))

    def _overlap(self, step: OverlapStep) -> OverlapOutput:
        from dialogue.turn_taking import normalize_user_text

        t0 = time.perf_counter()
        if self.drafter is None or self.heads is None:
            return OverlapOutput(1.0, True, {"total_s": 0.0})
        text = normalize_user_text(step.text)
        if not text:
            return OverlapOutput(0.0, False, {"total_s": time.perf_counter() - t0})
        track = self.drafter.new_track()
        self.drafter.sync(track, pieces_for(self.drafter.renderer, [], open_user=text))
        h = track.cache.hidden
        assert h is not None
        p = float(self.heads.overlap(h.float()))
        thr = float(getattr(self.policy, "interrupt_threshold", 0.5))
        return OverlapOutput(p, p >= thr, {"total_s": time.perf_counter() - t0})

    def _respond(self, state: DialogueState, step: Any) -> RespondOutput:
        if self._continues(step):
            return self._decode_batch([(state, step)])[0]
        t0 = time.perf_counter()
        relay_info: RelayInfo | None = None
        prefill = 0
        checked = False  # the slow model has read (and kept what it agrees with of) the draft
        # the answer's first words (dialogue/caller_notes.py): they go out with the first words the
        # slow model adds to them, unlike a committed draft, which goes out on its own step
        lead = ""
        if step.messages is not None:
            self._close_remote(state)
            msgs = [m for m in step.messages if m.get("role") != "system"]
            state.messages = msgs
            state.response_ids, state.emitted_chars, state.pending = [], 0, []
            state.prefix, state.done, state.answer_live, state.seam_space = "", False, False, False
            relay = self.drafter_options.relay if getattr(step, "relay", None) is None else bool(step.relay)
            lead = self._answer_lead(msgs)
            if lead:  # no draft to relay
                state.prefix, relay = lead, False
            if relay and self.drafter is not None and self.verifier is not None and state.drafter is not None:
                relay_info = self._draft(
                    state, msgs, getattr(step, "commit", None), grounded=self._relay_check(step) == "grounded"
                )
                if self._exact_relay(step):
                    relay_info, prefill = self._check_draft(state, relay_info)
                    checked = True
                elif relay_info.committed:
                    from dialogue.verifier import prefix_ends_word

                    state.prefix = relay_info.prefix
                    # with its space the TTS can speak the last word now instead of after the slow step
                    state.seam_space = prefix_ends_word(relay_info.draft, relay_info.prefix, relay_info.ended)
                    t = relay_info.draft_s
                    return RespondOutput(
                        relay_info.prefix + (" " if state.seam_space else ""),
                        False,
                        0,
                        0,
                        {"draft_s": t, "prefill_s": 0.0, "decode_s": 0.0, "total_s": t},
                        relay_info,
                    )
        t1 = time.perf_counter()
        if state.done:
            return RespondOutput("", True, 0, 0, {"total_s": 0.0})
        if self.remote is not None:
            text, n = self._remote_step(state, step.max_tokens)
        else:
            if (
                not checked
                and state.messages is not None
                and (step.messages is not None or not state.answer_live)
            ):
                prefill = self._slow_sync(state)
            words = int(getattr(step, "phrase_words", 0) or 0) if step.messages is not None else 0
            if words:
                # token by token until the TTS can start: a fixed step would overshoot, or stop short
                # and cost a whole further step before the first audio
                from duplex.base.phrases import first_phrase_ready

                text, n = (self._emit(state), len(state.response_ids)) if checked else (lead, 0)
                while not (
                    state.done or n >= FIRST_PHRASE_MAX_TOKENS or first_phrase_ready(text, False, words)
                ):
                    delta, k = self._slow_decode(state, 1)
                    text, n = text + delta, n + k
            else:
                head = self._emit(state) if checked else lead
                text, n = self._slow_decode(state, step.max_tokens)
                text, n = head + text, n + (len(state.response_ids) if checked else 0)
        text = _after_seam(state, text)
        t2 = time.perf_counter()
        timings = {"prefill_s": t1 - t0, "decode_s": t2 - t1, "total_s": t2 - t0}
        if relay_info is not None:
            timings["draft_s"] = relay_info.draft_s
        return RespondOutput(text, state.done, n, prefill, timings, relay_info)

    # -- relay ------------------------------------------------------------------------------

    def _relay_check(self, step: Any) -> str:
        """The step's relay check (a session option), else the drafter's."""
        return getattr(step, "relay_check", None) or self.drafter_options.relay_check

    def _exact_relay(self, step: Any) -> bool:
        """The slow model checks the draft (rather than the verifier): in-process slow model, and
        no commit forced by an evaluation."""
        return (
            self._relay_check(step) == "exact"
            and self.slow is not None
            and getattr(step, "commit", None) is None
        )

    def _check_draft(self, state: DialogueState, info: RelayInfo) -> tuple[RelayInfo, int]:
        """Speculative check of the draft by the slow model: prefill to the answer's start, read the
        draft's words (in the slow model's tokens) in one forward, keep the longest run of tokens the
        slow model picks itself, and queue its own pick after them. The answer is then token for
        token the slow model's greedy answer; the draft only saves the sequential steps it got right.
        Returns (what was kept, as RelayInfo; tokens prefilled)."""
        from dialogue.verifier import prefix_text

        assert self.slow is not None and state.slow is not None and state.messages is not None
        conv, track = self.slow, state.slow
        words = prefix_text(info.draft, ended=info.ended, max_words=self.drafter_options.draft_words)
        head = conv.renderer.answer_ids("")
        full = conv.renderer.answer_ids(words) if words.strip() else head
        draft_ids = full[len(head) :] if full[: len(head)] == head else []
        checked = None
        if draft_ids:
            # the end of the user's message, the answer's header and the draft in one forward
            target = pieces_for(conv.renderer, self._slow_messages(state.messages), answer_prefix=words)
            checked = conv.sync_checked(track, target, len(draft_ids))
            if checked is None:  # the draft was fed without its picks: back to the answer's start
                conv.take_back(track, len(draft_ids))
        if checked is not None:
            prefill, picks = checked
            prefill -= len(draft_ids)  # tokens of the conversation; the draft's are counted as checked
            state.pending = []
            state.answer_live = True
        else:
            prefill = self._slow_sync(state)  # the answer's start: state.prefix is "" here
            first = track.cache.logits
            assert first is not None
            picks = [int(torch.argmax(first))]
            if draft_ids:
                picks += conv.append_checked(track, draft_ids)
        kept = 0
        while kept < len(draft_ids) and draft_ids[kept] == picks[kept]:
            kept += 1
        conv.take_back(track, len(draft_ids) - kept)
        state.response_ids = list(draft_ids[:kept])
        state.pending = []
        nxt = picks[kept]
        if nxt in self.slow_stop:
            state.done = True
        else:
            state.response_ids.append(nxt)
            state.pending = [nxt]
            if len(state.response_ids) >= self.slow_options.max_new_tokens:
                state.done = True
        state.answer_live = True
        prefix = self.slow_tokenizer.decode(draft_ids[:kept], skip_special_tokens=True)
        checked = RelayInfo(
            info.draft,
            prefix,
            kept / len(draft_ids) if draft_ids else 0.0,
            kept > 0,
            info.draft_s,
            info.ended,
            info.threshold,
            info.veto,
        )
        return checked, prefill

    def relay_draft(self, history: list[dict[str, str]], text: str) -> RelayInfo:
        """The relay's draft of an answer to `text` after `history`, with the verifier's score, as the
        engine makes it when that turn ends; nothing is committed and the rolling threshold does not
        see it (evaluation: scoring stored drafts with another verifier)."""
        if self.drafter is None or self.verifier is None:
            raise ValueError("relay_draft: this engine has no drafter and verifier")
        state = self.init_state()
        with torch.inference_mode(), torch_threads(self.slow_options.threads):
            self._listen(state, ListenStep(history, text, prefill_slow=False, preclose=True))
            return self._draft(state, history + [{"role": "user", "content": text}], force=True)

    def _draft(
        self,
        state: DialogueState,
        msgs: list[dict[str, str]],
        force: bool | None = None,
        grounded: bool = False,
    ) -> RelayInfo:
        """Draft the answer's first words with the drafter and decide what of them is committed: the
        verifier's score against the threshold, the vetoes, and (`grounded`) only the head of the draft
        that restates the caller's words."""
        from dialogue.verifier import draft_stop, draft_veto, grounded_prefix, prefix_text, token_stats

        assert self.drafter is not None and state.drafter is not None
        t0 = time.perf_counter()
        o = self.drafter_options
        conv, track = self.drafter, state.drafter
        conv.sync(track, pieces_for(conv.renderer, _normalized(msgs), answer_prefix=""))
        hidden: list[torch.Tensor] = []
        stats: list[tuple[float, float, float]] = []
        ids: list[int] = []
        ended = False
        user = last_user_text(msgs) or ""
        while len(ids) < o.draft_tokens:
            logits, h = track.cache.logits, track.cache.hidden
            assert logits is not None and h is not None
            tok = int(torch.argmax(logits))
            if tok in self.drafter_stop:
                ended = True
                break
            hidden.append(h.float())
            stats.append(token_stats(logits, tok))
            ids.append(tok)
            text = self.drafter_tokenizer.decode(ids, skip_special_tokens=True)
            if draft_stop(text, len(ids), max_words=o.draft_words, max_tokens=o.draft_tokens):
                break
            conv.append(track, [tok])
        draft = self.drafter_tokenizer.decode(ids, skip_special_tokens=True)
        prefix = prefix_text(draft, ended=ended, max_words=o.draft_words)
        p = 0.0
        rolling = self.rolling_threshold
        thr = self.verifier_threshold if rolling is None else rolling.threshold()
        if hidden and prefix.strip():
            hs = torch.stack(hidden)[None]
            st = torch.tensor(stats, dtype=torch.float32, device=hs.device)[None]
            mask = torch.ones(1, len(stats), device=hs.device)
            p = float(self.verifier(hs, st, mask)[0])
            if rolling is not None and force is None:
                rolling.observe(p)
        veto = (
            draft_veto(prefix, previous_answer(msgs), user, previous_request=previous_request(msgs))
            if prefix.strip()
            else None
        )
        if grounded and prefix.strip() and veto is None:
            # at least the TTS's first phrase, or the committed words would wait for the slow model's
            head = grounded_prefix(prefix, user, min_words=o.draft_words)
            prefix, veto = (head, None) if head else (prefix, "ungrounded")
        committed = bool(prefix.strip()) and (p >= thr and veto is None if force is None else force)
        return RelayInfo(
            draft, prefix if committed else "", p, committed, time.perf_counter() - t0, ended, thr, veto
        )

    # -- slow model -------------------------------------------------------------------------

    def _slow_sync(self, state: DialogueState) -> int:
        assert self.slow is not None and state.slow is not None and state.messages is not None
        # the committed draft, and on a resync (after a listen step) what was decoded already
        said = (
            state.prefix + self.slow_tokenizer.decode(state.response_ids, skip_special_tokens=True)
            if state.response_ids
            else state.prefix
        )
        target = pieces_for(self.slow.renderer, self._slow_messages(state.messages), answer_prefix=said)
        n = self.slow.sync(state.slow, target)
        state.pending = []
        state.answer_live = True
        return n

    def _answer_lead(self, messages: list[dict[str, str]]) -> str:
        """The words the answer must start with ("Your sister"), or "": with caller notes on and the
        slow model in process."""
        if not self.slow_options.caller_notes or self.remote is not None or self.slow is None:
            return ""
        from dialogue.caller_notes import answer_lead

        return answer_lead(messages) or ""

    def _slow_messages(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        """The history as the slow model reads it: with caller notes when they are on."""
        if not self.slow_options.caller_notes:
            return messages
        from dialogue.caller_notes import with_caller_notes

        return with_caller_notes(messages)

    def _slow_decode(self, state: DialogueState, max_tokens: int) -> tuple[str, int]:
        assert self.slow is not None and state.slow is not None
        new = 0
        while not state.done and new < max_tokens:
            if state.pending:
                self.slow.append(state.slow, state.pending)
                state.pending = []
            new += self._next_token(state)
        return self._emit(state), new

    def _next_token(self, state: DialogueState) -> int:
        """Pick the next answer token from the slow cache's logits (it is fed on the next step, so a
        step that ends the answer costs no forward); 0 when the answer ended instead."""
        assert state.slow is not None
        logits = state.slow.cache.logits
        assert logits is not None
        tok = int(torch.argmax(logits))
        if tok in self.slow_stop:
            state.done = True
            return 0
        state.response_ids.append(tok)
        state.pending = [tok]
        if len(state.response_ids) >= self.slow_options.max_new_tokens:
            state.done = True
        return 1

    def _emit(self, state: DialogueState) -> str:
        text, state.emitted_chars = text_delta(
            self.slow_tokenizer, state.response_ids, state.emitted_chars, state.done
        )
        return text

    def _decode_batch(self, items: Sequence[tuple[DialogueState, Any]]) -> list[RespondOutput]:
        """Continuations (`RespondStep(None, max_tokens)`) of several sessions' answers, token by
        token with one batched forward of the slow model per token; a session leaves the batch at
        its stop token, `max_new_tokens` or its `max_tokens`. A session alone decodes as `step`."""
        slow = self.slow
        assert slow is not None
        t0 = time.perf_counter()
        for state, _ in items:  # a broken state fails the batch before any session moved
            if not isinstance(state, DialogueState) or state.slow is None:
                raise ValueError("dialogue engine: a continuation needs a session with a slow-model cache")
        t1 = time.perf_counter()
        live = [i for i, (state, _) in enumerate(items) if not state.done]
        prefill = [0] * len(items)
        for i in live:
            state = items[i][0]
            if state.messages is not None and not state.answer_live:
                prefill[i] = self._slow_sync(state)  # a listen step moved the cache: back to the answer
        marks = [(slow.mark(_track(items[i][0].slow)), _AnswerMark.of(items[i][0])) for i in live]
        new = [0] * len(items)
        try:
            active = live
            while True:
                active = [i for i in active if not items[i][0].done and new[i] < items[i][1].max_tokens]
                if not active:
                    break
                feeding = [i for i in active if items[i][0].pending]
                if feeding:
                    slow.append_batch(
                        [_track(items[i][0].slow) for i in feeding], [items[i][0].pending for i in feeding]
                    )
                    for i in feeding:
                        items[i][0].pending = []
                for i in active:
                    new[i] += self._next_token(items[i][0])
            texts = {i: _after_seam(items[i][0], self._emit(items[i][0])) for i in live}
        except BaseException:
            for i, (mark, answer) in zip(live, marks, strict=True):
                self._restore(items[i][0], mark, answer)
            raise
        t2 = time.perf_counter()
        out = []
        for i, (state, _) in enumerate(items):
            if i not in texts:
                out.append(RespondOutput("", True, 0, 0, {"total_s": 0.0}))
                continue
            timings = {"prefill_s": t1 - t0, "decode_s": t2 - t1, "total_s": t2 - t0}
            out.append(RespondOutput(texts[i], state.done, new[i], prefill[i], timings))
        return out

    def _restore(self, state: DialogueState, mark: TrackMark, answer: _AnswerMark) -> None:
        """Undo a failed batch's decoding of one session, so the executor's re-run decodes the same
        tokens; where the window scrolled meanwhile only the cache is made consistent, and the
        re-run goes on from the tokens decoded already (they are emitted then, none lost)."""
        assert self.slow is not None and state.slow is not None
        try:
            if self.slow.restore(state.slow, mark):
                answer.restore(state)
        except Exception:  # the session that broke the batch may not restore; its re-run fails alone
            log.exception("could not restore a session after a failed decode batch")

    def _remote_step(self, state: DialogueState, max_tokens: int) -> tuple[str, int]:
        if state.remote is None:
            assert state.messages is not None
            state.remote = self.remote.start(state.messages, prefix=state.prefix)
        text, done = state.remote.read(max_tokens)
        if done:
            state.done = True
            self._close_remote(state)
        return text, len(text.split())

    def _close_remote(self, state: DialogueState) -> None:
        if state.remote is not None:
            try:
                state.remote.close()
            finally:
                state.remote = None

    # -- offline convenience ----------------------------------------------------------------

    def generate(
        self, messages: list[dict[str, str]], state: DialogueState | None = None, relay: bool | None = None
    ) -> tuple[str, RelayInfo | None]:
        """The whole reply to `messages` in the stage's own step sizes, and what the relay did."""
        state = state if state is not None else self.init_state()
        out, state = self.step(state, RespondStep(messages, self.slow_options.first_step_tokens, relay))
        parts, info = [out.text], out.relay
        while not out.done:
            out, state = self.step(state, RespondStep(None, self.slow_options.step_tokens))
            parts.append(out.text)
        return "".join(parts), info


def _responds(chunk: Any) -> bool:
    """A step of an answer: a RespondStep, or any step with `max_tokens` that is not a listen or overlap
    step (what older callers send)."""
    return isinstance(chunk, RespondStep) or (
        hasattr(chunk, "max_tokens") and not isinstance(chunk, (ListenStep, OverlapStep))
    )


def _after_seam(state: DialogueState, text: str) -> str:
    """The slow model's text after a committed prefix that went out with its word-ending space."""
    if state.seam_space and text:
        text = text[1:] if text[0] == " " else text
        state.seam_space = False
    return text


def _track(track: Track | None) -> Track:
    assert track is not None
    return track


def _pieces(target: list[Piece] | None) -> list[Piece]:
    assert target is not None
    return target


def previous_answer(messages: list[dict[str, str]]) -> str | None:
    """The last assistant message (what the caller heard of it), if any."""
    return next((m["content"] for m in reversed(messages) if m.get("role") == "assistant"), None)


def previous_request(messages: list[dict[str, str]]) -> str | None:
    """The caller's turn before the last assistant message (what that answer answered), if any."""
    seen_answer = False
    for m in reversed(messages):
        if m.get("role") == "assistant":
            seen_answer = True
        elif m.get("role") == "user" and seen_answer:
            return m["content"]
    return None


def last_user_text(messages: list[dict[str, str]]) -> str | None:
    """The caller's turn being answered (the last user message), if any."""
    return next((m["content"] for m in reversed(messages) if m.get("role") == "user"), None)


def _normalized(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """User messages as the drafter sees them (ASR text without punctuation)."""
    from dialogue.turn_taking import normalize_user_text

    return [
        {"role": m["role"], "content": normalize_user_text(m["content"])} if m.get("role") == "user" else m
        for m in messages
    ]


# -- loading ---------------------------------------------------------------------------------


def load_dialogue_stage(
    llm: ComponentConfig, drafter: ComponentConfig | None, progress: bool = True
) -> DialogueStage:
    """The engine of a profile: its `llm` (slow model, in-process or `openai-chat`) and optional
    `drafter` component (fast path, turn-taking heads, relay verifier)."""
    slow_model = slow_tok = remote = None
    if llm.backend == "openai-chat":
        from dialogue.remote_llm import RemoteChatLlm, RemoteLlmOptions

        ropts = RemoteLlmOptions.from_mapping(llm.options)
        remote = RemoteChatLlm(ropts)
        slow_options = SlowOptions(system_prompt=ropts.system_prompt, max_new_tokens=ropts.max_tokens)
    elif llm.backend in ("transformers-gguf", "transformers"):
        slow_options = SlowOptions.from_mapping(llm.options)
        slow_model, slow_tok = llm_weights.load(
            llm.weights, slow_options.dtype, progress=progress, device=slow_options.device, what="llm"
        )
    else:
        raise ConfigError(
            f"llm: backend {llm.backend!r} is not one of transformers-gguf, transformers, openai-chat"
        )
    d_model = d_tok = heads = policy = verifier = verifier_meta = rolling = None
    d_opts = None
    threshold = 0.5
    if drafter is not None:
        if drafter.backend not in ("transformers-gguf", "transformers"):
            raise ConfigError(
                f"drafter: backend {drafter.backend!r} is not one of transformers-gguf, transformers"
            )
        d_opts = DrafterOptions.from_mapping(drafter.options)
        # before the heads, verifier and weights are read: a GPU profile on a CPU-only host fails here
        d_device = llm_weights.require_device(d_opts.device, "drafter")
        from dialogue.drafter_adapter import adapter_path, check_trained_with, load_drafter
        from dialogue.turn_taking import load_turn_heads
        from dialogue.verifier import load_verifier

        adapter = adapter_path(d_opts.adapter)
        heads, policy, heads_meta = load_turn_heads(
            None if d_opts.heads == "shipped" else _path(d_opts.heads)
        )
        verifier, threshold, verifier_meta = load_verifier(
            None if d_opts.verifier == "shipped" else _path(d_opts.verifier)
        )
        # both read the drafter's hidden states: a mismatch would give confident nonsense, so refuse it
        check_trained_with("the turn-taking heads", heads_meta, adapter)
        check_trained_with("the relay verifier", verifier_meta, adapter)
        trained_words = (verifier_meta.get("draft_rule") or {}).get("max_words")
        if trained_words is not None and int(trained_words) != d_opts.draft_words:
            log.warning(
                "drafter: draft_words is %d but the verifier was trained on %d-word drafts; its scores "
                "are then less reliable (retrain it or set draft_words: %d)",
                d_opts.draft_words,
                int(trained_words),
                int(trained_words),
            )
        d_model, d_tok = load_drafter(
            drafter.weights, d_opts.dtype, adapter, progress=progress, device=d_opts.device
        )
        # the heads and the verifier read the drafter's hidden states where they are computed
        heads, verifier = heads.to(d_device), verifier.to(d_device)
        threshold, rolling = verifier_operating_point(verifier_meta, d_opts.verifier_threshold)
    stage = DialogueStage(
        slow_model, slow_tok, slow_options, d_model, d_tok, d_opts, heads, policy, verifier, threshold, remote
    )
    stage.verifier_meta = verifier_meta or {}
    stage.rolling_threshold = rolling
    return stage


def verifier_operating_point(meta: Mapping[str, Any], choice: float | str | None) -> tuple[float, Any]:
    """(threshold, rolling rule or None) for `choice`: None or "balanced" (the tuned threshold),
    another name stored in the metadata (`thresholds`; one with a `rolling` rule, like "latency",
    keeps a share of drafts committed rather than a number), or a number in [0, 1]."""
    from dialogue.verifier import RollingThreshold, named_operating_points

    named = named_operating_points(meta)
    if choice is None:
        return float(named["balanced"]), None
    if isinstance(choice, str):
        try:
            choice = float(choice)
        except ValueError:
            if choice not in named:
                raise ConfigError(
                    f"drafter: verifier_threshold {choice!r} is not a number in [0, 1] or one of "
                    f"the verifier's operating points: {', '.join(sorted(named))}"
                ) from None
            point = named[choice]
            if not isinstance(point, dict):
                return point, None
            rolling = RollingThreshold.from_rule(point)
            return rolling.threshold(), rolling
    if not 0.0 <= float(choice) <= 1.0:
        raise ConfigError(f"drafter: verifier_threshold {choice} is not in [0, 1]")
    return float(choice), None


def _path(p: str) -> Any:
    from pathlib import Path

    return Path(p).expanduser()
