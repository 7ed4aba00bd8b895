"""Experiment (not a library option): at the wide heads' bits, are 4-bit keys in twice as many heads worth more?

The default stores the top KV heads of calibration's retrieval probe at 4 bits on both sides (11 of SmolLM2's 90:
+0.25 history bit at head_dim 64). The same bits buy 4-bit *keys only* in twice as many heads (or values only). For
each NIAH trial this builds, from the BF16 prefill, the default cache, a cache with every head at 2 bits and one with
every head at 4 bits (`head_precision_experiment`'s way), reads them back dequantized and un-rotated, and runs the
question through a `DynamicCache` that takes each (layer, KV head, side) from one of them:

- `default`: the default cache as calibrated (its own wide heads);
- `both:K`: the top K heads by the probe at 4 bits on both sides (K = 11 reproduces the default's choice);
- `keys:K`, `values:K`: the top K heads at 4 bits on one side only (K = 22: the default's bits).

    MODEL=smollm2-135m LENGTH=4096 SEEDS=0,1,2,3,4,5,6,7 DOMAIN=essays|python|shakespeare \
        SETS=default,both:11,keys:22,values:22 OUT=... python eval/wide_sides_experiment.py

Result in eval/NOTES.md.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
from transformers import DynamicCache

from head_precision_experiment import copy_scores, reconstructed_states, top_heads
from oscar_hf.cache import OscarCache
from oscar_hf.config import OscarConfig
from oscar_hf.evaluation.methods import fill_from_prefill, main_methods
from oscar_hf.evaluation.niah import answer_matches, greedy_answer, haystack_stream, make_trial, prefill
from oscar_hf.evaluation.runner import Session

MODEL = os.environ.get("MODEL", "smollm2-135m")
LENGTH = int(os.environ.get("LENGTH", "4096"))
DEPTHS = [float(x) for x in os.environ.get("DEPTHS", "0.1,0.3,0.5,0.7,0.9").split(",")]
SEEDS = [int(x) for x in os.environ.get("SEEDS", "0,1").split(",")]
SETS = os.environ.get("SETS", "default,both:11,keys:22,values:22").split(",")
OUT = os.environ.get("OUT", f"/tmp/wide_sides_{MODEL}_{LENGTH}.json")
DOMAIN = os.environ.get("DOMAIN", "essays")


def mixed_cache(model, source: DynamicCache, low: dict, high: dict, keys: set, values: set) -> DynamicCache:
    """Per OSCAR layer and KV head: keys from `high` for heads in `keys`, else `low`; values likewise."""
    cache = DynamicCache(config=model.config)
    for i, layer in enumerate(source.layers):
        k, v = layer.keys.clone(), layer.values.clone()
        if i in low:
            for h in range(k.shape[1]):
                k[:, h] = (high if (i, h) in keys else low)[i][0][:, h].to(k.dtype)
                v[:, h] = (high if (i, h) in values else low)[i][1][:, h].to(v.dtype)
        cache.update(k, v, i)
    return cache


def main() -> int:
    session = Session(MODEL, output="/tmp/wide_sides", threads=int(os.environ.get("THREADS", "2")), domain=DOMAIN)
    model, tokenizer = session.model, session.tokenizer
    method = main_methods()["oscar"]
    rotations = session.rotations({"oscar": method})["oscar"]
    layout = rotations.layout
    copy = copy_scores(model, tokenizer)
    stream = haystack_stream(tokenizer, session.eval_docs)
    records, start = [], time.perf_counter()
    for depth in DEPTHS:
        for seed in SEEDS:
            trial = make_trial(tokenizer, session.eval_docs, LENGTH, depth, seed, stream=stream)
            source = prefill(model, trial.haystack_ids)
            default = reconstructed_states(fill_from_prefill(method.make_cache(model, rotations), source))
            low = reconstructed_states(fill_from_prefill(
                OscarCache(model, rotations, OscarConfig(**{**layout, "wide_heads": "none"})), source))
            high = reconstructed_states(fill_from_prefill(
                OscarCache(model, rotations, OscarConfig(**{**layout, "bits": 4})), source))
            for spec in SETS:
                kind, _, k = spec.partition(":")
                top = top_heads(copy, int(k), set(low)) if k else set()
                cache = {"default": lambda: mixed_cache(model, source, default, default, set(), set()),
                         "both": lambda: mixed_cache(model, source, low, high, top, top),
                         "keys": lambda: mixed_cache(model, source, low, high, top, set()),
                         "values": lambda: mixed_cache(model, source, low, high, set(), top)}[kind]()
                text = tokenizer.decode(greedy_answer(model, cache, trial.question_ids, 8), skip_special_tokens=True)
                rec = {**trial.describe(), "set": spec, "answer": text, "hit": answer_matches(text, trial.key)}
                records.append(rec)
                print(f"{time.perf_counter() - start:.0f}s", depth, seed, spec, repr(text), rec["hit"], flush=True)
            summary = {s: f"{sum(r['hit'] for r in records if r['set'] == s)}/{sum(r['set'] == s for r in records)}"
                       for s in SETS}
            env = {k: os.environ.get(k) for k in ("MODEL", "LENGTH", "DEPTHS", "SEEDS", "SETS", "DOMAIN")}
            json.dump({"meta": {"command": "python eval/wide_sides_experiment.py", "env": env,
                                "wide_heads_of_default": rotations.wide_heads},
                       "summary": summary, "results": records}, open(OUT, "w"), indent=1)
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
