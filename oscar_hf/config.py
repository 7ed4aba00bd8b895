"""`OscarConfig`: every knob of the OSCAR cache and of its calibration, in one validated dataclass.

The config holds choices only; the mechanics live in `quant.py` (quantizer, packing), `rotation.py` (R = U·H·P),
`calibrate.py` (statistics, clip fitting) and `cache.py` (the three-segment cache). Invalid values raise
`ValueError` naming the field, at construction time.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_BITS = (2, 3, 4, 8, 16)
# dtype names used in configs, files and on the command line -> torch dtypes (the one map of the package)
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
KEY_TARGETS = ("query", "key", "hadamard", "identity")
VALUE_TARGETS = ("attention", "logit", "value", "hadamard", "identity")
SCALE_DTYPES = ("float16", "bfloat16", "float32")
CLIP_MODES = ("fitted", "none")
KEY_GRANULARITIES = ("channel", "token")
KEY_BLOCK_ALLOCATIONS = ("fitted", "uniform")
WIDE_HEAD_CHOICES = ("retrieval", "none")
KEY_CHANNEL_BITS = ("fitted", "uniform")
# Ratios tried when fitting clip thresholds. The threshold of a row x (length d) is sort(|x|)[floor(r*d)];
# r = 1.0 means "no clip". The reference implementation hand-sets 0.96 (keys) and 0.92 (values).
DEFAULT_CLIP_GRID = (0.60, 0.65, 0.70, 0.75, 0.80, 0.84, 0.88, 0.90, 0.92, 0.94, 0.96, 0.98, 1.0)


@dataclass
class OscarConfig:
    """How keys and values are stored, and how rotations are calibrated.

    Cache layout per attention layer and KV head: `[sink_tokens BF16 | INT-`bits` history | recent window BF16]`.
    New tokens enter the recent window; once it holds `window_tokens + demotion_block` tokens, its oldest
    `demotion_block` tokens are quantized and packed into the history: values token-wise (rotated, clipped, one
    scale/minimum per token and group of channels), keys channel-wise by default (one scale/minimum per channel over
    each block of tokens, KIVI's insight, which follows the per-channel structure of post-RoPE keys as it arrives;
    the block of each KV head allocated at calibration, at the bits of `key_block`).

    Args:
        bits: code width of the history: 2 (OSCAR), 3 or 4 (comparisons), 8, or 16 (no quantization: the history
            is kept in the model dtype, still rotated; useful to check the cache logic against `DynamicCache`).
        group_size: elements sharing one (scale, minimum) pair along head_dim; `None` means head_dim (one pair per
            token per KV head, the paper's setting).
        sink_tokens: first tokens of the sequence kept in full precision ("attention sinks"). Paper: 64.
        window_tokens: most recent tokens kept in full precision. Paper: 256.
        demotion_block: tokens moved from the recent window into the history at once (the paper's token-wise recipe
            used 8). Default 128: a multiple of every channel-wise key block.
        key_block: tokens sharing one key scale/minimum per channel (channel-wise keys), on average: a 16-bit
            scale and minimum per channel per 64 tokens (the default) cost 0.5 bit per key element, so the history
            is 2.375 bits at head_dim 128 (keys 2.5, values 2.25) and 2.5 at head_dim 64. Must divide demotion_block.
        key_block_allocation: `"fitted"` (default): calibration gives each KV head blocks of key_block/2, key_block
            or 2·key_block tokens (those dividing demotion_block), at the same total bits as key_block everywhere,
            choosing the allocation with the lowest held-out attention error (finer ranges where keys need them),
            stored with the rotations (models with fewer than 16 KV heads in their full-attention layers keep
            key_block everywhere, unless `allocation_history_bits` gives them more bits than that:
            `calibrate.MIN_ALLOCATION_HEADS`); rotations without an allocation get key_block everywhere.
            `"uniform"`: key_block for every head.
        allocation_history_bits: history bits per element (keys and values averaged) a fitted allocation may spend.
            `None` (default): those of key_block everywhere, except where values are cheaper than at head_dim 128
            (value groups over 128 channels: head_dim 256 stores values at 2.125 bits) — there the keys may use up
            to a history of bits + 0.5 (KIVI-2 g64's, the size allowed at head_dim 128): 2.875 key bits at head_dim
            256, which Gemma-3-270M spends as blocks of 32, 32 and 64 (code perplexity +3.0% -> +2.7% over BF16,
            8K code needles 8/10 -> 9/10; eval/NOTES.md). Used at calibration only; the file stores the blocks.
        wide_heads: `"retrieval"` (default): calibration keeps at 4 bits (`quant.WIDE_BITS`, two 2-bit planes) the
            histories of the KV heads that retrieve by content — those with the highest induction score on a repeated
            random-token sequence, a score that needs no data — as many as `wide_history_bits` pays for; the file
            stores them and the cache reads them. On SmolLM2-135M nine such heads (10%) took the 4K needles in a code
            haystack from 4/10 to 9/10 (eval/NOTES.md). Needs channel-wise keys and one value group per token.
            `"none"`: every head at `bits` (a file's wide heads are ignored).
        wide_history_bits: history bits per element (keys and values, averaged over every head) that the wide heads
            may bring the layout to. `None` (default): 2.75 at head_dim <= 64, 2.4375 at 128 (the whole cache stays
            <= 2.6 bits at 32K tokens), 2.5 above.
        key_channel_bits: `"fitted"` (default): calibration gives each 2-bit head's key channels 0, 2 or 4 bits at an average
            of 2 (the same bytes and metadata: `quant.quantize_wide_channels`), by greedy reverse water-filling of the
            expected attention-logit error Σ_c E[q_c²]·D_c(b_c) in the raw post-RoPE channels (where the query second
            moment is nearly diagonal), q from calibration's held-out text GQA-pooled, D_c(b) the held-out keys'
            squared error at b bits over the head's key blocks (0 bits: the block mean); the head's key rotation
            becomes the permutation that sorts its channels [4-bit | 2-bit | 0-bit] (wide heads keep their basis and
            4 bits). The file stores the counts (format 6) and the cache reads them. Through the real cache on
            SmolLM2-135M's 4K needles (40 trials each) essays 30 -> 31 and Shakespeare 33 -> 36 of 40 (BF16 35, 39),
            and perplexity better than "uniform" in every domain on three of four models (eval/NOTES.md).
            `"uniform"`: 2 bits in every channel of the per-head basis chosen at calibration (format 5's layout; a
            file's wide channels are ignored, with a warning). Needs 2-bit channel-wise keys (ignored otherwise).
        key_granularity: `"channel"` (default) or `"token"` (the paper's recipe: a scale/minimum per token and group
            of channels, after the clip).
        key_clip, value_clip: `"fitted"` (per-layer ratios fitted at calibration, stored with the rotations),
            `"none"`, or a fixed ratio in (0, 1] (the reference uses 0.96 for keys and 0.92 for values).
        scale_dtype: dtype of the per-group scale and minimum. 16-bit makes the INT2 history cost
            2 + 32/group_size bits per element (2.25 at group 128, 2.5 at group 64).
        key_target: covariance whose eigenvectors rotate keys: `"query"` (GQA-pooled query second moment, OSCAR),
            `"key"` (plain KᵀK, the ablation), `"hadamard"` (data-free H·P, QuaRot-style), `"identity"` (no rotation).
        value_target: `"attention"` (Σ_j (Σ_i S_ij²) v_j v_jᵀ with S the causal attention probabilities, the paper's
            VᵀSᵀSV), `"logit"` (the reference code's weighting w_j = E_q[(q·k_j)²]), `"value"` (plain VᵀV),
            `"hadamard"`, `"identity"`.
        per_head: one rotation per (layer, KV head); `False` shares one rotation per layer (the reference code).
        use_hadamard, use_permutation: the H and P factors of R = U·H·P (ablations turn them off).
        center_keys: subtract a calibrated per-(layer, KV head) mean μ `[H_kv, d]` of the post-RoPE keys before the
            cache stores them (every segment). Attention is unchanged (q·(k − μ) = q·k − q·μ, and softmax ignores the
            per-query constant q·μ), but token-wise INT2 no longer spends its levels on a common offset. Calibration
            then accumulates μ in its statistics pass, fits the key clips on centered keys and stores μ with the
            rotations; the cache applies μ whenever the rotations carry it. Worth it for models whose keys carry a
            large per-channel mean (Qwen2.5's k_proj bias, Gemma 3). Default False.
        choose_key_basis: at calibration, keep per (layer, KV head) the key rotation — the calibrated U·H·P, the
            data-free H·P, or none — whose quantized keys give the lowest attention-output error on the held-out
            tokens (needs `heldout_tokens`). Channel-wise keys of models with a k_proj bias (Qwen2.5) quantize far
            better unrotated; others gain from the rotation. Default True.
        key_basis_hadamard_preference: with `choose_key_basis`, the data-free H·P basis is kept unless another
            basis's held-out error is lower by more than this factor. Default 1.0 (the lowest error wins).
        clip_grid: ratios tried when fitting clips.
        calibration_tokens: tokens whose statistics build the rotations.
        calibration_sequence_length: tokens per calibration forward pass.
        heldout_tokens: further tokens, not used for the statistics, on which the clips are fitted.
    """

    bits: int = 2
    group_size: int | None = None
    sink_tokens: int = 64
    window_tokens: int = 256
    demotion_block: int = 128
    key_block: int = 64
    key_block_allocation: str = "fitted"
    allocation_history_bits: float | None = None
    wide_heads: str = "retrieval"
    wide_history_bits: float | None = None
    key_channel_bits: str = "fitted"
    key_granularity: str = "channel"
    key_clip: str | float = "fitted"
    value_clip: str | float = "fitted"
    scale_dtype: str = "float16"
    key_target: str = "query"
    value_target: str = "attention"
    per_head: bool = True
    use_hadamard: bool = True
    use_permutation: bool = True
    center_keys: bool = False
    choose_key_basis: bool = True
    key_basis_hadamard_preference: float = 1.0
    clip_grid: tuple[float, ...] = field(default=DEFAULT_CLIP_GRID)
    calibration_tokens: int = 8192
    calibration_sequence_length: int = 2048
    heldout_tokens: int = 1024

    def __post_init__(self):
        self.clip_grid = tuple(float(r) for r in self.clip_grid)
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        def fail(name: str, message: str):
            raise ValueError(f"OscarConfig.{name}: {message} (got {getattr(self, name)!r})")

        def check_int(name: str, minimum: int):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                fail(name, "must be an integer")
            if value < minimum:
                fail(name, f"must be >= {minimum}")

        if self.bits not in SUPPORTED_BITS or isinstance(self.bits, bool):
            fail("bits", f"must be one of {SUPPORTED_BITS}")
        if self.group_size is not None:
            check_int("group_size", 1)
        check_int("sink_tokens", 0)
        check_int("window_tokens", 0)
        check_int("demotion_block", 1)
        check_int("key_block", 1)
        if self.key_block_allocation not in KEY_BLOCK_ALLOCATIONS:
            fail("key_block_allocation", f"must be one of {KEY_BLOCK_ALLOCATIONS}")
        if self.allocation_history_bits is not None and (
                isinstance(self.allocation_history_bits, bool) or not isinstance(self.allocation_history_bits, (int, float))
                or not self.bits < self.allocation_history_bits <= 16):
            fail("allocation_history_bits", f"must be None or a number of bits above bits ({self.bits}) and at most 16")
        if self.wide_heads not in WIDE_HEAD_CHOICES:
            fail("wide_heads", f"must be one of {WIDE_HEAD_CHOICES}")
        if self.key_channel_bits not in KEY_CHANNEL_BITS:
            fail("key_channel_bits", f"must be one of {KEY_CHANNEL_BITS}")
        if self.wide_history_bits is not None and (
                isinstance(self.wide_history_bits, bool) or not isinstance(self.wide_history_bits, (int, float))
                or not self.bits < self.wide_history_bits <= 16):
            fail("wide_history_bits", f"must be None or a number of bits above bits ({self.bits}) and at most 16")
        if self.key_granularity == "channel" and self.demotion_block % self.key_block:
            fail("key_block", f"must divide demotion_block ({self.demotion_block}): keys enter the history in "
                              "whole demotion blocks")
        for name in ("key_clip", "value_clip"):
            value = getattr(self, name)
            if isinstance(value, str):
                if value not in CLIP_MODES:
                    fail(name, f"must be one of {CLIP_MODES} or a ratio in (0, 1]")
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < float(value) <= 1.0:
                fail(name, "must be a ratio in (0, 1] or one of " + str(CLIP_MODES))
        if self.key_granularity not in KEY_GRANULARITIES:
            fail("key_granularity", f"must be one of {KEY_GRANULARITIES}")
        if self.scale_dtype not in SCALE_DTYPES:
            fail("scale_dtype", f"must be one of {SCALE_DTYPES}")
        if self.key_target not in KEY_TARGETS:
            fail("key_target", f"must be one of {KEY_TARGETS}")
        if self.value_target not in VALUE_TARGETS:
            fail("value_target", f"must be one of {VALUE_TARGETS}")
        for name in ("per_head", "use_hadamard", "use_permutation", "center_keys", "choose_key_basis"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "must be a boolean")
        if not self.clip_grid or any(not 0.0 < r <= 1.0 for r in self.clip_grid):
            fail("clip_grid", "must be a non-empty list of ratios in (0, 1]")
        check_int("calibration_tokens", 1)
        check_int("calibration_sequence_length", 16)
        check_int("heldout_tokens", 0)
        if not (isinstance(self.key_basis_hadamard_preference, (int, float))
                and not isinstance(self.key_basis_hadamard_preference, bool) and self.key_basis_hadamard_preference >= 1):
            fail("key_basis_hadamard_preference", "must be a number >= 1")

    def check_head_dim(self, head_dim: int) -> None:
        """Checks the fields that depend on the model's head_dim."""
        group = self.group_size or head_dim
        if head_dim % group:
            raise ValueError(f"OscarConfig.group_size: {group} does not divide the model's head_dim {head_dim}")
        per_byte = 8 // self.bits if self.bits in (2, 4, 8) else 8
        if self.bits < 16 and head_dim % per_byte:
            raise ValueError(f"OscarConfig.bits: head_dim {head_dim} is not a multiple of {per_byte} codes per byte")

    # ------------------------------------------------------------------ derived values
    def clip_ratio(self, which: str, fitted: float | None) -> float:
        """The clip ratio to use for `which` in {"key", "value"}, given the fitted value from the rotation file."""
        if which == "key" and self.key_granularity == "channel" and self.bits < 16:
            return 1.0  # channel-wise keys are not clipped: the per-channel range over a block absorbs the outliers
        mode = self.key_clip if which == "key" else self.value_clip
        if mode == "none":
            return 1.0
        if mode == "fitted":
            if fitted is None:
                raise ValueError(
                    f"OscarConfig.{which}_clip is 'fitted' but the rotations carry no fitted {which} clip; "
                    f"calibrate with clip fitting or set {which}_clip to a ratio or 'none'"
                )
            return float(fitted)
        return float(mode)

    @property
    def key_block_choices(self) -> tuple[int, ...]:
        """Blocks a fitted allocation may give a KV head: key_block, and 2·key_block and key_block/2 where they divide
        demotion_block and are multiples of 8 tokens."""
        if self.key_block_allocation == "uniform":
            return (self.key_block,)
        kb = self.key_block
        # the packing runs along the block too (quant.quantize_channels): other blocks need multiples of 8 tokens
        return (kb,) + tuple(b for b in (2 * kb, kb // 2) if b % 8 == 0 and b and self.demotion_block % b == 0 and
                             (b != kb // 2 or kb % 2 == 0))

    def key_blocks(self, heads: int, fitted: tuple[int, ...] | list[int] | None) -> tuple[int, ...]:
        """The channel-wise key block of each of `heads` KV heads of a layer: the fitted allocation (from the
        rotations) when `key_block_allocation == "fitted"` and there is one, else key_block everywhere."""
        if self.key_block_allocation == "uniform" or fitted is None or self.key_granularity != "channel":
            return (self.key_block,) * heads
        fitted = tuple(int(b) for b in fitted)
        if len(fitted) != heads or any(b < 1 or self.demotion_block % b for b in fitted):
            raise ValueError(
                f"the rotations' key blocks {list(fitted)} do not fit {heads} KV heads in demotion blocks of "
                f"{self.demotion_block} tokens; set OscarConfig.key_block_allocation='uniform' or keep the file's "
                "demotion_block")
        return fitted

    @property
    def wide_layout(self) -> bool:
        """Whether this layout can hold wide heads: 2-bit, channel-wise keys, one value group per token (what the
        decode kernel reads)."""
        return self.bits == 2 and self.key_granularity == "channel" and self.group_size is None

    def wide_budget(self, head_dim: int) -> float:
        """History bits per element the wide heads may bring the layout to (`wide_history_bits`)."""
        if self.wide_history_bits is not None:
            return float(self.wide_history_bits)
        return 2.75 if head_dim <= 64 else 2.4375 if head_dim <= 128 else 2.5

    def head_bits(self, heads: int, fitted: tuple[int, ...] | list[int] | None) -> tuple[int, ...] | None:
        """The history bits of each of `heads` KV heads of a layer: the file's wide heads (`fitted`) where this config
        takes them (`wide_heads` not "none", a layout that holds them), else None (`bits` everywhere)."""
        if fitted is None or self.wide_heads == "none" or not self.wide_layout:
            return None
        fitted = tuple(int(b) for b in fitted)
        if len(fitted) != heads:
            raise ValueError(f"the rotations' head bits {list(fitted)} do not fit {heads} KV heads")
        return fitted

    @property
    def wide_channel_layout(self) -> bool:
        """Whether this layout can hold wide key channels: 2-bit channel-wise keys."""
        return self.bits == 2 and self.key_granularity == "channel"

    def key_wide_channels(self, heads: int, fitted: tuple[int, ...] | list[int] | None) -> tuple[int, ...] | None:
        """The wide key channels of each of `heads` KV heads of a layer: the file's (`fitted`) where this config takes
        them (`key_channel_bits == "fitted"`, a layout that holds them), else None."""
        if fitted is None or self.key_channel_bits != "fitted" or not self.wide_channel_layout:
            return None
        fitted = tuple(int(n) for n in fitted)
        if len(fitted) != heads:
            raise ValueError(f"the rotations' key wide channels {list(fitted)} do not fit {heads} KV heads")
        return fitted

    @property
    def inert_fields(self) -> frozenset[str]:
        """Fields that change nothing this config stores or calibrates: the channel-wise key layout's (blocks, their
        allocation, wide key channels) under token-wise keys, the wide heads' where the layout cannot hold them, a
        fitted allocation's budget under uniform blocks. (A result file written before such a field existed still
        describes this cache: `evaluation.runner.check_same_methods`.)"""
        inert = set()
        if self.key_granularity != "channel":
            inert |= {"key_block", "key_block_allocation", "allocation_history_bits"}
        elif self.key_block_allocation == "uniform":
            inert.add("allocation_history_bits")
        if not self.wide_layout:
            inert |= {"wide_heads", "wide_history_bits"}
        if not self.wide_channel_layout:
            inert.add("key_channel_bits")
        return frozenset(inert)

    @property
    def meta_bits(self) -> int:
        """Bits of one stored scale or minimum."""
        return {"float16": 16, "bfloat16": 16, "float32": 32}[self.scale_dtype]

    def value_bits(self, head_dim: int) -> float:
        """Bits per stored value element: codes plus a scale and minimum per group of channels."""
        return self.bits + 2 * self.meta_bits / (self.group_size or head_dim)

    def allocation_key_bits(self, head_dim: int) -> float:
        """Average key bits per element a fitted allocation may spend at `head_dim` (`allocation_history_bits`; for
        uniform blocks or token-wise keys, the bits of that layout)."""
        if self.key_granularity != "channel":
            return self.value_bits(head_dim)
        uniform = self.bits + 2 * self.meta_bits / self.key_block
        if self.key_block_allocation == "uniform":
            return uniform
        if self.allocation_history_bits is not None:
            return 2 * float(self.allocation_history_bits) - self.value_bits(head_dim)
        if (self.group_size or head_dim) > 128:  # values cheaper than at head_dim 128: the keys may take the rest
            return max(uniform, 2 * (self.bits + 0.5) - self.value_bits(head_dim))
        return uniform

    def history_bits_per_element(self, head_dim: int) -> float:
        """Bits per element of the quantized history (keys and values averaged): codes plus the 16-bit (or 32-bit)
        scale and minimum, per group of channels (values; token-wise keys) or per block of tokens (channel-wise keys:
        key_block on average; a fitted allocation spends at most `allocation_key_bits`), at most: wide heads fill the
        layout up to `wide_budget` (calibration's allocation stops at the last head that fits)."""
        if self.bits == 16:
            return 16.0
        base = (self.allocation_key_bits(head_dim) + self.value_bits(head_dim)) / 2
        if self.wide_layout and self.wide_heads != "none":
            return max(base, self.wide_budget(head_dim))
        return base

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["clip_grid"] = list(self.clip_grid)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "OscarConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"OscarConfig: unknown field(s) {unknown}; known fields are {sorted(known)}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "OscarConfig":
        return cls.from_dict(json.loads(text))

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> "OscarConfig":
        import yaml

        data = yaml.safe_load(text) or {}
        if not isinstance(data, dict):
            raise ValueError("OscarConfig: a YAML config must be a mapping of field names to values")
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.write_text(self.to_yaml() if path.suffix in (".yaml", ".yml") else self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "OscarConfig":
        path = Path(path)
        text = path.read_text()
        return cls.from_yaml(text) if path.suffix in (".yaml", ".yml") else cls.from_json(text)

    def replace(self, **changes) -> "OscarConfig":
        return dataclasses.replace(self, **changes)
