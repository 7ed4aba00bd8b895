"""Key centering, the evaluation side of `OscarConfig.center_keys` (`oscar-hf eval centering`).

Hypothesis: some models' post-RoPE keys carry a large per-channel mean μ (Qwen2.5's k_proj bias, outlier channels in
low-frequency RoPE pairs). After the rotation that offset is spread over every channel of every token and dominates
each token's min-max range, so token-wise INT2 spends its 4 levels on a constant. KIVI (per-channel keys) is immune.

The method `oscar_centered` is OSCAR with `OscarConfig(center_keys=True)`, calibrated through the normal path
(`calibrate.calibrate`: μ from the same streaming statistics pass, key clips fitted on centered held-out keys) and
run by the plain `OscarCache` (which subtracts μ in every segment). μ is a model-level constant like the rotations
(not counted in the bits per element, nor are the rotations).

This module only adds the diagnostic written to `centering_keys.json`: per layer and KV head, ‖μ‖² / E‖k‖², and the
token-wise INT2 relative key error after OSCAR's key rotation with and without centering (`int2_key_error`), over the
calibration tokens, accumulated in one streaming capture pass (memory independent of the token count).
"""

from __future__ import annotations

import time

import torch

from ..calibrate import StatisticsCollector, _run, calibration_sequences, capturing
from ..config import OscarConfig
from ..models import model_geometry
from ..quant import fake_quantize
from ..rotations_io import OscarRotations


def _int2_error_sum(keys: torch.Tensor, rotation: torch.Tensor, config: OscarConfig, clip_ratio: float = 1.0,
                    mean: torch.Tensor | None = None) -> torch.Tensor:
    """Σ‖Q(x·R) − x·R‖² per head `[H]` for keys `[H, N, d]`, x = k or k − μ."""
    k = keys.float()
    x = k if mean is None else k - mean.float().to(k.device)[:, None, :]
    xr = torch.matmul(x, rotation.float().to(k.device))
    group = config.group_size or k.shape[-1]
    return (fake_quantize(xr, config.bits, group, clip_ratio, config.scale_dtype) - xr).square().sum(dim=(1, 2))


def int2_key_error(keys: torch.Tensor, rotation: torch.Tensor, config: OscarConfig, clip_ratio: float = 1.0,
                   mean: torch.Tensor | None = None) -> torch.Tensor:
    """Squared error of token-wise quantization of `keys` `[H, N, d]` after `rotation` `[H, d, d]` (optionally
    centered by `mean` `[H, d]` first), per head `[H]`, relative to Σ‖k‖² of the un-centered keys (the same
    denominator with and without centering, so the two are comparable: what matters to q·k is the absolute error)."""
    err = _int2_error_sum(keys, rotation, config, clip_ratio, mean)
    return err / keys.float().square().sum(dim=(1, 2)).clamp(min=1e-30)


class _KeyErrorCollector(StatisticsCollector):
    """Streams the diagnostic sums over the OSCAR layers' post-RoPE keys (nothing is stored per token)."""

    def __init__(self, geometry, plain: OscarRotations, centered: OscarRotations, config: OscarConfig):
        super().__init__(geometry)
        self.plain, self.centered, self.config = plain, centered, config
        self.sums: dict[int, dict[str, torch.Tensor]] = {}
        self.fitted = config.bits < 16 and plain.key_clips is not None and centered.key_clips is not None

    def observe(self, layer_idx, query, key, value, attention_mask, scale):
        if layer_idx not in self.geometry.oscar_layers:
            return
        keys = key.detach().float().transpose(0, 1).flatten(1, 2)  # [H, B·T, d]
        rot, mu = self.plain.key_rotations[layer_idx], self.centered.key_means[layer_idx]
        parts = {
            "key_sum": keys.sum(1).double().cpu(),
            "key_norm2": keys.square().sum(dim=(1, 2)).double().cpu(),
            "tokens": torch.tensor(float(keys.shape[1]), dtype=torch.float64),
            "int2_error_noclip": _int2_error_sum(keys, rot, self.config),
            "int2_error_noclip_centered": _int2_error_sum(keys, self.centered.key_rotations[layer_idx], self.config,
                                                          mean=mu),
        }
        if self.fitted:
            parts["int2_error_fitted"] = _int2_error_sum(keys, rot, self.config, self.plain.key_clip(layer_idx))
            parts["int2_error_fitted_centered"] = _int2_error_sum(
                keys, self.centered.key_rotations[layer_idx], self.config, self.centered.key_clip(layer_idx), mean=mu)
        acc = self.sums.setdefault(layer_idx, {})
        for name, value in parts.items():
            value = value.double().cpu()
            acc[name] = acc[name] + value if name in acc else value


