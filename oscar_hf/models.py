"""Which architectures and layer types OSCAR supports, and the refusal messages for the others.

`layer_plan(config)` says, per decoder layer, what the cache does there:
- `"oscar"`: a full-attention layer, stored as BF16 sink | INT2 history | BF16 recent window with OSCAR rotations;
- `"sliding"`: a sliding-window layer (e.g. Gemma 3's local layers), kept as transformers' bounded BF16 window
  (it is already small; quantizing it would cost accuracy for no memory).
Anything else raises `UnsupportedModelError` naming the reason.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from .rotation import is_power_of_two

# Families whose attention modules call `cache.update(...)` then `ALL_ATTENTION_FUNCTIONS` with post-RoPE q/k/v
# (GPT-2: absolute positions, plain q/k/v), and that the test-suite covers; any other model type warns once.
TESTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3", "gpt2")

# Known architectures we refuse, with the reason.
REFUSED_MODEL_TYPES = {
    "deepseek_v2": "multi-head latent attention (MLA) caches a compressed latent, not per-head keys and values",
    "deepseek_v3": "multi-head latent attention (MLA) caches a compressed latent, not per-head keys and values",
    "kimi_k2": "multi-head latent attention (MLA) caches a compressed latent, not per-head keys and values",
    "gemma2": "attention-logit soft-capping is not implemented by the OSCAR attention",
    "gpt_oss": "learned attention-sink logits are not implemented by the OSCAR attention",
    "mamba": "state-space layers have no key/value cache",
    "mamba2": "state-space layers have no key/value cache",
    "jamba": "hybrid Mamba/attention caches are not supported",
    "qwen3_next": "linear-attention (gated DeltaNet) layers are not supported",
    "falcon_h1": "hybrid Mamba/attention caches are not supported",
    "gemma3n": "Gemma 3n shares KV caches across layers inside its forward pass",
    "llama4": "chunked attention layers are not supported",
}

SUPPORTED_LAYER_TYPES = {"full_attention": "oscar", "sliding_attention": "sliding"}
_warned_untested: set[str] = set()  # model types already warned about (once per process)


class UnsupportedModelError(ValueError):
    """The model's architecture or attention layout cannot use OscarCache."""


@dataclass(frozen=True)
class ModelGeometry:
    """What the cache and the rotation files need to know about a model."""

    model_type: str
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    plan: tuple[str, ...]  # per layer: "oscar" or "sliding"
    sliding_windows: tuple[int | None, ...]

    @property
    def oscar_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.plan) if kind == "oscar")

    @property
    def num_key_value_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads


