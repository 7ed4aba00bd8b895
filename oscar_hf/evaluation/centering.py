"""Key centering, an evaluation experiment: subtract a calibrated per-channel key mean before OSCAR stores the keys.

Hypothesis: some models' post-RoPE keys carry a large per-channel mean μ (Qwen2.5's k_proj bias, outlier channels in
low-frequency RoPE pairs). After the rotation that offset is spread over every channel of every token and dominates
each token's min-max range, so token-wise INT2 spends its 4 levels on a constant. KIVI (per-channel keys) is immune.

`oscar_centered` stores k − μ instead of k in every segment of the OSCAR layers (sink, INT2 history, recent window,
and the current chunk), before the rotation. Attention is unchanged mathematically: q·(k − μ) = q·k − q·μ, and q·μ
is one constant per query row, to which softmax is invariant. μ is per (full-attention layer, KV head), `[H, d]`,
the mean of the post-RoPE keys over the calibration tokens (the calibration split, disjoint from the evaluation
essays), a model-level constant like the rotations (not counted in the bits per element, nor are the rotations).

Clips: the rotations are OSCAR's own (the key rotation comes from the query second moment, which centering does not
touch); the clip ratios are refitted with `calibrate.clip_errors` on the same held-out tokens as OSCAR's fit, with
the held-out keys centered, i.e. the fit sees exactly what the centered cache quantizes (the value clips come out
unchanged: the attention probabilities do not depend on μ).

`fit_centering` does one extra capture pass over the calibration sequences (the same ones `calibrate` uses) and the
held-out sequence; it also returns the diagnostic: per layer and KV head, ‖μ‖² / E‖k‖², and the token-wise INT2
relative key error after the rotation with and without centering (`int2_key_error`).
"""

from __future__ import annotations

import math
import time

import torch

from ..cache import OscarCache, OscarLayer
from ..calibrate import StatisticsCollector, _run, best_ratio, capturing, clip_errors
from ..config import OscarConfig
from ..data import load_texts, sequence_prefix, token_sequences
from ..models import model_geometry
from ..quant import fake_quantize
from ..rotations_io import OscarRotations


class CenteredOscarCache(OscarCache):
    """`OscarCache` that subtracts a per-(layer, KV head) key mean `[H, d]` from the keys of its OSCAR layers before
    they are stored (all segments). Sliding-window layers are untouched.

    Args (besides `OscarCache`'s): key_means: `{layer: [H_kv, d]}` float tensors.
    """

    def __init__(self, model, rotations: OscarRotations, config: OscarConfig | None = None,
                 key_means: dict[int, torch.Tensor] | None = None, max_cache_len: int | None = None):
        super().__init__(model, rotations, config, max_cache_len)
        key_means = key_means if key_means is not None else getattr(rotations, "key_means", None)
        if key_means is None:
            raise ValueError("CenteredOscarCache needs key_means (per layer [H_kv, d]); see fit_centering")
        missing = [i for i in self.geometry.oscar_layers if i not in key_means]
        if missing:
            raise ValueError(f"CenteredOscarCache: no key mean for layers {missing}")
        self.key_means = {int(i): m.float() for i, m in key_means.items()}
        self._cast: dict[int, torch.Tensor] = {}

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if isinstance(self.layers[layer_idx], OscarLayer):
            mean = self._cast.get(layer_idx)
            if mean is None or mean.device != key_states.device:
                mean = self._cast[layer_idx] = self.key_means[layer_idx].to(key_states.device)[None, :, None, :]
            # Subtract in float32, then back to the model dtype (one rounding of the centered key).
            key_states = (key_states.float() - mean).to(key_states.dtype)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def int2_key_error(keys: torch.Tensor, rotation: torch.Tensor, config: OscarConfig, clip_ratio: float = 1.0,
                   mean: torch.Tensor | None = None) -> torch.Tensor:
    """Squared error of token-wise quantization of `keys` `[H, N, d]` after `rotation` `[H, d, d]` (optionally
    centered by `mean` `[H, d]` first), per head `[H]`, relative to Σ‖k‖² of the un-centered keys (the same
    denominator with and without centering, so the two are comparable: what matters to q·k is the absolute error)."""
    k = keys.float()
    x = k if mean is None else k - mean.float()[:, None, :]
    xr = torch.matmul(x, rotation.float())
    group = config.group_size or k.shape[-1]
    err = (fake_quantize(xr, config.bits, group, clip_ratio, config.scale_dtype) - xr).square().sum(dim=(1, 2))
    return err / k.square().sum(dim=(1, 2)).clamp(min=1e-30)


class _KeyCollector(StatisticsCollector):
    """Keeps the post-RoPE keys of the OSCAR layers (float32, CPU) of the calibration pass; records the held-out pass
    like `StatisticsCollector` (q, k, v, scale of one sequence)."""

    def __init__(self, geometry):
        super().__init__(geometry)
        self.keys: dict[int, list[torch.Tensor]] = {}

    def observe(self, layer_idx, query, key, value, attention_mask, scale):
        if layer_idx not in self.geometry.oscar_layers:
            return
        if self.record is not None:
            return super().observe(layer_idx, query, key, value, attention_mask, scale)
        self.scales[layer_idx] = scale
        self.keys.setdefault(layer_idx, []).append(key.detach().float().cpu().transpose(0, 1).flatten(1, 2))  # [H, B·T, d]


