"""The two configs of oscar-hf, kept apart from the mechanics.

- `OscarConfig`: what the cache stores and how it reads it — the one a user sets when building a cache.
- `CalibrationConfig`: what `calibrate()` does — token counts, the clip grid, and which per-head refinements of the
  storage layout it fits (key blocks, 4-bit "wide" heads, wide key channels) within which bit budgets.

Both are frozen dataclasses that validate at construction and raise `ValueError` naming the field. How a rotation
file's per-head refinements and this config become the bytes of each layer is `format.py`'s job.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_BITS = (2, 3, 4, 8, 16)
# dtype names used in configs, files and on the command line -> torch dtypes (the one map of the package)
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
SCALE_DTYPES = ("float16", "bfloat16", "float32")
CLIP_MODES = ("fitted", "none")
KEY_GRANULARITIES = ("channel", "token")
KEY_BLOCK_ALLOCATIONS = ("fitted", "uniform")
WIDE_HEAD_CHOICES = ("retrieval", "none")
KEY_CHANNEL_BITS = ("fitted", "uniform")
# Ratios tried when fitting clip thresholds. The threshold of a row x (length d) is sort(|x|)[floor(r*d)];
# r = 1.0 means "no clip". The reference implementation hand-sets 0.96 (keys) and 0.92 (values).
DEFAULT_CLIP_GRID = (0.60, 0.65, 0.70, 0.75, 0.80, 0.84, 0.88, 0.90, 0.92, 0.94, 0.96, 0.98, 1.0)


def codes_per_byte(bits: int) -> int:
    """Codes of `bits` bits packed per byte along a row (3-bit codes: a 2-bit plane and a 1-bit plane, so 8)."""
    return 8 if bits == 3 else 8 // bits


class _Serializable:
    """to/from dict, JSON and YAML, shared by both configs. Unknown fields are refused, naming the config that has
    them when it is the other one."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        if not isinstance(data, dict):
            raise ValueError(f"{cls.__name__}: a config must be a mapping of field names to values, "
                             f"got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            other = CalibrationConfig if cls is OscarConfig else OscarConfig
            theirs = [name for name in unknown if name in {f.name for f in dataclasses.fields(other)}]
            hint = f" ({', '.join(theirs)} belong to {other.__name__})" if theirs else ""
            raise ValueError(f"{cls.__name__}: unknown field(s) {unknown}{hint}; known fields are {sorted(known)}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str):
        return cls.from_dict(json.loads(text))

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str):
        import yaml

        data = yaml.safe_load(text) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{cls.__name__}: a YAML config must be a mapping of field names to values")
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.write_text(self.to_yaml() if path.suffix in (".yaml", ".yml") else self.to_json())

    @classmethod
    def load(cls, path: str | Path):
        path = Path(path)
        text = path.read_text()
        if path.suffix not in (".yaml", ".yml"):
            try:
                return cls.from_json(text)
            except ValueError as e:  # JSON syntax or a bad field: name the file
                raise ValueError(f"{path}: {e}") from None
        import yaml

        try:
            return cls.from_yaml(text)
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def _fail(self, name: str, message: str):
        raise ValueError(f"{type(self).__name__}.{name}: {message} (got {getattr(self, name)!r})")

    def _check_int(self, name: str, minimum: int) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, int):
            self._fail(name, "must be an integer")
        if value < minimum:
            self._fail(name, f"must be >= {minimum}")

    def _check_choice(self, name: str, choices: tuple) -> None:
        if getattr(self, name) not in choices:
            self._fail(name, f"must be one of {choices}")

    def _check_bits_budget(self, name: str) -> None:
        value = getattr(self, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value <= 16):
            self._fail(name, "must be None or a number of bits in (0, 16]")


