"""Reference outputs of the caches, recorded before the consolidation and required to stay the same after it.

Each case runs one tiny model (random weights, float32, the torch twins) through one cache with one storage layout:
a prefill, single-token decode steps (blocks complete, the window slides), a multi-token chunk onto the filled cache,
more decode steps, and `model.generate`. It records the logits of every step, the generated tokens and the bytes the
cache stores (sink, recent window or ring, packed history codes and metadata). `python tests/golden_cases.py`
rewrites `tests/data/cache_reference_outputs.safetensors`; `test_golden.py` compares against it (codes exactly,
logits to float32 rounding of a reordered sum). The `wide` case alone was recorded again when the clip stopped
applying to wide heads (a change of what they store, issue 50); `python tests/golden_cases.py wide` does that.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import VOCAB, tiny_model  # noqa: E402

from oscar_hf import OscarCache, OscarConfig, OscarRotations, StaticOscarCache  # noqa: E402
from oscar_hf.metrics import cache_kwarg  # noqa: E402

REFERENCE = Path(__file__).resolve().parent / "data" / "cache_reference_outputs.safetensors"
SMALL = dict(sink_tokens=4, window_tokens=8)


def _orthogonal(h: int, d: int, seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(h, d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return q.float()


def rotations_for(model, kind: str) -> OscarRotations:
    """Data-free Hadamard rotations, or ("per-head") random orthogonal ones with a per-head layout written into them
    the way a calibrated file carries it."""
    rot = OscarRotations.data_free(model, "hadamard")
    if kind == "hadamard":
        return rot
    h, d = rot.geometry["num_key_value_heads"], rot.geometry["head_dim"]
    layers = rot.layers
    keys = {layer: _orthogonal(h, d, 10 + layer) for layer in layers}
    values = {layer: _orthogonal(h, d, 50 + layer) for layer in layers}
    means = {layer: torch.randn(h, d, generator=torch.Generator().manual_seed(90 + layer)) * 0.5 for layer in layers}
    layout = {"key_granularity": "channel", "demotion_block": 16, "key_block": 8, "key_block_allocation": "fitted"}
    extra = {}
    if kind in ("blocks", "wide", "channels", "centered"):
        extra["key_blocks"] = {layer: (16, 8) for layer in layers}
    if kind in ("wide",):
        extra["head_bits"] = {layer: (4, 2) for layer in layers}
        extra["key_wide_channels"] = {layer: (0, 5) for layer in layers}
    if kind == "channels":
        extra["key_wide_channels"] = {layer: (3, 6) for layer in layers}
    return OscarRotations(rot.geometry, keys, values, key_clips={layer: 0.9 for layer in layers},
                          value_clips={layer: 0.85 for layer in layers}, metadata={"method": {"data_free": True}},
                          key_means=means if kind == "centered" else None, layout=layout, **extra)


# (name, model family, rotations kind, storage config, caches to run)
CASES = [
    ("token", "llama", "hadamard", dict(**SMALL, demotion_block=8, key_block=8, key_granularity="token", key_clip=0.9,
                                      value_clip=0.95), ("dynamic", "static", "sdpa")),
    ("channel", "llama", "hadamard", dict(**SMALL, demotion_block=8, key_block=4, value_clip=0.95),
     ("dynamic", "static", "sdpa")),
    ("channel-gemma", "gemma3", "hadamard", dict(**SMALL, demotion_block=8, key_block=8, value_clip=0.95),
     ("dynamic", "static")),
    ("blocks", "llama", "blocks", dict(**SMALL, demotion_block=16, key_block=8, key_clip="fitted",
                                       value_clip="fitted"), ("dynamic", "static")),
    ("wide", "llama", "wide", dict(**SMALL, demotion_block=16, key_block=8, key_clip="fitted", value_clip="fitted"),
     ("dynamic", "static", "sdpa")),
    ("channels", "llama", "channels", dict(**SMALL, demotion_block=16, key_block=8, value_clip="fitted"),
     ("dynamic", "static")),
    ("centered", "llama", "centered", dict(**SMALL, demotion_block=16, key_block=8, value_clip=0.95),
     ("dynamic", "static")),
    ("token-g8", "llama", "hadamard", dict(**SMALL, demotion_block=8, key_block=8, key_granularity="token",
                                           group_size=8, key_clip=0.9, value_clip=0.95), ("dynamic", "static")),
    ("bits4", "llama", "hadamard", dict(**SMALL, demotion_block=8, key_block=8, bits=4, group_size=8, value_clip=0.95),
     ("dynamic", "sdpa")),
    ("bits3-token", "llama", "hadamard", dict(**SMALL, demotion_block=8, key_block=8, bits=3, key_granularity="token", key_clip=0.9,
                                              value_clip=0.95),
     ("dynamic",)),
    ("bits8", "llama", "hadamard", dict(**SMALL, demotion_block=8, key_block=8, bits=8, value_clip=0.95), ("dynamic",)),
    ("bits16", "gemma3", "hadamard", dict(**SMALL, demotion_block=8, key_block=8, bits=16, key_clip="none",
                                            value_clip=0.95), ("dynamic",)),
]


def _ids(batch: int, n: int, seed: int) -> torch.Tensor:
    return torch.randint(4, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


STEPS = [_ids(2, 29, 0)] + [_ids(2, 1, s) for s in range(1, 27)] + [_ids(2, 11, 99)] + [_ids(2, 1, s) for s in range(40, 47)]


def stored_tensors(cache) -> dict[str, torch.Tensor]:
    """What the cache stores, by name: each OSCAR layer's sink, recent window (dynamic) or ring (static), and the
    history's packed buffers (valid rows of a dynamic cache, the whole buffers of a static one)."""
    from oscar_hf.cache import OscarLayer

    out = {}
    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, OscarLayer):
            continue
        st, plan = layer.storage, layer.plan
        streams = (("keys", st.keys), ("values", st.values))
        if layer.is_compileable:
            out[f"{i}.sink_keys"], out[f"{i}.sink_values"] = st.sink_keys, st.sink_values
            out[f"{i}.ring_keys"], out[f"{i}.ring_values"] = st.ring_keys, st.ring_values
            for stream, history in streams:
                for name, buf in (("dense", history.codes), ) if history.fmt.dense else (("codes", history.codes),
                                                                                       ("meta", history.meta)):
                    out[f"{i}.history_{stream}.{name}"] = buf
            continue
        length = plan.current_length()
        n_sink, n = plan.counts(length)[:2]
        first, last = plan.recent_positions(length)
        slots = plan.slots(first, last)
        out[f"{i}.sink_keys"] = st.sink_keys[:, :, :n_sink]
        out[f"{i}.sink_values"] = st.sink_values[:, :, :n_sink]
        out[f"{i}.recent_keys"] = st.ring_keys.index_select(2, slots)
        out[f"{i}.recent_values"] = st.ring_values.index_select(2, slots)
        for stream, history in streams:
            if history.fmt.dense:
                out[f"{i}.history_{stream}.dense"] = history.codes[:, :, :n]
                continue
            out[f"{i}.history_{stream}.codes"] = history.codes[:, :, :n]
            rows = n // history.fmt.chunk if history.fmt.channelwise else n
            out[f"{i}.history_{stream}.meta"] = history.meta.narrow(1 if history.fmt.channelwise else 2, 0, rows)
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def make_cache(kind: str, model, rotations, config):
    if kind == "static":
        return StaticOscarCache(model, rotations, config, max_cache_len=160)
    return OscarCache(model, rotations, config)