def text_config(config):
    """The decoder config of a (possibly multimodal) model config."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def model_geometry(config) -> ModelGeometry:
    """Reads and checks a transformers config; raises `UnsupportedModelError` with the reason if OSCAR cannot apply."""
    cfg = text_config(config)
    model_type = getattr(cfg, "model_type", None) or getattr(config, "model_type", "unknown")
    if model_type in REFUSED_MODEL_TYPES:
        raise UnsupportedModelError(f"model_type '{model_type}' is not supported: {REFUSED_MODEL_TYPES[model_type]}")
    if getattr(cfg, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"model_type '{model_type}': encoder-decoder models are not supported")
    for attr, reason in (
        ("kv_lora_rank", "multi-head latent attention (MLA) caches a compressed latent, not per-head keys/values"),
        ("attn_logit_softcapping", "attention-logit soft-capping is not implemented by the OSCAR attention"),
    ):
        if getattr(cfg, attr, None) is not None:
            raise UnsupportedModelError(f"model_type '{model_type}' is not supported: {reason} ({attr} is set)")

    n_layers = getattr(cfg, "num_hidden_layers", None)
    n_heads = getattr(cfg, "num_attention_heads", None)
    if n_layers is None or n_heads is None:
        raise UnsupportedModelError(f"model_type '{model_type}': config has no num_hidden_layers/num_attention_heads")
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    if n_heads % n_kv:
        raise UnsupportedModelError(f"num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}")
    if not is_power_of_two(head_dim):
        raise UnsupportedModelError(
            f"head_dim {head_dim} is not a power of two: OSCAR's rotation uses a Sylvester Hadamard matrix and a "
            "bit-reversal permutation of that size"
        )

    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is None:
        window = getattr(cfg, "sliding_window", None)
        use_sliding = getattr(cfg, "use_sliding_window", window is not None)
        layer_types = ["sliding_attention" if (window is not None and use_sliding) else "full_attention"] * n_layers
    plan, windows = [], []
    for i, layer_type in enumerate(layer_types):
        if layer_type not in SUPPORTED_LAYER_TYPES:
            raise UnsupportedModelError(
                f"model_type '{model_type}' layer {i} has layer type '{layer_type}'; OscarCache supports "
                f"{sorted(SUPPORTED_LAYER_TYPES)} (linear, chunked, latent or shared-KV attention layers are not supported)"
            )
        plan.append(SUPPORTED_LAYER_TYPES[layer_type])
        windows.append(getattr(cfg, "sliding_window", None) if layer_type == "sliding_attention" else None)
    if "oscar" not in plan:
        raise UnsupportedModelError(
            f"model_type '{model_type}' has no full-attention layer: every layer is a bounded sliding window, "
            "so there is no long-context KV cache for OSCAR to compress"
        )
    if model_type not in TESTED_MODEL_TYPES and model_type not in _warned_untested:
        _warned_untested.add(model_type)
        warnings.warn(
            f"model_type '{model_type}' is not among the architectures oscar-hf is tested on "
            f"({', '.join(TESTED_MODEL_TYPES)}); it may work, but check it (e.g. OscarConfig(bits=16) must match "
            "DynamicCache)", stacklevel=2,
        )
    return ModelGeometry(model_type, n_layers, n_heads, n_kv, head_dim, tuple(plan), tuple(windows))


def check_attention_interface(model) -> None:
    """Refuses models whose attention does not go through transformers' AttentionInterface."""
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        raise UnsupportedModelError(
            f"{type(model).__name__} computes attention outside transformers' AttentionInterface, so the OSCAR "
            "attention cannot be attached (the model code must call ALL_ATTENTION_FUNCTIONS.get_interface)"
        )


def attention_without_cache_kwargs(model) -> str | None:
    """The class name of the model's attention when its forward calls `cache.update(..., self.layer_idx)` without
    handing over the kwargs it gives the attention function (`kwargs=kwargs`; GPT-NeoX's in transformers 5.x), else
    None (also where the source cannot be read). Through those kwargs the fused "oscar" attention gets what the
    cache stored; without them a cache can only return dequantized states."""
    import inspect
    import re

    module = next(iter(decoder_attention(model).values()), (None, None))[1]
    if module is None:
        return None
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return None
    updates = [call for call in re.findall(r"\.update\(([^()]*)\)", source) if "layer_idx" in call]
    return type(module).__name__ if updates and not any("kwargs" in call for call in updates) else None


# Children of an attention module that project its output (not part of what keys/queries/values are made from).
OUTPUT_PROJECTIONS = ("o_proj", "c_proj", "dense", "out_proj", "wo")


def language_model(model):
    """The decoder whose layers the cache stores: `model.get_decoder()` (a vision-language model's language model,
    a causal LM's base model), or `model` itself when it has none."""
    get = getattr(model, "get_decoder", None)
    if callable(get):
        try:
            decoder = get()
        except (AttributeError, NotImplementedError, TypeError):
            decoder = None
        if decoder is not None and hasattr(decoder, "named_modules"):
            return decoder
    return model


