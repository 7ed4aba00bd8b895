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

import sys
import time
from copy import deepcopy

from transformers import DynamicCache

from head_precision_experiment import (answer, copy_scores, default_session, replayed, top_heads, trial_settings, trials,
                                       write_results)
from oscar_hf.cache import OscarCache
from oscar_hf.config import OscarConfig

SETTINGS = trial_settings("default,both:11,keys:22,values:22", "/tmp/wide_sides_{model}_{length}.json")


def mixed_cache(model, source: DynamicCache, low: dict, high: dict, keys: set, values: set) -> DynamicCache:
    """Per OSCAR layer and KV head: keys from `high` for heads in `keys`, else `low`; values likewise. The other
    layers are copies of `source`'s (a sliding-window layer keeps its window and the count of tokens it has seen,
    which a fresh `update` with the window alone would get wrong)."""
    cache = deepcopy(source)
    for i, layer in enumerate(cache.layers):
        if i in low:
            k, v = layer.keys, layer.values
            for h in range(k.shape[1]):
                k[:, h] = (high if (i, h) in keys else low)[i][0][:, h].to(k.dtype)
                v[:, h] = (high if (i, h) in values else low)[i][1][:, h].to(v.dtype)
    return cache


def main() -> int:
    session, method, rotations = default_session(SETTINGS, "/tmp/wide_sides")
    model, tokenizer = session.model, session.tokenizer
    layout = rotations.layout
    copy = copy_scores(model, tokenizer)
    records, start = [], time.perf_counter()
    for trial, source in trials(session, SETTINGS):
        default = replayed(method.make_cache(model, rotations), source)
        low = replayed(OscarCache(model, rotations, OscarConfig(**{**layout, "wide_heads": "none"})), source)
        high = replayed(OscarCache(model, rotations, OscarConfig(**{**layout, "bits": 4})), source)
        for spec in SETTINGS.sets:
            kind, _, k = spec.partition(":")
            top = top_heads(copy, int(k), set(low)) if k else set()
            keys, values = {"default": (set(), set()), "both": (top, top), "keys": (top, set()),
                            "values": (set(), top)}[kind]
            lo, hi = (default, default) if kind == "default" else (low, high)
            answer(session, mixed_cache(model, source, lo, hi, keys, values), trial, spec, records, start)
        # after every trial, so that a long run cut short keeps what it measured
        summary = write_results(SETTINGS.out, "wide_sides_experiment.py", records, SETTINGS.sets,
                                wide_heads_of_default=rotations.wide_heads)
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
