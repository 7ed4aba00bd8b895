"""Run by tests/test_distributed.py under `torchrun --nproc-per-node N` (or alone, N = 1).

`argv[1]`: a JSON list of cases, each `{"name", "model", "rotations", "config", "sensitivity"}`: a tiny model folder, a
rotation folder and an `OscarConfig` file. For each case the worker loads the model (with `tp_plan="auto"` when
N > 1), generates greedily with OscarCache and StaticOscarCache over the rotation file (tokens and logits), and
records, per OSCAR layer, what this rank's cache holds: its `LayerFormat`'s heads and per-head refinements, whether
that format equals `format.resolve` on this rank's shard of KV heads (rank r holds heads [r·H/N, (r+1)·H/N)), and
whether its rotations and key means are those rows of the file's. With `"sensitivity"` (N = 1 only) it also
generates with the file's per-head tables and rotations in reverse head order: what a rank holding another rank's
slice would do.

Every rank writes its record to `argv[2]` + `.rank{r}.json`.
"""

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM

import oscar_hf  # noqa: F401
from oscar_hf import OscarCache, OscarConfig, OscarRotations, StaticOscarCache
from oscar_hf.format import resolve

cases_path, out = sys.argv[1:3]
world = int(os.environ.get("WORLD_SIZE", "1"))
rank = int(os.environ.get("RANK", "0"))


def reversed_heads(rot: OscarRotations) -> OscarRotations:
    flip = lambda table: None if table is None else {l: tuple(v)[::-1] for l, v in table.items()}  # noqa: E731
    return OscarRotations(rot.geometry, {l: r.flip(0) for l, r in rot.key_rotations.items()},
                          {l: r.flip(0) for l, r in rot.value_rotations.items()}, key_clips=rot.key_clips,
                          value_clips=rot.value_clips, metadata=rot.metadata,
                          key_means=None if rot.key_means is None else {l: m.flip(0) for l, m in rot.key_means.items()},
                          layout=rot.layout, key_blocks=flip(rot.key_blocks), head_bits=flip(rot.head_bits),
                          key_wide_channels=flip(rot.key_wide_channels))


def layer_record(cache, layer: int, rotations: OscarRotations, config: OscarConfig) -> dict:
    """What this rank's cache holds for `layer`, and its checks against the file's rows for this rank's heads."""
    heads = cache.geometry.num_key_value_heads
    count = heads // world
    first = rank * count
    held = cache.layers[layer]
    fmt = held.fmt
    expected = resolve(config, rotations, cache.geometry, {l: (first, count) for l in cache.geometry.oscar_layers},
                       warn=False)[layer]
    rows = slice(first, first + count)
    mean = rotations.key_mean(layer)
    return {
        "first_head": fmt.first_head, "heads": fmt.heads, "key_blocks": list(fmt.keys.blocks),
        "wide_rows": list(fmt.keys.wide_rows), "value_wide_rows": list(fmt.values.wide_rows),
        "wide_channels": list(fmt.keys.wide_channels), "value_clip": fmt.values.clip,
        "format_is_resolve_on_shard": fmt == expected,
        "key_rotation_rows": torch.equal(held.key_rotation, rotations.key_rotations[layer][rows]),
        "value_rotation_rows": torch.equal(held.value_rotation, rotations.value_rotations[layer][rows]),
        "key_mean_rows": (held.key_mean is None and mean is None) or
                         (held.key_mean is not None and torch.equal(held.key_mean[0, :, 0], mean[rows])),
    }


def generate(model, rotations, config, ids, new_tokens):
    result = {}
    for name, cache in (("dynamic", OscarCache(model, rotations, config, allow_other_weights=True)),
                        ("static", StaticOscarCache(model, rotations, config, max_cache_len=80,
                                                    allow_other_weights=True))):
        with torch.no_grad():
            out = model.generate(ids, past_key_values=cache, max_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        result[name] = out.sequences[:, ids.shape[1]:].tolist()
        result[f"{name}_logits"] = torch.stack(out.logits, 1).tolist()  # [B, new_tokens, vocab]
        result[f"{name}_local_heads"] = cache.layers[cache.first_oscar_layer].key_rotation.shape[0]
        result[f"{name}_history_rows"] = cache.plan.history_rows(cache.plan.current_length())
        result[f"{name}_layers"] = {str(l): layer_record(cache, l, rotations, config)
                                    for l in cache.geometry.oscar_layers}
    return result


record = {}
for case in json.loads(open(cases_path).read()):
    model = AutoModelForCausalLM.from_pretrained(case["model"], attn_implementation="oscar", dtype=torch.float32,
                                                 **({"tp_plan": "auto"} if world > 1 else {})).eval()
    rotations = OscarRotations.from_pretrained(case["rotations"])
    config = OscarConfig.load(case["config"])
    ids = torch.randint(4, 90, (2, 40), generator=torch.Generator().manual_seed(0))
    record[case["name"]] = generate(model, rotations, config, ids, 12)
    if case.get("sensitivity") and world == 1:
        flipped = generate(model, reversed_heads(rotations), config, ids, 12)
        record[case["name"]]["reversed_heads_logits"] = flipped["dynamic_logits"]
with open(f"{out}.rank{rank}.json", "w") as f:
    json.dump(record, f)
