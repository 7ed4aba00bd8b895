"""Run by tests/test_distributed.py under `torchrun --nproc-per-node N` (or alone, N = 1): loads the tiny model of
`argv[1]` (with `tp_plan="auto"` when N > 1), generates greedily with OscarCache and StaticOscarCache over the
rotation file `argv[2]`, and rank 0 writes the tokens and each cache's per-rank head count to `argv[3]` (JSON)."""

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM

import oscar_hf  # noqa: F401
from oscar_hf import OscarCache, OscarConfig, OscarRotations, StaticOscarCache

model_dir, rotation_dir, out = sys.argv[1:4]
world = int(os.environ.get("WORLD_SIZE", "1"))
model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="oscar", dtype=torch.float32,
                                             **({"tp_plan": "auto"} if world > 1 else {})).eval()
rotations = OscarRotations.from_pretrained(rotation_dir)
config = OscarConfig(sink_tokens=4, window_tokens=8, demotion_block=4, key_block=4, value_clip=0.95, center_keys=True)
ids = torch.randint(4, 90, (2, 40), generator=torch.Generator().manual_seed(0))
result = {}
for name, cache in (("dynamic", OscarCache(model, rotations, config, allow_other_weights=True)),
                    ("static", StaticOscarCache(model, rotations, config, max_cache_len=80, allow_other_weights=True))):
    with torch.no_grad():
        tokens = model.generate(ids, past_key_values=cache, max_new_tokens=12, do_sample=False, pad_token_id=0)
    result[name] = tokens[:, 40:].tolist()
    result[f"{name}_local_heads"] = cache.layers[0].key_rotation.shape[0]
if int(os.environ.get("RANK", "0")) == 0:
    with open(out, "w") as f:
        json.dump(result, f)
