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

import json
import os
import sys
import time

import torch
from transformers import DynamicCache

from head_precision_experiment import reconstructed_states
from oscar_hf.evaluation.methods import fill_from_prefill, main_methods
from oscar_hf.evaluation.niah import answer_matches, greedy_answer, haystack_stream, make_trial, prefill
from oscar_hf.evaluation.runner import Session

MODEL = os.environ.get("MODEL", "smollm2-135m")
LENGTH = int(os.environ.get("LENGTH", "4096"))
DEPTHS = [float(x) for x in os.environ.get("DEPTHS", "0.1,0.3,0.5,0.7,0.9").split(",")]
SEEDS = [int(x) for x in os.environ.get("SEEDS", "0,1").split(",")]
SETS = os.environ.get("SETS", "none,needle,needle-keys,needle-values,haystack").split(",")
OUT = os.environ.get("OUT", f"/tmp/needle_tokens_{MODEL}_{LENGTH}.json")
DOMAIN = os.environ.get("DOMAIN", "essays")
NEEDLE_TOKENS = int(os.environ.get("NEEDLE_TOKENS", "16"))  # covers "The special magic number for X is NNNNN."


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
    session = Session(MODEL, output="/tmp/needle_tokens", threads=int(os.environ.get("THREADS", "2")), domain=DOMAIN)
    model, tokenizer = session.model, session.tokenizer
    method = main_methods()["oscar"]
    rotations = session.rotations({"oscar": method})["oscar"]
    stream = haystack_stream(tokenizer, session.eval_docs)
    records, start = [], time.perf_counter()
    for depth in DEPTHS:
        for seed in SEEDS:
            trial = make_trial(tokenizer, session.eval_docs, LENGTH, depth, seed, stream=stream)
            source = prefill(model, trial.haystack_ids)
            recon = reconstructed_states(fill_from_prefill(method.make_cache(model, rotations), source))
            n = trial.haystack_ids.shape[1]
            needle = torch.zeros(n, dtype=torch.bool)
            needle[trial.needle_token : trial.needle_token + NEEDLE_TOKENS] = True
            for spec in SETS:
                positions, sides = {"none": (needle & False, "kv"), "needle": (needle, "kv"),
                                    "needle-keys": (needle, "k"), "needle-values": (needle, "v"),
                                    "haystack": (~needle, "kv")}[spec]
                tokens = greedy_answer(model, mixed_cache(model, source, recon, positions, sides), trial.question_ids, 8)
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                rec = {**trial.describe(), "set": spec, "answer": text, "hit": answer_matches(text, trial.key)}
                records.append(rec)
                print(f"{time.perf_counter() - start:.0f}s", depth, seed, spec, repr(text), rec["hit"], flush=True)
    summary = {s: f"{sum(r['hit'] for r in records if r['set'] == s)}/{sum(r['set'] == s for r in records)}" for s in SETS}
    print(summary)
    env = {k: os.environ.get(k) for k in ("MODEL", "LENGTH", "DEPTHS", "SEEDS", "SETS", "DOMAIN", "NEEDLE_TOKENS")}
    json.dump({"meta": {"command": "python eval/needle_tokens_experiment.py", "env": env},
               "summary": summary, "results": records}, open(OUT, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