@dataclass(frozen=True)
class OscarConfig(_Serializable):
    """What the cache stores, per full-attention layer and KV head:

        [ sink_tokens BF16 | history, `bits` per element | recent window BF16 ]

    all rotated (k·R_K, v·R_V). Tokens beyond the sink enter the window; once it holds `window_tokens` +
    `demotion_block` tokens, its oldest `demotion_block` join the history (`positions.py`). Values are quantized
    token-wise (a scale and minimum per token and group of channels, after a clip); keys channel-wise by default (a
    scale and minimum per channel over blocks of tokens, following the per-channel structure of post-RoPE keys). A
    rotation file may refine this per KV head (its own key block, a 4-bit history for heads that retrieve by
    content, 4-bit and 0-bit key channels in pairs); the cache reads those refinements wherever this layout can hold
    them (`format.py`).

    Args:
        bits: code width of the history: 2 (OSCAR), 3, 4 or 8 (comparisons), or 16 (not quantized, still rotated:
            checks the cache logic against `DynamicCache`).
        group_size: channels sharing one (scale, minimum) pair of a value (and of a token-wise key); `None`: the whole
            head (one pair per token and KV head, the paper's setting). Must divide head_dim.
        sink_tokens: first tokens kept in BF16 ("attention sinks").
        window_tokens: most recent tokens kept in BF16.
        demotion_block: tokens moved from the window into the history at once.
        key_granularity: `"channel"` (default) or `"token"` (the paper's: a scale and minimum per token, after a clip).
        key_block: tokens sharing one key scale and minimum per channel (channel-wise keys), unless the rotation file
            allocated a block per KV head for this key_block and demotion_block. Must divide demotion_block.
        key_clip, value_clip: `"fitted"` (the per-layer ratios in the rotation file), `"none"`, or a fixed ratio in
            (0, 1]: each row is clamped at its sort(|x|)[floor(r·d)] before token-wise quantization. Channel-wise keys
            are never clipped.
        scale_dtype: dtype of the stored scales and minima.
    """

    bits: int = 2
    group_size: int | None = None
    sink_tokens: int = 64
    window_tokens: int = 256
    demotion_block: int = 128
    key_granularity: str = "channel"
    key_block: int = 64
    key_clip: str | float = "fitted"
    value_clip: str | float = "fitted"
    scale_dtype: str = "float16"

    def __post_init__(self):
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or self.bits not in SUPPORTED_BITS:
            self._fail("bits", f"must be one of {SUPPORTED_BITS}")
        if self.group_size is not None:
            self._check_int("group_size", 1)
            if self.group_size & (self.group_size - 1):
                self._fail("group_size", "must be a power of two (it divides a power-of-two head_dim)")
        self._check_int("sink_tokens", 0)
        self._check_int("window_tokens", 0)
        self._check_int("demotion_block", 1)
        self._check_int("key_block", 1)
        self._check_choice("key_granularity", KEY_GRANULARITIES)
        if self.key_granularity == "channel" and self.demotion_block % self.key_block:
            self._fail("key_block", f"must divide demotion_block ({self.demotion_block}): keys enter the history "
                                    "in whole demotion blocks")
        if self.key_granularity == "channel" and self.bits < 16 and self.key_block % codes_per_byte(self.bits):
            self._fail("key_block", f"must be a multiple of {codes_per_byte(self.bits)} at bits={self.bits}: "
                                    "channel-wise key codes are packed along the block")
        for name in ("key_clip", "value_clip"):
            value = getattr(self, name)
            if isinstance(value, str):
                if value not in CLIP_MODES:
                    self._fail(name, f"must be one of {CLIP_MODES} or a ratio in (0, 1]")
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < float(value) <= 1.0:
                self._fail(name, "must be a ratio in (0, 1] or one of " + str(CLIP_MODES))
        self._check_choice("scale_dtype", SCALE_DTYPES)

    def check_head_dim(self, head_dim: int) -> None:
        """Checks the fields that depend on the model's head_dim."""
        group = self.group_size or head_dim
        if head_dim % group:
            raise ValueError(f"OscarConfig.group_size: {group} does not divide the model's head_dim {head_dim}")
        per_byte = codes_per_byte(self.bits)
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
    def wide_layout(self) -> bool:
        """Whether this layout can hold 4-bit (wide) heads: 2-bit, channel-wise keys, one value group per token
        (what the decode kernel reads)."""
        return self.bits == 2 and self.key_granularity == "channel" and self.group_size is None

    @property
    def wide_channel_layout(self) -> bool:
        """Whether this layout can hold wide key channels: 2-bit channel-wise keys."""
        return self.bits == 2 and self.key_granularity == "channel"

    @property
    def meta_bits(self) -> int:
        """Bits of one stored scale or minimum."""
        return {"float16": 16, "bfloat16": 16, "float32": 32}[self.scale_dtype]

    def value_bits(self, head_dim: int) -> float:
        """Bits per stored value element: codes plus a scale and minimum per group of channels."""
        return self.bits + 2 * self.meta_bits / (self.group_size or head_dim)

    def uniform_key_bits(self, head_dim: int) -> float:
        """Bits per stored key element with key_block everywhere (channel-wise) or per group (token-wise)."""
        if self.key_granularity != "channel":
            return self.value_bits(head_dim)
        return self.bits + 2 * self.meta_bits / self.key_block


