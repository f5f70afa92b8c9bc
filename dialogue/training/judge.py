"""Answer-quality judges for `duplex eval dialogue`, both run by the in-process slow model.

* **Rating** (`RatingJudge`): the slow model is asked to grade the reply from 1 to 9; the grade is
  the expectation over its next-token distribution on the digits. Simple and what papers do with
  large judges, but a 0.5B model is a lenient grader: it gives the slow model's answer to *another*
  prompt only ~0.3 points less than the right one (AUROC ~0.69 between the two).
* **Likelihood** (`LikelihoodJudge`): how much the answer is an answer to *these* words. Per answer
  token, the log-probability the slow model gives it after the caller's words minus after a neutral
  "Hello." in the same conversation (pointwise mutual information with the caller's turn, in nats
  per token; an answer that would fit any turn scores ~0), times the probability that the turn ends
  where the answer ends (a reply cut mid-sentence scores ~0):

      quality = max(0, mean_t[log P(a_t | conv, words) - log P(a_t | conv, "Hello.")]) * P(end | conv, words, a)

  It tells a right-topic answer from another prompt's answer with AUROC ~0.98 and a whole answer
  from its first third with ~1.0 (`python -m dialogue.training.judge --check`). It does not see a wrong fact
  on the right topic, it favours the slow model's own wording (its greedy answer is the likeliest)
  and per token it marks down filler words and quotes, so it is strict with the relay, never
  lenient. `likelihood-total` is the same over the whole answer (`LikelihoodScore.quality_total`):
  filler costs nothing there, a longer on-topic answer gains; the two bracket the wording bias.

`python -m dialogue.training.judge --check N` measures both judges' validity on N answered prompts from the
drafter's *training* split (not the evaluation's prompts): each prompt's own answer against another
prompt's answer and against its own first third.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

JUDGE_SYSTEM = "You grade the replies of a friendly voice assistant on a phone call. You are strict and fair."
JUDGE_PROMPT = (
    '{context}The caller said: "{text}"\nThe assistant replied: "{answer}"\n\n'
    "Rate the reply from 1 (wrong, off-topic, broken or rambling) to 9 (correct, helpful, natural and short). "
    "Answer with a single digit."
)
#: the caller's turn the likelihood judge compares the real one with: a greeting, which asks nothing
NEUTRAL_TEXT = "Hello."


def context_lines(history: Sequence[dict[str, str]]) -> str:
    """The last four turns of the call, as the rating prompt shows them."""
    context = "".join(
        f"{'Caller' if m['role'] == 'user' else 'Assistant'}: {m['content']}\n" for m in history[-4:]
    )
    return f"Earlier in the call:\n{context}\n" if context else ""


class RatingJudge:
    """The slow model's expected grade 1..9 of a reply (its next-token distribution over the digits)."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(1, 10)]

    def __call__(self, history: Sequence[dict[str, str]], text: str, answer: str) -> float:
        from dialogue.fast_decoder import decoder_hidden

        content = JUDGE_PROMPT.format(context=context_lines(history), text=text, answer=answer or "(silence)")
        msgs = [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": content}]
        ids = self.tokenizer.apply_chat_template(
            msgs, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        with torch.inference_mode():
            logits = self.model.lm_head(decoder_hidden(self.model, list(ids))[:, -1])[0].float()
        p = torch.softmax(logits[self.digits], dim=-1)
        return float((p * torch.arange(1, 10, dtype=torch.float32)).sum())


@dataclass(frozen=True)
class LikelihoodScore:
    """One answer under the likelihood judge (sums in nats over the answer's tokens)."""

    n_tokens: int
    logp: float  # log P(answer | conversation, the caller's words)
    logp_neutral: float  # log P(answer | the same conversation, the caller said NEUTRAL_TEXT)
    logp_end: float  # log P(the turn ends after the answer | conversation, the caller's words)

    @property
    def pmi(self) -> float:
        """Nats per answer token the caller's words add (0 for an empty answer)."""
        return (self.logp - self.logp_neutral) / self.n_tokens if self.n_tokens else 0.0

    @property
    def quality(self) -> float:
        """The judge's grade: nats per token the caller's words add (floored at 0), times P(end)."""
        return max(0.0, self.pmi) * math.exp(self.logp_end) if self.n_tokens else 0.0

    @property
    def quality_total(self) -> float:
        """The same over the whole answer instead of per token: filler words ("Sure, I'd be happy
        to ...") add ~0 here where they dilute `quality`, and a longer on-topic answer scores more."""
        return max(0.0, self.logp - self.logp_neutral) * math.exp(self.logp_end) if self.n_tokens else 0.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self) | {"pmi": self.pmi, "quality": self.quality, "quality_total": self.quality_total}


class LikelihoodJudge:
    """Scores answers by the slow model's likelihood of them after the caller's words against after a
    neutral turn (see the module doc). The two conversations are prefilled once per prompt and every
    answer is run on a copy-free crop of the same cache."""

    def __init__(self, model: Any, tokenizer: Any, system_prompt: str, neutral: str = NEUTRAL_TEXT) -> None:
        from dialogue.llm import stop_token_ids

        self.model, self.tokenizer, self.system_prompt, self.neutral = (
            model,
            tokenizer,
            system_prompt,
            neutral,
        )
        self.stop = sorted(stop_token_ids(tokenizer))

    def _answer_logprobs(
        self, ctx: Sequence[int], answers: Sequence[list[int]]
    ) -> list[tuple[torch.Tensor, float]]:
        """For each answer: log-probabilities of its tokens after `ctx`, and log P(stop) after it."""
        from transformers import DynamicCache

        from dialogue.fast_decoder import decoder_hidden
        from dialogue.training.relay_features import crop_to

        model = self.model
        cache = DynamicCache(config=model.config)
        out = []
        with torch.inference_mode():
            last = decoder_hidden(model, list(ctx), cache)[:, -1:]
            for ids in answers:
                hidden = (
                    last if not ids else torch.cat([last, decoder_hidden(model, ids, cache, len(ctx))], dim=1)
                )
                crop_to(cache, len(ctx))
                logp = torch.log_softmax(model.lm_head(hidden[0]).float(), dim=-1)
                tokens = (
                    logp[torch.arange(len(ids)), torch.tensor(ids, dtype=torch.long)] if ids else logp[:0, 0]
                )
                out.append((tokens, float(torch.logsumexp(logp[-1, self.stop], dim=0))))
        return out

    def score(
        self, history: Sequence[dict[str, str]], text: str, answers: Sequence[str]
    ) -> list[LikelihoodScore]:
        from dialogue.verifier import chat_ids

        ids = [list(self.tokenizer.encode(a.strip(), add_special_tokens=False)) for a in answers]
        real = self._answer_logprobs(chat_ids(self.tokenizer, self.system_prompt, history, text), ids)
        neutral = self._answer_logprobs(
            chat_ids(self.tokenizer, self.system_prompt, history, self.neutral), ids
        )
        return [
            LikelihoodScore(len(i), float(r[0].sum()), float(n[0].sum()), r[1])
            for i, r, n in zip(ids, real, neutral, strict=True)
        ]


def validity(good: Sequence[float], bad: Sequence[float]) -> dict[str, float]:
    """How well a judge tells each prompt's own answer (`good`) from a bad one for the same prompt
    (`bad`, paired): AUROC over all pairs, the share of prompts where the own answer wins, and the
    bad answers' mean as a share of the good ones' (what a "quality ratio" of a bad answer would be)."""
    from dialogue.training.relay_metrics import auroc

    n = len(good)
    mean_good = sum(good) / n if n else float("nan")
    return {
        "n": n,
        "auroc": auroc(list(good) + list(bad), [1] * n + [0] * len(bad)),
        "paired_wins": sum((g > b) + 0.5 * (g == b) for g, b in zip(good, bad, strict=True)) / n
        if n
        else float("nan"),
        "bad_ratio": (sum(bad) / n) / mean_good if n and mean_good else float("nan"),
    }


# -- the validity check ----------------------------------------------------------------------------


def check_prompts(n: int, seed: int) -> list[dict[str, Any]]:
    """`n` answered prompts from the drafter's training split (ended answers, not code-length)."""
    from dialogue.training.drafter_data import read_targets

    rows = [
        r for r in read_targets().values() if r["split"] == "train" and r["ended"] and len(r["answer"]) < 300
    ]
    random.Random(seed).shuffle(rows)
    for r in rows:
        r["history"] = [
            {"role": m[0], "content": m[1]} if isinstance(m, list) else m for m in r.get("history") or []
        ]
    return rows[:n]


def run_check(stage: Any, n: int, seed: int, progress: bool = True) -> dict[str, Any]:
    """Both judges on `n` training prompts: own answer vs another prompt's answer and vs its first third."""
    from tqdm.auto import tqdm

    rows = check_prompts(n, seed)
    rating = RatingJudge(stage.slow.lm.model, stage.slow_tokenizer)
    likelihood = LikelihoodJudge(stage.slow.lm.model, stage.slow_tokenizer, stage.system_prompt)
    judges = ("rating", "likelihood", "likelihood-total")
    scores: dict[str, dict[str, list[float]]] = {j: {"own": [], "other": [], "cut": []} for j in judges}
    t0 = time.perf_counter()
    for i, r in enumerate(tqdm(rows, desc="judge check", disable=not progress)):
        words = r["answer"].split()
        answers = {
            "own": r["answer"],
            "other": rows[(i + 1) % len(rows)]["answer"],
            "cut": " ".join(words[: max(1, len(words) // 3)]),
        }
        for kind, a in answers.items():
            scores["rating"][kind].append(rating(r["history"], r["text"], a))
        for kind, s in zip(
            answers, likelihood.score(r["history"], r["text"], list(answers.values())), strict=True
        ):
            scores["likelihood"][kind].append(s.quality)
            scores["likelihood-total"][kind].append(s.quality_total)
    return {
        "n": len(rows),
        "seed": seed,
        "seconds": round(time.perf_counter() - t0, 1),
        "judges": {
            j: {
                "mean": {k: sum(v) / len(v) for k, v in s.items()},
                "own_vs_other": validity(s["own"], s["other"]),
                "own_vs_cut": validity(s["own"], s["cut"]),
            }
            for j, s in scores.items()
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m dialogue.training.judge", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--check", type=int, default=80, metavar="N", help="training prompts to check the judges on"
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--profile", default=None, help="models.yaml profile (its in-process llm is the judge)")
    ap.add_argument("--out", default=None, help="write the check's results to this JSON file")
    args = ap.parse_args(argv)

    from dialogue.engine import load_dialogue_stage
    from duplex.base.config import load_profile

    stage = load_dialogue_stage(load_profile(args.profile).component("llm"), None)
    if stage.slow is None:
        raise SystemExit("judge: the judge is the in-process slow model; this profile's llm is remote")
    res = run_check(stage, args.check, args.seed)
    for name, j in res["judges"].items():
        m = j["mean"]
        print(
            f"{name:10s} mean own {m['own']:.3f} / another prompt's answer {m['other']:.3f} / first third "
            f"{m['cut']:.3f};  AUROC own vs other {j['own_vs_other']['auroc']:.3f}, own vs cut "
            f"{j['own_vs_cut']['auroc']:.3f};  another prompt's answer scores "
            f"{100 * j['own_vs_other']['bad_ratio']:.1f} % of the own (n={res['n']})"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
