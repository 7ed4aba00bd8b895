"""The KV-cache methods compared by the evaluation harness: a registry of name -> cache factory, and the honest
bits per element each cache really stores.

Every method is a `transformers.Cache` usable in `generate()`:

| name              | cache                                                                                      |
|-------------------|--------------------------------------------------------------------------------------------|
| bf16              | `DynamicCache` (the reference)                                                             |
| oscar             | `OscarCache`, per-head calibrated rotations (query / attention targets), fitted clips      |
| oscar-ref         | the reference recipe: one rotation per layer, logit-weighted value target, clips 0.96/0.92 |
| naive-int2        | `OscarCache` with identity rotations and no clip: token-wise asymmetric INT2               |
| hadamard-int2     | `OscarCache` with data-free H·P rotations and no clip (QuaRot-style)                       |
| kivi2             | `KiviCache`: keys per channel, values per token, groups of 32, residual 128 (KIVI-2)       |
| kivi2-g64 / -g128 | KIVI-2 with larger groups (fewer metadata bits: the matched-bits comparisons)              |
| oscar-s32w64      | OSCAR with a 32-token sink and a 64-token window (matched bits against KIVI)               |
| hf-hqq-int2       | transformers' `QuantizedCache(backend="hqq", nbits=2)` (per-token groups of 64, residual 128) |
| naive-int4        | `OscarCache` with identity rotations, no clip, 4 bits: the INT4 reference point            |
| oscar_centered    | OSCAR with `center_keys=True`: calibrated key mean subtracted before storage (`centering.py`) |

All OSCAR-family methods share the sink/window (64/256 by default) so that their differences are the rotation and
clip only; KIVI and the HF cache use their own full-precision residual (128 by default). The window sizes can be
scaled together (`Windows`) for short-context evaluations (multiple choice), where 64 + 256 tokens would hold the
whole prompt in full precision.

Rotations: methods name what they need (`rotations` field): "calibrated" (an OSCAR calibration for the method's
own `OscarConfig`, with its `CalibrationConfig` and `RotationTargets`), or "identity"/"hadamard" (data-free).
`Method.make_cache(model, rotations)` takes the calibrated `OscarRotations` when needed; `RotationStore` makes them
(and reuses calibration statistics).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from ..cache import OscarCache
from ..calibrate import RotationTargets
from ..config import CalibrationConfig, OscarConfig
from ..models import model_geometry, text_config
from ..rotations_io import OscarRotations
from .kivi import KiviCache, KiviConfig

REFERENCE_CLIPS = (0.96, 0.92)  # the reference implementation's fixed key / value clip ratios


@dataclass(frozen=True)
class Windows:
    """Full-precision token budgets shared by the methods of one comparison.

    sink, window: OSCAR-family sink and recent window. residual: KIVI's and the HF cache's full-precision residual.
    """

    sink: int = 64
    window: int = 256
    residual: int = 128

    def describe(self) -> str:
        return f"OSCAR-family sink {self.sink} / window {self.window}; KIVI and HF residual {self.residual}"


@dataclass(frozen=True)
class Method:
    """One KV-cache method.

    Attributes:
        name: registry key (used in result files and on the command line).
        label: human-readable description for tables.
        family: "bf16", "oscar", "kivi" or "hf-quantized".
        rotations: for the oscar family, "calibrated", "identity" or "hadamard".
        oscar: the `OscarConfig` (oscar family): what the cache stores, and the layout calibration fits for.
        calibration: the `CalibrationConfig` of a "calibrated" method.
        targets: how its rotations are built (`RotationTargets`; the ablations change it).
        kivi: the `KiviConfig` (kivi family).
        hf: `QuantizedCache` keyword arguments (hf-quantized family).
    """

    name: str
    label: str
    family: str
    rotations: str | None = None
    oscar: OscarConfig | None = None
    calibration: CalibrationConfig = CalibrationConfig()
    targets: RotationTargets = RotationTargets()
    kivi: KiviConfig | None = None
    hf: dict[str, Any] = field(default_factory=dict)

    @property
    def needs_calibration(self) -> bool:
        return self.family == "oscar" and self.rotations == "calibrated"

    def make_cache(self, model, rotations: OscarRotations | None = None) -> Cache:
        """A fresh cache of this method for `model` (calibrated `rotations` required when `needs_calibration`)."""
        if self.family == "bf16":
            return DynamicCache(config=model.config)
        if self.family == "oscar":
            if self.rotations == "calibrated":
                if rotations is None:
                    raise ValueError(
                        f"method {self.name!r} needs calibrated OSCAR rotations: run `oscar-hf calibrate` (or "
                        "`oscar_hf.calibrate.calibrate`) and pass them"
                    )
            else:
                rotations = _data_free(model, self.rotations)
            return OscarCache(model, rotations, self.oscar)
        if self.family == "kivi":
            return KiviCache(model, self.kivi)
        if self.family == "hf-quantized":
            return hf_quantized_cache(model, **self.hf)
        raise ValueError(f"unknown method family {self.family!r}")

    def describe(self) -> dict[str, Any]:
        """JSON-able description (recorded beside every result)."""
        out: dict[str, Any] = {"name": self.name, "label": self.label, "family": self.family}
        if self.oscar is not None:
            out["rotations"] = self.rotations
            out["oscar_config"] = self.oscar.to_dict()
            if self.needs_calibration:
                out["calibration_config"] = {k: v for k, v in self.calibration.to_dict().items()
                                             if k not in ("tokens", "sequence_length", "clip_grid")}
                out["rotation_targets"] = self.targets.describe()
        if self.kivi is not None:
            out["kivi_config"] = self.kivi.__dict__.copy()
        if self.hf:
            out["hf_quantized_cache"] = dict(self.hf)
        return out


_DATA_FREE: dict[tuple, OscarRotations] = {}


def _data_free(model, kind: str) -> OscarRotations:
    # Keyed by the model's geometry, not id(model): ids are reused once a model is freed, and a stale entry would be
    # another model's rotations.
    key = (model_geometry(model.config), kind)
    if key not in _DATA_FREE:
        _DATA_FREE[key] = OscarRotations.data_free(model, kind)
    return _DATA_FREE[key]


# ------------------------------------------------------------------------------------------------ registry
def oscar_config(windows: Windows, **changes) -> OscarConfig:
    return OscarConfig(sink_tokens=windows.sink, window_tokens=windows.window, **changes)


def oscar_method(name: str, label: str, config: OscarConfig, rotations: str = "calibrated", **calibration) -> Method:
    """An OSCAR-family method; `calibration` holds `CalibrationConfig` fields and, under `targets`, `RotationTargets`."""
    targets = calibration.pop("targets", RotationTargets())
    return Method(name, label, "oscar", rotations, config, CalibrationConfig(**calibration), targets)


def paper_layout(windows: Windows, **changes) -> OscarConfig:
    """The paper's storage layout: token-wise keys (clipped, one scale/minimum per token), demotion in blocks of 8."""
    return oscar_config(windows, key_granularity="token", demotion_block=8, **changes)