def calibration_sequences(tokenizer, config: OscarConfig, data=None):
    """The calibration and held-out sequences exactly as `calibrate` builds them: `(sequences, heldout, data_info)`."""
    documents, data_info = load_texts(data)
    seq_len = config.calibration_sequence_length
    n_seq = math.ceil(config.calibration_tokens / seq_len)
    sequences = token_sequences(tokenizer, documents, seq_len, n_seq)
    heldout = []
    if config.heldout_tokens:
        offset = n_seq * (seq_len - len(sequence_prefix(tokenizer)))
        heldout = token_sequences(tokenizer, documents, config.heldout_tokens, 1, offset=offset)
    return sequences, heldout, data_info


def fit_centering(model, tokenizer, rotations: OscarRotations, config: OscarConfig, data=None,
                  progress: bool = False) -> tuple[OscarRotations, dict]:
    """Key means on the calibration tokens, clips refitted on centered held-out keys, and the diagnostic.

    Returns `(centered, diagnostic)`: `centered` is a copy of `rotations` (same rotation matrices) with the refitted
    clips and a `key_means` attribute `{layer: [H, d]}`; `diagnostic` is JSON-able (per layer, per KV head).
    """
    start = time.perf_counter()
    geometry = model_geometry(model.config)
    sequences, heldout, data_info = calibration_sequences(tokenizer, config, data)
    collector = _KeyCollector(geometry)
    with capturing(model, collector):
        _run(model, sequences, progress, "key means")
        if heldout and config.bits < 16:
            collector.record = {}
            _run(model, heldout, False, "held-out")
    means: dict[int, torch.Tensor] = {}
    key_clips = dict(rotations.key_clips or {})
    value_clips = dict(rotations.value_clips or {})
    per_layer = {}
    for layer in geometry.oscar_layers:
        keys = torch.cat(collector.keys[layer], dim=1)  # [H, N, d]
        mu = keys.mean(dim=1)  # [H, d]
        means[layer] = mu
        energy = keys.square().sum(-1).mean(1)  # E‖k‖² per head
        rot = rotations.key_rotations[layer]
        row = {
            "mean_energy_ratio": (mu.square().sum(-1) / energy).tolist(),
            "key_norm2": energy.tolist(),
            "int2_error_noclip": int2_key_error(keys, rot, config).tolist(),
            "int2_error_noclip_centered": int2_key_error(keys, rot, config, mean=mu).tolist(),
        }
        if heldout and config.bits < 16:
            q, k, v, scale = collector.record[layer]
            dev = q.device
            errs = clip_errors(q, k - mu.to(dev)[:, None, :], v, rot.to(dev),
                               rotations.value_rotations[layer].to(dev), scale, config, config.clip_grid)
            old = key_clips.get(layer, 1.0)
            key_clips[layer], value_clips[layer] = best_ratio(errs["key"]), best_ratio(errs["value"])
            row.update({
                "key_clip": old, "key_clip_centered": key_clips[layer],
                "int2_error_fitted": int2_key_error(keys, rot, config, old).tolist(),
                "int2_error_fitted_centered": int2_key_error(keys, rot, config, key_clips[layer], mean=mu).tolist(),
                "heldout_attention_error": errs["key"][key_clips[layer]],
            })
        per_layer[layer] = row
    seconds = time.perf_counter() - start
    metadata = dict(rotations.metadata)
    metadata["key_centering"] = {
        "means": "per (layer, KV head) mean of the post-RoPE keys over the calibration tokens",
        "tokens": sum(len(s) for s in sequences), "heldout_tokens": sum(len(s) for s in heldout),
        "data": data_info, "clips": "refitted on the held-out keys, centered", "seconds": round(seconds, 2),
    }
    centered = OscarRotations(rotations.geometry, rotations.key_rotations, rotations.value_rotations,
                              rotations.key_eigenvalues, rotations.value_eigenvalues,
                              key_clips or None, value_clips or None, metadata=metadata)
    centered.key_means = means
    diagnostic = {"layers": per_layer, "summary": summarise(per_layer), "seconds": round(seconds, 2),
                  "tokens": metadata["key_centering"]["tokens"], "data": data_info,
                  "error_definition": "Σ‖Q(x·R) − x·R‖² / Σ‖k‖² with x = k (plain) or k − μ (centered), token-wise "
                                      f"{config.bits}-bit, group {config.group_size or 'head_dim'}, R = OSCAR's key "
                                      "rotation; 'noclip' without clip, 'fitted' with OSCAR's fitted clip (plain) "
                                      "and the clip refitted on centered keys (centered)"}
    return centered, diagnostic


def summarise(per_layer: dict[int, dict]) -> dict:
    """Median and max over (layer, head) of each per-head quantity, and the layer of the max."""
    out = {}
    keys = [k for k, v in next(iter(per_layer.values())).items() if isinstance(v, list)]
    for name in keys:
        values = torch.tensor([x for row in per_layer.values() for x in row[name]], dtype=torch.float64)
        out[name] = {"median": values.median().item(), "mean": values.mean().item(), "max": values.max().item()}
    return out


__all__ = ["CenteredOscarCache", "int2_key_error", "fit_centering", "calibration_sequences", "summarise"]