def key_diagnostic(model, tokenizer, plain: OscarRotations, centered: OscarRotations, config: OscarConfig,
                   data=None, progress: bool = False) -> dict:
    """The key-centering diagnostic over the calibration tokens (one capture pass), JSON-able, per layer and KV head.

    Args:
        plain: OSCAR's rotations (center_keys=False); centered: the same calibration with center_keys=True (μ, and
            the key clips fitted on centered keys). `config` gives the bits, group size and calibration sequences.
    """
    if not centered.center_keys:
        raise ValueError("key_diagnostic needs rotations calibrated with center_keys=True (they carry key_means)")
    start = time.perf_counter()
    geometry = model_geometry(model.config)
    sequences, _, data_info = calibration_sequences(tokenizer, config, data)
    collector = _KeyErrorCollector(geometry, plain, centered, config)
    with capturing(model, collector):
        _run(model, sequences, progress, "key diagnostic")
    per_layer = {}
    for layer in geometry.oscar_layers:
        acc = collector.sums[layer]
        n, norm2 = acc["tokens"], acc["key_norm2"]
        mu = centered.key_means[layer].double()
        row = {
            "mean_energy_ratio": (mu.square().sum(-1) / (norm2 / n)).tolist(),
            "key_norm2": (norm2 / n).tolist(),
            "int2_error_noclip": (acc["int2_error_noclip"] / norm2).tolist(),
            "int2_error_noclip_centered": (acc["int2_error_noclip_centered"] / norm2).tolist(),
        }
        if collector.fitted:
            clip = centered.key_clip(layer)
            curves = centered.metadata.get("clip_fit", {}).get("errors", {}).get(str(layer), {}).get("key", {})
            row.update({
                "key_clip": plain.key_clip(layer), "key_clip_centered": clip,
                "int2_error_fitted": (acc["int2_error_fitted"] / norm2).tolist(),
                "int2_error_fitted_centered": (acc["int2_error_fitted_centered"] / norm2).tolist(),
                "heldout_attention_error": curves.get(str(clip)),
            })
        per_layer[layer] = row
    seconds = time.perf_counter() - start
    return {"layers": per_layer, "summary": summarise(per_layer), "seconds": round(seconds, 2),
            "tokens": sum(len(s) for s in sequences), "data": data_info,
            "means": "OscarConfig.center_keys: per (layer, KV head) mean of the post-RoPE keys over the calibration "
                     "tokens, from calibrate's statistics pass",
            "error_definition": "Σ‖Q(x·R) − x·R‖² / Σ‖k‖² with x = k (plain) or k − μ (centered), token-wise "
                                f"{config.bits}-bit, group {config.group_size or 'head_dim'}, R = OSCAR's key "
                                "rotation; 'noclip' without clip, 'fitted' with OSCAR's fitted clip (plain) "
                                "and the clip fitted on centered keys (centered)"}


def summarise(per_layer: dict[int, dict]) -> dict:
    """Median and max over (layer, head) of each per-head quantity, and the layer of the max."""
    out = {}
    keys = [k for k, v in next(iter(per_layer.values())).items() if isinstance(v, list)]
    for name in keys:
        values = torch.tensor([x for row in per_layer.values() for x in row[name]], dtype=torch.float64)
        out[name] = {"median": values.median().item(), "mean": values.mean().item(), "max": values.max().item()}
    return out


__all__ = ["int2_key_error", "key_diagnostic", "summarise"]