# the paper's recipe keeps the calibrated key rotation as it is, and has no per-head refinements
PAPER_CALIBRATION = dict(choose_key_basis=False, key_channel_bits="uniform")


def main_methods(windows: Windows = Windows()) -> dict[str, Method]:
    """The side-by-side comparison, in table order."""
    off = dict(key_clip="none", value_clip="none")
    sink_small, window_small = max(windows.sink // 2, 0), max(windows.window // 4, 0)
    r = windows.residual
    methods = [
        Method("bf16", "BF16 DynamicCache", "bf16"),
        oscar_method("oscar", "OSCAR INT2, oscar-hf default (channel-wise keys over per-head blocks, each 2-bit head's "
                     "raw channels at 0/2/4 bits water-filled by held-out query energy x key error, 4-bit heads in a "
                     "per-head basis; values U·H·P token-wise, fitted clips)", oscar_config(windows)),
        oscar_method("oscar-token", "OSCAR INT2 in the paper's layout (token-wise keys, per-head U·H·P, fitted clips)",
                     paper_layout(windows), **PAPER_CALIBRATION),
        oscar_method("oscar-ref", "OSCAR reference recipe (paper layout, per-layer R, logit V target, clips 0.96/0.92)",
                     paper_layout(windows, key_clip=REFERENCE_CLIPS[0], value_clip=REFERENCE_CLIPS[1]),
                     **PAPER_CALIBRATION, targets=RotationTargets(per_head=False, value_target="logit")),
        Method("naive-int2", "naive INT2 (token-wise, no rotation, no clip)", "oscar", "identity",
               paper_layout(windows, **off)),
        Method("hadamard-int2", "Hadamard-only INT2 (H·P, no clip; QuaRot-style)", "oscar", "hadamard",
               paper_layout(windows, **off)),
        Method("kivi2", f"KIVI-2 (K per-channel, V per-token, group 32, residual {r})", "kivi",
               kivi=KiviConfig(2, 32, r)),
        Method("kivi2-g64", f"KIVI-2, group 64, residual {max(r, 64)} (matched bits)", "kivi",
               kivi=KiviConfig(2, 64, max(r, 64))),
        Method("kivi2-g128", f"KIVI-2, group 128, residual {max(r, 128)}", "kivi", kivi=KiviConfig(2, 128, max(r, 128))),
        oscar_method("oscar-s32w64", f"OSCAR INT2, sink {sink_small} / window {window_small} (matched bits)",
                     oscar_config(Windows(sink_small, window_small, r))),
        Method("hf-hqq-int2", f"transformers QuantizedCache, HQQ 2-bit, per-token groups of 64, residual {r}",
               "hf-quantized", hf=dict(backend="hqq", nbits=2, axis_key=1, axis_value=1, q_group_size=64,
                                       residual_length=r)),
        Method("naive-int4", "naive INT4 (token-wise, no rotation, no clip)", "oscar", "identity",
               paper_layout(windows, bits=4, **off)),
    ]
    return {m.name: m for m in methods}


def ablation_methods(windows: Windows = Windows()) -> dict[str, Method]:
    """The paper's ablations (Tables 4-5 and the clip study), on OSCAR in the paper's layout (token-wise keys), with
    its calibration statistics reused."""
    base = paper_layout(windows)
    T = RotationTargets
    rows: list[tuple[str, str, OscarConfig, RotationTargets, str]] = [
        ("oscar-token", "OSCAR in the paper's layout (U·H·P, per head, attention V target, fitted clips)", base, T(),
         "calibrated"),
        ("no-U", "w/o U: H·P (data-free) + fitted clips", base, T("hadamard", "hadamard"), "calibrated"),
        ("no-H", "w/o H: U·P", base, T(hadamard=False), "calibrated"),
        ("no-P", "w/o P: U·H (group = head_dim: P cannot matter)", base, T(permutation=False), "calibrated"),
        ("g32", "OSCAR, quantization groups of 32", base.replace(group_size=32), T(), "calibrated"),
        ("g32-no-P", "w/o P, groups of 32 (where P can matter)", base.replace(group_size=32), T(permutation=False),
         "calibrated"),
        ("no-rotation", "no rotation, fitted clips only", base, T("identity", "identity"), "calibrated"),
        ("ktk-vtv", "U from KᵀK / VᵀV (reconstruction targets)", base, T("key", "value"), "calibrated"),
        ("logit-v", "logit-weighted V target (reference code)", base, T(value_target="logit"), "calibrated"),
        ("shared-per-layer", "one rotation per layer (reference code)", base, T(per_head=False), "calibrated"),
        ("clip-none", "no clip", base.replace(key_clip="none", value_clip="none"), T(), "calibrated"),
        ("clip-ref", "fixed clips 0.96 / 0.92 (reference)",
         base.replace(key_clip=REFERENCE_CLIPS[0], value_clip=REFERENCE_CLIPS[1]), T(), "calibrated"),
        ("sw-0-0", "sink 0 / window 0", base.replace(sink_tokens=0, window_tokens=0), T(), "calibrated"),
        ("sw-32-128", "sink 32 / window 128", base.replace(sink_tokens=32, window_tokens=128), T(), "calibrated"),
        ("sw-128-512", "sink 128 / window 512", base.replace(sink_tokens=128, window_tokens=512), T(), "calibrated"),
        ("naive-int2-sw-0-0", "naive INT2, sink 0 / window 0 (the paper's naive baseline)",
         base.replace(sink_tokens=0, window_tokens=0, key_clip="none", value_clip="none"), T(), "identity"),
    ]
    return {name: oscar_method(name, label, cfg, rot, targets=targets, **PAPER_CALIBRATION)
            for name, label, cfg, targets, rot in rows}


def format_methods(windows: Windows = Windows()) -> dict[str, Method]:
    """The default with one of its refinements taken away (`oscar-hf eval format`): what each lever adds."""
    base = oscar_config(windows)
    rows = [
        ("oscar-token-centered", "paper layout, keys centered by their calibrated mean", paper_layout(windows),
         dict(PAPER_CALIBRATION, center_keys=True)),
        ("oscar-uniform-b64", "the default with key blocks of 64 for every head (no per-head allocation)", base,
         dict(key_block_allocation="uniform")),
        ("oscar-no-wide", "the default without 4-bit heads (every head at 2 bits)", base, dict(wide_heads="none")),
        ("oscar-uniform-channels", "the default with 2 bits in every key channel of the per-head basis "
         "(CalibrationConfig.key_channel_bits='uniform')", base, dict(key_channel_bits="uniform")),
        ("oscar-value-clip-ref", "the default with the reference's fixed value clip 0.92 instead of the fitted ones",
         base.replace(value_clip=REFERENCE_CLIPS[1]), {}),
        ("oscar-value-clip-none", "the default without value clipping", base.replace(value_clip="none"), {}),
    ]
    return {name: oscar_method(name, label, cfg, **calibration) for name, label, cfg, calibration in rows}


def all_methods(windows: Windows = Windows()) -> dict[str, Method]:
    methods = dict(main_methods(windows))
    for name, m in {**ablation_methods(windows), **format_methods(windows)}.items():
        methods.setdefault(name, m)
    return methods


def get_method(name: str, windows: Windows = Windows()) -> Method:
    methods = all_methods(windows)
    if name not in methods:
        raise ValueError(f"unknown method {name!r}; known methods: {', '.join(methods)}")
    return methods[name]


# ------------------------------------------------------------------------------------------------ rotations
def calibration_key(method: Method, tokens: int, sequence_length: int) -> str:
    """What determines a method's calibrated rotation file (its folder name): the storage layout calibration fits
    for, the calibration settings and the rotation targets."""
    calibration = method.calibration.replace(tokens=tokens, sequence_length=sequence_length)
    parts = {**method.oscar.to_dict(), **calibration.to_dict(), **method.targets.describe()}
    return ",".join(f"{k}={'/'.join(f'{r:g}' for r in v) if isinstance(v, list) else v}" for k, v in parts.items())


class RotationStore:
    """Calibrates once per model, then rebuilds rotations for other methods from the saved statistics.

    `rotations_for(method)` returns the calibrated `OscarRotations` for a method that needs them (None otherwise).
    """

    def __init__(self, model, tokenizer, data=None, calibration_tokens: int = 8192, progress: bool = True,
                 calibration_sequence_length: int = 2048):
        self.model, self.tokenizer, self.data = model, tokenizer, data
        self.calibration_tokens = calibration_tokens
        self.calibration_sequence_length = calibration_sequence_length
        self.progress = progress
        self.statistics = None
        self.cache: dict[str, OscarRotations] = {}
        self.seconds: dict[str, float] = {}

    def key(self, method: Method) -> str:
        return calibration_key(method, self.calibration_tokens, self.calibration_sequence_length)

    def put(self, method: Method, rotations: OscarRotations) -> None:
        self.cache[self.key(method)] = rotations

    def rotations_for(self, method: Method) -> OscarRotations | None:
        if not method.needs_calibration:
            return None
        import time

        from ..calibrate import calibrate

        key = self.key(method)
        if key not in self.cache:
            start = time.perf_counter()
            calibration = method.calibration.replace(tokens=self.calibration_tokens,
                                                     sequence_length=self.calibration_sequence_length)
            rotations = calibrate(self.model, self.tokenizer, data=self.data, config=method.oscar,
                                  calibration=calibration, progress=self.progress, statistics=self.statistics,
                                  targets=method.targets)
            self.statistics = rotations.statistics
            self.seconds[key] = time.perf_counter() - start
            self.cache[key] = rotations
        return self.cache[key]


# ------------------------------------------------------------------------------------------------ bits
def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (tuple, list)):
        return sum(_tensor_bytes(v) for v in obj)
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("optimum"):  # quanto QTensor
        return sum(_tensor_bytes(getattr(obj, name)) for name in ("_data", "_scale", "_shift") if hasattr(obj, name))
    return 0


