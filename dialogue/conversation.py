"""A conversation kept in one model's session KV cache, message by message.

The session core owns the chat history as text (what was said and heard). Each model of the
dialogue engine keeps that history in its KV cache (`dialogue.kv_cache`): the system prompt is the
attention sink, older turns scroll out of a rolling window, and nothing is ever prefilled twice.
`Track.sync` makes the cache hold a target conversation by rolling back to the first token that
differs and feeding only what follows, so:

* the user's words can be fed slice by slice while they speak (an *open* user message, no end
  marker), and a revised partial transcript rolls back to the first changed token;
* a draft or a generated answer that was discarded or cut at a barge-in is rolled back to the
  words that were kept;
* an answer that was spoken as generated costs one end-of-message marker.

Messages are rendered one at a time with the model's own chat template (every template we ship
starts a message with a special token, so per-message tokenization equals whole-chat tokenization),
so a step costs time in proportion to what changed, not to the length of the conversation.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dialogue.kv_cache import CachedLM, LmCache

_SENTINEL = "\u2063SENTINEL\u2063"


class ChatRenderer:
    """Token ids of the pieces of a chat in one tokenizer's template."""

    def __init__(self, tokenizer: Any, system_prompt: str) -> None:
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt.strip()
        sys_msgs = [{"role": "system", "content": self.system_prompt}]
        base = self._template(sys_msgs, generation=False)
        self.system_ids = self.encode(base)
        self._base = base
        gen = self._template(sys_msgs, generation=True)
        if not gen.startswith(base):
            raise ValueError("chat template: the generation prompt does not extend the system message")
        self.generation_ids = self.encode(gen[len(base) :])
        self._memo: OrderedDict[tuple[str, str, bool], tuple[int, ...]] = OrderedDict()
        self._header: dict[str, str] = {}
        self._suffix: dict[str, str] = {}
        for role in ("user", "assistant"):
            piece = self._piece(role, _SENTINEL)
            i = piece.find(_SENTINEL)
            if i < 0:
                raise ValueError(f"chat template drops the content of {role} messages")
            self._header[role] = piece[:i]
            self._suffix[role] = piece[i + len(_SENTINEL) :]

    def _template(self, msgs: list[dict[str, str]], generation: bool) -> str:
        return str(self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation))

    def _piece(self, role: str, content: str) -> str:
        full = self._template(
            [{"role": "system", "content": self.system_prompt}, {"role": role, "content": content}], False
        )
        if not full.startswith(self._base):
            raise ValueError(
                "chat template renders the system message differently when followed by a message"
            )
        return full[len(self._base) :]

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def message_ids(self, role: str, content: str, complete: bool = True) -> list[int]:
        """One message; an incomplete one has no end marker (the user is still talking, or the
        assistant's answer is still being generated). Memoised: every step renders the history."""
        key = (role, content, complete)
        hit = self._memo.get(key)
        if hit is not None:
            self._memo.move_to_end(key)
            return list(hit)
        if role not in self._header:
            raise ValueError(f"bad chat role {role!r}; need user or assistant")
        ids = self.encode(self._header[role] + content + (self._suffix[role] if complete else ""))
        self._memo[key] = tuple(ids)
        if len(self._memo) > 4096:
            self._memo.popitem(last=False)
        return ids

    def answer_ids(self, prefix: str = "") -> list[int]:
        """The generation prompt followed by the first words of the answer (a committed draft)."""
        return self.generation_ids + (self.encode(prefix) if prefix else [])


@dataclass
class Piece:
    """One fed message: its identity (role, content, complete) and its tokens."""

    key: tuple[Any, ...]
    ids: list[int]
    #: token count, kept when `ids` are dropped after the piece scrolled out of the window
    size: int = -1

    def __post_init__(self) -> None:
        if self.size < 0:
            self.size = len(self.ids)


def pieces_for(
    renderer: ChatRenderer,
    messages: Sequence[Mapping[str, str]],
    open_user: str | None = None,
    answer_prefix: str | None = None,
) -> list[Piece]:
    """Target pieces: the history, then an open user message or the start of an answer."""
    out = []
    for m in messages:
        role, content = m.get("role"), m.get("content")
        if role == "system":
            continue  # the renderer's own system prompt is the cache's sink
        if role not in ("user", "assistant") or not isinstance(content, str):
            raise ValueError(f"bad chat message {dict(m)!r}; need role user/assistant and str content")
        out.append(Piece((role, content, True), renderer.message_ids(role, content)))
    if open_user is not None:
        out.append(Piece(("user", open_user, False), renderer.message_ids("user", open_user, complete=False)))
    if answer_prefix is not None:
        out.append(Piece(("answer", answer_prefix), renderer.answer_ids(answer_prefix)))
    return out


