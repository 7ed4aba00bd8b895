"""Experiment (not a library option): key bits allocated across channels by the attention-score error.

The issue's lever "attention-aware bit allocation across directions": a key error e changes a query's logit by q·e,
so the expected logit error is Σ_c E[q_c²]·E[e_c²] in a basis where the query second moment is (nearly) diagonal.
Post-RoPE, the position-averaged query second moment is nearly diagonal in the raw channels (each RoPE pair is
rotation-averaged to a multiple of the identity), so the raw basis is that basis. Per (layer, KV head), calibration's
held-out sequence gives each channel's query energy w_c and the squared error D_c(b) of its keys quantized
channel-wise over the default's key blocks (its per-head allocation; KEY_BLOCKS=64: 64 for every head) at
b = 0..MAX_BITS bits (0 bits: the block mean); a greedy reverse water-filling then gives each channel b_c bits so
that Σ_c b_c = 2·d (4·d for the default's wide heads) and Σ_c w_c·D_c(b_c) is least. The same (scale, minimum)
per channel and block as the default: no more bits.

Replayed like `replay_variants_experiment.py`: per trial the default cache is filled from the BF16 prefill; a
variant takes its values from the default's reconstruction and its history keys (the same positions the default
quantizes) from the allocation. Sets:

- `bf16`, `default`: as in `replay_variants_experiment.py`;
- `uniform:B`: every channel 2 bits (4 in wide heads) in basis B (the allocation's reference);
- `water:B[:W[:K]]`: the allocated bits in basis B, B `identity` (raw post-RoPE channels) or `stored` (each head's
  stored key rotation, the default's basis); W the allowed widths as digits (e.g. `024`; default every width); K the
  code bits per key channel on average in a 2-bit head (default 2: the default's bits; 2.25 spends the 0.125
  history bit at head_dim 64 that 4-bit keys alone in the wide heads would free, see `wide_sides_experiment.py`).

WEIGHTS (env): the query energies w_c from calibration's held-out text (`heldout`, default), from the data-free
retrieval probe's random tokens read twice (`probe`), or the two normalised and summed (`both`).

VALUES=narrow (env) takes every variant's values from the cache without wide heads (2-bit values in every head, as
wide heads with 4-bit keys only would store them); default: the default's values.

    MODEL=smollm2-135m LENGTH=4096 SEEDS=0,...,7 DOMAIN=essays|python|shakespeare MAX_BITS=4 \
        SETS=bf16,default,uniform:identity,water:identity,water:identity:024 OUT=... python eval/key_waterfill_experiment.py

Result in eval/NOTES.md.
"""
from __future__ import annotations

import os
import sys
import time

import torch

from head_precision_experiment import (answer, default_session, heldout_record, reconstructed_states, recorded_states,
                                       replayed, trial_settings, trials, write_results)
from oscar_hf.cache import OscarCache
from oscar_hf.calibrate import retrieval_sequences, water_fill
from oscar_hf.config import OscarConfig
from oscar_hf.evaluation.methods import fill_from_prefill
from oscar_hf.quant import fake_quantize
from wide_sides_experiment import mixed_cache

SETTINGS = trial_settings("bf16,default,uniform:identity,water:identity,water:stored",
                          "/tmp/waterfill_{model}_{length}.json")
MAX_BITS = int(os.environ.get("MAX_BITS", "4"))
CHUNK = 128  # every key block divides it
KEY_BLOCKS = os.environ.get("KEY_BLOCKS", "allocated")
WEIGHTS = os.environ.get("WEIGHTS", "heldout")  # heldout | probe | both


def blocks_of(rotations, layer: int, heads: int) -> tuple[int, ...]:
    """The key block of each KV head: KEY_BLOCKS=allocated (default) the default's calibrated allocation, so that
    the variants cost its bits; KEY_BLOCKS=<n> n tokens for every head."""
    if KEY_BLOCKS != "allocated":
        return (int(KEY_BLOCKS),) * heads
    blocks = (rotations.key_blocks or {}).get(layer)
    return tuple(blocks) if blocks else (rotations.layout["key_block"],) * heads


