"""KIVI-2 (Liu et al. 2024, jy-yuan/KIVI) as a `transformers.Cache`: the accuracy baseline OSCAR is compared with.

Storage of one full-attention layer (per batch row and KV head), following the reference implementation:
- keys: quantized **per channel**: each block of `group_size` consecutive tokens gets, for every channel, one
  (scale, minimum) pair; the newest tokens that do not yet fill `residual` tokens stay in full precision. When the
  full-precision key residual reaches `residual` tokens, all of it is quantized at once (KIVI's prefill keeps
  `L mod R` tokens, its decode flushes every R tokens: both are "flush floor(n / R)·R tokens").
- values: quantized **per token** in groups of `group_size` channels along head_dim; the `residual` most recent
  tokens stay in full precision, older ones are quantized as they leave that window.
Quantization math and packing are `oscar_hf.quant` (asymmetric min/scale, 16-bit metadata, planar 2-bit packing):
keys are quantized as rows of `group_size` tokens of one channel, values as rows of head_dim channels of one token.

Bits per element at 16-bit metadata: keys 2 + 32/group_size, values 2 + 32/min(group_size, head_dim); KIVI's default
group of 32 thus stores 3 bits per element, plus the full-precision residual.

Attention is plain (the cache hands back dequantized keys/values): this class is an accuracy baseline, not a kernel.
As in OscarCache, the tokens of the current forward pass attend to each other exactly and to earlier tokens as stored.
Sliding-window layers (Gemma 3) keep transformers' bounded BF16 window, exactly as in OscarCache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from ..models import model_geometry
from ..quant import QuantizedRows, dequantize_rows, quantize_rows


@dataclass(frozen=True)
class KiviConfig:
    """KIVI settings. The paper's KIVI-2: bits 2, group_size 32, residual 128 (residual a multiple of the group)."""

    bits: int = 2
    group_size: int = 32
    residual: int = 128
    scale_dtype: str = "float16"

    def __post_init__(self):
        if self.bits not in (2, 4, 8):
            raise ValueError(f"KiviConfig.bits: must be 2, 4 or 8 (got {self.bits})")
        if self.group_size < 1 or self.residual < self.group_size or self.residual % self.group_size:
            raise ValueError(
                f"KiviConfig: residual ({self.residual}) must be a positive multiple of group_size ({self.group_size}), "
                "because keys are flushed from the residual in whole groups of tokens"
            )

    def value_group(self, head_dim: int) -> int:
        return min(self.group_size, head_dim)

    def history_bits_per_element(self, head_dim: int) -> float:
        """Mean of key and value bits in the quantized part, metadata included (the residual not counted)."""
        meta = 32 if self.scale_dtype == "float32" else 16
        key_bits = self.bits + 2 * meta / self.group_size
        value_bits = self.bits + 2 * meta / self.value_group(head_dim)
        return (key_bits + value_bits) / 2