@dataclass
class Track:
    """One model's KV cache of the conversation, and which pieces it holds."""

    cache: LmCache
    pieces: list[Piece] = field(default_factory=list)
    rebuilds: int = 0
    #: tokens of the oldest pieces, forgotten entirely once they scrolled out of the window
    dropped_tokens: int = 0
    #: (cache length, logits, hidden) after the latest feeds: rolling back to one of these
    #: restores its exact outputs without running the model
    checkpoints: list[tuple[int, Any, Any]] = field(default_factory=list)

    def checkpoint(self) -> None:
        c = self.cache
        self.checkpoints = [cp for cp in self.checkpoints if cp[0] < len(c.ids)][-7:]
        self.checkpoints.append((len(c.ids), c.logits, c.hidden))

    def length(self) -> int:
        """Tokens fed after the system prompt (absolute, including those scrolled out)."""
        return self.dropped_tokens + sum(p.size for p in self.pieces)

    def forget_scrolled_out(self, sink_tokens: int, keep_pieces: int = 64) -> None:
        """Bound the bookkeeping like the cache: pieces wholly out of the window lose their token
        ids, and beyond `keep_pieces` of them (kept to align a front-trimmed history) are dropped."""
        start = sink_tokens + self.dropped_tokens
        first_kept = sink_tokens + self.cache.evicted
        out = 0
        for p in self.pieces:
            if start + p.size > first_kept:
                break
            if p.ids:
                p.ids = []
            start += p.size
            out += 1
        if out > keep_pieces:
            drop = out - keep_pieces
            self.dropped_tokens += sum(p.size for p in self.pieces[:drop])
            del self.pieces[:drop]


@dataclass
class _Remainder:
    """What a sync feeds once its track was rolled back, and the bookkeeping after the feed."""

    ids: list[int]
    evicted: int  # the cache's evictions before the feed: if it evicts, checkpoints are void
    target: list[Piece]


def _remainder(plan: int | _Remainder) -> _Remainder:
    assert isinstance(plan, _Remainder)
    return plan


@dataclass
class TrackMark:
    """A track's position at `Conversations.mark`: enough to undo later feeds that evicted nothing."""

    length: int
    evicted: int
    cached: int  # the layers' length (== length unless the track is broken)
    logits: Any
    hidden: Any
    pieces: list[Piece]
    checkpoints: list[tuple[int, Any, Any]]