def block_reconstructions(kr: torch.Tensor, blocks) -> torch.Tensor:
    """Keys `[H, n, d]` (n a multiple of every block) -> `[MAX_BITS + 1, H, n, d]`: head h channel-wise over blocks
    of `blocks[h]` tokens at 0..MAX_BITS bits, 16-bit (scale, minimum); 0 bits keeps the block mean."""
    heads = []
    for head, block in enumerate(blocks):
        n, d = kr.shape[1:]
        cols = kr[head].float().reshape(n // block, block, d).transpose(-1, -2)  # [nb, d, block]
        out = [cols.mean(-1, keepdim=True).half().float().expand_as(cols)]
        out += [fake_quantize(cols, b, block).float() for b in range(1, MAX_BITS + 1)]
        heads.append(torch.stack([o.transpose(-1, -2).reshape(n, d) for o in out]))
    return torch.stack(heads, 1)


def allocate(weights: torch.Tensor, errors: torch.Tensor, budget: int, widths=None) -> torch.Tensor:
    """`calibrate.water_fill` over `errors` `[d, MAX_BITS + 1]` (squared error at 0..MAX_BITS bits), the widths
    limited to `widths` (and 0, where every channel starts) when given: bits `[d]` summing to at most `budget`."""
    allowed = sorted({0, *(range(MAX_BITS + 1) if widths is None else widths)})
    return water_fill(weights, errors[:, allowed], budget, allowed)


def query_energy(q: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """E[q_c²] per KV head and channel `[H, d]` (float64) of queries `[Hq, T, d]` in `basis` `[H, d, d]`, the
    query heads of each GQA group pooled."""
    h, d = basis.shape[0], q.shape[-1]
    qr = torch.matmul(q.reshape(h, q.shape[0] // h, -1, d), basis.float().unsqueeze(1))
    return qr.square().mean(dim=(1, 2)).double()


@torch.no_grad()
def probe_queries(model, tokenizer) -> dict[int, torch.Tensor]:
    """{layer: queries [Hq, T, d]} of calibration's data-free retrieval probe (a random-token sequence read twice,
    `calibrate.retrieval_sequences`, its first seed), the queries of heads that look things up by content."""
    _, _, sequences = retrieval_sequences(model, tokenizer, seeds=(0,))
    return {layer: q for layer, (q, _, _, _) in recorded_states(model, sequences).items()}


def layer_allocation(weights: torch.Tensor, keys: torch.Tensor, blocks, budgets, widths=None) -> torch.Tensor:
    """Channel bits `[H, d]` of one layer: `weights` `[H, d]` (query energy per channel), `keys` `[H, T, d]` (the
    held-out keys after the sink, in the allocation's basis, whole chunks), each head's key block and code-bit
    budget (`allocate`)."""
    err = ((block_reconstructions(keys, blocks) - keys) ** 2).mean(2).permute(1, 2, 0).double()  # [H, d, bits]
    return torch.stack([allocate(weights[h], err[h], budgets[h], widths) for h in range(keys.shape[0])])


@torch.no_grad()
def heldout_allocation(session, rotations, tables: dict[str, tuple[dict[int, torch.Tensor], tuple | None, float]],
                       wide) -> dict:
    """{name: {layer: bits [H, d]}} for each {name: (basis, allowed widths or None, key bits)}, from calibration's
    held-out sequence (disjoint from calibration and evaluation text)."""
    config = OscarConfig(**rotations.layout)
    record = heldout_record(session.model, session.tokenizer, config, session.store.data)
    probe = probe_queries(session.model, session.tokenizer) if WEIGHTS != "heldout" else None
    out = {}
    for name, (basis, widths, key_bits) in tables.items():
        out[name] = {}
        for layer, (q, k, _, _) in record.items():
            h, d = k.shape[0], k.shape[-1]
            b = basis[layer].float()  # [H, d, d]
            kr = torch.matmul(k, b)[:, config.sink_tokens:]
            kr = kr[:, : kr.shape[1] // CHUNK * CHUNK]
            w = query_energy(q, b)  # [H, d]
            if probe is not None:
                w_probe = query_energy(probe[layer], b)
                share = lambda x: x / x.sum(-1, keepdim=True)  # noqa: E731
                w = w_probe if WEIGHTS == "probe" else share(w) + share(w_probe)
            budgets = [round((4 if (layer, hh) in wide else key_bits) * d) for hh in range(h)]
            out[name][layer] = layer_allocation(w, kr, blocks_of(rotations, layer, h), budgets, widths)
    return out


def allocated_keys(keys: torch.Tensor, start: int, length: int, basis: torch.Tensor, bits: torch.Tensor,
                   blocks) -> torch.Tensor:
    """Exact keys `[1, H, n, d]` with positions start..start+length replaced by their allocated reconstruction."""
    out = keys.float().clone()
    kr = torch.matmul(out[0, :, start:start + length], basis.float())  # [H, L, d]
    recon = block_reconstructions(kr, blocks)  # [bits, H, L, d]
    chosen = recon.gather(0, bits[None, :, None, :].expand(1, -1, length, -1)).squeeze(0)
    out[0, :, start:start + length] = torch.matmul(chosen, basis.float().transpose(-1, -2))
    return out


def main() -> int:
    session, method, rotations = default_session(SETTINGS, "/tmp/key_waterfill")
    model, tokenizer = session.model, session.tokenizer
    wide = set(map(tuple, rotations.wide_heads))
    layers = sorted(rotations.key_rotations)
    d = rotations.key_rotations[layers[0]].shape[-1]
    bases = {"identity": {i: torch.eye(d).expand_as(rotations.key_rotations[i]) for i in layers},
             "stored": {i: rotations.key_rotations[i] for i in layers}}
    tables = {}
    for s in SETTINGS.sets:
        kind, _, rest = s.partition(":")
        if kind == "water":
            basis, _, widths = rest.partition(":")
            widths, _, key_bits = widths.partition(":")
            tables[rest] = (bases[basis], tuple(int(c) for c in widths) if widths else None, float(key_bits or 2))
    bits = heldout_allocation(session, rotations, tables, wide)
    for name, table in bits.items():
        hist = torch.bincount(torch.cat([t.flatten() for t in table.values()]), minlength=MAX_BITS + 1)
        print(f"{name}: channel bits histogram 0..{MAX_BITS}: {hist.tolist()}", flush=True)
    uniform = {i: torch.tensor([[4 if (i, hh) in wide else 2] * d for hh in range(t.shape[0])])
               for i, t in next(iter(bits.values())).items()} if bits else {}
    records, start = [], time.perf_counter()
    for trial, source in trials(session, SETTINGS):
        cache = fill_from_prefill(method.make_cache(model, rotations), source)
        spans = {i: (layer.n_sink, layer.history_keys.length) for i, layer in enumerate(cache.layers) if i in layers}
        default = reconstructed_states(cache)
        value_source = default
        if os.environ.get("VALUES", "default") == "narrow":
            narrow = OscarConfig(**{**rotations.layout, "wide_heads": "none"})
            value_source = replayed(OscarCache(model, rotations, narrow), source)
        exact = {i: (source.layers[i].keys.float(), source.layers[i].values.float()) for i in default}
        heads = {(i, h) for i in default for h in range(default[i][0].shape[1])}
        for spec in SETTINGS.sets:
            kind, _, rest = spec.partition(":")
            basis = rest.partition(":")[0]
            if kind in ("bf16", "default"):
                low, high = default, exact
                keys, values = (heads, heads) if kind == "bf16" else (set(), set())
            else:
                table = bits[rest] if kind == "water" else uniform
                low = {i: (allocated_keys(exact[i][0], *spans[i], bases[basis][i], table[i],
                                          blocks_of(rotations, i, table[i].shape[0])), value_source[i][1])
                       for i in default}
                high, keys, values = low, set(), set()
            answer(session, mixed_cache(model, source, low, high, keys, values), trial, spec, records, start)
        summary = write_results(SETTINGS.out, "key_waterfill_experiment.py", records, SETTINGS.sets,
                                max_bits=MAX_BITS, key_blocks=KEY_BLOCKS, weights=WEIGHTS,
                                values=os.environ.get("VALUES", "default"),
                                channel_bits={n: {str(i): t.tolist() for i, t in tb.items()}
                                                                 for n, tb in bits.items()})
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