def run_case(name: str, family: str, rotations_kind: str, fields: dict, kinds) -> dict[str, torch.Tensor]:
    """One case's outputs, on one thread (the order of float sums, hence the last bits, depends on the thread count)."""
    threads = torch.get_num_threads()
    os.environ["OSCAR_HF_KERNELS"] = "0"
    torch.set_num_threads(1)
    try:
        return _run_case(name, family, rotations_kind, fields, kinds)
    finally:
        torch.set_num_threads(threads)


def _run_case(name: str, family: str, rotations_kind: str, fields: dict, kinds) -> dict[str, torch.Tensor]:
    out = {}
    config = OscarConfig(**fields)
    for kind in kinds:
        model = tiny_model(family, attn="sdpa" if kind == "sdpa" else "oscar")
        rotations = rotations_for(model, rotations_kind)
        cache = make_cache(kind, model, rotations, config)
        kwarg = cache_kwarg(model)
        logits = []
        with torch.no_grad():
            for step, ids in enumerate(STEPS):
                logits.append(model(ids, **{kwarg: cache}).logits)
                if step == 20 and family != "gemma3":  # a rollback, then the same tokens again
                    cache.crop(-1)
                    logits.append(model(ids, **{kwarg: cache}).logits)
        out[f"{name}.{kind}.logits"] = torch.cat([x.reshape(-1, x.shape[-1]) for x in logits])
        for key, t in stored_tensors(cache).items():
            out[f"{name}.{kind}.stored.{key}"] = t
        generated = make_cache(kind, model, rotations, config)
        with torch.no_grad():
            tokens = model.generate(_ids(2, 33, 7), max_new_tokens=24, do_sample=False, pad_token_id=0,
                                    **{kwarg: generated})
        out[f"{name}.{kind}.generated"] = tokens
    return out


def record_all() -> dict[str, torch.Tensor]:
    out = {}
    for case in CASES:
        out.update(run_case(*case))
    return out


if __name__ == "__main__":
    from safetensors.torch import save_file

    REFERENCE.parent.mkdir(exist_ok=True)
    names = sys.argv[1:]  # cases to record again, the others kept as they are (default: all)
    if set(names) - {case[0] for case in CASES}:
        raise SystemExit(f"no case named {sorted(set(names) - {case[0] for case in CASES})}")
    if names:
        from safetensors.torch import load_file

        tensors = load_file(str(REFERENCE))
        for case in CASES:
            if case[0] in names:
                tensors.update(run_case(*case))
    else:
        tensors = record_all()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(REFERENCE))
    print(f"wrote {len(tensors)} tensors to {REFERENCE}")
