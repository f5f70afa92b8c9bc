"""A global-variance postfilter for the codec decoder, folded into its output layer.

The decoder regresses the teacher's normalised PCA coefficients of the two log-envelopes (harmonic `lh`, noise
`nz`). A regression predicts the conditional mean, so its coefficients vary less than the teacher's and the
formants it draws are flatter. Over training sentences this measures each coefficient's mean and std in the
teacher's features (`m_t`, `s_t`) and in the decoder's (`m_p`, `s_p`, hibari audio -> encode -> FSQ -> decode)
and moves every decoded coefficient by a fixed affine map,

    c' = alpha * m_t + (1 - alpha) * m_p + (c - m_p) * (s_t / s_p) ** alpha,

which is folded into the rows of `head` that emit the coefficients: no new parameter, no runtime cost, the
streaming decoder unchanged, and the latent (so the flow model trained on it) untouched. `alpha` 0 is the
identity, 1 matches the teacher's global variance, larger values sharpen further; it was chosen on a
validation slice of held-out sentences disjoint from the evaluation's (docs/codec.md).

    python -m codec.training.postfilter --weights codec/weights/speech_codec.safetensors --alpha 2 \\
        --stats 60 --out /tmp/codec-pf        # writes speech_codec.safetensors + .json there
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch

from codec.speech_codec import SpeechCodec, load_codec

#: (24 kHz audio, teacher lh [F, 601], teacher merged noise [F, 601]) of one utterance
Example = tuple[np.ndarray, np.ndarray, np.ndarray]
NAMES = ("lh", "nz")


@torch.no_grad()
def envelope_stats(codec: SpeechCodec, examples: Iterable[Example]) -> dict[str, dict[str, torch.Tensor]]:
    """Per coefficient: the teacher's and the decoder's mean and std (`m_t`, `s_t`, `m_p`, `s_p`) and their
    correlation, over the frames both have."""
    acc: dict[str, dict[str, list[torch.Tensor]]] = {k: {"t": [], "p": []} for k in NAMES}
    for audio, lh, nz in examples:
        mel = codec.mel(torch.from_numpy(np.asarray(audio, np.float32))[None])
        t = mel.shape[1] // codec.cfg.down * codec.cfg.down
        feats = codec.decode_features(codec.fsq(codec.encode_latent(mel[:, :t]))[0])
        for name, target in (("lh", lh), ("nz", nz)):
            pred = getattr(feats, name)[0]
            tgt = codec.envelope_coefs(name, torch.from_numpy(np.ascontiguousarray(target, np.float32)))
            m = min(len(pred), len(tgt))
            acc[name]["t"].append(tgt[:m])
            acc[name]["p"].append(pred[:m])
    out = {}
    for name, d in acc.items():
        if not d["t"]:
            raise ValueError("envelope_stats: no examples")
        t, p = torch.cat(d["t"]), torch.cat(d["p"])
        corr = ((t - t.mean(0)) * (p - p.mean(0))).mean(0) / (t.std(0) * p.std(0) + 1e-8)
        out[name] = {"m_t": t.mean(0), "s_t": t.std(0), "m_p": p.mean(0), "s_p": p.std(0), "corr": corr}
    return out


def affine(stats: dict[str, torch.Tensor], alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, shift) per coefficient such that c' = c * scale + shift is the postfilter."""
    scale = (stats["s_t"] / stats["s_p"].clamp(min=1e-3)) ** alpha
    shift = alpha * stats["m_t"] + (1 - alpha) * stats["m_p"] - stats["m_p"] * scale
    return scale, shift


@torch.no_grad()
def fold(codec: SpeechCodec, stats: dict[str, dict[str, torch.Tensor]], alpha: float) -> None:
    """Fold the postfilter into `codec.head` in place (its `lh` and `nz` rows)."""
    k = codec.cfg.n_pca
    rows = {"lh": slice(2, 2 + k), "nz": slice(2 + k, 2 + 2 * k)}
    w, b = codec.head.weight, codec.head.bias
    for name, sl in rows.items():
        scale, shift = affine(stats[name], alpha)
        w[sl] *= scale[:, None].to(w.dtype)
        b[sl] = b[sl] * scale.to(b.dtype) + shift.to(b.dtype)


