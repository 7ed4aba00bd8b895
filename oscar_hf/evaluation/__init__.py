"""The accuracy-evaluation harness: OSCAR against its peers, as caches usable in `generate()`.

- `methods`: the registry (name -> cache factory: BF16, OSCAR, reference recipe, naive/Hadamard INT2, KIVI-2,
  transformers' QuantizedCache, INT4; the paper's ablations) and `cache_bits`, the bits each cache really stores.
- `kivi`: `KiviCache`, KIVI-2 as a `transformers.Cache`.
- `niah`: seeded needle-in-a-haystack trials run through each cache.
- `diagnostics`, `report`: per-layer attention KL / output error against BF16 (`oscar-hf report`).
- `lm_eval_model`: the `oscar` lm-eval model type (`OscarLM`), scoring through the cache; offline tasks in `tasks/`.
- `runner`: `oscar-hf eval ppl|ablations|diagnostics|niah|lm-eval|all`, writing JSON results with provenance.
"""