class Conversations:
    """Syncs Tracks of one model (stateless: the Tracks live in the session state)."""

    def __init__(self, lm: CachedLM, renderer: ChatRenderer, *, per_session_quant: bool = False) -> None:
        self.lm = lm
        self.renderer = renderer
        #: batched feeds quantise each track's int8 activations alone (`CachedLM.feed_batch`)
        self.per_session_quant = per_session_quant
        self._warm = lm.new()
        lm.feed(self._warm, renderer.system_ids)

    @property
    def sink_tokens(self) -> int:
        return len(self.renderer.system_ids)

    def new_track(self) -> Track:
        return Track(cache=self.lm.fork(self._warm))

    def sync(self, track: Track, target: list[Piece]) -> int:
        """Make the cache hold system prompt + `target`; returns tokens fed (prefilled)."""
        plan = self._prepare(track, target)
        if isinstance(plan, int):
            return plan
        self.lm.feed(track.cache, plan.ids)
        return self._settle(track, plan)

    def sync_batch(self, tracks: Sequence[Track], targets: Sequence[list[Piece]]) -> list[int]:
        """`sync` of several sessions' tracks: each rolls back on its own, then what is left to feed
        goes through one batched forward (`CachedLM.feed_batch`); returns the tokens fed per track."""
        if len(tracks) != len(targets):
            raise ValueError(f"sync_batch: {len(tracks)} tracks but {len(targets)} targets")
        if len({id(t) for t in tracks}) != len(tracks):
            raise ValueError("sync_batch: a track appears more than once")
        plans = [self._prepare(t, g) for t, g in zip(tracks, targets, strict=True)]
        feeding = [i for i, p in enumerate(plans) if isinstance(p, _Remainder)]
        if len(feeding) == 1:
            self.lm.feed(tracks[feeding[0]].cache, _remainder(plans[feeding[0]]).ids)
        elif feeding:
            self.lm.feed_batch(
                [tracks[i].cache for i in feeding],
                [_remainder(plans[i]).ids for i in feeding],
                per_session_quant=self.per_session_quant,
            )
        return [p if isinstance(p, int) else self._settle(t, p) for t, p in zip(tracks, plans, strict=True)]

    def _prepare(self, track: Track, target: list[Piece]) -> int | _Remainder:
        """A sync up to its feed: the rollback to the first differing token and what to feed after
        it, or (nothing to feed, or a rebuild) the tokens fed, with the sync complete."""
        fed = track.pieces
        target = self._align(fed, target)
        k = 0
        while k < len(fed) and k < len(target) and fed[k].key == target[k].key and fed[k].key[0] != "answer":
            k += 1
        same = 0
        if k < len(fed) and k < len(target):
            a, b = fed[k].ids, target[k].ids
            n = min(len(a), len(b))
            while same < n and a[same] == b[same]:
                same += 1
        base = self.sink_tokens
        if k < len(fed) and k < len(target) and not fed[k].ids and fed[k].size:
            return self._rebuild(track, target)  # the change is in a message that scrolled out
        keep_abs = base + track.dropped_tokens + sum(p.size for p in fed[:k]) + same
        new_ids = (target[k].ids[same:] if k < len(target) else []) + [
            i for p in target[k + 1 :] for i in p.ids
        ]
        total_abs = base + track.length()
        if keep_abs == total_abs and not new_ids and track.cache.logits is not None:
            track.pieces = target
            return 0
        c = track.cache
        keep_cache = keep_abs - c.evicted
        if keep_abs < base + c.evicted or keep_cache < 1:
            return self._rebuild(track, target)
        if not new_ids:
            cp = next((cp for cp in track.checkpoints if cp[0] == keep_cache), None)
            if cp is not None and keep_cache <= len(c.ids):
                self.lm.rollback(c, keep_cache)
                c.logits, c.hidden = cp[1], cp[2]
                track.pieces = target
                track.checkpoints = [x for x in track.checkpoints if x[0] <= keep_cache]
                return 0
            # nothing new, but the logits after the last kept token are needed: re-feed it
            keep_cache -= 1
            if keep_cache < base:
                return self._rebuild(track, target)
            new_ids = [c.ids[keep_cache]]
        evicted = c.evicted
        self.lm.rollback(c, keep_cache)
        track.checkpoints = [x for x in track.checkpoints if x[0] <= keep_cache]
        return _Remainder(new_ids, evicted, target)

    def _settle(self, track: Track, plan: _Remainder) -> int:
        """The bookkeeping of a sync once its remainder was fed."""
        if track.cache.evicted != plan.evicted:
            track.checkpoints = []  # cache positions moved
        track.checkpoint()
        track.pieces = plan.target
        track.forget_scrolled_out(self.sink_tokens)
        return len(plan.ids)

    def append(self, track: Track, ids: Sequence[int]) -> None:
        """Feed generated tokens onto the open last piece (an answer being decoded)."""
        self.append_batch([track], [ids])

    def append_batch(self, tracks: Sequence[Track], ids: Sequence[Sequence[int]]) -> None:
        """`append` for several sessions' tracks in one batched forward (`CachedLM.feed_batch`)."""
        if len(tracks) != len(ids):
            raise ValueError(f"append_batch: {len(tracks)} tracks but {len(ids)} id lists")
        if any(not t.pieces for t in tracks):
            raise ValueError("append needs an open piece to extend")
        toks = [list(x) for x in ids]
        evicted = [t.cache.evicted for t in tracks]
        if len(tracks) == 1:
            self.lm.feed(tracks[0].cache, toks[0])
        else:
            self.lm.feed_batch([t.cache for t in tracks], toks, per_session_quant=self.per_session_quant)
        for track, new, before in zip(tracks, toks, evicted, strict=True):
            if track.cache.evicted != before:
                track.checkpoints = []
            last = track.pieces[-1]
            track.pieces[-1] = Piece(last.key, last.ids + new)
            track.forget_scrolled_out(self.sink_tokens)

    def append_checked(self, track: Track, ids: Sequence[int]) -> list[int]:
        """`append`, and the model's greedy pick after each fed token: one forward tells which of a
        draft's tokens the model would have chosen itself (`CachedLM.feed(greedy=True)`)."""
        if not track.pieces:
            raise ValueError("append needs an open piece to extend")
        toks = [int(t) for t in ids]
        before = track.cache.evicted
        res = self.lm.feed(track.cache, toks, greedy=True)
        if track.cache.evicted != before:
            track.checkpoints = []
        last = track.pieces[-1]
        track.pieces[-1] = Piece(last.key, last.ids + toks)
        track.forget_scrolled_out(self.sink_tokens)
        assert res.greedy is not None
        return res.greedy

    def sync_checked(self, track: Track, target: list[Piece], n_checked: int) -> tuple[int, list[int]] | None:
        """`sync` to a target whose open last piece ends with `n_checked` drafted tokens, in one forward
        that also gives the model's greedy pick after the token before them and after each of them
        (`append_checked` without a forward of its own). Returns (tokens fed, the n_checked + 1 picks),
        or None where that one forward did not hold the draft (it was in the cache already, or a
        rebuild fed it): the track then holds the target as `sync` leaves it, and the caller checks
        the draft another way (take it back, sync, `append_checked`)."""
        if n_checked < 1 or not target or target[-1].key[0] != "answer":
            raise ValueError("sync_checked: the target must end with an answer holding the draft")
        c = track.cache
        plan = self._prepare(track, target)
        if isinstance(plan, int):
            return None
        short = len(plan.ids) < n_checked + 1
        res = self.lm.feed(c, plan.ids, picks_last=0 if short else n_checked + 1)
        if c.evicted != plan.evicted:
            track.checkpoints = []
        # no checkpoint here: the draft's tail may be taken back, and a checkpoint past the cache's
        # end would restore another text's logits at that length later
        track.pieces = plan.target
        track.forget_scrolled_out(self.sink_tokens)
        if short:
            return None
        assert res.greedy is not None and len(res.greedy) == n_checked + 1
        return len(plan.ids), res.greedy

    def take_back(self, track: Track, n: int) -> None:
        """Drop the last `n` tokens of the open last piece (a draft's rejected tail). The cache's
        logits are cleared: the caller knows the model's pick there from `append_checked`."""
        if n <= 0:
            return
        last = track.pieces[-1] if track.pieces else None
        if last is None or n > len(last.ids):
            raise ValueError(
                f"take_back: {n} tokens, but the open piece holds {len(last.ids) if last else 0}"
            )
        self.lm.rollback(track.cache, len(track.cache.ids) - n)
        track.pieces[-1] = Piece(last.key, last.ids[:-n])
        # a checkpoint past the new end would give another text's logits at that length later
        track.checkpoints = [x for x in track.checkpoints if x[0] <= len(track.cache.ids)]

    def mark(self, track: Track) -> TrackMark:
        """Where a track stands now, for `restore` (a batch that failed part way)."""
        c = track.cache
        return TrackMark(
            len(c.ids),
            c.evicted,
            c.cache.get_seq_length(),
            c.logits,
            c.hidden,
            list(track.pieces),
            list(track.checkpoints),
        )

    def restore(self, track: Track, mark: TrackMark) -> bool:
        """Undo the feeds since `mark`; False where that cannot be done exactly (the window scrolled
        or the cache was rolled back since), in which case the cache is only made consistent again
        (a forward that raised part way may have written some layers and not the others)."""
        c = track.cache
        exact = c.evicted == mark.evicted and mark.length <= len(c.ids)
        n = mark.length if exact else len(c.ids)
        cached = mark.cached if exact else n
        for layer in c.cache.layers:
            keys = getattr(layer, "keys", None)
            if isinstance(keys, torch.Tensor) and keys.shape[-2] > cached:
                layer.crop(cached - keys.shape[-2])
        del c.ids[n:]
        if not exact:
            if c.evicted != mark.evicted:
                track.checkpoints = []  # positions moved, and the feed's bookkeeping may not have run
            return False
        c.logits, c.hidden = mark.logits, mark.hidden
        track.pieces = list(mark.pieces)
        track.checkpoints = list(mark.checkpoints)
        return True

    def _align(self, fed: list[Piece], target: list[Piece]) -> list[Piece]:
        """A history trimmed at the front is the tail of what was fed: keep the dropped messages
        as context (they scroll out of the window anyway) instead of rebuilding the cache."""
        if not fed or not target or fed[0].key == target[0].key:
            return target
        first = target[0].key
        for j in range(1, len(fed)):
            if fed[j].key == first:
                tail = fed[j:]
                n = min(len(tail), len(target))
                if all(tail[i].key == target[i].key for i in range(n - 1)):
                    return fed[:j] + target
        return target

    def _rebuild(self, track: Track, target: list[Piece]) -> int:
        """The change reaches into tokens that scrolled out: start over from the system prompt with
        as many of the latest pieces as fit in three quarters of the window."""
        budget = int(0.75 * self.lm.window_tokens)
        kept: list[Piece] = []
        n = 0
        for p in reversed(target):
            if kept and n + len(p.ids) > budget:
                break
            kept.append(p)
            n += len(p.ids)
        kept.reverse()
        track.cache = self.lm.fork(self._warm)
        ids = [i for p in kept for i in p.ids]
        if ids:
            self.lm.feed(track.cache, ids)
        track.pieces = kept
        track.checkpoints = []
        track.checkpoint()
        track.dropped_tokens = 0
        track.rebuilds += 1
        return len(ids)
