"""A cache of an LLM's int8 weights, so a start does not rebuild them from the float32 checkpoint.

`llm_weights.load(..., "int8-dynamic")` reads the float32 safetensors, calibrates and folds the
SmoothQuant scales, and packs every Linear to int8: for the 1.5B `cpu-large` model that took ~112 s
and peaked at ~10 GB (the float32 file mapped, plus the float model, plus the int8 copies). The
result is saved once, after the first such load, as a `torch.save` of the quantised model's
state dict (packed int8 weights with their per-channel scales, the smoothed norms, the float
embeddings); a later start builds the model's skeleton on the meta device (no float32 copy of the
matrices is ever made), puts the same int8 modules in place and loads the state into them. The model is then the same
module for module and number for number as a fresh quantisation (`tests/dialogue/test_int8_cache.py`).

The file sits under ``$DUPLEX_CACHE/int8/`` with a key over everything that decides the numbers:
the source weights (the converted cache's directory name carries the GGUF's sha256; a user's own
directory is keyed on its files' sizes and times), torch and transformers versions, the
calibration texts, the smoothing alpha and this format's version. A file that fails to load is
reported, deleted and rebuilt. `DUPLEX_INT8_CACHE=0` turns the cache off (every int8 load quantises
again and nothing is written).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

FORMAT = 1


def cache_key(model_dir: Path, *, alpha: float, calibration: Sequence[str], weight_only: bool) -> str:
    """A key over what decides the int8 numbers (see the module doc)."""
    import torch
    import transformers

    files = sorted(
        (p.name, p.stat().st_size, p.stat().st_mtime_ns)
        for p in model_dir.iterdir()
        if p.is_file() and (p.suffix in (".safetensors", ".json") or p.name.endswith(".bin"))
    )
    doc = {
        "format": FORMAT,
        "dir": str(model_dir.resolve()),
        "files": files,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "alpha": alpha,
        "calibration": list(calibration),
        "weight_only": weight_only,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def save(model: PreTrainedModel, path: Path) -> None:
    """Write the quantised model's state dict atomically (a temp file, then a rename)."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        torch.save({"format": FORMAT, "state": model.state_dict()}, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load(path: Path, model_dir: Path, weight_only_cls: Callable[..., Any] | None) -> PreTrainedModel:
    """The int8 model saved at `path`, on a skeleton built from `model_dir`'s config.json.

    Raises on any mismatch (missing or unexpected keys, a tensor left on the meta device): the caller
    then rebuilds from the float weights."""
    import warnings

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with warnings.catch_warnings():  # quantised tensors still go through TypedStorage when loaded
        warnings.simplefilter("ignore", UserWarning)
        doc = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{path}: not an int8 cache of format {FORMAT}")
    state: dict[str, Any] = doc["state"]
    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _int8_modules(model, state, weight_only_cls)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"{path}: missing {list(missing)[:3]}, unexpected {list(unexpected)[:3]}")
    _rebuild_rotary(model)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{path}: left on the meta device: {left[:3]}")
    try:
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(model_dir))
    except OSError:
        pass  # no generation_config.json: the default one stays
    model.eval()
    return model


def _int8_modules(model: Any, state: dict[str, Any], weight_only_cls: Callable[..., Any] | None) -> None:
    """Replace each Linear the state holds as int8 with an empty module of the same kind."""
    import torch
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    for name, mod in list(model.named_modules()):
        if not isinstance(mod, torch.nn.Linear):
            continue
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        if f"{name}._packed_params._packed_params" in state:
            # built 1 x 1 (the constructor packs a zero weight of its size: as costly as the real one),
            # then sized; loading the state packs the real weight once
            new: Any = DynamicLinear(1, 1, bias_=mod.bias is not None, dtype=torch.qint8)
            new.in_features, new.out_features = mod.in_features, mod.out_features
        elif f"{name}.weight_int8" in state:
            if weight_only_cls is None:
                raise ValueError("the cache holds weight-only int8 layers but this torch has no kernel")
            new = weight_only_cls.empty(mod.in_features, mod.out_features, mod.bias is not None)
        else:
            continue  # a float Linear in the cache too
        setattr(owner, attr, new)


def _rebuild_rotary(model: Any) -> None:
    """Rotary embeddings keep `inv_freq` as a non-persistent buffer (not in any state dict): build them
    again on the CPU from the config."""
    for name, mod in list(model.named_modules()):
        buf = getattr(mod, "inv_freq", None)
        if buf is None or not buf.is_meta:
            continue
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, attr, type(mod)(config=model.config))
