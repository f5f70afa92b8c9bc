"""The project's FSQ speech codec: 24 kHz audio -> 26.7 Hz FSQ codes -> 24 kHz audio, streaming decode.

    audio --log-mel (80 Hz)--> causal ConvNeXt encoder (3 frames of lookahead) --/3--> latent [G*4]
          --FSQ (levels 8,5,5,5 per group, G groups)--> codes [G] per 37.5 ms frame
          --> causal ConvNeXt decoder --x3--> 80 Hz vocoder features (F0, voicing, harmonic and noise
          log-envelopes as PCA coefficients expanded to 601 bins) --> HarmonicNoiseVocoder --> audio

The decoder is strictly causal: every conv keeps its last (k - 1) inputs in `DecoderState`, so
`decode_step` over any chunking (or batched over sessions) gives the offline samples. The continuous
quantised latent (`FSQ.quantize`, G*4 values in [-1, 1] per frame) is what an acoustic model predicts;
`decode_latent_step` takes it directly. Imports only torch/numpy (and `codec.fsq`, `codec.dsp_vocoder`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from codec.dsp_vocoder import HOP, N_BINS, N_FFT, SR, HarmonicNoiseVocoder, VocoderState, output_delay
from codec.fsq import FSQ

LOG_F0_MEAN, LOG_F0_STD = 5.3, 0.25
MEL_FLOOR = 1e-5


@dataclass(frozen=True)
class CodecConfig:
    """Model dimensions; saved with the weights."""

    n_mels: int = 80
    enc_fast_dim: int = 128
    enc_fast_blocks: int = 2
    enc_dim: int = 192
    enc_blocks: int = 3
    enc_lookahead: int = 3  # 80 Hz frames the encoder reads ahead
    levels: tuple[int, ...] = (8, 5, 5, 5)
    groups: int = 3
    down: int = 3  # 80 Hz feature frames per code frame
    dec_dim: int = 192
    dec_blocks: int = 4
    dec_fast_dim: int = 128
    dec_fast_blocks: int = 3
    kernel: int = 7
    n_pca: int = 48
    env_delay: int = 2  # vocoder: frames the envelopes wait for their pulses (decoder-side only; dsp_vocoder)

    @property
    def latent_dim(self) -> int:
        return len(self.levels) * self.groups

    @property
    def frame_rate(self) -> float:
        return SR / (HOP * self.down)

    @property
    def samples_per_code(self) -> int:
        return HOP * self.down

    @property
    def output_delay(self) -> int:
        """Samples from a code frame's start to its audio in `decode`'s output: the overlap-add (900) plus
        the vocoder's envelope delay (300 per frame)."""
        return output_delay(self.env_delay)

    @property
    def bitrate(self) -> float:
        return self.frame_rate * self.groups * math.log2(math.prod(self.levels))

    @staticmethod
    def from_dict(d: dict) -> CodecConfig:
        d = dict(d)
        d["levels"] = tuple(d["levels"])
        return CodecConfig(**{f.name: d[f.name] for f in fields(CodecConfig) if f.name in d})

    def to_dict(self) -> dict:
        return asdict(self)