def cache_bits(cache: Cache) -> dict[str, Any]:
    """Bits per K/V element the cache really stores for its long-context (full-attention) layers.

    Metadata (scales, minima / zeros) and full-precision windows or residuals are included. `bits_per_element`
    counts the bytes that hold valid tokens; `bits_per_element_allocated` also counts spare capacity that a cache
    reserves for growth (OscarCache's history and window buffers). Sliding-window layers (BF16 in every method) are
    reported apart.
    """
    if isinstance(cache, OscarCache):
        r = cache.memory_report()
        return {"tokens": r["tokens"], "bits_per_element": r["bits_per_element_used"],
                "bits_per_element_allocated": r["bits_per_element"], "layers": r["oscar_layers"]}
    if isinstance(cache, KiviCache):
        r = cache.memory_report()
        return {"tokens": r["tokens"], "bits_per_element": r["bits_per_element"],
                "bits_per_element_allocated": r["bits_per_element"], "layers": len(cache.geometry.oscar_layers)}
    stored = elements = layers = 0
    tokens = 0
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False) or not layer.is_initialized:
            continue
        layers += 1
        tokens = layer.get_seq_length()
        k = layer.keys
        if k.dim() == 4 and k.numel():
            b, h, d = k.shape[0], k.shape[1], k.shape[-1]
        else:  # a quantized layer whose residual is empty: read the shape from the quantized keys
            b, h, d = _quantized_shape(layer)
        elements += 2 * b * h * d * tokens
        stored += _tensor_bytes(layer.keys) + _tensor_bytes(layer.values)
        stored += _tensor_bytes(getattr(layer, "_quantized_keys", None)) + _tensor_bytes(getattr(layer, "_quantized_values", None))
    bits = 8 * stored / elements if elements else float("nan")
    return {"tokens": tokens, "bits_per_element": bits, "bits_per_element_allocated": bits, "layers": layers}


