"""Experiment (not a library option): do a few (layer, KV head)s carry the needle?

For each NIAH trial, the default `OscarCache` is filled from the BF16 prefill as in `niah.run_trial`; its stored
history is read back dequantized and un-rotated, and a `DynamicCache` is built that holds, per (layer, KV head),
either those reconstructions or the exact BF16 states. The question and the answer then run through that cache, so a
head set S kept exact shows how much of the needle gap S carries. S comes from a calibration-time head score:

- `copy`: induction score on a repeated random-token sequence (attention from each token of the second copy to the
  token after its earlier occurrence; a KV head takes the largest of its query heads): heads that retrieve by content;
- `oracle`: the trial's own BF16 attention from the question's last token to the needle's tokens (not available at
  calibration; an upper bound for any head score).

Run (SmolLM2 4K, the default's 10 trials): `python eval/head_precision_experiment.py` with env MODEL, LENGTH, SETS
(comma list of `none`, `all`, `copy:K`, `oracle:K`), OUT (json path). Result in eval/NOTES.md.
"""
from __future__ import annotations

import json
import os
import sys
import time
from types import SimpleNamespace

import torch
from transformers import DynamicCache

from oscar_hf.cache import OscarCache, OscarLayer
from oscar_hf.calibrate import StatisticsCollector, _run, calibration_sequences, capturing
from oscar_hf.config import OscarConfig
from oscar_hf.evaluation.methods import fill_from_prefill, main_methods
from oscar_hf.evaluation.niah import answer_matches, greedy_answer, haystack_stream, make_trial, prefill
from oscar_hf.evaluation.runner import Session
from oscar_hf.metrics import cache_kwarg
from oscar_hf.models import model_geometry

ENV_KEYS = ("MODEL", "LENGTH", "DEPTHS", "SEEDS", "SETS", "DOMAIN", "VALUES", "KEY_BLOCKS", "MAX_BITS", "WEIGHTS")


def trial_settings(sets: str, out: str) -> SimpleNamespace:
    """The settings the NIAH experiment scripts here read from the environment: MODEL, LENGTH, DEPTHS, SEEDS, SETS
    (default `sets`), DOMAIN, THREADS and OUT (default `out`, formatted with the model and length)."""
    model, length = os.environ.get("MODEL", "smollm2-135m"), int(os.environ.get("LENGTH", "4096"))
    return SimpleNamespace(
        model=model, length=length, domain=os.environ.get("DOMAIN", "essays"),
        depths=[float(x) for x in os.environ.get("DEPTHS", "0.1,0.3,0.5,0.7,0.9").split(",")],
        seeds=[int(x) for x in os.environ.get("SEEDS", "0,1").split(",")],
        sets=os.environ.get("SETS", sets).split(","), threads=int(os.environ.get("THREADS", "2")),
        out=os.environ.get("OUT", out.format(model=model, length=length)))


def hit_summary(records: list[dict], sets: list[str]) -> dict[str, str]:
    """{set: "hits/trials"} over the records of an experiment run."""
    return {s: f"{sum(r['hit'] for r in records if r['set'] == s)}/{sum(r['set'] == s for r in records)}" for s in sets}


def write_results(out: str, script: str, records: list[dict], sets: list[str], **meta) -> dict[str, str]:
    """Writes `records` with their summary and the environment that chose them to `out`; returns the summary."""
    summary = hit_summary(records, sets)
    json.dump({"meta": {"command": f"python eval/{script}", "env": {k: os.environ.get(k) for k in ENV_KEYS}, **meta},
               "summary": summary, "results": records}, open(out, "w"), indent=1)
    return summary


def default_session(settings: SimpleNamespace, output: str):
    """The evaluation session of the settings' model and domain, the default method and its calibrated rotations."""
    session = Session(settings.model, output=output, threads=settings.threads, domain=settings.domain)
    method = main_methods()["oscar"]
    return session, method, session.rotations({"oscar": method})["oscar"]


def answer(session, cache, trial, spec: str, records: list[dict], start: float) -> dict:
    """Runs the trial's question through `cache`, appends and prints the record of set `spec`."""
    tokens = greedy_answer(session.model, cache, trial.question_ids, 8)
    text = session.tokenizer.decode(tokens, skip_special_tokens=True)
    rec = {**trial.describe(), "set": spec, "answer": text, "hit": answer_matches(text, trial.key)}
    records.append(rec)
    print(f"{time.perf_counter() - start:.0f}s", trial.depth, trial.seed, spec, repr(text), rec["hit"], flush=True)
    return rec