def decoder_attention(model) -> dict[int, tuple[str, object]]:
    """The language model's attention modules, `{layer_idx: (name in model, module)}`: the modules that call
    `cache.update(..., self.layer_idx)`, so exactly those the cache's layers belong to. A vision tower's attention
    (`vision_tower.encoder.layers.N.self_attn`) is no part of it.

    Found inside `language_model(model)` as the modules with an integer `layer_idx` that own a q/k/v projection
    (q_proj/k_proj/v_proj, GPT-2's c_attn, GPT-NeoX's query_key_value, fused qkv_proj/Wqkv/W_pack); without any,
    by name (`layers.N.self_attn` / `h.N.attn` / `layers.N.attention`)."""
    import re

    decoder = language_model(model)
    prefix = next((name + "." for name, module in model.named_modules() if module is decoder and name), "")
    projections = ("q_proj", "k_proj", "v_proj", "c_attn", "query_key_value", "qkv_proj", "Wqkv", "W_pack")
    found: dict[int, tuple[str, object]] = {}
    for name, module in decoder.named_modules():
        index = getattr(module, "layer_idx", None)
        if isinstance(index, int) and not isinstance(index, bool) and any(
                hasattr(module, p) for p in projections):
            found.setdefault(index, (prefix + name, module))
    if not found:
        for name, module in decoder.named_modules():
            match = re.search(r"(?:^|\.)(?:layers|h)\.(\d+)\.(?:self_attn|attn|attention)$", name)
            if match:
                found.setdefault(int(match.group(1)), (prefix + name, module))
    return dict(sorted(found.items()))


def tensor_parallel_rank(model, tp_size: int) -> int:
    """This process's coordinate along the tensor-parallel dimension of `model`'s device mesh.

    transformers records the mesh as `model._device_mesh` (5.2x: dims ("pp", "fsdp", "tp"); 4.5x: the TP mesh
    itself); the coordinate is taken on its "tp" dimension (or on the mesh itself when it is one-dimensional), which
    holds wherever TP sits in the mesh. Only without a mesh is it the global rank modulo `tp_size` (TP innermost, as
    `torchrun` with TP alone lays it out)."""
    import torch

    mesh = getattr(model, "_device_mesh", None) or getattr(model, "device_mesh", None)
    if mesh is not None and hasattr(mesh, "get_local_rank"):
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if "tp" in names:
            return int(mesh.get_local_rank("tp"))
        if getattr(mesh, "ndim", None) == 1:
            return int(mesh.get_local_rank())
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 0
    return torch.distributed.get_rank() % tp_size


def kv_head_shards(model, head_dim: int, num_key_value_heads: int) -> dict[int, tuple[int, int]]:
    """Under tensor parallelism (`tp_plan="auto"` under torchrun), the KV heads each layer computes on this rank:
    `{layer: (first head, count)}`, only for layers holding fewer than all heads (empty without TP).

    Read from the `k_proj` weight of the language model's attention layers (`decoder_attention`; a vision tower's
    projections are no part of the cache): a DTensor sharded on its output rows tells its global offset; a plain
    tensor smaller than the whole projection (a model sharded into local tensors) is taken as the rank's contiguous
    block, at its coordinate on the mesh's TP dimension (`tensor_parallel_rank`). Shardings the cache cannot follow
    (heads split inside, a replicated-but-partial layout) are refused."""
    import torch

    shards = {}
    for layer, (_, module) in decoder_attention(model).items():
        weight = getattr(getattr(module, "k_proj", None), "weight", None)
        if weight is None:
            continue
        if hasattr(weight, "placements"):  # DTensor
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            shape, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
            rows, first_row = shape[0], offset[0]
        else:
            rows = weight.shape[0]
            if rows >= num_key_value_heads * head_dim:
                continue
            tp_size = getattr(model, "tp_size", None) or (torch.distributed.get_world_size()
                                                           if torch.distributed.is_initialized() else 1)
            first_row = tensor_parallel_rank(model, tp_size) * rows
        if rows == num_key_value_heads * head_dim:
            continue
        if rows % head_dim or first_row % head_dim:
            raise UnsupportedModelError(
                f"layer {layer}'s k_proj is sharded into {rows} output rows at offset {first_row}, which splits KV "
                f"heads of dim {head_dim}: OscarCache can follow tensor parallelism only across whole KV heads")
        shards[layer] = (first_row // head_dim, rows // head_dim)
    return shards
