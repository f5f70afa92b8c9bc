"""The learned verifier of the relay: may the drafter's first words be spoken before the slow model?

When the user's turn ends, a fast drafter (SmolLM2-135M-Instruct) greedily drafts the first few
words of the answer. Speaking them at once hides the slow model's (Qwen2.5-0.5B) time to first
word, but a bad opening ("I'm sorry, but as an AI…", an echo of the question, another language)
cannot be taken back once it is audible. The verifier reads what the drafter already computed
while drafting (its per-token final-norm hidden states and three per-token statistics: entropy,
log-probability of the chosen token, top-1 minus top-2 logit margin) and returns
P(prefix is acceptable). At or above the shipped threshold the prefix is committed to TTS and the
slow model continues from it; below it the slow model answers alone.

This module is what the engine imports, so the drafting procedure lives here as a pure function
(`draft`): training (dialogue/training/train_verifier.py) and the engine then draft, stop and cut exactly
alike, and the verifier never sees features from a procedure it was not trained on.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dialogue.llm import stop_token_ids
from duplex.base.cues import opens_with_cue
from duplex.base.errors import ModelError

__all__ = [
    "MAX_DRAFT_TOKENS",
    "MAX_DRAFT_WORDS",
    "Draft",
    "Verifier",
    "WEIGHTS_DIR",
    "chat_ids",
    "complete_words",
    "draft",
    "draft_stop",
    "ends_sentence",
    "load_verifier",
    "prefix_ends_word",
    "prefix_text",
    "stop_token_ids",
    "token_stats",
]

#: the drafter stops once its draft holds this many complete words (the TTS's first phrase is 3 words:
#: a longer draft only delays the first audio, and a shorter one leaves the slow model to finish it)
MAX_DRAFT_WORDS = 3
#: ... or after this many tokens, whatever it holds (bounds the drafter's time)
MAX_DRAFT_TOKENS = 12
WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
DEFAULT_WEIGHTS = WEIGHTS_DIR / "verifier.safetensors"
#: fields load_verifier() requires in the metadata file; the engine checks models against them
REQUIRED_METADATA = ("threshold", "hidden_size", "dim", "drafter", "slow_model", "label_rule", "heldout")

# -- per-token statistics -------------------------------------------------------------------------


def token_stats(logits: torch.Tensor, chosen: int) -> tuple[float, float, float]:
    """(entropy of softmax(logits) in nats, log-prob of `chosen`, top-1 minus top-2 logit).

    Computed in float32 whatever the model's dtype, because the verifier was trained on float32
    statistics and bf16 rounding of near-tied logits would move the margin feature.
    """
    x = logits.detach().reshape(-1).float()
    logp = torch.log_softmax(x, dim=-1)
    entropy = float(-(logp.exp() * logp).sum())
    top = torch.topk(x, 2).values if x.numel() > 1 else torch.cat([x, x.new_full((1,), -math.inf)])
    margin = float(top[0] - top[1]) if x.numel() > 1 else math.inf
    return entropy, float(logp[int(chosen)]), margin


# -- words, stopping and cutting ----------------------------------------------------------------------

#: characters that join two word characters into one word (I'm, well-known)
_JOINERS = "'\u2019-"
#: closing punctuation kept after the last complete word of a committed prefix ("Sure," "Hello!")
_CLOSING = ".,!?;:\u2026)]}\"\u201d\u2019'"


def _is_word_char(c: str) -> bool:
    return c.isalnum() or c == "_"


def complete_words(text: str, ended: bool = False) -> list[tuple[int, int]]:
    """Spans (start, end) of the complete words of `text`.

    A word is a run of letters/digits, joined across apostrophes and hyphens (I'm, well-known) and
    across . or , between digits (3.5, 1,000). It is complete once followed by a space or other
    punctuation; a trailing joiner ("well-", "I'", "3.") leaves it open because the next token may
    continue it. `ended` (the drafter chose EOS) completes the last word: nothing will follow it.
    """
    spans: list[tuple[int, int]] = []
    n = len(text)
    i = 0
    while i < n:
        if not _is_word_char(text[i]):
            i += 1
            continue
        j = i
        open_end = False
        while j < n:
            c = text[j]
            if _is_word_char(c):
                j += 1
                continue
            joiner = c in _JOINERS or (c in ".," and text[j - 1].isdigit())
            if joiner and j + 1 == n:
                open_end = True  # "well-" / "I'" / "3." at the end: may still continue
                break
            if c in _JOINERS and _is_word_char(text[j + 1]):
                j += 1
                continue
            if c in ".," and text[j - 1].isdigit() and text[j + 1].isdigit():
                j += 1
                continue
            break
        if ended or (j < n and not open_end):
            spans.append((i, j))
        i = j + 1 if j < n else n
    return spans


def ends_sentence(text: str) -> bool:
    """Whether the draft ends a sentence with . ! or ? (a '.' right after a digit may be a decimal point)."""
    t = text.rstrip()
    if not t or t[-1] not in ".!?":
        return False
    return not (t[-1] == "." and len(t) > 1 and t[-2].isdigit())


def draft_stop(
    text: str, n_tokens: int, max_words: int = MAX_DRAFT_WORDS, max_tokens: int = MAX_DRAFT_TOKENS
) -> bool:
    """Whether drafting stops after this decoded draft of `n_tokens` tokens (EOS is checked by the caller).

    Stops at `max_words` complete words (enough to start speaking; the slow model says the rest),
    at a sentence end (a full short answer), or at `max_tokens` (bounds the drafter's time).
    """
    if n_tokens >= max_tokens:
        return True
    if ends_sentence(text):
        return True
    return len(complete_words(text)) >= max_words


def prefix_text(text: str, ended: bool = False, max_words: int = MAX_DRAFT_WORDS) -> str:
    """The committed prefix: the draft cut back to its last complete word (at most `max_words`).

    Closing punctuation right after that word is kept ("Sure," "Hello!"); a half word never is,
    because the slow model would have to finish a word it did not choose and TTS would say it wrong.
    """
    words = complete_words(text, ended=ended)[:max_words]
    if not words:
        return ""
    end = words[-1][1]
    while end < len(text) and text[end] in _CLOSING:
        end += 1
    return text[:end].strip()


def prefix_ends_word(draft: str, prefix: str, ended: bool) -> bool:
    """Whether the committed `prefix` of `draft` ends where the drafter started a new word (or ended).

    Then its last word is complete and can be spoken at once; the TTS's phrase rule counts a word
    as complete only once a space follows it, so the engine sends such a prefix with that space.
    """
    if not prefix:
        return False
    rest = draft.strip()
    if not rest.startswith(prefix):
        return False
    rest = rest[len(prefix) :]
    if rest:
        return rest[:1].isspace()
    # the draft stopped right after the prefix: at the end of turn, or on a clause / sentence mark
    # (drafting stops once the last word is complete, and "day," or "Certainly!" is complete: in
    # English a space follows such a mark; a "." after a digit may be a decimal point)
    return ended or (prefix[-1] in ",;:!?" or ends_sentence(prefix))


# -- drafting -----------------------------------------------------------------------------------------


def chat_ids(tokenizer: Any, system: str, history: Sequence[Mapping[str, str]], text: str) -> list[int]:
    """Token ids of [system] + history + [user text] with the model's own chat template.

    Drafter and slow model both see this same chat, each through its own template, so the prefix
    the drafter commits is an answer to the conversation the slow model will continue.
    """
    msgs = [{"role": "system", "content": system}] if system else []
    msgs += [{"role": m["role"], "content": m["content"]} for m in history]
    msgs.append({"role": "user", "content": text})
    rendered = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(rendered, add_special_tokens=False))


@dataclass
class Draft:
    """A greedy draft: its tokens and text, the per-token features, and the committed prefix."""

    tokens: list[int]
    text: str
    #: [T, H] float32: final-norm hidden state at the position whose logits chose each token
    hidden: torch.Tensor
    #: [T, 3] float32: entropy, log-prob of the chosen token, top1-top2 margin
    stats: torch.Tensor
    #: the drafter chose EOS (the draft is a whole answer)
    ended: bool
    prefix: str


def _last_hidden(model: Any, ids: Sequence[int], cache: Any, pos: int) -> torch.Tensor:
    from dialogue.fast_decoder import decoder_hidden

    return decoder_hidden(model, ids, cache, pos)[:, -1:]  # [1, 1, H]: the quantized lm_head wants >= 2 dims


def draft(
    model: Any,
    tokenizer: Any,
    ids: Sequence[int],
    cache: Any = None,
    stop_ids: frozenset[int] | None = None,
    max_words: int = MAX_DRAFT_WORDS,
    max_tokens: int = MAX_DRAFT_TOKENS,
) -> Draft:
    """Greedy draft after the prompt `ids` with the features the verifier reads.

    At each step: logits = lm_head(h) of the final-norm hidden state h at the last position, in
    float32; the argmax is chosen; h and `token_stats` are recorded for it. Stops before a stop
    token (EOS, <|im_end|>), or once `draft_stop` says so. `cache`, if given, must hold exactly the
    keys/values of ids[:cache.get_seq_length()] (a warm system prompt); it is extended in place.
    """
    from transformers import DynamicCache

    if cache is None:
        cache = DynamicCache(config=model.config)
    done = cache.get_seq_length()
    if not 0 <= done < len(ids):
        raise ValueError(f"draft: cache holds {done} positions, prompt has {len(ids)} tokens")
    stops = stop_token_ids(tokenizer) if stop_ids is None else stop_ids
    tokens: list[int] = []
    hidden: list[torch.Tensor] = []
    stats: list[tuple[float, float, float]] = []
    ended = False
    text = ""
    with torch.inference_mode():
        h = _last_hidden(model, ids[done:], cache, done)
        pos = len(ids)
        while True:
            logits = model.lm_head(h)[0, -1].float()
            tok = int(torch.argmax(logits))
            if tok in stops:
                ended = True
                break
            tokens.append(tok)
            hidden.append(h[0, -1].float().clone())
            stats.append(token_stats(logits, tok))
            text = tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            if draft_stop(text, len(tokens), max_words, max_tokens):
                break
            h = _last_hidden(model, [tok], cache, pos)
            pos += 1
    size = int(model.config.hidden_size)
    return Draft(
        tokens=tokens,
        text=text,
        hidden=torch.stack(hidden) if hidden else torch.zeros(0, size),
        stats=torch.tensor(stats, dtype=torch.float32).reshape(-1, 3),
        ended=ended,
        prefix=prefix_text(text, ended=ended, max_words=max_words),
    )


# -- the verifier -------------------------------------------------------------------------------------


class Verifier(nn.Module):
    """P(prefix acceptable) from the drafter's per-token hidden states and statistics.

    RelayS2S-style: the hidden state is projected to `dim` and gated per token by the three
    statistics (a confident token and an unsure one with the same hidden state mean different
    things), attention pooling over the draft's tokens picks the tokens that matter (the opening
    word and any unsure one), and a small head outputs a sigmoid. Masked-pooled summaries of the
    statistics (mean, min) and the draft length join the pooled vector: they are the classic
    confidence signals, made cheap to use. ~88K parameters at H=576 (RelayS2S: <= ~170K).
    """

    def __init__(self, hidden_size: int, dim: int = 128, head_dim: int = 64, dropout: float = 0.1) -> None:
        super().__init__()
        self.hidden_size = int(hidden_size)
        self.dim = int(dim)
        self.norm = nn.LayerNorm(hidden_size)
        self.proj = nn.Linear(hidden_size, dim)
        self.gate = nn.Sequential(nn.Linear(3, 32), nn.GELU(), nn.Linear(32, dim))
        self.score = nn.Linear(dim, 1)
        self.head = nn.Sequential(
            nn.Linear(dim + 7, head_dim), nn.GELU(), nn.Dropout(dropout), nn.Linear(head_dim, 1)
        )
        self.drop = nn.Dropout(dropout)
        # statistics are standardised with the training set's mean/std (saved with the weights)
        self.register_buffer("stats_mean", torch.zeros(3))
        self.register_buffer("stats_std", torch.ones(3))

    def set_stats_norm(self, stats: torch.Tensor, mask: torch.Tensor) -> None:
        """Fit the statistics standardisation on the real (unpadded) tokens of a training set."""
        real = stats[mask.bool()]
        real = torch.nan_to_num(real, nan=0.0, posinf=50.0, neginf=-50.0)
        self.stats_mean.copy_(real.mean(0))
        self.stats_std.copy_(real.std(0).clamp(min=1e-3))

    def logits(self, hidden: torch.Tensor, stats: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Pre-sigmoid scores [B] (what the loss trains)."""
        m = mask.bool()
        mf = m.unsqueeze(-1)
        # padded positions may hold anything (even NaN): zero them so they cannot leak through 0 * x
        hidden = torch.where(mf, hidden.float(), 0.0)
        s = torch.nan_to_num(stats.float(), nan=0.0, posinf=50.0, neginf=-50.0)
        s = torch.where(mf, (s - self.stats_mean) / self.stats_std, 0.0)
        x = self.proj(self.drop(self.norm(hidden))) * torch.sigmoid(self.gate(s))
        a = self.score(torch.tanh(x)).squeeze(-1).masked_fill(~m, -1e9)
        w = torch.softmax(a, dim=-1) * m  # all-padded rows give w = 0, not NaN
        pooled = (w.unsqueeze(-1) * x).sum(1)
        n = m.sum(1, keepdim=True).clamp(min=1)
        s_mean = s.sum(1) / n
        s_min = torch.where(mf, s, math.inf).amin(1)
        s_min = torch.where(m.any(1, keepdim=True), s_min, 0.0)
        length = m.sum(1, keepdim=True).float() / MAX_DRAFT_TOKENS
        return self.head(torch.cat([pooled, s_mean, s_min, length], dim=-1)).squeeze(-1)

    def forward(self, hidden: torch.Tensor, stats: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """hidden [B,T,H], stats [B,T,3], mask [B,T] (1 = real token) -> P(acceptable) [B]."""
        if hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"verifier expects hidden size {self.hidden_size}, got {hidden.shape[-1]}")
        return torch.sigmoid(self.logits(hidden, stats, mask))

    def score_draft(self, d: Draft) -> float:
        """P(acceptable) of one `Draft` (0.0 when nothing was drafted)."""
        if d.hidden.shape[0] == 0:
            return 0.0
        with torch.inference_mode():
            mask = torch.ones(1, d.hidden.shape[0])
            return float(self(d.hidden[None], d.stats[None], mask)[0])


def load_verifier(
    path: str | Path | None = None, hidden_size: int | None = None
) -> tuple[Verifier, float, dict[str, Any]]:
    """Load (verifier in eval mode, threshold, metadata) from X.safetensors + X.json.

    `hidden_size`, when given (the drafter's config.hidden_size), must match the trained one:
    a verifier trained on another drafter's hidden states would output confident nonsense.
    """
    from safetensors.torch import load_file

    weights = Path(path) if path is not None else DEFAULT_WEIGHTS
    meta_path = weights.with_suffix(".json")
    hint = "train it with `python -m dialogue.training.train_verifier` (writes both files)"
    if not weights.is_file() or not meta_path.is_file():
        missing = [str(p) for p in (weights, meta_path) if not p.is_file()]
        raise ModelError(f"relay verifier: missing {', '.join(missing)}; {hint}")
    try:
        meta = json.loads(meta_path.read_text())
    except ValueError as exc:
        raise ModelError(f"relay verifier: {meta_path} is not valid JSON ({exc}); {hint}") from exc
    absent = [k for k in REQUIRED_METADATA if k not in meta]
    if absent:
        raise ModelError(f"relay verifier: {meta_path} lacks {', '.join(absent)}; {hint}")
    if hidden_size is not None and int(hidden_size) != int(meta["hidden_size"]):
        raise ModelError(
            f"relay verifier: trained on hidden size {meta['hidden_size']} "
            f"({meta['drafter'].get('name', '?')}), but the drafter has {hidden_size}; {hint}"
        )
    threshold = float(meta["threshold"])
    if not 0.0 < threshold < 1.0:
        raise ModelError(f"relay verifier: threshold {threshold} in {meta_path} is not in (0, 1)")
    model = Verifier(int(meta["hidden_size"]), dim=int(meta["dim"]), head_dim=int(meta.get("head_dim", 64)))
    try:
        state = load_file(str(weights))
        model.load_state_dict(state)
    except Exception as exc:  # wrong shapes, truncated file: one message with the fix
        raise ModelError(
            f"relay verifier: cannot load {weights} ({type(exc).__name__}: {exc}); {hint}"
        ) from exc
    model.eval()
    return model, threshold, meta


def commit_threshold(p: Sequence[float] | torch.Tensor, fraction: float) -> float:
    """The highest threshold that commits at least `fraction` of the drafts scored `p` (midway to
    the next lower score, so a score equal to it still commits)."""
    s = sorted((float(x) for x in torch.as_tensor(p).reshape(-1).tolist()), reverse=True)
    if not s:
        return 0.5
    k = min(len(s) - 1, max(0, math.ceil(fraction * len(s)) - 1))
    lower = s[k + 1] if k + 1 < len(s) else s[k]
    return float((s[k] + lower) / 2)


class RollingThreshold:
    """Commit the drafts the verifier scores above the lowest (1 - `commit`) of the latest `window`
    scores: the verifier picks which drafts to drop, the share dropped stays put however the scores
    of a population of prompts shift (new prompts score lower than the validation ones). Seeded
    with `prior` scores (the validation drafts'); shared by the sessions of one engine."""

    def __init__(self, prior: Sequence[float], commit: float, window: int) -> None:
        import collections
        import threading

        if not 0.0 < commit <= 1.0 or window < 1:
            raise ValueError(f"rolling threshold: commit {commit} must be in (0, 1] and window {window} >= 1")
        self.commit = float(commit)
        self.window = int(window)
        self.prior = tuple(float(x) for x in prior)
        self._scores: collections.deque[float] = collections.deque(
            (float(x) for x in prior), maxlen=self.window
        )
        self._lock = threading.Lock()

    @classmethod
    def from_rule(cls, rule: Mapping[str, Any]) -> RollingThreshold:
        """From a `rolling` entry of the verifier's metadata: {commit, window, prior}."""
        return cls(rule["prior"], float(rule["commit"]), int(rule["window"]))

    @property
    def rule(self) -> dict[str, Any]:
        """The rule it started from (what `from_rule` reads)."""
        return {"commit": self.commit, "window": self.window, "prior": list(self.prior)}

    def threshold(self) -> float:
        with self._lock:
            return commit_threshold(list(self._scores), self.commit) if self._scores else 0.0

    def observe(self, p: float) -> None:
        with self._lock:
            self._scores.append(float(p))


def named_operating_points(meta: Mapping[str, Any]) -> dict[str, float | dict[str, Any]]:
    """The operating points stored with the verifier: "balanced" (its tuned `threshold`), the other
    `thresholds`, and a `rolling` rule ({commit, window, prior}) in place of a threshold of that name."""
    named: dict[str, float | dict[str, Any]] = {"balanced": float(meta["threshold"])}
    named |= {k: float(v) for k, v in (meta.get("thresholds") or {}).items()}
    return named | {k: dict(v) for k, v in (meta.get("rolling") or {}).items()}


# -- rules a draft fails whatever its scores (labels and the engine's veto) ---------------------------


def is_foreign(text: str) -> bool:
    """Letters outside Latin (CJK, Cyrillic, ...): not what an English phone service should say."""
    return any(c.isalpha() and ord(c) > 0x24F for c in text)


def is_markup(text: str) -> bool:
    """Code fences, markdown or line breaks: the system prompt forbids them and TTS cannot say them."""
    t = text.lstrip()
    return "`" in t or "\n" in t or t[:1] in ("#", "*", "-", "|", ">") or "**" in t


def words(text: str) -> list[str]:
    """The complete words of `text`, lower case, apostrophes unified."""
    return [text[a:b].lower().replace("\u2019", "'") for a, b in complete_words(text, ended=True)]


def repeats_question(prefix: str, question: str) -> bool:
    """The prefix echoes the user instead of answering.

    Either it restates the question from its start (its first >= 3 words are the question's first
    words: "Remind me to take my", "In which film did") or it contains the whole question ("Hey
    how's it going?"). Turning the question's noun phrase into a statement ("The capital of France
    is", "The lowest army rank of") is how answers start, so that is left to the slow model's scores.
    """
    pw, qw = words(prefix), words(question)
    if len(pw) < 2 or not qw:
        return False
    k = min(len(pw), len(qw))
    if k >= 3 and pw[:k] == qw[:k]:
        return True
    n = len(qw)
    return n >= 2 and any(pw[i : i + n] == qw for i in range(len(pw) - n + 1))


def repeats_previous_answer(prefix: str, previous: str | None) -> bool:
    """The draft opens with the words the previous answer opened with (>= 2 of them). A small
    drafter copies an interrupted answer's opening ("The dragon is a" after the caller cut off
    "The dragon is a fierce and ... " with "stop, what is two plus two?"), and the slow model,
    continuing it, copies the rest. A follow-up that legitimately starts the same way ("The capital
    of ...") only loses the draft's head start."""
    pw, aw = words(prefix), words(previous or "")
    return len(pw) >= 2 and aw[: len(pw)] == pw


_FUNCTION_WORDS = frozenset(
    "a an the is are was were be been being am i you he she it we they me my your his her its our their this "
    "that these those of in on at to for with by from and or but so as if then than there here what which who "
    "whom whose when where why how do does did done can could would should will shall may might must not no "
    "yes just very really also about into over under up down out off again more most some any all each both "
    "few many much such only own same too don't it's i'm let's that's there's okay ok please stop wait hold "
    "hang sorry excuse actually well oh one".split()
)


def _content(text: str) -> set[str]:
    """Content words, crudely stemmed (a plural 's' dropped), so "trucks" meets "truck"."""
    out = set()
    for w in words(text):
        w = w.strip("'")
        if len(w) >= 3 and w not in _FUNCTION_WORDS and any(c.isalpha() for c in w):
            out.add(w[:-1] if len(w) > 3 and w.endswith("s") and not w.endswith("ss") else w)
    return out


#: words a grounded draft may say that the caller did not: they carry no fact of their own. The function
#: words less those that answer, count or apologise ("yes", "no", "not", "one", "sorry": "I'm sorry, but
#: I" opens a refusal) and the first person (below), plus auxiliaries and connectives ("has", "equals")
#: and the openers of a reply that is not a fact ("Sure,", "Of course,", "I'm doing well").
_GROUND_FREE = (_FUNCTION_WORDS - {"yes", "no", "not", "one", "sorry", "excuse"}) | frozenset(
    "has have had having equals equal sure certainly okay ok well oh hello hi hey thanks thank course "
    "glad happy here's let let's doing fine good great".split()
)
#: the speaker's own person: a draft in it answers as the service ("I live on the" to "Which planet do
#: we live on?", "I'm a color." to "What colour do you get when you mix red and white?"), which a
#: grounded draft may only do when the caller spoke to the service ("How are you?", "Can you ...")
_FIRST_PERSON = frozenset("i i'm i've i'll i'd my mine myself".split())
_TO_SERVICE = frozenset("your yours yourself you're you've".split())
_ASKS_SERVICE = frozenset("are can could would will have did were about thank".split())
_YOU_VERBS = frozenset("like love think know feel want remember prefer enjoy believe mean understand".split())
_SPELLING = {"colour": "color", "favourite": "favorite", "grey": "gray", "centre": "center", "metre": "meter"}


def _forms(word: str) -> set[str]:
    """A word and the forms it may take with a plural or third-person ending, British spellings unified:
    "makes" meets "make", "bees" "bee", "flies" "fly", "colour" "color"."""
    w = _SPELLING.get(word, word)
    out = {w}
    if len(w) > 3 and w.endswith("s") and not w.endswith("ss"):
        out.add(w[:-1])
        if w.endswith("es"):
            out.add(w[:-2])
        if w.endswith("ies"):
            out.add(w[:-3] + "y")
    return out


def addresses_service(said: Sequence[str]) -> bool:
    """The caller speaks to the service ("How are you?", "Can you ...", "What's your name?", "Do you like
    ..."), not of people in general ("What colour do you get when you mix ...?")."""
    if _TO_SERVICE & set(said):
        return True
    for i, w in enumerate(said):
        if w != "you":
            continue
        before = said[i - 1] if i else ""
        after = said[i + 1] if i + 1 < len(said) else ""
        if before in _ASKS_SERVICE or after == "are" or (before in ("do", "don't") and after in _YOU_VERBS):
            return True
    return False


def grounded_prefix(prefix: str, user_text: str, min_words: int = 2) -> str:
    """The longest head of `prefix` that states nothing the caller did not say (`relay_check:
    grounded`), or "" when that is under `min_words` words.

    Every word of the head is the caller's own (up to a plural or verb ending and British spelling: "Bees
    are", "A cow makes a" to "What sound does a cow make?", "Grass is a color") or one that carries no fact
    (`_GROUND_FREE`); the first person only where the caller spoke to the service. So a committed draft
    restates the question and the slow model says the fact, and the drafter's slips stay out of the
    answer whoever the slow model is ("Bees are made of" to "What do bees make?" becomes "Bees are"; "The
    sky is black" becomes "The sky is"; "The barber is a" to "Which animal barks?" and "I'm a color." are
    not committed). The head ends where a word of the draft ends, with the punctuation that closes it."""
    said = words(user_text)
    own = set().union(*(_forms(w) for w in said)) if said else set()
    addressed = addresses_service(said)
    end, kept = 0, 0
    for a, b in complete_words(prefix, ended=True):
        w = prefix[a:b].lower().replace("\u2019", "'")
        if w in _FIRST_PERSON:
            ok = addressed
        else:
            ok = w in _GROUND_FREE or bool(_forms(w) & own)
        if not ok:
            break
        end, kept = b, kept + 1
    if kept < min_words:
        return ""
    while end < len(prefix) and prefix[end] in _CLOSING:
        end += 1
    return prefix[:end].strip()


def carries_interrupted_topic(
    prefix: str, user_text: str | None, previous: str | None, previous_request: str | None = None
) -> bool:
    """After a barge-in cue, the draft goes on about the answer the caller cut off: it shares a content
    word with that answer (or with the request it answered) and none with the caller's new words ("The
    car engine works" after "Stop. How many days are in a year?" cut off "A car engine is ..."; the slow
    model, continuing it, said "The car engine works 365 days."; "The story about a" after "Tell me a
    long story about a brave little mouse" and "Stop. What is two plus two?"). A follow-up on the same
    topic names it ("Wait, why does the engine need oil?") and is left to the scores; a wrong veto only
    loses the draft's head start."""
    if not user_text or not (previous or previous_request) or not opens_with_cue(user_text):
        return False
    draft = _content(prefix)
    topic = _content(previous or "") | _content(previous_request or "")
    return bool(draft & topic) and not draft & _content(user_text)


def draft_veto(
    prefix: str,
    previous_answer: str | None = None,
    user_text: str | None = None,
    previous_request: str | None = None,
) -> str | None:
    """Why the engine must not commit this draft whatever the verifier says (None if nothing):
    another script, markup, a repeat of the previous answer's opening, or, after a barge-in cue, the
    topic of the previous exchange (`previous_request`, `previous_answer`) instead of the caller's new one. (An echo of the question, a negative label
    in training, is not vetoed: "Good evening!" to "good evening" and "Saudi Arabia imports ..." are the
    slow model's own openings too.)"""
    if is_foreign(prefix):
        return "foreign"
    if is_markup(prefix):
        return "markup"
    if repeats_previous_answer(prefix, previous_answer):
        return "repeat"
    if carries_interrupted_topic(prefix, user_text, previous_answer, previous_request):
        return "topic"
    return None