@torch.no_grad()
def heldout_record(model, tokenizer, config: OscarConfig, data=None) -> dict:
    """{layer: (query [Hq, T, d], key [H, T, d], value, scale)} of calibration's held-out sequence, as `calibrate`
    records it for its clip fit (disjoint from the calibration and evaluation text)."""
    _, heldout, _ = calibration_sequences(tokenizer, config, data)
    return recorded_states(model, heldout)


@torch.no_grad()
def recorded_states(model, sequences) -> dict:
    """{layer: (query [Hq, T, d], key [H, T, d], value, scale)} of the OSCAR layers on the last of `sequences`."""
    collector = StatisticsCollector(model_geometry(model.config))
    collector.record = {}
    with capturing(model, collector):
        _run(model, sequences, False, "recorded pass")
    return collector.record


def trials(session, settings: SimpleNamespace):
    """Each (trial, its BF16 prefill) over the settings' depths × seeds, the haystack text tokenized once."""
    stream = haystack_stream(session.tokenizer, session.eval_docs)
    for depth in settings.depths:
        for seed in settings.seeds:
            trial = make_trial(session.tokenizer, session.eval_docs, settings.length, depth, seed, stream=stream)
            yield trial, prefill(session.model, trial.haystack_ids)


_SETTINGS = trial_settings("none,all,copy:9,copy:18", "/tmp/head_precision_{model}_{length}.json")
MODEL, LENGTH, DEPTHS, SEEDS = _SETTINGS.model, _SETTINGS.length, _SETTINGS.depths, _SETTINGS.seeds
SETS, OUT, DOMAIN = _SETTINGS.sets, _SETTINGS.out, _SETTINGS.domain


def replayed(cache, source: DynamicCache) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """`cache` filled from the BF16 prefill `source`, read back (`reconstructed_states`)."""
    return reconstructed_states(fill_from_prefill(cache, source))


def reconstructed_states(cache) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per OSCAR layer: every stored token as the default cache gives it back, un-rotated, `[B, H, n, d]`."""
    out = {}
    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, OscarLayer):
            continue
        keys, values = layer.stored_states()
        rk, rv = layer.key_rotation.float(), layer.value_rotation.float()
        keys = keys.float() @ rk.transpose(-1, -2)
        values = values.float() @ rv.transpose(-1, -2)
        if layer.key_mean is not None:
            keys = keys + layer.key_mean  # [1, H, 1, d]
        out[i] = (keys, values)
    return out


def mixed_cache(model, source: DynamicCache, recon: dict, exact: set[tuple[int, int]],
                upgrade: dict | None = None) -> DynamicCache:
    """Per (layer, KV head): the default's reconstruction, or for heads in `exact` the BF16 states (or, with
    `upgrade`, that cache's reconstruction: the heads stored at more bits)."""
    cache = DynamicCache(config=model.config)
    for i, layer in enumerate(source.layers):
        k, v = layer.keys.clone(), layer.values.clone()
        if i in recon:
            rk, rv = recon[i]
            for h in range(k.shape[1]):
                if (i, h) not in exact:
                    k[:, h] = rk[:, h].to(k.dtype)
                    v[:, h] = rv[:, h].to(v.dtype)
                elif upgrade is not None:
                    k[:, h] = upgrade[i][0][:, h].to(k.dtype)
                    v[:, h] = upgrade[i][1][:, h].to(v.dtype)
        cache.update(k, v, i)
    return cache


@torch.no_grad()
def copy_scores(model, tokenizer, span: int = 256, seed: int = 0) -> torch.Tensor:
    """Induction score per (layer, KV head) `[L, H_kv]` on a random token sequence repeated once."""
    cfg = model.config.get_text_config(decoder=True)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, min(cfg.vocab_size, 30000), (1, span), generator=g)
    bos = torch.tensor([[tokenizer.bos_token_id or 0]])
    ids = torch.cat([bos, ids, ids], 1)
    model.set_attn_implementation("eager")
    try:
        att = model(input_ids=ids, output_attentions=True).attentions
    finally:
        model.set_attn_implementation("oscar")
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    scores = []
    for a in att:  # [1, Hq, n, n]
        q = torch.arange(1 + span, 1 + 2 * span - 1)  # second copy, each but its last token
        target = q - span + 1  # the token after the earlier occurrence
        s = a[0][:, q, target].float().mean(-1)  # [Hq]
        scores.append(s.view(cfg.num_key_value_heads, group).amax(-1))
    return torch.stack(scores)


