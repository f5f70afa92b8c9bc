"""Cache-aware streaming FastConformer models built from an in-code config (no download), and their tokenizer.

The architecture follows NeMo's `fastconformer_ctc_bpe_streaming` / hybrid RNNT-CTC recipes: 8x causal
depthwise-striding subsampling (80 ms frames), `chunked_limited` attention with several lookaheads in one
model (`att_context_size` [[70,13],[70,6],[70,1],[70,0]] = 1040/480/80/0 ms, one picked per training
batch), causal convolutions, layer norm in the conv module (batch statistics would differ between one
stream and a batch), and no per-utterance feature normalisation (it would need the whole utterance).
NeMo is imported only when a model is built or loaded.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# lookahead frames of the shipped model, each at 80 ms: 13 -> 1040 ms, 6 -> 480 ms, 1 -> 80 ms, 0 -> 0 ms
ATT_CONTEXT_SIZES: list[list[int]] = [[70, 13], [70, 6], [70, 1], [70, 0]]
ATT_CONTEXT_PROBS: list[float] = [0.25, 0.35, 0.2, 0.2]
FRAME_MS = 80


def train_tokenizer(sentences: list[str], out_dir: str | os.PathLike, vocab_size: int = 256) -> Path:
    """Train a SentencePiece BPE tokenizer on `sentences` (normalised text) into `out_dir`."""
    import sentencepiece as spm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text_path = out / "text.txt"
    text_path.write_text("\n".join(sentences) + "\n")
    spm.SentencePieceTrainer.train(
        input=str(text_path),
        model_prefix=str(out / "tokenizer"),
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        bos_id=-1,
        eos_id=-1,
        unk_id=0,
        num_threads=1,
        minloglevel=2,
        input_sentence_size=200000,
        shuffle_input_sentence=True,
    )
    text_path.unlink()
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    (out / "vocab.txt").write_text("\n".join(sp.id_to_piece(i) for i in range(sp.get_piece_size())) + "\n")
    return out


def model_config(
    tokenizer_dir: str | os.PathLike,
    *,
    d_model: int = 176,
    n_layers: int = 10,
    n_heads: int = 4,
    conv_kernel_size: int = 9,
    subsampling_conv_channels: int = 128,
    decoder: str = "ctc",
    att_context_size: list[list[int]] | None = None,
    att_context_probs: list[float] | None = None,
    dropout: float = 0.1,
    subsampling_factor: int = 8,
) -> Any:
    """The OmegaConf config of a cache-aware streaming FastConformer (`decoder` 'ctc' or 'hybrid')."""
    from omegaconf import OmegaConf

    contexts = att_context_size or ATT_CONTEXT_SIZES
    probs = att_context_probs or (ATT_CONTEXT_PROBS if contexts == ATT_CONTEXT_SIZES else None)
    encoder = {
        "_target_": "nemo.collections.asr.modules.ConformerEncoder",
        "feat_in": 80,
        "feat_out": -1,
        "n_layers": n_layers,
        "d_model": d_model,
        "subsampling": "dw_striding",
        "subsampling_factor": subsampling_factor,
        "subsampling_conv_channels": subsampling_conv_channels,
        "causal_downsampling": True,
        "ff_expansion_factor": 4,
        "self_attention_model": "rel_pos",
        "n_heads": n_heads,
        "att_context_size": contexts,
        "att_context_probs": probs,
        "att_context_style": "chunked_limited",
        "xscaling": True,
        "untie_biases": True,
        "pos_emb_max_len": 5000,
        "conv_kernel_size": conv_kernel_size,
        "conv_norm_type": "layer_norm",
        "conv_context_size": "causal",
        "dropout": dropout,
        "dropout_pre_encoder": dropout,
        "dropout_emb": 0.0,
        "dropout_att": dropout,
    }
    cfg: dict[str, Any] = {
        "sample_rate": 16000,
        "tokenizer": {"dir": str(tokenizer_dir), "type": "bpe"},
        "preprocessor": {
            "_target_": "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor",
            "sample_rate": 16000,
            "normalize": "NA",
            "window_size": 0.025,
            "window_stride": 0.01,
            "window": "hann",
            "features": 80,
            "n_fft": 512,
            "log": True,
            "frame_splicing": 1,
            "dither": 1e-5,
            "pad_to": 0,
            "pad_value": 0.0,
        },
        "spec_augment": {
            "_target_": "nemo.collections.asr.modules.SpectrogramAugmentation",
            "freq_masks": 2,
            "time_masks": 4,
            "freq_width": 15,
            "time_width": 0.04,
        },
        "encoder": encoder,
        "decoder": {
            "_target_": "nemo.collections.asr.modules.ConvASRDecoder",
            "feat_in": d_model,
            "num_classes": -1,
            "vocabulary": [],
        },
        "decoding": {"strategy": "greedy_batch"},
    }
    if decoder == "hybrid":
        cfg["aux_ctc"] = {
            "decoder": dict(cfg["decoder"]),
            "ctc_loss_weight": 0.3,
            "decoding": {"strategy": "greedy_batch"},
        }
        cfg["decoder"] = {
            "_target_": "nemo.collections.asr.modules.RNNTDecoder",
            "normalization_mode": None,
            "random_state_sampling": False,
            "blank_as_pad": True,
            "prednet": {"pred_hidden": 64, "pred_rnn_layers": 1, "t_max": None, "dropout": 0.0},
        }
        cfg["joint"] = {
            "_target_": "nemo.collections.asr.modules.RNNTJoint",
            "log_softmax": None,
            "preserve_memory": False,
            "fuse_loss_wer": False,
            "fused_batch_size": 4,
            "jointnet": {"joint_hidden": 64, "activation": "relu", "dropout": 0.0},
        }
        cfg["model_defaults"] = {"enc_hidden": d_model, "pred_hidden": 64}
        cfg["decoding"] = {"strategy": "greedy_batch", "greedy": {"max_symbols": 5}}
        cfg["loss"] = {"loss_name": "default"}
    elif decoder != "ctc":
        raise ValueError(f"decoder must be 'ctc' or 'hybrid', not {decoder!r}")
    return OmegaConf.create(cfg)


def build_model(cfg: Any) -> Any:
    """Instantiate the NeMo model for `cfg` (CTC: EncDecCTCModelBPE; hybrid: EncDecHybridRNNTCTCBPEModel)."""
    import logging

    logging.getLogger("nemo_logger").setLevel(logging.ERROR)
    from nemo.collections.asr.models import EncDecCTCModelBPE, EncDecHybridRNNTCTCBPEModel

    cls = EncDecHybridRNNTCTCBPEModel if "joint" in cfg else EncDecCTCModelBPE
    return cls(cfg=cfg)