def _quantized_shape(layer) -> tuple[int, int, int]:
    q = layer._quantized_keys
    meta = q[1] if isinstance(q, tuple) else None
    if meta is not None and "shape" in meta:
        shape = meta["shape"]
        return shape[0], shape[1], shape[-1]
    shape = q.shape
    return shape[0], shape[1], shape[-1]


def nominal_history_bits(method: Method, head_dim: int) -> float | None:
    """Bits per element of the quantized part alone (the asymptote at long context), from the configuration."""
    if method.family == "oscar":
        return method.calibration.history_bits_per_element(method.oscar, head_dim)
    if method.family == "kivi":
        return method.kivi.history_bits_per_element(head_dim)
    if method.family == "hf-quantized":
        return method.hf["nbits"] + 32 / min(method.hf["q_group_size"], head_dim)
    return 16.0


# ------------------------------------------------------------------------------------------------ HF QuantizedCache
def hf_quantized_cache(model, backend: str = "hqq", **kwargs) -> Cache:
    """transformers' `QuantizedCache`; for hybrid models (which it refuses: only full-attention layers) the same
    transformers quantized layer class is used on the full-attention layers and BF16 sliding windows elsewhere."""
    from transformers.cache_utils import DynamicSlidingWindowLayer, HQQQuantizedLayer, QuantizedCache, QuantoQuantizedLayer

    config = model.config
    geometry = model_geometry(config)
    if all(kind == "oscar" for kind in geometry.plan):
        return QuantizedCache(backend=backend, config=config, **kwargs)
    layer_class = {"hqq": HQQQuantizedLayer, "quanto": QuantoQuantizedLayer}[backend]
    layers = [
        layer_class(**kwargs) if kind == "oscar" else DynamicSlidingWindowLayer(sliding_window=geometry.sliding_windows[i])
        for i, kind in enumerate(geometry.plan)
    ]
    return Cache(layers=layers)


