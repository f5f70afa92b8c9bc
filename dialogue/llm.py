"""Streaming LLM stage: a per-session KV cache that follows the chat history, greedy decoding.

Each step either brings a new chat history (`LlmStep.messages`) or continues the current
response. A new history is rendered with the chat template and compared with the tokens already
in the session's cache: the cache is cropped to the longest common prefix and only the rest is
prefilled. Earlier turns are therefore never prefilled twice, and a barge-in costs nothing extra:
the caller passes the history with the assistant message cut where playback stopped.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from duplex.base.config import ComponentConfig, ConfigError
from duplex.base.stage import SequentialBatchMixin

from . import llm_weights

BACKENDS = ("transformers-gguf", "transformers")


@dataclass(frozen=True)
class LlmOptions:
    """Frozen runtime options of the `llm` component (models.yaml `options:`)."""

    #: "int8-dynamic" decodes ~2.5x faster than "bfloat16" on a 2-core AVX-512 CPU at 95 % top-1
    #: agreement with float32 (bfloat16: 99 %); see dialogue/llm_speed.py
    dtype: str = "int8-dynamic"
    max_new_tokens: int = 64
    #: tokens the caller asks for in the first step of a response, then per later step
    first_step_tokens: int = 4
    step_tokens: int = 4
    system_prompt: str = ""
    #: intra-op torch threads while this stage runs; None leaves the process setting alone
    threads: int | None = None
    #: the session KV cache window of the dialogue engine (dialogue/engine.py); unused here
    window_tokens: int = 1536

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> LlmOptions:
        """Validate a models.yaml options mapping; unknown keys raise ConfigError."""
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ConfigError(f"llm: unknown options {sorted(unknown)} (known: {', '.join(sorted(known))})")
        opts = cls(**dict(raw))
        if opts.dtype not in llm_weights.DTYPES:
            raise ConfigError(f"llm: dtype {opts.dtype!r} is not one of {', '.join(llm_weights.DTYPES)}")
        for name in ("max_new_tokens", "first_step_tokens", "step_tokens"):
            if int(getattr(opts, name)) < 1:
                raise ConfigError(f"llm: {name} must be >= 1")
        if opts.threads is not None and int(opts.threads) < 1:
            raise ConfigError("llm: threads must be >= 1 or null")
        return opts


@dataclass
class LlmStep:
    """One step: a new chat history (system prompt excluded) or None to continue; token budget."""

    messages: list[dict[str, str]] | None = None
    max_tokens: int = 4


@dataclass
class LlmOutput:
    """Text decoded in this step (complete characters only) and bookkeeping."""

    text: str
    done: bool
    n_tokens: int
    prefill_tokens: int
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class LlmState:
    """Per-session state. Invariant: `cache` holds exactly the keys/values of `ids`."""

    cache: DynamicCache
    ids: list[int] = field(default_factory=list)
    #: next-token logits after ids[-1]; None when not computed yet
    logits: torch.Tensor | None = None
    #: generated tokens not yet run through the model (forwarded lazily, at the next step)
    pending: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    emitted_chars: int = 0
    done: bool = True


def text_delta(
    tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], emitted_chars: int, final: bool
) -> tuple[str, int]:
    """New text of `ids` beyond `emitted_chars`; an incomplete UTF-8 tail is held back unless final."""
    text = tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)
    end = len(text)
    if not final:
        # byte-level tokens can split a character; its bytes decode to U+FFFD until complete
        while end > emitted_chars and text[end - 1] == "\ufffd":
            end -= 1
    if end <= emitted_chars:
        return "", emitted_chars
    return text[emitted_chars:end], end


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """EOS and the chat end markers (<|im_end|>, <|endoftext|>) of a tokenizer."""
    ids = {tokenizer.eos_token_id}
    for special in ("<|im_end|>", "<|endoftext|>"):
        i = tokenizer.convert_tokens_to_ids(special)
        if isinstance(i, int) and i != tokenizer.unk_token_id:
            ids.add(i)
    return frozenset(i for i in ids if isinstance(i, int))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@contextmanager
def _torch_threads(n: int | None) -> Iterator[None]:
    # torch's intra-op pool is process-wide: set it only around our own work, then restore
    if n is None or torch.get_num_threads() == n:
        yield
        return
    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


class LlmStage(SequentialBatchMixin[LlmState, LlmStep, LlmOutput]):
    """Greedy chat decoding with a rolling-back KV cache; one instance serves every session."""

    kind = "llm"

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        options: LlmOptions | Mapping[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.options = options if isinstance(options, LlmOptions) else LlmOptions.from_mapping(options or {})
        self.stop_ids = stop_token_ids(tokenizer)
        # read-only template state: the system prompt prefilled once (see warm_state)
        self._warm: LlmState | None = None

    # -- prompt -------------------------------------------------------------------------

    def system_messages(self) -> list[dict[str, str]]:
        """The system message the stage puts before every history (none if the prompt is empty)."""
        p = self.options.system_prompt.strip()
        return [{"role": "system", "content": p}] if p else []

    def render(self, messages: Sequence[Mapping[str, str]], generation_prompt: bool = True) -> list[int]:
        """Token ids of system prompt + history through the chat template."""
        msgs = [dict(m) for m in messages]
        for m in msgs:
            if m.get("role") not in ("system", "user", "assistant") or not isinstance(m.get("content"), str):
                raise ValueError(
                    f"llm: bad chat message {m!r}; need role system/user/assistant and str content"
                )
        if not msgs or msgs[0]["role"] != "system":
            msgs = self.system_messages() + msgs
        text = self.tokenizer.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=generation_prompt
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # -- state ----------------------------------------------------------------------------

    def _empty_state(self) -> LlmState:
        return LlmState(cache=DynamicCache(config=self.model.config))

    def warm_state(self) -> LlmState:
        """Prefill the system prompt once; init_state() then hands each session a copy."""
        state = self._empty_state()
        sys_msgs = self.system_messages()
        if sys_msgs:
            ids = self.render(sys_msgs, generation_prompt=False)
            with torch.inference_mode(), _torch_threads(self.options.threads):
                self._forward(state, ids)
        self._warm = state
        return state

    def init_state(self) -> LlmState:
        """A new session: a private copy of the warm state (or an empty cache)."""
        if self._warm is None:
            return self._empty_state()
        with torch.inference_mode():
            return copy.deepcopy(self._warm)

    # -- model ----------------------------------------------------------------------------

    def _forward(self, state: LlmState, ids: Sequence[int]) -> None:
        pos = len(state.ids)
        input_ids = torch.tensor([list(ids)], dtype=torch.long)
        out = self.model(
            input_ids=input_ids,
            past_key_values=state.cache,
            use_cache=True,
            cache_position=torch.arange(pos, pos + len(ids)),
            logits_to_keep=1,  # the lm_head over every prefill position would be wasted work
        )
        state.logits = out.logits[0, -1].float()
        state.ids.extend(ids)

    def _sync(self, state: LlmState, target: list[int]) -> int:
        """Roll the cache back to its common prefix with `target` and prefill the rest."""
        # keep one token to prefill so the logits of the last position are fresh
        keep = min(common_prefix(state.ids, target), len(target) - 1)
        if keep < len(state.ids):
            state.cache.crop(keep - state.cache.get_seq_length())
            del state.ids[keep:]
        state.pending.clear()
        state.response_ids.clear()
        state.emitted_chars = 0
        state.done = False
        rest = target[keep:]
        self._forward(state, rest)
        return len(rest)

    def step(self, state: LlmState, chunk: LlmStep) -> tuple[LlmOutput, LlmState]:
        """Sync to a new history if given, then decode up to `chunk.max_tokens` tokens (in place)."""
        t0 = time.perf_counter()
        prefill_n = 0
        new: list[int] = []
        with torch.inference_mode(), _torch_threads(self.options.threads):
            if chunk.messages is not None:
                prefill_n = self._sync(state, self.render(chunk.messages))
            t1 = time.perf_counter()
            limit = self.options.max_new_tokens
            while not state.done and len(new) < chunk.max_tokens:
                if state.pending:
                    self._forward(state, state.pending)
                    state.pending = []
                assert state.logits is not None
                tok = int(torch.argmax(state.logits))
                if tok in self.stop_ids:
                    state.done = True
                    break
                state.response_ids.append(tok)
                state.pending = [tok]
                new.append(tok)
                if len(state.response_ids) >= limit:
                    state.done = True
        t2 = time.perf_counter()
        text, state.emitted_chars = text_delta(
            self.tokenizer, state.response_ids, state.emitted_chars, final=state.done
        )
        timings = {"prefill_s": t1 - t0, "decode_s": t2 - t1, "total_s": time.perf_counter() - t0}
        return LlmOutput(text, state.done, len(new), prefill_n, timings), state

    def generate(self, messages: list[dict[str, str]], state: LlmState | None = None) -> str:
        """Offline convenience: the whole reply to `messages`, in the stage's own step sizes."""
        state = state if state is not None else self.init_state()
        out, state = self.step(state, LlmStep(messages, self.options.first_step_tokens))
        parts = [out.text]
        while not out.done:
            out, state = self.step(state, LlmStep(None, self.options.step_tokens))
            parts.append(out.text)
        return "".join(parts)


def load_llm_stage(component: ComponentConfig, progress: bool = True) -> LlmStage:
    """Prepare and load the weights of an `llm` component and prefill its system prompt."""
    if component.backend not in BACKENDS:
        raise ConfigError(f"llm: backend {component.backend!r} is not one of {', '.join(BACKENDS)}")
    options = LlmOptions.from_mapping(component.options)
    model, tok = llm_weights.load(component.weights, options.dtype, progress=progress)
    stage = LlmStage(model, tok, options)
    stage.warm_state()
    return stage
