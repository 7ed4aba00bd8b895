"""Bits per element a `StaticOscarCache` of 131,072 tokens allocates for the Qwen3-8B geometry (36 layers, 8 KV heads,
head_dim 128), by the cache's own accounting (`memory_report`), with and without wide heads.

The buffers are allocated on the CPU by each layer's `lazy_initialization` (what the first store does); the model's
hidden sizes are shrunk, which the cache never sees. Key blocks and wide heads as `bench_generate.py` gives this
geometry. The CUDA allocator holds a little more (its rounding): `bench_generate.py --sections memory` measures that.

Run: `python eval/static_cache_bits.py` (CPU, under a minute).
"""
import sys

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import oscar_hf  # noqa: F401  (registers the "oscar" attention StaticOscarCache requires)
from oscar_hf import StaticOscarCache

sys.path.insert(0, "eval")
import bench_generate as bg  # noqa: E402

MAX_LEN = 131072
cfg = Qwen3Config(hidden_size=128, intermediate_size=128, num_hidden_layers=36, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128, vocab_size=128, max_position_embeddings=MAX_LEN)
model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
model.set_attn_implementation("oscar")
heads = cfg.num_hidden_layers * cfg.num_key_value_heads
elements = heads * 2 * cfg.head_dim * MAX_LEN
for wide in (False, True):
    bg.WIDE_HEADS = wide
    rot = bg.oscar_rotations(model)
    cache = StaticOscarCache(model, rot, bg.oscar_config(), max_cache_len=MAX_LEN)
    states = torch.zeros(1, cfg.num_key_value_heads, 1, cfg.head_dim, dtype=torch.bfloat16)
    for layer in cache.layers:
        layer.lazy_initialization(states, states)
    held = cache.memory_report()["oscar_allocated_bytes"]
    print(f"wide heads {'on ' if wide else 'off'}: {len(rot.wide_heads)} of {heads} KV heads wide; {held / 2**30:.3f} GiB, "
          f"{8 * held / elements:.3f} bits per element")