def _cat(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b if a is None else torch.cat([a, b], dim=2)


class KiviLayer(CacheLayerMixin):
    """KIVI storage of one full-attention layer.

    State (B batch, H KV heads, d head_dim, G group_size):
        key_codes `[B, H, nb, d, G·bits/8]` uint8 and key_meta `[B, H, nb, d, 1, 2]`: nb blocks of G tokens, one
            (scale, minimum) per channel per block;
        key_residual `[B, H, rk, d]` (0 <= rk < residual) full precision;
        value_codes `[B, H, nv, d·bits/8]`, value_meta `[B, H, nv, d/Gv, 2]`;
        value_residual `[B, H, rv, d]` (rv <= residual) full precision.
    """

    is_compileable = False
    is_sliding = False
    is_croppable = False  # tokens already quantized in a key block cannot be removed one by one

    def __init__(self, config: KiviConfig):
        super().__init__()
        self.config = config
        self._reset_state()

    def _reset_state(self) -> None:
        self.is_initialized = False
        self.keys = self.values = None
        self.key_codes = self.key_meta = self.key_residual = None
        self.value_codes = self.value_meta = self.value_residual = None
        self.quantized_keys = self.quantized_values = 0

    def __repr__(self):
        return f"KiviLayer(keys quantized={self.quantized_keys}, values quantized={self.quantized_values}, tokens={self.get_seq_length()})"

    # ------------------------------------------------------------------ quantization
    def _quantize_keys(self, keys: torch.Tensor) -> QuantizedRows:
        """`[B, H, n·G, d]` -> per-channel groups of G tokens."""
        b, h, t, d = keys.shape
        g = self.config.group_size
        blocks = keys.float().reshape(b, h, t // g, g, d).transpose(-1, -2)  # [B, H, nb, d, G]
        return quantize_rows(blocks, self.config.bits, g, self.config.scale_dtype)

    def _dequantized_keys(self) -> torch.Tensor:
        if self.key_codes is None:
            return self.key_residual[:, :, :0]
        rows = dequantize_rows(QuantizedRows(self.key_codes, self.key_meta, self.config.bits, self.config.group_size), self.dtype)
        b, h, nb, d, g = rows.shape
        return rows.transpose(-1, -2).reshape(b, h, nb * g, d)

    def _dequantized_values(self) -> torch.Tensor:
        if self.value_codes is None:
            return self.value_residual[:, :, :0]
        group = self.config.value_group(self.value_residual.shape[-1])
        return dequantize_rows(QuantizedRows(self.value_codes, self.value_meta, self.config.bits, group), self.dtype)

    # ------------------------------------------------------------------ CacheLayerMixin contract
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        d = key_states.shape[-1]
        if d % self.config.value_group(d):
            raise ValueError(f"KIVI group_size {self.config.group_size} does not divide head_dim {d}")
        self.dtype, self.device = key_states.dtype, key_states.device
        self.key_residual = key_states[:, :, :0]
        self.value_residual = value_states[:, :, :0]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores `[B, H, n, d]` states; returns `[B, H, past + n, d]`: the past as stored (dequantized), then the
        new states exactly."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys = torch.cat([self._dequantized_keys(), self.key_residual, key_states], dim=2)
        values = torch.cat([self._dequantized_values(), self.value_residual, value_states], dim=2)
        self._store(key_states, value_states)
        return keys, values

    def _store(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        cfg = self.config
        residual = torch.cat([self.key_residual, key_states], dim=2)
        flush = residual.shape[2] // cfg.residual * cfg.residual
        if flush:
            q = self._quantize_keys(residual[:, :, :flush])
            self.key_codes, self.key_meta = _cat(self.key_codes, q.codes), _cat(self.key_meta, q.meta)
            self.quantized_keys += flush
        self.key_residual = residual[:, :, flush:].clone()

        residual = torch.cat([self.value_residual, value_states], dim=2)
        flush = max(residual.shape[2] - cfg.residual, 0)
        if flush:
            q = quantize_rows(residual[:, :, :flush].float(), cfg.bits, cfg.value_group(residual.shape[-1]), cfg.scale_dtype)
            self.value_codes, self.value_meta = _cat(self.value_codes, q.codes), _cat(self.value_meta, q.meta)
            self.quantized_values += flush
        self.value_residual = residual[:, :, flush:].clone()

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        return self.quantized_keys + self.key_residual.shape[2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return -1

    def reset(self) -> None:
        self._reset_state()

    def crop(self, tokens_to_remove: int) -> None:
        """Removes `-tokens_to_remove` newest tokens, only while they are all still in full precision."""
        remove = -tokens_to_remove
        if tokens_to_remove > 0 or (
            self.is_initialized and (remove > self.key_residual.shape[2] or remove > self.value_residual.shape[2])
        ):
            raise ValueError(
                f"KiviLayer.crop({tokens_to_remove}): KIVI can only drop tokens that are still in its full-precision "
                f"residual (keys: {self.key_residual.shape[2] if self.is_initialized else 0} tokens); quantized key "
                "blocks cannot be split"
            )
        if self.is_initialized and remove:
            self.key_residual = self.key_residual[:, :, :-remove]
            self.value_residual = self.value_residual[:, :, :-remove]

    # Beam search and batch selection move every tensor of the state (transformers' own layers move only
    # `keys`/`values`: a quantized layer must move all of them).
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._map_batch(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices])

    def offload(self):
        raise RuntimeError("KiviLayer does not support CPU offloading")

    def prefetch(self):
        raise RuntimeError("KiviLayer does not support CPU offloading")

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for name in ("key_codes", "key_meta", "key_residual", "value_codes", "value_meta", "value_residual"):
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, fn(tensor))

    # ------------------------------------------------------------------ accounting
    def memory_bytes(self) -> dict[str, int]:
        """Bytes stored (codes, metadata and full-precision residuals; nothing is over-allocated) and elements."""
        if not self.is_initialized:
            return {"allocated": 0, "used": 0, "elements": 0, "tokens": 0}
        tensors = [self.key_codes, self.key_meta, self.key_residual, self.value_codes, self.value_meta, self.value_residual]
        stored = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        b, h, _, d = self.key_residual.shape
        tokens = self.get_seq_length()
        return {"allocated": stored, "used": stored, "elements": 2 * b * h * d * tokens, "tokens": tokens}


class KiviCache(Cache):
    """KIVI-2 KV cache for any model OscarCache supports; sliding-window layers stay a bounded BF16 window.

    Usage: `model.generate(**inputs, cache=KiviCache(model))` (any attention implementation).
    """

    def __init__(self, model, config: KiviConfig | None = None):
        model_config = getattr(model, "config", model)
        self.kivi_config = config or KiviConfig()
        self.geometry = model_geometry(model_config)
        layers: list[CacheLayerMixin] = []
        for i, kind in enumerate(self.geometry.plan):
            if kind == "oscar":
                layers.append(KiviLayer(self.kivi_config))
            else:
                layers.append(DynamicSlidingWindowLayer(sliding_window=self.geometry.sliding_windows[i]))
        super().__init__(layers=layers)

    def crop(self, tokens_to_remove: int) -> None:
        for layer in self.layers:
            layer.crop(tokens_to_remove)

    def memory_report(self) -> dict:
        """Bits per K/V element stored in the KIVI layers (metadata and full-precision residuals included)."""
        stored = elements = 0
        for layer in self.layers:
            if isinstance(layer, KiviLayer):
                m = layer.memory_bytes()
                stored, elements = stored + m["allocated"], elements + m["elements"]
        tokens = self.get_seq_length(self.geometry.oscar_layers[0])
        bits = 8 * stored / elements if elements else float("nan")
        return {"tokens": tokens, "allocated_bytes": stored, "elements": elements, "bits_per_element": bits,
                "bits_per_element_used": bits}