class CausalConvNeXt(nn.Module):
    """Depthwise causal conv (kernel k, cache of k-1 frames) + LayerNorm + pointwise MLP, residual."""

    def __init__(self, dim: int, kernel: int, mult: int = 3) -> None:
        super().__init__()
        self.kernel = kernel
        self.dw = nn.Conv1d(dim, dim, kernel, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.pw1 = nn.Linear(dim, mult * dim)
        self.pw2 = nn.Linear(mult * dim, dim)
        self.scale = nn.Parameter(torch.full((dim,), 0.1))

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, C], cache [B, C, k-1] -> y [B, T, C], new cache."""
        xc = torch.cat([cache, x.transpose(1, 2)], 2)
        h = self.dw(xc).transpose(1, 2)
        h = self.pw2(F.gelu(self.pw1(self.norm(h))))
        return x + self.scale * h, xc[:, :, xc.shape[2] - (self.kernel - 1) :]

    def zero_cache(self, batch: int, device: torch.device | str) -> torch.Tensor:
        return torch.zeros(batch, self.dw.in_channels, self.kernel - 1, device=device)


def _run_stack(
    blocks: nn.ModuleList, x: torch.Tensor, caches: list[torch.Tensor] | None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    new = []
    for i, blk in enumerate(blocks):
        c = caches[i] if caches is not None else blk.zero_cache(x.shape[0], x.device)
        x, c = blk(x, c)
        new.append(c)
    return x, new


@dataclass
class DecoderState:
    """Per-session streaming state of the decoder (batched along dim 0)."""

    slow: list[torch.Tensor]  # conv caches of the code-rate blocks
    fast: list[torch.Tensor]  # conv caches of the 80 Hz blocks
    vocoder: VocoderState

    @staticmethod
    def stack(states: list[DecoderState]) -> DecoderState:
        return DecoderState(
            [torch.cat(c) for c in zip(*(s.slow for s in states), strict=True)],
            [torch.cat(c) for c in zip(*(s.fast for s in states), strict=True)],
            VocoderState.stack([s.vocoder for s in states]),
        )

    def unbind(self) -> list[DecoderState]:
        voc = self.vocoder.unbind()
        return [
            DecoderState([c[i : i + 1] for c in self.slow], [c[i : i + 1] for c in self.fast], voc[i])
            for i in range(len(voc))
        ]


@dataclass
class Features:
    """Decoder output at 80 Hz: voicing logit and log F0 [B, T]; harmonic / noise PCA coefficients
    [B, T, K] (normalised)."""

    voicing: torch.Tensor
    log_f0: torch.Tensor
    lh: torch.Tensor
    nz: torch.Tensor


class SpeechCodec(nn.Module):
    """Encoder + FSQ + decoder + vocoder. Offline: `encode`, `decode`; streaming: `init_state`,
    `decode_step`, `decode_step_batch`, `flush`."""

    def __init__(self, cfg: CodecConfig = CodecConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        c = cfg
        # log-mel front end
        self.register_buffer("mel_fb", _mel_filterbank(c.n_mels), persistent=False)
        self.register_buffer("stft_win", torch.hann_window(N_FFT, periodic=True), persistent=False)
        # encoder
        self.enc_in = nn.Linear(c.n_mels, c.enc_fast_dim)
        self.enc_fast = nn.ModuleList(
            CausalConvNeXt(c.enc_fast_dim, c.kernel) for _ in range(c.enc_fast_blocks)
        )
        self.enc_down = nn.Linear(c.down * c.enc_fast_dim, c.enc_dim)
        self.enc_slow = nn.ModuleList(CausalConvNeXt(c.enc_dim, c.kernel) for _ in range(c.enc_blocks))
        self.enc_norm = nn.LayerNorm(c.enc_dim)
        self.enc_out = nn.Linear(c.enc_dim, c.latent_dim)
        self.fsq = FSQ(c.levels, c.groups)
        # decoder
        self.dec_in = nn.Linear(c.latent_dim, c.dec_dim)
        self.dec_slow = nn.ModuleList(CausalConvNeXt(c.dec_dim, c.kernel) for _ in range(c.dec_blocks))
        self.dec_norm = nn.LayerNorm(c.dec_dim)
        self.dec_up = nn.Linear(c.dec_dim, c.down * c.dec_fast_dim)
        self.dec_fast = nn.ModuleList(
            CausalConvNeXt(c.dec_fast_dim, c.kernel) for _ in range(c.dec_fast_blocks)
        )
        self.dec_fast_norm = nn.LayerNorm(c.dec_fast_dim)
        self.head = nn.Linear(c.dec_fast_dim, 2 + 2 * c.n_pca)
        # PCA bases of the two log-envelopes (fitted on teacher data by the training recipe; saved)
        for name in ("lh", "nz"):
            self.register_buffer(f"{name}_mean", torch.zeros(N_BINS))
            self.register_buffer(f"{name}_basis", torch.zeros(c.n_pca, N_BINS))
            self.register_buffer(f"{name}_std", torch.ones(c.n_pca))
        self.vocoder = HarmonicNoiseVocoder(c.env_delay)

    # -- front end / encoder ------------------------------------------------------------------------
    def mel(self, audio: torch.Tensor) -> torch.Tensor:
        """audio [B, S] at 24 kHz -> log-mel [B, S // 300, n_mels] (frame k centred on sample 300k)."""
        spec = torch.stft(audio, N_FFT, HOP, window=self.stft_win, center=True, return_complex=True)
        mag = spec.abs()[:, :, : audio.shape[1] // HOP]
        return torch.log(torch.einsum("mf,bft->btm", self.mel_fb, mag) + MEL_FLOOR)

    def encode_latent(self, mel: torch.Tensor) -> torch.Tensor:
        """log-mel [B, T, n_mels] (T a multiple of `down`) -> unquantised latent [B, T/down, G*4]."""
        c = self.cfg
        b, t, _ = mel.shape
        if t % c.down:
            raise ValueError(f"mel frames {t} not a multiple of {c.down}")
        if c.enc_lookahead:
            pad = mel.new_full((b, c.enc_lookahead, mel.shape[2]), math.log(MEL_FLOOR))
            mel = torch.cat([mel[:, c.enc_lookahead :], pad], 1)
        x, _ = _run_stack(self.enc_fast, self.enc_in(mel), None)
        x = self.enc_down(x.reshape(b, t // c.down, c.down * x.shape[2]))
        x, _ = _run_stack(self.enc_slow, x, None)
        return self.enc_out(self.enc_norm(x))

    def encode(self, audio: torch.Tensor) -> torch.Tensor:
        """audio [B, S] -> codes [B, S // 900, G] (int64)."""
        mel = self.mel(audio)
        t = mel.shape[1] // self.cfg.down * self.cfg.down
        return self.fsq(self.encode_latent(mel[:, :t]))[1]

    # -- decoder --------------------------------------------------------------------------------------
    def _decode_features(
        self, zq: torch.Tensor, state: DecoderState | None
    ) -> tuple[Features, list[torch.Tensor], list[torch.Tensor]]:
        c = self.cfg
        x, slow = _run_stack(self.dec_slow, self.dec_in(zq), state.slow if state else None)
        x = self.dec_up(self.dec_norm(x))
        b, n, _ = x.shape
        x = x.reshape(b, n * c.down, c.dec_fast_dim)
        x, fast = _run_stack(self.dec_fast, x, state.fast if state else None)
        h = self.head(self.dec_fast_norm(x))
        k = c.n_pca
        return Features(h[..., 0], h[..., 1], h[..., 2 : 2 + k], h[..., 2 + k :]), slow, fast

    def decode_features(self, zq: torch.Tensor) -> Features:
        """Quantised latent [B, N, G*4] -> 80 Hz features [.., N*3, ..] (offline, fresh state)."""
        return self._decode_features(zq, None)[0]

    def expand(self, feats: Features) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Features -> vocoder inputs: f0 [B, T] Hz (0 = unvoiced), lh / nz [B, T, 601]."""
        f0 = torch.where(
            feats.voicing > 0,
            torch.exp(feats.log_f0 * LOG_F0_STD + LOG_F0_MEAN),
            torch.zeros_like(feats.log_f0),
        )
        return f0, self.envelope("lh", feats.lh), self.envelope("nz", feats.nz)

    def envelope(self, name: str, coefs: torch.Tensor) -> torch.Tensor:
        """Normalised PCA coefficients [..., K] of `lh` or `nz` -> the log-envelope [..., 601] (the inverse of
        `envelope_coefs`)."""
        if name not in ("lh", "nz"):
            raise ValueError(f"no envelope {name!r} (lh or nz)")
        mean, basis, std = (getattr(self, f"{name}_{k}") for k in ("mean", "basis", "std"))
        return mean + (coefs * std) @ basis

    def envelope_coefs(self, name: str, envelope: torch.Tensor) -> torch.Tensor:
        """A log-envelope `lh` or `nz` [..., 601] -> its normalised PCA coefficients [..., K], the decoder's
        target (the inverse of `expand`'s projection, up to what K coefficients cannot hold)."""
        if name not in ("lh", "nz"):
            raise ValueError(f"no envelope {name!r} (lh or nz)")
        mean, basis, std = (getattr(self, f"{name}_{k}") for k in ("mean", "basis", "std"))
        return ((envelope - mean) @ basis.T) / std

    def latent_sha256(self) -> str:
        """`latent_fingerprint` of this model (equal to its exported file's `latent_sha256`)."""
        import json

        return latent_fingerprint(json.dumps(self.cfg.to_dict()), self.state_dict())

    def init_state(self, batch: int = 1, device: torch.device | str = "cpu") -> DecoderState:
        return DecoderState(
            [b.zero_cache(batch, device) for b in self.dec_slow],
            [b.zero_cache(batch, device) for b in self.dec_fast],
            self.vocoder.init_state(batch, device),
        )

    @torch.no_grad()
    def decode_latent_step(self, state: DecoderState, zq: torch.Tensor) -> tuple[torch.Tensor, DecoderState]:
        """Quantised (or predicted continuous) latent [B, n, G*4] -> audio [B, n*900], new state."""
        feats, slow, fast = self._decode_features(zq, state)
        f0, lh, nz = self.expand(feats)
        audio, voc = self.vocoder.step(state.vocoder, f0, lh, nz)
        return audio, DecoderState(slow, fast, voc)

    def decode_step(self, state: DecoderState, codes: torch.Tensor) -> tuple[torch.Tensor, DecoderState]:
        """Codes [B, n, G] -> audio [B, n*900] (delayed by 900 samples of overlap-add), new state."""
        return self.decode_latent_step(state, self.fsq.from_codes(codes))

    def decode_step_batch(
        self, states: list[DecoderState], codes: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[DecoderState]]:
        """One step for several sessions at once (each codes [1, n, G], the same n): one batched pass."""
        audio, st = self.decode_step(DecoderState.stack(states), torch.cat(codes))
        return list(audio.split(1)), st.unbind()

    def flush(self, state: DecoderState) -> torch.Tensor:
        """The rest of a finished stream (`cfg.output_delay` samples)."""
        return self.vocoder.flush(state.vocoder)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Offline: codes [B, N, G] -> audio [B, N*900 + output_delay] (a fresh state, then flushed)."""
        state = self.init_state(codes.shape[0], codes.device)
        audio, state = self.decode_step(state, codes)
        return torch.cat([audio, self.flush(state)], 1)


def _mel_filterbank(n_mels: int, fmin: float = 0.0, fmax: float = 12000.0) -> torch.Tensor:
    """Slaney-style triangular mel filters [n_mels, 601] for n_fft 1200 at 24 kHz (HTK mel scale)."""

    def hz2mel(f: torch.Tensor) -> torch.Tensor:
        return 2595.0 * torch.log10(1.0 + f / 700.0)

    def mel2hz(m: torch.Tensor) -> torch.Tensor:
        return 700.0 * (10 ** (m / 2595.0) - 1.0)

    freqs = torch.linspace(0, SR / 2, N_BINS, dtype=torch.float64)
    pts = mel2hz(
        torch.linspace(
            hz2mel(torch.tensor(fmin)), hz2mel(torch.tensor(fmax)), n_mels + 2, dtype=torch.float64
        )
    )
    lo, ce, hi = pts[:-2, None], pts[1:-1, None], pts[2:, None]
    fb = torch.clamp(torch.minimum((freqs - lo) / (ce - lo), (hi - freqs) / (hi - ce)), min=0)
    fb = fb * (2.0 / (hi - lo))
    return fb.float()


def load_codec(path: str, map_location: str = "cpu") -> SpeechCodec:
    """A SpeechCodec from a safetensors file written by the training recipe (config in its metadata)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(path, "pt") as f:
        meta = f.metadata() or {}
    model = SpeechCodec(CodecConfig.from_dict(json.loads(meta["config"])))
    sd = {k: v.float() for k, v in load_file(path, device=map_location).items()}
    model.load_state_dict(sd)
    return model.eval()


#: config fields that change only how the decoder's features become audio, not the latent
DECODER_ONLY = ("env_delay",)


def latent_fingerprint(config_json: str, tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of what defines a codec's latent: its config and its encoder tensors (as fp16), not the decoder.

    A flow model predicts the latent, so it stays valid for any codec with the same fingerprint, e.g. one
    whose decoder was trained further with the encoder frozen (`train_codec --freeze-encoder`)."""
    import hashlib
    import json

    if config_json:  # decoder-side settings do not change the latent
        config = json.loads(config_json)
        for key in DECODER_ONLY:
            config.pop(key, None)
        config_json = json.dumps(config)
    h = hashlib.sha256(config_json.encode())
    for key in sorted(k for k in tensors if k.startswith("enc_")):
        t = tensors[key].detach().cpu().half().contiguous()
        h.update(key.encode())
        h.update(str(t.dtype).encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def fits_codec(path: str, sha256: str, latent: str | None) -> bool:
    """Whether the codec file at `path` is the one with `sha256`, or (when `latent` is known) one whose
    encoder has that `latent_fingerprint`: what was made with the first decodes with the second."""
    import hashlib

    with open(path, "rb") as f:
        if hashlib.sha256(f.read()).hexdigest() == sha256:
            return True
    return latent is not None and latent_sha256(path) == latent


def latent_sha256(path: str) -> str:
    """`latent_fingerprint` of a codec file written by the training recipe (config in its metadata)."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        config = (f.metadata() or {}).get("config", "")
        return latent_fingerprint(config, {k: f.get_tensor(k) for k in f.keys() if k.startswith("enc_")})