_PROBED: list[torch.Tensor] = []


def _probe_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """sdpa, recording the softmax of the chunk's last query row over every key `[H_q, n]`."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    group = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(group, 1)
    _PROBED.append(torch.softmax((query[0, :, -1:].float() @ k[0].float().transpose(-1, -2)).squeeze(1)
                                 * (scaling or query.shape[-1] ** -0.5), -1))
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


@torch.no_grad()
def needle_scores(model, trial, source: DynamicCache) -> torch.Tensor:
    """Oracle: BF16 attention mass from the question's last token onto the needle's tokens, per (layer, KV head)."""
    import copy as _copy

    from transformers import AttentionInterface

    AttentionInterface.register("oscar_probe", _probe_attention)
    cfg = model.config.get_text_config(decoder=True)
    _PROBED.clear()
    model.set_attn_implementation("oscar_probe")
    try:
        model(input_ids=trial.question_ids, use_cache=True, logits_to_keep=1, **{cache_kwarg(model): _copy.deepcopy(source)})
    finally:
        model.set_attn_implementation("oscar")
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    lo, hi = trial.needle_token, trial.needle_token + 12
    return torch.stack([a[:, lo:hi].sum(-1).view(cfg.num_key_value_heads, group).amax(-1) for a in _PROBED])


def top_heads(scores: torch.Tensor, k: int, layers: set[int]) -> set[tuple[int, int]]:
    s = scores.clone()
    for i in range(s.shape[0]):
        if i not in layers:
            s[i] = -1
    flat = s.flatten().topk(k).indices
    return {(int(i) // s.shape[1], int(i) % s.shape[1]) for i in flat}


def main() -> int:
    session = Session(MODEL, output="/tmp/head_precision", threads=2, domain=DOMAIN)
    model, tokenizer = session.model, session.tokenizer
    method = main_methods()["oscar"]
    rotations = session.rotations({"oscar": method})["oscar"]
    t = time.perf_counter()
    copy = copy_scores(model, tokenizer)
    print(f"copy scores in {time.perf_counter() - t:.0f}s; top 12:",
          sorted(((round(float(copy[i, h]), 3), i, h) for i in range(copy.shape[0]) for h in range(copy.shape[1])), reverse=True)[:12],
          flush=True)
    records = []
    for depth in DEPTHS:
        for seed in SEEDS:
            trial = make_trial(tokenizer, session.eval_docs, LENGTH, depth, seed)
            source = prefill(model, trial.haystack_ids)
            cache = fill_from_prefill(method.make_cache(model, rotations), source)
            recon = reconstructed_states(cache)
            del cache
            oracle, upgraded = None, {}
            for spec in SETS:
                kind, _, k = spec.partition(":")
                upgrade = None
                if kind.startswith("copy") and kind != "copy":
                    # copyB:K: the K heads at B bits, clips as fitted; copyBn:K: values not clipped
                    variant = kind[4:]
                    if variant not in upgraded:
                        config = OscarConfig(**{**rotations.layout, "bits": int(variant.rstrip("n"))},
                                             **({"value_clip": "none"} if variant.endswith("n") else {}))
                        upgraded[variant] = replayed(OscarCache(model, rotations, config), source)
                    upgrade, kind = upgraded[variant], "copy"
                if kind == "none":
                    exact = set()
                elif kind == "all":
                    exact = {(i, h) for i in recon for h in range(recon[i][0].shape[1])}
                elif kind == "copy":
                    exact = top_heads(copy, int(k), set(recon))
                elif kind == "oracle":
                    if oracle is None:
                        oracle = needle_scores(model, trial, source)
                    exact = top_heads(oracle, int(k), set(recon))
                else:
                    raise SystemExit(f"unknown head set {spec!r}")
                tokens = greedy_answer(model, mixed_cache(model, source, recon, exact, upgrade), trial.question_ids, 8)
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                rec = {**trial.describe(), "set": spec, "exact_heads": sorted(exact), "answer": text,
                       "hit": answer_matches(text, trial.key)}
                records.append(rec)
                print(depth, seed, spec, repr(text), rec["hit"], flush=True)
    print(write_results(OUT, "head_precision_experiment.py", records, SETS, copy_scores=copy.tolist()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
