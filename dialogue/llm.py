"""What the dialogue engine shares with its decoders: the LLM options (models.yaml `llm`), UTF-8-safe
text deltas and the tokenizer's stop tokens (the scoped torch thread count is `duplex.base.devices.torch_threads`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from transformers import PreTrainedTokenizerBase

from duplex.base.config import ConfigError
from duplex.base.devices import check_threads

from . import llm_weights

BACKENDS = ("transformers-gguf", "transformers")


@dataclass(frozen=True)
class LlmOptions:
    """Frozen runtime options of the `llm` component (models.yaml `options:`)."""

    #: "int8-dynamic" decodes ~2.5x faster than "bfloat16" on a 2-core AVX-512 CPU at 95 % top-1
    #: agreement with float32 (bfloat16: 99 %)
    dtype: str = "int8-dynamic"
    max_new_tokens: int = 64
    #: tokens the caller asks for in the first step of a response, then per later step
    first_step_tokens: int = 4
    step_tokens: int = 4
    system_prompt: str = ""
    #: intra-op torch threads while this stage runs; None leaves the process setting alone; "auto": the
    #: cores free when each step starts (`duplex.base.devices.resolve_threads`: two threads on a core another
    #: process holds made each token ~6x slower)
    threads: int | str | None = None
    #: the session KV cache window of the dialogue engine (dialogue/engine.py); unused here
    window_tokens: int = 1536
    #: where the model runs: "cpu", "cuda" or "cuda:N" (CUDA wants dtype bfloat16 or float16;
    #: int8-dynamic is CPU-only); a missing GPU fails at load, never falls back silently
    device: str = "cpu"

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
        llm_weights.check_device(opts.device, opts.dtype, "llm")
        for name in ("max_new_tokens", "first_step_tokens", "step_tokens"):
            if int(getattr(opts, name)) < 1:
                raise ConfigError(f"llm: {name} must be >= 1")
        check_threads(opts.threads, "llm")
        return opts


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
