"""Diagnostic (not a library option): is the needle lost in its own tokens or in the haystack around it?

For each NIAH trial the default `OscarCache` is filled from the BF16 prefill (as in `niah.run_trial`) and read back
dequantized (`head_precision_experiment.reconstructed_states`); a `DynamicCache` then holds those reconstructions
except for a set of *token positions* kept exact (BF16) in every head, and the question and answer run through it.

SETS (comma list):
- `none`: the default's reconstruction everywhere (must reproduce the default's answers);
- `needle`, `needle-keys`, `needle-values`: the needle sentence's tokens exact (both sides, keys only, values only);
- `haystack`: every history token but the needle's exact (the needle alone quantized).

If `needle` recovers BF16's hits, the needle's own tokens carry the loss and a cache-time detector of such tokens is
worth building; if `haystack` does, the loss is the other tokens' error drowning the needle.

    MODEL=smollm2-135m LENGTH=4096 SETS=none,needle,needle-keys,needle-values,haystack \
        OUT=eval/results/smollm2-135m/niah_needle_tokens.json python eval/needle_tokens_experiment.py

Result in eval/NOTES.md.
"""
from __future__ import annotations

import sys
import time

import torch
from transformers import DynamicCache

from head_precision_experiment import answer, default_session, replayed, trial_settings, trials, write_results

SETTINGS = trial_settings("none,needle,needle-keys,needle-values,haystack", "/tmp/needle_tokens_{model}_{length}.json")
NEEDLE_TOKENS = 16  # covers "The special magic number is NNNNN." in the tokenizers here


def mixed_cache(model, source: DynamicCache, recon: dict, positions: torch.Tensor, sides: str) -> DynamicCache:
    """The default's reconstruction, with `positions` (bool `[n]`) exact on `sides` ("kv", "k" or "v")."""
    cache = DynamicCache(config=model.config)
    for i, layer in enumerate(source.layers):
        k, v = layer.keys.clone(), layer.values.clone()
        if i in recon:
            rk, rv = recon[i]
            n = rk.shape[-2]
            keep = positions[:n]
            k = torch.where(keep[:, None] & ("k" in sides), k, rk.to(k.dtype))
            v = torch.where(keep[:, None] & ("v" in sides), v, rv.to(v.dtype))
        cache.update(k, v, i)
    return cache


def main() -> int:
    session, method, rotations = default_session(SETTINGS, "/tmp/needle_tokens")
    model, tokenizer = session.model, session.tokenizer
    records, start = [], time.perf_counter()
    for trial, source in trials(session, SETTINGS):
        recon = replayed(method.make_cache(model, rotations), source)
        needle = torch.zeros(trial.haystack_ids.shape[1], dtype=torch.bool)
        needle[trial.needle_token : trial.needle_token + NEEDLE_TOKENS] = True
        for spec in SETTINGS.sets:
            positions, sides = {"none": (needle & False, "kv"), "needle": (needle, "kv"), "needle-keys": (needle, "k"),
                                "needle-values": (needle, "v"), "haystack": (~needle, "kv")}[spec]
            answer(session, mixed_cache(model, source, recon, positions, sides), trial, spec, records, start)
    print(write_results(SETTINGS.out, "needle_tokens_experiment.py", records, SETTINGS.sets,
                        needle_tokens=NEEDLE_TOKENS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
