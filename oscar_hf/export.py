"""Rotation files for serving engines: `oscar-hf export --format sglang-oscar`.

One target: the OSCAR reference, an SGLang fork (FutureMLS-Lab/OSCAR, `sglang-research`). What it loads, read in its
code (`srt/mem_cache/memory_pool.py: load_oscar_rotations`, `unified_kv_pool.py`, `QuantKernel/oscar_rotation_clip_
int2_kv.py`, and the writer `rotation/compute_kv_rotation.py`):

- two torch files, keys and values, each `{"format_version": 1, "objective": str, "source_grouping": "layer",
  "layers": {layer_id (int): {"layer_id": int, "rotation": float32 [d, d], "eigenvalues": float32 [d]}}}`;
  the engine checks `rotation.shape == (d, d)`: **one rotation per layer, shared by every KV head**;
- applied as `rows @ R` (the same orientation as `OscarCache`), to keys and queries; values the same, or folded into
  the V projection (`SGLANG_OSCAR_ABSORB_V_ROTATION=1`) with the output un-rotated by `R_Vᵀ`;
- keys and values quantized token-wise (one scale/zero per token and group of `--kv-cache-quant-group-size`
  channels, default head_dim), after a per-row clip at sort(|x|)[int(r·d)] with **one ratio per stream for all layers**
  (`SGLANG_OSCAR_{K,V}_CLIP_RATIO`; 0 turns the clip off); no key mean.

So only rotations calibrated for that recipe serve there as measured here: token-wise keys, one rotation per layer
(`per_head=False`), no key centering, and one clip ratio per stream (fixed, or fitted ratios that agree across layers;
`--key-clip` / `--value-clip` choose one explicitly). Anything else is refused with the reason, never approximated: an
engine given channel-wise-fitted rotations would store a different cache than the one measured.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .config import OscarConfig, split_legacy
from .quant import clip_threshold_index
from .rotations_io import OscarRotations

SGLANG_OSCAR = "sglang-oscar"
FORMATS = (SGLANG_OSCAR,)
KEY_FILE, VALUE_FILE, ENV_FILE = "k_rotation_oscar_hf.pt", "v_rotation_oscar_hf.pt", "oscar_sglang.env"
REFERENCE_FORMAT_VERSION = 1  # `format_version` written by the reference's compute_kv_rotation.py


class ExportError(ValueError):
    """The rotations cannot be served by the target engine without changing what is stored."""


def _shared_rotation(stack: torch.Tensor, layer: int, stream: str) -> torch.Tensor:
    """`[H_kv, d, d]` -> `[d, d]` when every KV head holds the same matrix."""
    if not torch.equal(stack, stack[:1].expand_as(stack)):
        raise ExportError(
            f"layer {layer}: the {stream} rotations differ between KV heads, and the reference loads one rotation per "
            "layer; calibrate with `per_head: false` in --config"
        )
    return stack[0].float().contiguous()


def _one_ratio(rotations: OscarRotations, config: OscarConfig, given: float | None, stream: str) -> float:
    """The single clip ratio the engine will use for `stream` (0.0 = off, the engine's convention): `given`, or the
    ratio `OscarCache` applies with `config` (fixed, or the fitted ones when they agree across layers)."""
    head_dim = int(rotations.geometry["head_dim"])
    if given is not None:
        if not 0.0 < given <= 1.0:
            raise ExportError(f"--{stream}-clip must be in (0, 1], got {given:g}")
        ratios = [float(given)]
    else:
        fitted = rotations.key_clip if stream == "key" else rotations.value_clip
        ratios = sorted({config.clip_ratio(stream, fitted(layer)) for layer in rotations.layers})
        if len(ratios) > 1:
            raise ExportError(
                f"the {stream} clips were fitted per layer ({ratios[0]:g} .. {ratios[-1]:g}) and the reference takes "
                f"one ratio for all layers; pass --{stream}-clip to choose one"
            )
    ratio = ratios[0]
    if clip_threshold_index(ratio, head_dim) >= head_dim:
        return 0.0  # no clip (the engine's 0.0 skips the sort)
    if int(ratio * head_dim) != clip_threshold_index(ratio, head_dim):
        raise ExportError(f"clip ratio {ratio!r} picks another threshold index in the engine (floating point); round it")
    return ratio


def calibration_config(rotations: OscarRotations) -> OscarConfig:
    """The `OscarConfig` the rotations were calibrated for (recorded in their metadata), else the default."""
    recorded = rotations.metadata.get("oscar_config")
    return split_legacy(recorded)[0] if recorded else OscarConfig()


def export_sglang_oscar(
    rotations: OscarRotations,
    output_dir: str | Path,
    *,
    config: OscarConfig | None = None,
    key_clip: float | None = None,
    value_clip: float | None = None,
) -> dict[str, Path]:
    """Writes the reference engine's two rotation files and an environment file into `output_dir`.

    `config`: the cache settings to reproduce (sink, window, group size, scale dtype, clip modes); default: the ones
    the rotations were calibrated with. Returns the written paths by role ("keys", "values", "env"). Raises
    `ExportError` (one line, naming the field) for rotations the engine cannot serve unchanged."""
    if not isinstance(rotations, OscarRotations):
        raise TypeError(f"export_sglang_oscar needs OscarRotations (OscarRotations.from_pretrained loads a folder), got "
                        f"{type(rotations).__name__}")
    if config is not None and not isinstance(config, OscarConfig):
        raise TypeError(f"export_sglang_oscar: config must be an OscarConfig (or None), got {type(config).__name__}")
    config = config or calibration_config(rotations)
    for fitted_for in (rotations.layout["key_granularity"], config.key_granularity):
        if fitted_for != "token":
            raise ExportError(
                f"these rotations are for {fitted_for}-wise keys; the reference stores keys token-wise: calibrate with "
                "`key_granularity: token` in --config"
            )
    if rotations.center_keys:
        raise ExportError("these rotations subtract a calibrated key mean, which the reference does not; calibrate "
                          "without --center-keys")
    if config.bits != 2:
        raise ExportError(f"the reference stores 2-bit codes; this config has bits={config.bits}")
    for name, tokens in (("sink_tokens", config.sink_tokens), ("window_tokens", config.window_tokens)):
        if tokens % 8:
            raise ExportError(f"{name} must be a multiple of 8 (the engine's page), got {tokens}")
    head_dim = int(rotations.geometry["head_dim"])
    ratios = {stream: _one_ratio(rotations, config, given, stream)
              for stream, given in (("key", key_clip), ("value", value_clip))}
    method = rotations.metadata.get("method", {})
    files = {}
    for stream, table, eigen in (("key", rotations.key_rotations, rotations.key_eigenvalues),
                                 ("value", rotations.value_rotations, rotations.value_eigenvalues)):
        layers = {}
        for layer in rotations.layers:
            entry = {"layer_id": layer, "rotation": _shared_rotation(table[layer], layer, stream)}
            if layer in eigen:
                entry["eigenvalues"] = eigen[layer][0].float().contiguous()
            layers[layer] = entry
        files[stream] = {
            "format_version": REFERENCE_FORMAT_VERSION,
            "objective": f"oscar-hf:{method.get(f'{stream}_target', 'unknown')}",
            "source_grouping": "layer",
            "layers": layers,
        }
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"keys": out / KEY_FILE, "values": out / VALUE_FILE, "env": out / ENV_FILE}
    torch.save(files["key"], paths["keys"])
    torch.save(files["value"], paths["values"])
    env = [
        "# Environment of the OSCAR reference (SGLang fork) for these rotations; written by `oscar-hf export`.",
        f"# Launch with --kv-cache-dtype int2 --kv-cache-quant-group-size {config.group_size or head_dim}.",
        f"SGLANG_OSCAR_K_ROTATION_PATH={paths['keys'].resolve()}",
        f"SGLANG_OSCAR_V_ROTATION_PATH={paths['values'].resolve()}",
        f"SGLANG_OSCAR_K_CLIP_RATIO={ratios['key']!r}",
        f"SGLANG_OSCAR_V_CLIP_RATIO={ratios['value']!r}",
        "SGLANG_ENABLE_MIXED_KV_WINDOWS=1",
        f"SGLANG_MIXED_KV_PREFIX_TOKENS={config.sink_tokens}",
        f"SGLANG_MIXED_KV_RECENT_TOKENS={config.window_tokens}",
        f"SGLANG_MIXED_KV_SCALE_DTYPE={config.scale_dtype}",
        "SGLANG_OSCAR_ABSORB_V_ROTATION=1",
    ]
    paths["env"].write_text("\n".join(env) + "\n")
    return paths