# ------------------------------------------------------------------------------------------------ cache surgery
def fill_from_prefill(cache: Cache, prefilled: DynamicCache) -> Cache:
    """Feeds the keys/values of a BF16 prefill into `cache`, layer by layer, exactly as the model's own prefill
    forward would have (`cache.update(k, v, layer)` with the post-RoPE states).

    Valid because every cache here lets the tokens of a forward pass attend to each other exactly: the prefill's
    hidden states, hence its keys/values, are those of BF16. Sliding-window layers, BF16 in every method, are copied.
    Returns `cache`.
    """
    if len(cache.layers) != len(prefilled.layers):
        raise ValueError(f"caches have {len(cache.layers)} and {len(prefilled.layers)} layers")
    for i, source in enumerate(prefilled.layers):
        if getattr(source, "is_sliding", False):
            if not getattr(cache.layers[i], "is_sliding", False):
                raise ValueError(f"layer {i} is a sliding-window layer in the prefill but not in the target cache")
            cache.layers[i] = copy.deepcopy(source)
            continue
        if isinstance(cache, OscarCache):
            cache.store(source.keys, source.values, i)  # no attention call follows: nothing to hand over
        else:
            cache.update(source.keys, source.values, i)
    return cache


def head_dim_of(model) -> int:
    cfg = text_config(model.config)
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


__all__ = [
    "Method", "Windows", "main_methods", "ablation_methods", "format_methods", "all_methods", "get_method", "RotationStore",
    "cache_bits", "nominal_history_bits", "hf_quantized_cache", "fill_from_prefill", "head_dim_of",
]
