"""`OscarRotations`: the calibrated artefact (rotations + clip thresholds), saved Hub-style beside a model.

On disk (a folder, or a Hub repo where it sits beside the model's own files):
- `oscar_rotations.safetensors`: per OSCAR layer l, `layers.{l}.key_rotation` / `layers.{l}.value_rotation`
  `[num_key_value_heads, head_dim, head_dim]` float32, and `layers.{l}.key_eigenvalues` / `value_eigenvalues`
  `[num_key_value_heads, head_dim]` (ascending, from the covariance targets); with key centering
  (`OscarConfig.center_keys`), `layers.{l}.key_mean` `[num_key_value_heads, head_dim]` float32, the mean of the
  post-RoPE keys that the cache subtracts before storing them.
- `oscar_rotations.json`: format version, model identity and geometry, calibration data and token counts, method
  options, fitted clip ratios (and the error curves they were fitted on), `center_keys`, the OscarConfig used,
  library versions.

Format versions: 1 (no key means), 2 (key means present), 3 (adds `layout`: the storage layout the rotations and
clips were fitted for — `key_granularity` and `demotion_block`, then also the block of channel-wise keys), 4 (the
layout adds `key_block` and `key_block_allocation`; with a fitted allocation the JSON's `key_blocks` gives each OSCAR
layer's channel-wise key block per KV head, `{"layer": [blocks]}`), 5 (adds `head_bits`, `{"layer": [bits per KV
head]}` or null: 2, or 4 for the wide heads that calibration keeps at 4 bits, `OscarConfig.wide_heads`; a version 4 file
loads with every head at 2 bits), 6 (adds `key_wide_channels`, `{"layer": [wide key channels per KV head]}` or
null: the channels of each head that calibration water-filled to 4 bits, as many others keeping only their block
mean, `OscarConfig.key_channel_bits`, `quant.quantize_wide_channels`; the head's key rotation is the permutation that
sorts its raw channels for them; a version 5 file loads with none). Versions 1 and 2 were written for token-wise keys
demoted in blocks of 8, version 3 for one key block (its demotion_block) everywhere, and load with that layout;
`OscarCache` follows a file's layout unless given a config (and warns when the config's layout differs from the
file's).

Loading never unpickles (safetensors + JSON only) and validates shapes, finiteness and orthogonality; `validate_for`
checks the file against a model config and names the field and both values on mismatch.

Beside the model: `from_pretrained(model)` looks in the model's own folder or Hub repo (root, then `oscar/`). The JSON
may carry `weight_fingerprint` (`weight_fingerprint(model)`: a hash of a few projection weights), which
`check_fingerprint` compares, so rotations calibrated for other weights of the same shapes are caught.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .config import KEY_BLOCK_ALLOCATIONS, OscarConfig
from .format import WIDE_BITS, check_head_layout
from .models import ModelGeometry, model_geometry, text_config
from .rotation import build_rotation, orthogonality_error

FORMAT_NAME = "oscar-rotations"
FORMAT_VERSION = 6  # the version written
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6)
# what format 1 and 2 files were calibrated for
LEGACY_LAYOUT = {"key_granularity": "token", "demotion_block": 8, "key_block": 8, "key_block_allocation": "uniform"}
LAYOUT_FIELDS = ("key_granularity", "demotion_block", "key_block", "key_block_allocation")
# the layout a file without one was calibrated for: the default storage layout, with a fitted block allocation
DEFAULT_LAYOUT = {"key_granularity": "channel", "demotion_block": 128, "key_block": 64, "key_block_allocation": "fitted"}
WEIGHTS_NAME = "oscar_rotations.safetensors"
CONFIG_NAME = "oscar_rotations.json"
ROTATIONS_SUBFOLDER = "oscar"  # where rotations sit inside a model folder or repo
FINGERPRINT_KEY = "weight_fingerprint"  # metadata field: see `weight_fingerprint`
ORTHOGONALITY_TOLERANCE = 1e-4
# Geometry fields that must match between the rotation file and the model.
MATCHED_FIELDS = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")


class RotationFileError(ValueError):
    """A rotation file is malformed, or does not belong to the model it is used with."""


class OscarRotations:
    """Per-layer, per-KV-head key/value rotations and clip ratios for one model.

    Args:
        geometry: model identity and shapes (see `ModelGeometry`), as a dict.
        key_rotations, value_rotations: `{layer: [H_kv, d, d]}` float32 orthogonal matrices.
        key_eigenvalues, value_eigenvalues: `{layer: [H_kv, d]}`.
        key_clips, value_clips: `{layer: ratio}` fitted clip ratios, or `None` when not fitted.
        metadata: calibration data, method options, fit curves, versions.
        key_means: `{layer: [H_kv, d]}` key means to subtract before storage (`OscarConfig.center_keys`), or `None`.
        layout: the storage layout the rotations were fitted for (`LAYOUT_FIELDS` of `OscarConfig`); default: the
            default `OscarConfig`'s.
        key_blocks: `{layer: (block per KV head, ...)}` channel-wise key blocks allocated at calibration
            (`OscarConfig.key_block_allocation="fitted"`), or `None`.
        head_bits: `{layer: (history bits per KV head, ...)}`: 2, or `quant.WIDE_BITS` for the wide heads picked at
            calibration (`OscarConfig.wide_heads`), or `None` (every head at the layout's bits).
        key_wide_channels: `{layer: (wide key channels per KV head, ...)}` water-filled at calibration
            (`OscarConfig.key_channel_bits`), or `None`.
    """

    def __init__(
        self,
        geometry: dict[str, Any],
        key_rotations: dict[int, torch.Tensor],
        value_rotations: dict[int, torch.Tensor],
        key_eigenvalues: dict[int, torch.Tensor] | None = None,
        value_eigenvalues: dict[int, torch.Tensor] | None = None,
        key_clips: dict[int, float] | None = None,
        value_clips: dict[int, float] | None = None,
        metadata: dict[str, Any] | None = None,
        key_means: dict[int, torch.Tensor] | None = None,
        layout: dict[str, Any] | None = None,
        key_blocks: dict[int, Any] | None = None,
        head_bits: dict[int, Any] | None = None,
        key_wide_channels: dict[int, Any] | None = None,
    ):
        self.geometry = dict(geometry)
        layout = dict(layout or {})
        if "demotion_block" in layout and "key_block" not in layout:  # a layout of one key block (format 3)
            layout = {"key_block": layout["demotion_block"], "key_block_allocation": "uniform"} | layout
        self.layout = dict(DEFAULT_LAYOUT) | layout
        try:
            if self.layout["key_block_allocation"] not in KEY_BLOCK_ALLOCATIONS:
                raise ValueError(f"key_block_allocation must be one of {KEY_BLOCK_ALLOCATIONS}")
            OscarConfig(**{k: v for k, v in self.layout.items() if k != "key_block_allocation"})
        except (TypeError, ValueError) as e:
            raise RotationFileError(f"rotation layout {self.layout} is not valid: {e}") from None
        self.key_rotations = {int(k): v.float().contiguous() for k, v in key_rotations.items()}
        self.value_rotations = {int(k): v.float().contiguous() for k, v in value_rotations.items()}
        self.key_eigenvalues = {int(k): v.float() for k, v in (key_eigenvalues or {}).items()}
        self.value_eigenvalues = {int(k): v.float() for k, v in (value_eigenvalues or {}).items()}
        self.key_clips = {int(k): float(v) for k, v in key_clips.items()} if key_clips else None
        self.value_clips = {int(k): float(v) for k, v in value_clips.items()} if value_clips else None
        self.key_means = {int(k): v.float().contiguous() for k, v in key_means.items()} if key_means else None
        try:
            self.key_blocks = ({int(k): tuple(int(b) for b in v) for k, v in key_blocks.items()}
                               if key_blocks else None)
        except (TypeError, ValueError, AttributeError):
            raise RotationFileError(f"key_blocks must map layers to lists of integers, got {key_blocks!r}") from None
        try:
            self.head_bits = ({int(k): tuple(int(b) for b in v) for k, v in head_bits.items()} if head_bits else None)
        except (TypeError, ValueError, AttributeError):
            raise RotationFileError(f"head_bits must map layers to lists of integers, got {head_bits!r}") from None
        try:
            self.key_wide_channels = ({int(k): tuple(int(n) for n in v) for k, v in key_wide_channels.items()}
                                      if key_wide_channels else None)
        except (TypeError, ValueError, AttributeError):
            raise RotationFileError(f"key_wide_channels must map layers to lists of integers, "
                                    f"got {key_wide_channels!r}") from None
        self.metadata = dict(metadata or {})
        if not isinstance(self.metadata.get("method", {}), dict):
            raise RotationFileError(f"rotation metadata field 'method' must be an object, got {self.metadata['method']!r:.80}")
        self._check_consistency()

    # ------------------------------------------------------------------ accessors
    @property
    def layers(self) -> list[int]:
        return sorted(self.key_rotations)

    @property
    def center_keys(self) -> bool:
        """True when these rotations carry key means (the cache then subtracts them before storing keys)."""
        return self.key_means is not None

    def key_mean(self, layer: int) -> torch.Tensor | None:
        return None if self.key_means is None else self.key_means[layer]

    def key_block(self, layer: int) -> tuple[int, ...] | None:
        """The channel-wise key block of each KV head of `layer` allocated at calibration, or None."""
        return None if self.key_blocks is None else self.key_blocks[layer]

    def head_bit(self, layer: int) -> tuple[int, ...] | None:
        """The history bits of each KV head of `layer` (wide heads at `quant.WIDE_BITS`), or None."""
        return None if self.head_bits is None else self.head_bits[layer]

    def key_wide_channel(self, layer: int) -> tuple[int, ...] | None:
        """The wide key channels of each KV head of `layer` (`quant.quantize_wide_channels`), or None."""
        return None if self.key_wide_channels is None else self.key_wide_channels[layer]

    @property
    def wide_heads(self) -> list[tuple[int, int]]:
        """The (layer, KV head) pairs stored at `quant.WIDE_BITS`."""
        return [(layer, h) for layer, bits in sorted((self.head_bits or {}).items()) for h, b in enumerate(bits)
                if b == WIDE_BITS]

    def key_clip(self, layer: int) -> float | None:
        return None if self.key_clips is None else self.key_clips.get(layer)

    def value_clip(self, layer: int) -> float | None:
        return None if self.value_clips is None else self.value_clips.get(layer)

    def __repr__(self):
        g = self.geometry
        return (
            f"OscarRotations(model_type={g.get('model_type')!r}, layers={len(self.layers)}, "
            f"kv_heads={g.get('num_key_value_heads')}, head_dim={g.get('head_dim')}, "
            f"clips={'fitted' if self.key_clips else 'none'}, center_keys={self.center_keys})"
        )

    # ------------------------------------------------------------------ data-free constructors
    @classmethod
    def data_free(cls, config_or_geometry, kind: str = "hadamard") -> "OscarRotations":
        """Rotations that need no calibration: `"identity"` (naive quantization) or `"hadamard"` (H·P, QuaRot-style)."""
        geometry = _as_geometry(config_or_geometry)
        d, h = geometry.head_dim, geometry.num_key_value_heads
        if kind == "identity":
            rotation = torch.eye(d, dtype=torch.float64)
        elif kind == "hadamard":
            rotation, _ = build_rotation(torch.eye(d), use_eigenvectors=False)
        else:
            raise ValueError(f"data-free rotation kind must be 'identity' or 'hadamard', got {kind!r}")
        stack = rotation.float().expand(h, d, d).clone()
        rots = {layer: stack.clone() for layer in geometry.oscar_layers}
        return cls(
            _geometry_dict(geometry),
            rots,
            {layer: r.clone() for layer, r in rots.items()},
            metadata={"method": {"key_target": kind, "value_target": kind, "data_free": True}},
        )

    # ------------------------------------------------------------------ validation
    def _check_consistency(self) -> None:
        g = self.geometry
        missing = [f for f in MATCHED_FIELDS if f not in g]
        if missing:
            raise RotationFileError(f"rotation metadata lacks the model field(s) {missing}")
        h, d = int(g["num_key_value_heads"]), int(g["head_dim"])
        if set(self.key_rotations) != set(self.value_rotations):
            raise RotationFileError("key and value rotations cover different layers")
        expected_layers = g.get("oscar_layers")
        if expected_layers is not None and sorted(expected_layers) != self.layers:
            raise RotationFileError(
                f"rotation file covers layers {self.layers} but its metadata lists OSCAR layers {sorted(expected_layers)}"
            )
        for name, table in (("key_rotation", self.key_rotations), ("value_rotation", self.value_rotations)):
            for layer, rot in table.items():
                if tuple(rot.shape) != (h, d, d):
                    raise RotationFileError(
                        f"layers.{layer}.{name} has shape {tuple(rot.shape)}, expected {(h, d, d)} "
                        f"(num_key_value_heads={h}, head_dim={d})"
                    )
                if not torch.isfinite(rot).all():
                    raise RotationFileError(f"layers.{layer}.{name} contains NaN or Inf")
                err = orthogonality_error(rot)
                if err > ORTHOGONALITY_TOLERANCE:
                    raise RotationFileError(
                        f"layers.{layer}.{name} is not orthogonal: max |RᵀR − I| = {err:.2e} > {ORTHOGONALITY_TOLERANCE}"
                    )
        if self.key_means is not None:
            if set(self.key_means) != set(self.key_rotations):
                raise RotationFileError(
                    f"key means cover layers {sorted(self.key_means)}, rotations cover {self.layers}"
                )
            for layer, mean in self.key_means.items():
                if tuple(mean.shape) != (h, d):
                    raise RotationFileError(
                        f"layers.{layer}.key_mean has shape {tuple(mean.shape)}, expected {(h, d)} "
                        f"(num_key_value_heads={h}, head_dim={d})"
                    )
                if not torch.isfinite(mean).all():
                    raise RotationFileError(f"layers.{layer}.key_mean contains NaN or Inf")
        chunk = int(self.layout["demotion_block"])
        for name, table in (("key_blocks", self.key_blocks), ("head_bits", self.head_bits),
                            ("key_wide_channels", self.key_wide_channels)):
            if table is not None and set(table) != set(self.key_rotations):
                raise RotationFileError(f"{name} cover layers {sorted(table)}, rotations cover {self.layers}")
        for layer in self.layers:
            try:
                check_head_layout(h, d, chunk, self.key_block(layer), self.head_bit(layer), self.key_wide_channel(layer))
            except ValueError as e:
                raise RotationFileError(f"layer {layer}: {e}") from None
        layout = OscarConfig(**{k: v for k, v in self.layout.items() if k != "key_block_allocation"})
        if self.head_bits is not None and not layout.wide_layout:
            raise RotationFileError(f"head_bits need a layout with channel-wise 2-bit keys, got {self.layout}")
        if self.key_wide_channels is not None and layout.key_granularity != "channel":
            raise RotationFileError(f"key_wide_channels need a layout with channel-wise keys, got {self.layout}")
        for name, clips in (("key", self.key_clips), ("value", self.value_clips)):
            if clips is None:
                continue
            if set(clips) != set(self.key_rotations):
                raise RotationFileError(f"{name} clips cover layers {sorted(clips)}, rotations cover {self.layers}")
            bad = {layer: r for layer, r in clips.items() if not 0.0 < r <= 1.0}
            if bad:
                raise RotationFileError(f"{name} clip ratios must lie in (0, 1], got {bad}")

    def validate_for(self, config) -> ModelGeometry:
        """Checks that these rotations belong to a model with `config`; returns the model's geometry."""
        geometry = model_geometry(config)
        theirs = _geometry_dict(geometry)
        for field_name in MATCHED_FIELDS:
            mine, other = self.geometry.get(field_name), theirs[field_name]
            if mine != other:
                raise RotationFileError(
                    f"rotation file does not match the model: {field_name} is {mine!r} in the rotation file but "
                    f"{other!r} in the model config (rotations calibrated for "
                    f"{self.geometry.get('name_or_path', 'another model')!r})"
                )
        if sorted(geometry.oscar_layers) != self.layers:
            raise RotationFileError(
                f"rotation file does not match the model: it has rotations for layers {self.layers} but the model's "
                f"full-attention layers are {list(geometry.oscar_layers)}"
            )
        return geometry

    # ------------------------------------------------------------------ serialisation
    def state_dict(self) -> dict[str, torch.Tensor]:
        tensors = {}
        for layer in self.layers:
            tensors[f"layers.{layer}.key_rotation"] = self.key_rotations[layer]
            tensors[f"layers.{layer}.value_rotation"] = self.value_rotations[layer]
            if layer in self.key_eigenvalues:
                tensors[f"layers.{layer}.key_eigenvalues"] = self.key_eigenvalues[layer]
            if layer in self.value_eigenvalues:
                tensors[f"layers.{layer}.value_eigenvalues"] = self.value_eigenvalues[layer]
            if self.key_means is not None:
                tensors[f"layers.{layer}.key_mean"] = self.key_means[layer]
        return {k: v.contiguous() for k, v in tensors.items()}

    def to_json_dict(self) -> dict[str, Any]:
        def clips(table):
            return None if table is None else {str(k): v for k, v in sorted(table.items())}

        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "model": self.geometry,
            "layout": self.layout,
            "clip": {"key": clips(self.key_clips), "value": clips(self.value_clips)},
            "center_keys": self.center_keys,
            "key_blocks": None if self.key_blocks is None else {str(k): list(v) for k, v in sorted(self.key_blocks.items())},
            "head_bits": None if self.head_bits is None else {str(k): list(v) for k, v in sorted(self.head_bits.items())},
            "key_wide_channels": (None if self.key_wide_channels is None
                                  else {str(k): list(v) for k, v in sorted(self.key_wide_channels.items())}),
            **self.metadata,
        }

    def save_pretrained(self, save_directory: str | os.PathLike) -> Path:
        """Writes `oscar_rotations.safetensors` and `oscar_rotations.json` into `save_directory`."""
        directory = Path(save_directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file(self.state_dict(), str(directory / WEIGHTS_NAME), metadata={"format": FORMAT_NAME})
        (directory / CONFIG_NAME).write_text(json.dumps(self.to_json_dict(), indent=2, default=_json_default) + "\n")
        return directory

    @classmethod
    def from_pretrained(
        cls,
        model_or_path: str | os.PathLike | Any,
        *,
        revision: str | None = None,
        subfolder: str | None = None,
        cache_dir: str | None = None,
        token: str | bool | None = None,
        local_files_only: bool | None = None,
        allow_other_weights: bool = False,
    ) -> "OscarRotations":
        """Loads rotations from a local folder, a Hub repo id (any `revision`), or the offline Hub cache.

        `model_or_path` may also be the model itself: the rotations are then looked up beside it (its
        `config._name_or_path`, a folder or a Hub repo), and checked against its weights (`check_fingerprint`;
        `allow_other_weights=True` turns a mismatch into a warning). Without `subfolder`, a folder or repo is searched
        at its root, then in `oscar/` (where `oscar-hf calibrate` writes by default for a model folder).
        """
        model = None
        if not isinstance(model_or_path, (str, os.PathLike)):
            model = model_or_path
            config = getattr(model, "config", model)
            model_or_path = getattr(config, "_name_or_path", None) or ""
            if not model_or_path:
                raise RotationFileError(
                    "the model has no config._name_or_path to look for rotations beside: pass the rotation folder or repo id"
                )
        subfolders = [subfolder] if subfolder else [None, ROTATIONS_SUBFOLDER]
        local = Path(model_or_path).expanduser()
        if local.is_dir():
            candidates = [local / s if s else local for s in subfolders]
            found = next((c for c in candidates if (c / CONFIG_NAME).is_file()), None)
            if found is None:
                where = " or ".join(str(c) for c in candidates)
                raise RotationFileError(f"{where} is not an OSCAR rotation folder: {CONFIG_NAME} is missing")
            weights, config_path = found / WEIGHTS_NAME, found / CONFIG_NAME
            if not weights.is_file():
                raise RotationFileError(f"{found} is not an OSCAR rotation folder: {WEIGHTS_NAME} is missing")
        elif is_local_path(str(model_or_path)):
            raise RotationFileError(f"rotation folder {model_or_path} not found")
        else:
            weights, config_path = _download(str(model_or_path), subfolders, revision, cache_dir, token, local_files_only)
        try:
            rotations = cls._load(weights, config_path)
        except RotationFileError:
            raise
        except KeyError as e:
            raise RotationFileError(f"{config_path} is malformed: it lacks the field {e.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError) as e:  # a field of the wrong type
            raise RotationFileError(f"{config_path} is malformed: {type(e).__name__}: {e}") from None
        if model is not None:
            rotations.check_fingerprint(model, strict=not allow_other_weights)
        return rotations

    def check_fingerprint(self, model, strict: bool = True) -> None:
        """Checks that these rotations belong to `model`: its geometry first (`validate_for`: a file for another
        architecture or size is named as such), then its weights (`weight_fingerprint`).

        What the fingerprint promises: the same checkpoint passes in any float dtype (float32, bfloat16, float16), on
        any device, whole or tensor-parallel; weights that differ in any decoder layer's attention tensors (q/k/v
        projections, their biases and norms) fail: a tensor rescaled by 0.1% or more, or changed by about 2% of its
        RMS or more (another fine-tune, a random init). MLP and embedding weights are not looked at; changes below
        those sizes are within what float16/bfloat16 rounding does to one checkpoint.

        A mismatch raises `RotationFileError` naming the first tensor that differs (`strict=False`: a warning
        instead, and that model is accepted from then on). Files written before the fingerprint covered every layer
        record only the sign bits of the first and last layers' q/k weights: those are still verified, with that
        weaker check. A file without a fingerprint (older oscar-hf, or `calibrate()` output saved without one)
        loads with a one-time warning; data-free rotations need none. The model's side is computed once per model
        and weight state (see `weight_fingerprint`), so building many caches costs nothing more.
        """
        self.validate_for(getattr(model, "config", model))
        recorded = self.metadata.get(FINGERPRINT_KEY)
        if recorded is None:
            if not self.metadata.get("method", {}).get("data_free"):
                _warn_once(
                    "rotation file records no weight fingerprint, so it cannot be checked against the model's weights "
                    "(an older oscar-hf, `calibrate()` output saved without one, or weights that could not be read: "
                    "quantized or offloaded); recalibrate with `oscar-hf calibrate`, or set "
                    "rotations.metadata['weight_fingerprint'] = weight_fingerprint(model) before saving"
                )
            return
        if not isinstance(recorded, dict) or not isinstance(recorded.get("sketch", recorded.get("sha256")), (dict, str)):
            raise RotationFileError(f"rotation metadata field {FINGERPRINT_KEY!r} is malformed: {recorded!r:.120}")
        if _accepted(self, model):
            return  # accepted before (allow_other_weights): later checks stay quiet
        if "sketch" in recorded:
            problem = _compare_sketches(recorded["sketch"], _weight_sketch(model, copy_result=False))
        else:  # a file written before the sketch: the sign bits of the first and last layers' q/k weights
            theirs = _legacy_sign_fingerprint(model)
            mine = recorded["sha256"]
            problem = None if theirs is None or theirs["sha256"] == mine else (
                f"weight fingerprint {mine[:16]} in the rotation file, {theirs['sha256'][:16]} for the model (this "
                "file's fingerprint holds only the signs of the first and last layers' q/k weights)")
        if problem is None:
            return
        name = getattr(getattr(model, "config", model), "_name_or_path", None) or type(model).__name__
        message = (
            f"rotations were calibrated on other weights than {name!r} (same architecture and shapes): {problem}; "
            "recalibrate, or pass allow_other_weights=True / --allow-other-weights to use them anyway"
        )
        if strict:
            raise RotationFileError(message)
        warnings.warn(message, stacklevel=2)
        _accepted(self, model, add=True)

    @classmethod
    def _load(cls, weights_path: Path, config_path: Path) -> "OscarRotations":
        try:
            meta = json.loads(config_path.read_text())
        except json.JSONDecodeError as e:
            raise RotationFileError(f"{config_path} is not valid JSON: {e}") from None
        if not isinstance(meta, dict):
            raise RotationFileError(f"{config_path} is not an OSCAR rotation file: it holds a JSON "
                                    f"{type(meta).__name__}, not an object")
        if meta.get("format") != FORMAT_NAME:
            raise RotationFileError(f"{config_path} is not an OSCAR rotation file (format={meta.get('format')!r})")
        version = meta.get("format_version")
        if version not in READABLE_VERSIONS:
            raise RotationFileError(
                f"{config_path} has format_version {version!r}; this oscar-hf reads versions {list(READABLE_VERSIONS)}"
            )
        try:
            tensors = load_file(str(weights_path))
        except Exception as e:  # safetensors raises several error types for corrupt files
            raise RotationFileError(f"{weights_path} is not a readable safetensors file: {e}") from None
        tables: dict[str, dict[int, torch.Tensor]] = {
            "key_rotation": {}, "value_rotation": {}, "key_eigenvalues": {}, "value_eigenvalues": {}, "key_mean": {}
        }
        for name, tensor in tensors.items():
            parts = name.split(".")
            if len(parts) != 3 or parts[0] != "layers" or not parts[1].isdigit() or parts[2] not in tables:
                raise RotationFileError(f"{weights_path} has an unexpected tensor {name!r}")
            tables[parts[2]][int(parts[1])] = tensor
        clip = meta.pop("clip", {}) or {}
        center_keys = meta.pop("center_keys", False)
        if center_keys not in (True, False):
            raise RotationFileError(f"{config_path}: center_keys must be true or false, got {center_keys!r}")
        if center_keys != bool(tables["key_mean"]):
            raise RotationFileError(
                f"{config_path} says center_keys={str(center_keys).lower()} but {weights_path.name} "
                f"{'has no' if center_keys else 'has'} layers.*.key_mean tensors"
            )
        geometry = meta.pop("model")
        layout = meta.pop("layout", None) if version >= 3 else dict(LEGACY_LAYOUT)
        if version == 3 and isinstance(layout, dict) and "demotion_block" in layout:
            # one key block (the demotion block) for every head
            layout = {"key_block": layout["demotion_block"], "key_block_allocation": "uniform"} | layout
        key_blocks = meta.pop("key_blocks", None)
        head_bits = meta.pop("head_bits", None) if version >= 5 else None
        key_wide_channels = meta.pop("key_wide_channels", None) if version >= 6 else None
        if not isinstance(layout, dict) or set(layout) != set(LAYOUT_FIELDS):
            raise RotationFileError(f"{config_path}: layout must be an object with the fields {list(LAYOUT_FIELDS)}, "
                                    f"got {layout!r}")
        for key in ("format", "format_version"):
            meta.pop(key)
        return cls(
            geometry,
            tables["key_rotation"],
            tables["value_rotation"],
            tables["key_eigenvalues"],
            tables["value_eigenvalues"],
            clip.get("key"),
            clip.get("value"),
            metadata=meta,
            key_means=tables["key_mean"] or None,
            layout=layout,
            key_blocks=key_blocks,
            head_bits=head_bits,
            key_wide_channels=key_wide_channels,
        )

    def push_to_hub(
        self,
        repo_id: str,
        *,
        subfolder: str | None = None,
        revision: str | None = None,
        token: str | bool | None = None,
        private: bool | None = None,
        commit_message: str = "Upload OSCAR rotations",
        create_repo: bool = True,
    ):
        """Uploads the two files to `repo_id` (beside the model's own files, or into `subfolder`)."""
        from huggingface_hub import HfApi

        api = HfApi(token=token)
        if create_repo:
            api.create_repo(repo_id, private=private, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(tmp)
            return api.upload_folder(
                repo_id=repo_id,
                folder_path=tmp,
                path_in_repo=subfolder,
                revision=revision,
                commit_message=commit_message,
            )


def _download(repo_id: str, subfolders, revision, cache_dir, token, local_files_only) -> tuple[Path, Path]:
    """`(weights, json)` from a Hub repo (or the offline Hub cache): the first of `subfolders` that has them."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError

    kwargs = dict(revision=revision, cache_dir=cache_dir, token=token)
    if local_files_only is not None:
        kwargs["local_files_only"] = local_files_only
    first_error = None
    for subfolder in subfolders:
        try:
            config = Path(hf_hub_download(repo_id, CONFIG_NAME, subfolder=subfolder, **kwargs))
            return Path(hf_hub_download(repo_id, WEIGHTS_NAME, subfolder=subfolder, **kwargs)), config
        except (EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError) as e:
            first_error = first_error or e
    reason = str(first_error).strip().splitlines()[0] if str(first_error).strip() else type(first_error).__name__
    places = " or its oscar/ subfolder" if len(subfolders) > 1 else f" subfolder {subfolders[0]}/"
    raise RotationFileError(f"no OSCAR rotations found in Hub repo {repo_id!r}{places}: {reason}") from first_error


def is_local_path(spec: str) -> bool:
    """True when `spec` can only mean a local path (absolute, ./, ../, ~, or under an existing folder), so that a
    missing one is reported as "not found" instead of being tried as a Hub repo id."""
    if spec in (".", "..") or spec.startswith(("/", "./", "../", "~", ".\\", "..\\")) or Path(spec).is_absolute():
        return True
    parent = Path(spec).parent
    return Path(spec).exists() or (str(parent) != "." and parent.is_dir())


FINGERPRINT_SAMPLE = 65536  # elements of a tensor the sketch reads: all of a smaller one, else FINGERPRINT_BLOCKS evenly
FINGERPRINT_BLOCKS = 64  # spaced runs of contiguous elements (cache-friendly: a strided sample costs 5x more)
FINGERPRINT_PROJECTIONS = 8  # random +-1 projections per tensor
# The same weights in any float dtype agree within these, as fractions of the tensor's RMS: its RMS to 1e-3 (a
# rescaling of 0.1% is caught), its projections to 2e-2 (float16 loads of a float32 checkpoint round about one element
# in 16 to another bfloat16 neighbour, which moves a projection by about 2e-3; a random change of the weights by 2% of
# their RMS moves it as much as that)
FINGERPRINT_TOLERANCE = {"rms": 1e-3, "projections": 2e-2}
FINGERPRINT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
SKETCH_METHOD = (f"every decoder layer's attention tensors (output projection excluded), each rounded to bfloat16: "
                 f"RMS and {FINGERPRINT_PROJECTIONS} random +-1 projections (seed 0) / sqrt(n) of its elements, or of "
                 f"{FINGERPRINT_BLOCKS} evenly spaced runs of {FINGERPRINT_SAMPLE // FINGERPRINT_BLOCKS} elements")
LEGACY_METHOD = "sign bits of q_proj/k_proj (or c_attn) weights, first and last layer"


def weight_fingerprint(model) -> dict[str, Any] | None:
    """A fingerprint of the weights rotations are calibrated on, recorded in the rotation file and compared by
    `OscarRotations.check_fingerprint` (which says what it promises: the same checkpoint in any float dtype passes,
    other attention weights fail).

    `{"sketch": {...}, "sha256": ..., "method": ..., "layers": [...]}`:
    - `sketch`: for every attention tensor of every decoder layer of the language model (`models.decoder_attention`:
      q/k/v projections or the fused qkv, biases, q/k norms; not the output projection, and never a vision tower's
      layers), rounded to bfloat16 (so that float32, bfloat16 and float16 loads of one checkpoint give the same
      numbers, or close ones): its RMS and 8 fixed random +-1 projections of its elements (of 64 evenly spaced runs
      of 1,024 in a larger tensor), in the RMS's units. Two sketches agree when each RMS is within 1e-3 of itself and
      the projections within 2e-2 of the RMS (`FINGERPRINT_TOLERANCE`).
    - `sha256`/`method`/`layers`: the fingerprint of oscar-hf before the sketch (sign bits of the first and last
      layers' q/k weights), kept so that those versions still verify a new file; absent when there is none to take
      (e.g. GPT-NeoX's fused query_key_value).

    `None` when there is nothing to read (weights on the meta device, offloaded, or stored as integers); float8
    weights get only the sign-bit part.

    Cost: each part is computed once per model and kept (in a weak-keyed memo: it goes with the model) until what
    it read changes: another tensor object, dtype or shape, an in-place write (the version counter), `.data`
    replaced (the storage), or any sampled element, however written: the memo keeps a copy of the samples (at most
    65,536 elements per tensor: 128 KiB in bfloat16, on the CPU or the tensor's GPU) and compares them on every
    call, since a write through `p.data` (`p.data.copy_(w)`) leaves `p`'s version counter as it was. So the caches
    built for one model do not recompute it (the first costs about 30 ms at Qwen3-8B size on one CPU thread; each
    later one a few ms to walk the attention modules and compare the samples), and on a GPU it is computed and
    compared there, with one small copy (or one flag) per device to the host. (The sign-bit part reads whole
    tensors; its memo compares the same samples of them, so a write through `.data` that misses them all is not
    seen there.)
    """
    sketch = _weight_sketch(model)
    fingerprint: dict[str, Any] = {"sketch": sketch} if sketch is not None else {}
    fingerprint.update(_legacy_sign_fingerprint(model) or {})
    return fingerprint or None


_ACCEPTED = None  # WeakKeyDictionary: rotations -> WeakSet of the models accepted with other weights


def _accepted(rotations, model, add: bool = False) -> bool:
    """Whether `model` was accepted for `rotations` despite other weights (`allow_other_weights`); `add` records it."""
    global _ACCEPTED
    import weakref

    if _ACCEPTED is None:
        _ACCEPTED = weakref.WeakKeyDictionary()
    try:
        models = _ACCEPTED.setdefault(rotations, weakref.WeakSet())
        if add:
            models.add(model)
        return model in models
    except TypeError:  # not weak-referenceable
        return False


def fingerprint_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """`[("layers.{i}.{name in the attention module}", tensor)]`: what the sketch reads (see `weight_fingerprint`)."""
    from .models import OUTPUT_PROJECTIONS, decoder_attention

    tensors = []
    for layer, (_, module) in decoder_attention(model).items():
        for name, param in module.named_parameters():
            if name.split(".")[0] not in OUTPUT_PROJECTIONS:
                tensors.append((f"layers.{layer}.{name}", param))
    return tensors


_SKETCHES = None  # WeakKeyDictionary: model -> (what its fingerprinted tensors held, sketch)


def _read_state(tensors) -> list:
    """What `tensors` hold, for the memos: per tensor its name, shape, dtype and device, the tensor object, its
    version counter and storage, and the bytes of its sampled elements (`_sample`, as a view; `_kept` copies them).
    The bytes, because a write through `p.data` (`p.data.copy_(w)`) bumps the version counter of another tensor
    than `p`. They are not read on the meta device, nor of a tensor subclass; not of a DTensor in particular: its
    sample of its own shard differs by rank, so that a write to one rank's shard would send that rank alone into
    the collective `full_tensor`."""
    import weakref

    state = []
    for name, t in tensors:
        try:
            version = t._version
        except RuntimeError:  # an inference tensor (made under torch.inference_mode) has no version counter
            version = None
        try:
            pointer = (t._local_tensor if hasattr(t, "_local_tensor") else t).data_ptr()
        except (RuntimeError, AttributeError):
            pointer = None
        contents, plain = None, t.detach()
        if t.device.type != "meta" and type(plain) is torch.Tensor:  # not a DTensor or another tensor subclass
            try:
                contents = _sample_view(plain.reshape(-1)).view(torch.uint8)
            except RuntimeError:  # no byte view (e.g. a quantized tensor)
                pass
        state.append(((name, tuple(t.shape), t.dtype, str(t.device), version, pointer), weakref.ref(t), contents))
    return state


def _kept(state) -> list:
    """`state` as the memo keeps it: the sampled bytes copied (as `bytes` on the CPU, a tensor on another device)."""
    return [(key, ref, c if c is None else c.numpy().tobytes() if c.device.type == "cpu" else c.clone())
            for key, ref, c in state]


def _same_state(kept, state) -> bool:
    """Whether `state` (fresh) holds what `kept` does; the bytes compared where they lie (one read to the host per
    device)."""
    if len(kept) != len(state) or any(
            key_a != key_b or ref_a() is None or ref_a() is not ref_b() or (a is None) != (b is None)
            for (key_a, ref_a, a), (key_b, ref_b, b) in zip(kept, state)):
        return False
    differs: dict[str, list] = {}
    for (_, _, a), (_, _, b) in zip(kept, state):
        if isinstance(a, bytes):  # a copy and a memcmp: faster than np.array_equal or torch.equal on the CPU
            if b.numpy().tobytes() != a:
                return False
        elif a is not None:
            differs.setdefault(str(b.device), []).append(torch.ne(a, b).reshape(-1))
    return not any(torch.cat(flags).any().item() for flags in differs.values())


def _weight_sketch(model, copy_result: bool = True) -> dict[str, Any] | None:
    """The `sketch` of `weight_fingerprint`, memoised per model and weight state (a copy unless `copy_result` is
    False: the caller only reads it)."""
    global _SKETCHES
    import copy
    import weakref

    if _SKETCHES is None:
        _SKETCHES = weakref.WeakKeyDictionary()
    tensors = fingerprint_tensors(model)
    state = _read_state(tensors)
    try:
        cached = _SKETCHES.get(model)
    except TypeError:  # not weak-referenceable
        cached = None
    if cached is not None and _same_state(cached[0], state):
        sketch = cached[1]
    else:
        sketch = _compute_sketch(tensors)
        try:
            _SKETCHES[model] = (_kept(state), sketch)
        except TypeError:
            pass
    return copy.deepcopy(sketch) if copy_result else sketch


_PROJECTIONS: dict[tuple[int, str], torch.Tensor] = {}


def _projections(n: int, device) -> torch.Tensor:
    """`[FINGERPRINT_PROJECTIONS, n]` fixed random +-1 (float32) on `device`."""
    key = (n, str(device))
    if key not in _PROJECTIONS:
        signs = torch.randint(0, 2, (FINGERPRINT_PROJECTIONS, n), generator=torch.Generator().manual_seed(0))
        _PROJECTIONS[key] = (signs * 2 - 1).float().to(device)
    return _PROJECTIONS[key]


def _compute_sketch(tensors) -> dict[str, Any] | None:
    if not tensors:
        return None
    rows, shapes = [], []
    for name, param in tensors:
        if param.device.type == "meta" or param.dtype not in FINGERPRINT_DTYPES:
            return None
        if hasattr(param, "full_tensor"):  # a DTensor (tensor parallelism): the whole weight, as calibrated
            param = param.full_tensor()
        sample = _sample(param.detach().reshape(-1)).to(torch.bfloat16).float()
        n = sample.numel()
        rms = sample.square().mean().sqrt() if n else sample.new_zeros(())
        proj = _projections(n, sample.device) @ sample / max(n, 1) ** 0.5
        rows.append(torch.cat([rms.reshape(1), proj]))
        shapes.append(list(param.shape))
    values = torch.stack([r.to("cpu", non_blocking=False) for r in rows]).tolist()  # one copy per tensor's device
    return {
        "method": SKETCH_METHOD,
        "tolerance": FINGERPRINT_TOLERANCE,
        "tensors": {name: {"shape": shape, "values": [float(f"{v:.8g}") for v in row]}
                    for (name, _), shape, row in zip(tensors, shapes, values)},
    }


def _sample(flat: torch.Tensor) -> torch.Tensor:
    """`FINGERPRINT_SAMPLE` elements of a flat tensor: all of them, or `FINGERPRINT_BLOCKS` evenly spaced runs."""
    return _sample_view(flat).reshape(-1)


def _sample_view(flat: torch.Tensor) -> torch.Tensor:
    """The elements `_sample` reads, as a view: `flat`, or `[FINGERPRINT_BLOCKS, run]`."""
    if flat.numel() <= FINGERPRINT_SAMPLE:
        return flat
    run = FINGERPRINT_SAMPLE // FINGERPRINT_BLOCKS
    spacing = (flat.numel() - run) // (FINGERPRINT_BLOCKS - 1)
    return flat.as_strided((FINGERPRINT_BLOCKS, run), (spacing, 1), flat.storage_offset())


def _compare_sketches(recorded, mine) -> str | None:
    """`None` when the sketches agree, else what differs, in words."""
    if mine is None:
        return None  # nothing to compare (quantized or offloaded weights)
    theirs = recorded.get("tensors") if isinstance(recorded, dict) else None
    if not isinstance(theirs, dict):
        raise RotationFileError(f"rotation metadata field {FINGERPRINT_KEY!r} has a malformed sketch: {recorded!r:.120}")
    tolerance = recorded.get("tolerance", FINGERPRINT_TOLERANCE)
    if not isinstance(tolerance, dict) or not all(isinstance(tolerance.get(k), (int, float)) for k in FINGERPRINT_TOLERANCE):
        raise RotationFileError(f"rotation metadata field {FINGERPRINT_KEY!r} has a malformed sketch tolerance: {tolerance!r}")
    ours = mine["tensors"]
    if set(theirs) != set(ours):
        only_file, only_model = sorted(set(theirs) - set(ours)), sorted(set(ours) - set(theirs))
        return ("the fingerprinted attention tensors differ: "
                + "; ".join(part for part in (f"only in the rotation file: {', '.join(only_file[:3])}" if only_file else "",
                                              f"only in the model: {', '.join(only_model[:3])}" if only_model else "")
                            if part))
    differing = []
    for name in sorted(theirs, key=_layer_order):
        a, b = theirs[name], ours[name]
        if list(a.get("shape", [])) != b["shape"]:
            differing.append(f"{name} has shape {a.get('shape')} in the rotation file, {b['shape']} in the model")
            continue
        va, vb = a["values"], b["values"]
        scale = max(abs(va[0]), abs(vb[0]), 1e-30)
        rms = abs(va[0] - vb[0]) / scale
        projections = max((abs(x - y) for x, y in zip(va[1:], vb[1:])), default=0.0) / scale
        if rms > tolerance["rms"]:
            differing.append(f"{name} differs: RMS {va[0]:.6g} in the rotation file, {vb[0]:.6g} in the model "
                             f"({rms:.1e} apart; the same weights in any float dtype agree within {tolerance['rms']:g})")
        elif projections > tolerance["projections"]:
            differing.append(f"{name} differs: its random projections are {projections:.1e} of its RMS apart (the same "
                             f"weights in any float dtype agree within {tolerance['projections']:g})")
    if not differing:
        return None
    more = f"; so do {len(differing) - 1} more of the {len(theirs)} attention tensors" if len(differing) > 1 else ""
    return differing[0] + more


def _layer_order(name: str):
    parts = name.split(".")
    return (int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else -1, name)


def _legacy_sign_fingerprint(model) -> dict[str, Any] | None:
    """The fingerprint of oscar-hf before the sketch (kept unchanged, so that its files still verify): sha256 over
    the sign bits (and shapes) of the q_proj/k_proj (GPT-2: c_attn) weights of the first and last layer, taken in
    float32 on the CPU. Sign bits survive every float cast, but it sees nothing else: weights that differ slightly in
    value, or in any other layer, pass it."""
    global _LEGACY
    import weakref

    if _LEGACY is None:
        _LEGACY = weakref.WeakKeyDictionary()
    found = []
    for name, param in model.named_parameters():
        match = re.search(r"\.(\d+)\.(?:.*\.)?(q_proj|k_proj|c_attn)\.weight$", name)  # c_attn: GPT-2's fused qkv
        if match:
            found.append((int(match.group(1)), match.group(2), param))
    if not found:
        return None
    # a write through `.data` (no version counter) that misses the sketch's samples of these tensors goes unseen here
    state = _read_state([(f"{layer}.{which}", p) for layer, which, p in found])
    try:
        cached = _LEGACY.get(model)
    except TypeError:
        cached = None
    if cached is not None and _same_state(cached[0], state):
        return dict(cached[1]) if cached[1] is not None else None
    ends = (min(f[0] for f in found), max(f[0] for f in found))
    chosen = sorted((f for f in found if f[0] in ends), key=lambda f: (f[0], f[1]))
    digest = hashlib.sha256()
    result = None
    for layer, which, param in chosen:
        if param.device.type == "meta" or not param.dtype.is_floating_point:
            break
        if hasattr(param, "full_tensor"):  # a DTensor (tensor parallelism): the whole weight, as calibrated
            param = param.full_tensor()
        signs = torch.signbit(param.detach().to("cpu", torch.float32)).flatten()
        digest.update(f"{'first' if layer == ends[0] else 'last'}.{which}{tuple(param.shape)};".encode())
        digest.update(np.packbits(signs.numpy()).tobytes())
    else:
        result = {"sha256": digest.hexdigest(), "method": LEGACY_METHOD, "layers": list(ends)}
    try:
        _LEGACY[model] = (_kept(state), result)
    except TypeError:
        pass
    return dict(result) if result is not None else None


_LEGACY = None  # WeakKeyDictionary: model -> (state of its q/k weights, legacy fingerprint)


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


def _as_geometry(config_or_geometry) -> ModelGeometry:
    if isinstance(config_or_geometry, ModelGeometry):
        return config_or_geometry
    return model_geometry(getattr(config_or_geometry, "config", config_or_geometry))


def _geometry_dict(geometry: ModelGeometry) -> dict[str, Any]:
    return {
        "model_type": geometry.model_type,
        "num_hidden_layers": geometry.num_hidden_layers,
        "num_attention_heads": geometry.num_attention_heads,
        "num_key_value_heads": geometry.num_key_value_heads,
        "head_dim": geometry.head_dim,
        "oscar_layers": list(geometry.oscar_layers),
    }


def geometry_dict_for(config) -> dict[str, Any]:
    """Model identity recorded in a rotation file: geometry plus the model's name/path."""
    data = _geometry_dict(model_geometry(config))
    data["name_or_path"] = getattr(config, "_name_or_path", None) or getattr(text_config(config), "_name_or_path", None)
    return data


def _json_default(obj):
    if isinstance(obj, OscarConfig):
        return obj.to_dict()
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"cannot serialise {type(obj).__name__} into the rotation JSON")
