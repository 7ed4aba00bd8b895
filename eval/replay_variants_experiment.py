"""Experiment (not a library option): many cache variants replayed on the same NIAH trials, sides taken apart.

For each trial the BF16 prefill is stored once per variant cache, read back dequantized and un-rotated
(`head_precision_experiment.reconstructed_states`), and the question runs through a `DynamicCache` that takes each
side (keys, values) of every OSCAR layer from one of those reconstructions or from the exact BF16 states. Sets:

- `bf16`: every state exact (the replay's own BF16, which can differ from the real BF16 cache by rounding);
- `default`: the default cache as calibrated;
- `keys-exact`, `values-exact`: that side exact, the other as the default stores it;
- `cfg:<field>=<value>[+<field>=<value>...]`: the default's rotations with those `OscarConfig` fields changed (e.g.
  `cfg:value_clip=none`, `cfg:key_block=32+key_block_allocation=uniform`);
- `keys-cfg:<changes>`: keys from that configuration's cache, values as the default stores them (e.g.
  `keys-cfg:bits=3+wide_heads=none`: 3-bit keys everywhere).

    MODEL=smollm2-135m LENGTH=4096 SEEDS=0,...,7 DOMAIN=essays|python|shakespeare \
        SETS=bf16,default,keys-exact,values-exact,cfg:value_clip=none OUT=... python eval/replay_variants_experiment.py

Result in eval/NOTES.md.
"""
from __future__ import annotations

import sys
import time

from head_precision_experiment import answer, default_session, replayed, trial_settings, trials, write_results
from oscar_hf.cache import OscarCache
from oscar_hf.config import OscarConfig
from wide_sides_experiment import mixed_cache

SETTINGS = trial_settings("bf16,default,keys-exact,values-exact", "/tmp/replay_{model}_{length}.json")


def config_changes(spec: str) -> dict:
    """`field=value+field=value` -> {field: value}, values parsed as int, float or kept as strings."""
    changes = {}
    for item in spec.split("+"):
        name, _, text = item.partition("=")
        for parse in (int, float, str):
            try:
                changes[name] = parse(text)
                break
            except ValueError:
                continue
    return changes


def main() -> int:
    session, method, rotations = default_session(SETTINGS, "/tmp/replay_variants")
    model, tokenizer = session.model, session.tokenizer
    layout = rotations.layout
    configs = {s: OscarConfig(**{**layout, **config_changes(s.partition("cfg:")[2])}) for s in SETTINGS.sets
               if s.startswith(("cfg:", "keys-cfg:"))}
    records, start = [], time.perf_counter()
    for trial, source in trials(session, SETTINGS):
        default = replayed(method.make_cache(model, rotations), source)
        exact = {i: (source.layers[i].keys.float(), source.layers[i].values.float()) for i in default}
        heads = {(i, h) for i in default for h in range(default[i][0].shape[1])}
        for spec in SETTINGS.sets:
            if spec in configs:
                recon = replayed(OscarCache(model, rotations, configs[spec]), source)
                low, high, keys, values = recon, recon, set(), set()
                if spec.startswith("keys-cfg:"):
                    low, keys = default, heads
            else:
                low, high = default, exact
                keys, values = {"bf16": (heads, heads), "default": (set(), set()), "keys-exact": (heads, set()),
                                "values-exact": (set(), heads)}[spec]
            answer(session, mixed_cache(model, source, low, high, keys, values), trial, spec, records, start)
        summary = write_results(SETTINGS.out, "replay_variants_experiment.py", records, SETTINGS.sets,
                                wide_heads_of_default=rotations.wide_heads)
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