def teacher_examples(sentences: list[str], audio_seed: int = 0) -> Iterable[Example]:
    """hibari's audio and vocoder features for each sentence (the codec recipe's teacher)."""
    from codec.training.hibari_teacher import HibariTeacher, merged_noise

    teacher = HibariTeacher(threads=1)
    for i, s in enumerate(sentences):
        outs = teacher.text(s, audio_seed=audio_seed + i)
        yield (
            np.concatenate([o.audio for o in outs]),
            np.concatenate([o.lh.T for o in outs]),
            np.concatenate([merged_noise(o.ln, o.lr).T for o in outs]),
        )


def stats_sentences(n: int) -> list[str]:
    """n training sentences spread over the corpus (every 97th), never held-out text."""
    from codec.training.hibari_teacher import training_sentences

    return training_sentences()[::97][:n]


def read_source(src: Path) -> tuple[dict[str, str], set[str], dict]:
    """The source file's safetensors metadata, its tensor names and its JSON (read before anything is written,
    so the output may replace the source)."""
    from safetensors import safe_open

    with safe_open(str(src), "pt") as f:
        file_meta, keys = f.metadata() or {}, set(f.keys())
    src_json = src.with_suffix(".json")
    return file_meta, keys, json.loads(src_json.read_text()) if src_json.is_file() else {}


def write(
    codec: SpeechCodec, source: tuple[dict[str, str], set[str], dict], out_dir: Path, info: dict
) -> Path:
    """Save `codec` as out_dir/speech_codec.safetensors (fp16, the source's metadata and tensors) and its JSON
    (the source's, with `postfilter` = info and the new size)."""
    from safetensors.torch import save_file

    file_meta, keys, meta = source
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "speech_codec.safetensors"
    tensors = {
        k: v.detach().half().contiguous() if v.is_floating_point() else v.contiguous()
        for k, v in codec.state_dict().items()
        if k in keys
    }
    save_file(tensors, str(path), metadata=file_meta)
    meta = dict(meta, postfilter=info)
    meta["bytes"] = path.stat().st_size
    (out_dir / "speech_codec.json").write_text(json.dumps(meta, indent=1))
    return path


def main(argv: list[str] | None = None, examples: Callable[[int], Iterable[Example]] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", type=Path, default=Path("codec/weights/speech_codec.safetensors"))
    ap.add_argument("--alpha", type=float, required=True, help="0: identity; 1: the teacher's variance")
    ap.add_argument("--stats", type=int, default=60, help="training sentences for the statistics")
    ap.add_argument(
        "--out", type=Path, required=True, help="folder for the new speech_codec.safetensors + json"
    )
    args = ap.parse_args(argv)
    if not 0 <= args.alpha <= 5:
        raise SystemExit("postfilter: --alpha must be in [0, 5]")
    source_info = read_source(args.weights)
    if "postfilter" in source_info[2]:
        raise SystemExit(f"postfilter: {args.weights} already has one folded in (its JSON says so)")
    torch.set_num_threads(1)
    codec = load_codec(str(args.weights)).eval()
    t0 = time.time()
    source = examples(args.stats) if examples else teacher_examples(stats_sentences(args.stats))
    stats = envelope_stats(codec, source)
    fold(codec, stats, args.alpha)
    info = {
        "alpha": args.alpha,
        "stats_sentences": args.stats,
        "std_ratio_decoder_over_teacher_mean": {
            k: float((v["s_p"] / v["s_t"]).mean()) for k, v in stats.items()
        },
        "corr_mean": {k: float(v["corr"].mean()) for k, v in stats.items()},
        "command": f"python -m codec.training.postfilter --weights {args.weights} --alpha {args.alpha:g} "
        f"--stats {args.stats} --out {args.out}",
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    path = write(codec, source_info, args.out, info)
    print(f"postfilter alpha {args.alpha:g} folded ({time.time() - t0:.0f} s): {path}")
    return path


if __name__ == "__main__":
    main()