@dataclass(frozen=True)
class CalibrationConfig(_Serializable):
    """What `calibrate()` measures and fits, for a storage layout given by an `OscarConfig`.

    Args:
        tokens: calibration tokens whose statistics build the rotations.
        sequence_length: tokens per calibration forward pass (lowered to the model's positions by the CLI).
        heldout_tokens: further tokens, disjoint from the calibration ones, on which the clips, key blocks and key
            channel widths are fitted (0: none of those is fitted).
        clip_grid: ratios tried when fitting the clips.
        key_block_allocation: `"fitted"`: each KV head gets key blocks of key_block/2, key_block or 2·key_block tokens
            (those dividing demotion_block), at no more average bits than `allocation_history_bits` allows, by least
            held-out attention-output error (models with fewer than `calibrate.MIN_ALLOCATION_HEADS` KV heads in their
            full-attention layers keep key_block everywhere unless the budget exceeds it). `"uniform"`: key_block.
        allocation_history_bits: history bits per element (keys and values averaged) the key blocks may spend. `None`:
            those of key_block everywhere, except where values are cheaper than at head_dim 128 (value groups over
            128 channels): there keys may bring the history to bits + 0.5.
        wide_heads: `"retrieval"`: the KV heads with the highest induction (retrieval) score keep a 4-bit history,
            as many as `wide_history_bits` pays for. `"none"`: none. Needs a layout that holds them
            (`OscarConfig.wide_layout`).
        wide_history_bits: history bits per element, averaged over every head, the wide heads may bring the layout
            to. `None`: 2.75 at head_dim <= 64, 2.4375 at 128, 2.5 above.
        key_channel_bits: `"fitted"`: each 2-bit head's key channels get 0, 2 or 4 bits at an average of 2, by
            reverse water-filling of the held-out expected logit error; the head's key rotation becomes the
            permutation that sorts its channels for that. `"uniform"`: 2 bits in every channel of the head's key
            basis. Needs 2-bit channel-wise keys.
        center_keys: subtract a calibrated per-(layer, KV head) mean of the post-RoPE keys before the cache stores
            them (softmax ignores the per-query constant q·μ); the rotation file carries the means and the cache
            applies them.
        choose_key_basis: per KV head that keeps a key rotation, the key basis (calibrated U·H·P, data-free H·P, or
            none) whose quantized keys give the least held-out attention-output error. With fitted key channels only
            the wide heads keep one: a 2-bit head stores its raw channels, sorted by width, and its key blocks and
            clips are weighed in that basis.
    """

    tokens: int = 8192
    sequence_length: int = 2048
    heldout_tokens: int = 1024
    clip_grid: tuple[float, ...] = field(default=DEFAULT_CLIP_GRID)
    key_block_allocation: str = "fitted"
    allocation_history_bits: float | None = None
    wide_heads: str = "retrieval"
    wide_history_bits: float | None = None
    key_channel_bits: str = "fitted"
    center_keys: bool = False
    choose_key_basis: bool = True

    def __post_init__(self):
        grid = self.clip_grid
        if isinstance(grid, (str, bytes)) or not hasattr(grid, "__iter__") or \
                any(isinstance(r, bool) or not isinstance(r, numbers.Real) for r in grid):
            self._fail("clip_grid", "must be a non-empty list of ratios in (0, 1]")
        object.__setattr__(self, "clip_grid", tuple(float(r) for r in grid))
        self._check_int("tokens", 1)
        self._check_int("sequence_length", 16)
        self._check_int("heldout_tokens", 0)
        if not self.clip_grid or any(not 0.0 < r <= 1.0 for r in self.clip_grid):
            self._fail("clip_grid", "must be a non-empty list of ratios in (0, 1]")
        self._check_choice("key_block_allocation", KEY_BLOCK_ALLOCATIONS)
        self._check_choice("wide_heads", WIDE_HEAD_CHOICES)
        self._check_choice("key_channel_bits", KEY_CHANNEL_BITS)
        self._check_bits_budget("allocation_history_bits")
        self._check_bits_budget("wide_history_bits")
        for name in ("center_keys", "choose_key_basis"):
            if not isinstance(getattr(self, name), bool):
                self._fail(name, "must be a boolean")

    def check_for(self, config: OscarConfig) -> None:
        """Checks the budgets against the storage layout they are fitted for."""
        for name in ("allocation_history_bits", "wide_history_bits"):
            value = getattr(self, name)
            if value is not None and value <= config.bits:
                self._fail(name, f"must be above the layout's bits ({config.bits})")

    def key_block_choices(self, config: OscarConfig) -> tuple[int, ...]:
        """Blocks a fitted allocation may give a KV head: key_block, and 2·key_block and key_block/2 where they divide
        demotion_block and are multiples of 8 tokens (the packing runs along the block: `quant.quantize_channels`)."""
        kb = config.key_block
        if self.key_block_allocation == "uniform":
            return (kb,)
        return (kb,) + tuple(b for b in (2 * kb, kb // 2) if b % 8 == 0 and b and config.demotion_block % b == 0 and
                             (b != kb // 2 or kb % 2 == 0))

    def allocation_key_bits(self, config: OscarConfig, head_dim: int) -> float:
        """Average key bits per element a fitted allocation may spend at `head_dim` (`allocation_history_bits`; for
        uniform blocks or token-wise keys, the bits of that layout)."""
        uniform = config.uniform_key_bits(head_dim)
        if config.key_granularity != "channel" or self.key_block_allocation == "uniform":
            return uniform
        if self.allocation_history_bits is not None:
            return 2 * float(self.allocation_history_bits) - config.value_bits(head_dim)
        if (config.group_size or head_dim) > 128:  # values cheaper than at head_dim 128: the keys may take the rest
            return max(uniform, 2 * (config.bits + 0.5) - config.value_bits(head_dim))
        return uniform

    def wide_budget(self, head_dim: int) -> float:
        """History bits per element the wide heads may bring the layout to (`wide_history_bits`)."""
        if self.wide_history_bits is not None:
            return float(self.wide_history_bits)
        return 2.75 if head_dim <= 64 else 2.4375 if head_dim <= 128 else 2.5

    def history_bits_per_element(self, config: OscarConfig, head_dim: int) -> float:
        """Bits per element of the quantized history (keys and values averaged, metadata included) at most, for a
        file calibrated with this config for `config`'s layout."""
        if config.bits == 16:
            return 16.0
        base = (self.allocation_key_bits(config, head_dim) + config.value_bits(head_dim)) / 2
        if config.wide_layout and self.wide_heads != "none":
            return max(base, self.wide_budget(head_dim))
        return base


# Fields written by oscar-hf up to 0.1 into one `OscarConfig` (rotation files' metadata, result files), by their
# place now; fields that no longer exist are listed so that reading such a file can drop them.
LEGACY_CALIBRATION_NAMES = {"calibration_tokens": "tokens", "calibration_sequence_length": "sequence_length"}
LEGACY_RECIPE_FIELDS = ("key_target", "value_target", "per_head", "use_hadamard", "use_permutation")
_LEGACY_DROPPED = ("key_basis_hadamard_preference",)


def split_legacy(data: dict[str, Any]) -> tuple[OscarConfig, CalibrationConfig, dict[str, Any]]:
    """An `OscarConfig` dict as oscar-hf 0.1 wrote it (storage, calibration and rotation-recipe fields in one) ->
    `(OscarConfig, CalibrationConfig, recipe fields)`. Also accepts a dict of today's `OscarConfig` fields."""
    storage = {f.name for f in dataclasses.fields(OscarConfig)}
    calibration = {f.name for f in dataclasses.fields(CalibrationConfig)}
    parts: tuple[dict, dict, dict] = ({}, {}, {})
    for name, value in data.items():
        name = LEGACY_CALIBRATION_NAMES.get(name, name)
        if name in storage:
            parts[0][name] = value
        elif name in calibration:
            parts[1][name] = value
        elif name in LEGACY_RECIPE_FIELDS:
            parts[2][name] = value
        elif name not in _LEGACY_DROPPED:
            raise ValueError(f"unknown OscarConfig field {name!r}")
    return OscarConfig(**parts[0]), CalibrationConfig(**parts[1]), parts[2]
