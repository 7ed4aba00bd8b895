"""Decode speed through `model.generate`, what users run: OSCAR (dynamic, static eager, static compiled) against
BF16 `DynamicCache` (eager), BF16 `StaticCache` (auto-compiled by generate, = `cache_implementation="static"`), the
same with `attn_implementation="flex_attention"` (`bf16-flex`) and transformers' `QuantizedCache` (HQQ, 2 bits),
interleaved in one run.

    python eval/bench_generate.py --out DIR [--sections check,speed] [--archs qwen3-8b] [--points 4096x1,32768x8]

Protocol, per (architecture, prompt length L, batch B): each method's cache is filled with L random tokens per
sequence (speed does not depend on the values; a 100K prefill per call would cost minutes), then
`model.generate(ids of length L + 1, cache=cache, max_new_tokens=n, greedy)` is timed for n = N + 1 and
n = 1 (the cache refilled before each call, static caches reused as generate reuses its own); decode tokens/s =
B·N / (t(N+1) − t(1)). Methods are interleaved within a round; one warm-up round (compilation, CUDA graphs), then
the best of `--rounds`. GPU time per token: the summed CUDA kernel time of the two calls under the profiler,
differenced the same way. Roofline per step: (weights + KV bytes a step must read) / measured copy bandwidth.

Sections: `memory` (what a static cache of 128K tokens allocates, and that decode adds nothing), `kernels` (the CUDA kernels of one compiled decode step, per method), `runtime` (the CUDA runtime calls and device reads of a decode step on the host, per method), `profile` (its host time,
cProfile), `check` (GPU correctness: decode kernel vs its torch twin on a static cache's buffers with the ring
wrapped; the same greedy tokens from OscarCache, StaticOscarCache eager and StaticOscarCache compiled), `speed`,
`per-call` (a user who makes a cache per request: a fresh cache and a real prefill in every call, static caches
included; the first token's seconds, and decode as t(N+1) − t(1) from fresh caches; rows under "per_call").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import MIXED_KEY_BLOCKS, GIB, decode_kernel, wide_channel_counts, build_model, chunks, copy_bandwidth, environment, free, kv_bytes_bf16, log, sync, tiny_qwen3  # noqa: E402

METHODS = ("bf16-eager", "bf16-static", "bf16-flex", "hf-quantized", "oscar-eager", "oscar-static-eager",
           "oscar-static", "oscar-static-format5", "oscar-static-triton")
COMPILED = {"bf16-static", "bf16-flex", "oscar-static", "oscar-static-format5", "oscar-static-triton",
            "oscar-static-cuda"}
# a method named "<oscar method>-cuda" or "-triton": the same with OSCAR_HF_DECODE_KERNEL set so while its cache is made
# and its generate calls run (its graphs capture that kernel); the others keep the process's (by default `auto`)
KERNEL_SUFFIXES = ("-cuda", "-triton")
BF16 = ("bf16-eager", "bf16-static", "bf16-flex")
DEADLINE = float("inf")


# ------------------------------------------------------------------------------------------------ caches
# Per-KV-head key blocks every layer gets (cycled over the heads; "uniform": 64 everywhere): random weights have no
# calibrated allocation, so the benchmark uses bench_gpu's mixed one, at the default budget (16 meta rows per 8 heads
# per chunk).
KEY_BLOCKS = ",".join(str(b) for b in MIXED_KEY_BLOCKS)


WIDE_HEADS = True  # --no-wide-heads: every head at 2 bits (the format before wide heads)


_ROTATIONS: dict = {}


def oscar_rotations(model, channels: bool = True):
    """The rotations of `_oscar_rotations`, made once per (model, format) as a user loads them once (a cache made from
    the same object checks the model's weight fingerprint once)."""
    key = (id(model), channels, KEY_BLOCKS, WIDE_HEADS)
    if key not in _ROTATIONS:
        _ROTATIONS[key] = _oscar_rotations(model, channels)
    return _ROTATIONS[key]


def _oscar_rotations(model, channels: bool = True):
    """Data-free rotations in the default storage format: per-head key blocks (KEY_BLOCKS), as many wide heads as
    calibration's budget gives this geometry (`calibrate.allocate_wide_heads` within
    `CalibrationConfig().wide_budget`; which heads are wide comes from seeded random retrieval scores, random weights
    having no retrieval heads) and, with `channels` (format 6; False: format 5, the rotations' `key_wide_channels`
    None), wide key channels in the 2-bit heads (`bench_gpu.wide_channel_counts`). The key rotation stays H·P rather
    than the permutation calibration stores with wide channels: the kernels read both the same way, so speed does
    not depend on it."""
    from oscar_hf import CalibrationConfig, OscarRotations
    from oscar_hf.calibrate import allocate_wide_heads

    rot = OscarRotations.data_free(model, "hadamard")
    heads = model.config.num_key_value_heads
    if KEY_BLOCKS != "uniform":
        pattern = [int(b) for b in KEY_BLOCKS.split(",")]
        rot.key_blocks = {layer: tuple(pattern[h % len(pattern)] for h in range(heads)) for layer in rot.layers}
    if WIDE_HEADS:
        g = torch.Generator().manual_seed(0)
        scores = {layer: torch.rand(heads, generator=g) for layer in rot.layers}
        head_dim = model.config.head_dim
        rot.head_bits = allocate_wide_heads(scores, oscar_config(), head_dim, CalibrationConfig().wide_budget(head_dim),
                                            rot.key_blocks)
    if channels:
        bits = rot.head_bits or {layer: (2,) * heads for layer in rot.layers}
        rot.key_wide_channels = {layer: wide_channel_counts(model.config.head_dim, bits[layer]) for layer in rot.layers}
        rot._check_consistency()  # what loading a file would check
    return rot


def storage_format_text(model) -> str:
    """What the OSCAR rows store, for the results table: the format and its per-head allocation."""
    rot = oscar_rotations(model)
    heads = model.config.num_hidden_layers * model.config.num_key_value_heads
    wide = sum(b != 2 for bits in (rot.head_bits or {}).values() for b in bits)
    channels = sum(sum(c) for c in (rot.key_wide_channels or {}).values())
    narrow = (heads - wide) * model.config.head_dim
    blocks = KEY_BLOCKS if KEY_BLOCKS == "uniform" else "/".join(KEY_BLOCKS.split(",")[:4]) + "/..."
    return (f"{6 if channels else 5} (per-head key blocks {blocks}; {wide} of the {heads} KV heads wide, at 4 bits"
            + (f"; {channels:,} of the 2-bit heads' {narrow:,} key channels wide" if channels else "") + ")"
            + ("; oscar-static-format5: the same without wide key channels" if channels else ""))


def oscar_config():
    from oscar_hf import OscarConfig

    return OscarConfig(value_clip=0.92)  # the default layout; a fixed clip stands in for a fitted one


def random_kv(model, batch, n, device):
    cfg = model.config
    k = torch.randn(batch, cfg.num_key_value_heads, n, cfg.head_dim, device=device, dtype=torch.bfloat16)
    return k, torch.randn_like(k)


def fill(cache, model, batch, length, device, chunk=16384):
    """Stores `length` random tokens per sequence in every layer, as a prefill would (not timed)."""
    from transformers import StaticCache

    from oscar_hf import OscarCache, StaticOscarCache

    layers = model.config.num_hidden_layers
    k, v = random_kv(model, batch, min(chunk, length), device)
    if isinstance(cache, OscarCache):  # chunk by chunk through every layer: the layers share one position plan
        if isinstance(cache, StaticOscarCache):
            cache.reset()
        for n in chunks(length, chunk):
            for i in range(layers):
                cache.store(k[:, :, :n], v[:, :, :n], i)
    elif isinstance(cache, StaticCache):
        cache.reset()
        for i in range(layers):
            done = 0
            while done < length:
                n = min(chunk, length - done)
                cache.update(k[:, :, :n], v[:, :, :n], i)
                done += n
    else:
        for i in range(layers):  # BF16 DynamicCache; QuantizedCache re-quantizes its history when the residual fills
            kk, vv = random_kv(model, batch, length, device)  # one chunk
            cache.update(kk, vv, i)
            del kk, vv
    sync()
    return cache


def history_kernel_for(method):
    """OSCAR_HF_DECODE_KERNEL=cuda for a "-cuda" method, =triton for a "-triton" one, else as the process has it."""
    suffix = next((x for x in KERNEL_SUFFIXES if (method or "").endswith(x)), None)
    return decode_kernel(suffix[1:] if suffix else None)


def make_cache(method, model, batch, max_len):
    with history_kernel_for(method):
        for suffix in KERNEL_SUFFIXES:
            method = method.removesuffix(suffix)
        return _make_cache(method, model, batch, max_len)


def _make_cache(method, model, batch, max_len):
    from transformers import DynamicCache, QuantizedCache, StaticCache

    from oscar_hf import OscarCache, StaticOscarCache

    if method == "bf16-eager":
        return DynamicCache(config=model.config)
    if method in ("bf16-static", "bf16-flex"):
        return StaticCache(config=model.config, max_cache_len=max_len)
    if method == "hf-quantized":
        return QuantizedCache(backend="hqq", config=model.config, nbits=2, axis_key=1, axis_value=1, q_group_size=64,
                              residual_length=128)
    if method == "oscar-eager":
        return OscarCache(model, oscar_rotations(model), oscar_config())
    if method in ("oscar-static", "oscar-static-eager"):
        return StaticOscarCache(model, oscar_rotations(model), oscar_config(), max_cache_len=max_len)
    if method == "oscar-static-format5":  # the same without wide key channels, for the cost of format 6's
        return StaticOscarCache(model, oscar_rotations(model, channels=False), oscar_config(), max_cache_len=max_len)
    raise ValueError(method)


def kv_bytes(method, model, batch, length) -> float:
    """Bytes of KV a decode step reads at `length` tokens (layout accounting)."""
    bf16 = kv_bytes_bf16(model.config, batch, length)
    if method.startswith("oscar"):
        return bf16 * 2.5 / 16  # history 2.375 bits + BF16 sink/window, rounded up
    if method == "hf-quantized":
        return bf16 * 3.0 / 16  # dequantized every step: at least its 2-bit codes and group metadata are read
    return bf16


# ------------------------------------------------------------------------------------------------ timing
@contextlib.contextmanager
def attention_for(model, method):
    """The model's attention for `method`: flex attention for `bf16-flex`, else the "oscar" attention (plain sdpa
    without an OSCAR cache)."""
    if method != "bf16-flex":
        yield
        return
    model.set_attn_implementation("flex_attention")
    try:
        yield
    finally:
        model.set_attn_implementation("oscar")


def generate_once(model, cache, batch, length, new_tokens, compiled, device, profile=False, method=None):
    ids = torch.randint(10, min(1000, model.config.vocab_size), (batch, length + 1), device=device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, cache=cache,
                  attention_mask=torch.ones_like(ids), disable_compile=not compiled, pad_token_id=0)
    sync()
    with attention_for(model, method), history_kernel_for(method):
        return _generate_timed(model, ids, kwargs, length, new_tokens, profile)


def _generate_timed(model, ids, kwargs, length, new_tokens, profile):
    if profile:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof

        with prof(activities=[ProfilerActivity.CUDA]) as p:
            with torch.no_grad():
                model.generate(ids, **kwargs)
            sync()
        return sum(e.time_range.elapsed_us() for e in p.events() if e.device_type == DeviceType.CUDA) / 1e6
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, **kwargs)
    sync()
    assert out.shape[1] == length + 1 + new_tokens, out.shape
    return time.perf_counter() - t


def measure_point(model, arch, length, batch, methods, new_tokens, rounds, device, copy_bw):
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    caches = {}
    skipped = {}
    budget = torch.cuda.get_device_properties(device).total_memory - weights - 10 * GIB if device.type == "cuda" else 8 * GIB
    for m in methods:
        need = kv_bytes(m, model, batch, length + new_tokens + 8) * (2 if m == "hf-quantized" else 1)
        if need > budget - sum(kv_bytes(x, model, batch, length) for x in caches):
            skipped[m] = f"needs {need / GIB:.0f} GiB of KV beside the others, {budget / GIB:.0f} GiB free"
            continue
        try:
            caches[m] = make_cache(m, model, batch, length + new_tokens + 8)
        except Exception as e:  # a backend missing on this machine (hqq)
            skipped[m] = f"{type(e).__name__}: {str(e)[:200]}"
    fresh = {"bf16-eager", "hf-quantized", "oscar-eager"}  # dynamic caches: a new one per call
    times = {m: {"long": [], "short": []} for m in caches}
    for r in range(rounds + 1):  # round 0: warm-up
        for m in list(caches):
            if time.time() > DEADLINE:
                skipped.setdefault(m, "not run: the device-time budget of this call ran out")
                continue
            try:
                for key, n in (("long", new_tokens + 1), ("short", 1)):
                    cache = make_cache(m, model, batch, length + new_tokens + 8) if m in fresh else caches[m]
                    fill(cache, model, batch, length, device)
                    dt = generate_once(model, cache, batch, length, n, m in COMPILED, device, method=m)
                    if r > 0:
                        times[m][key].append(dt)
                    if m in fresh:
                        del cache
            except Exception as e:
                skipped[m] = f"{type(e).__name__}: {str(e)[:300]}"
                log(traceback.format_exc()[-1500:])
                caches.pop(m)
                free()
    row = dict(arch=arch, length=length, batch=batch, new_tokens=new_tokens, rounds=rounds, skipped=skipped)
    for m, cache in caches.items():  # eager static caches: how their decode graphs were replayed (graphs.py)
        if getattr(cache, "graphs", None) is not None and cache.graphs.stats:
            row[f"{m}_graph_replays"] = dict(cache.graphs.stats)
            log(f"{m} L={length} B={batch} decode graphs: {dict(cache.graphs.stats)}")
    step_bytes = {}
    for m in caches:
        if not times[m]["long"]:
            continue
        long_t, short_t = min(times[m]["long"]), min(times[m]["short"])
        if long_t <= short_t:  # N decode steps took no measurable time: noise (tiny models, a busy CPU)
            skipped[m] = f"timing noise: generate of {new_tokens + 1} tokens took {long_t:.4f} s, of 1 token {short_t:.4f} s"
            continue
        row[f"{m}_tokens_per_s"] = batch * new_tokens / (long_t - short_t)
        row[f"{m}_ms_per_step"] = 1000 * (long_t - short_t) / new_tokens
        step_bytes[m] = weights + kv_bytes(m, model, batch, length)
        row[f"{m}_roofline_ms"] = 1000 * step_bytes[m] / copy_bw
        if device.type == "cuda":
            try:
                gl = []
                for n in (new_tokens + 1, 1):
                    cache = make_cache(m, model, batch, length + new_tokens + 8) if m in fresh else caches[m]
                    fill(cache, model, batch, length, device)
                    gl.append(generate_once(model, cache, batch, length, n, m in COMPILED, device, profile=True, method=m))
                row[f"{m}_gpu_ms_per_step"] = 1000 * (gl[0] - gl[1]) / new_tokens
            except Exception as e:
                row[f"{m}_gpu_ms_per_step"] = None
                skipped[f"{m} (profile)"] = f"{type(e).__name__}: {str(e)[:200]}"
    best_bf16 = max((row.get(f"{m}_tokens_per_s", 0) for m in BF16), default=0)
    for m in ("oscar-static", "oscar-static-triton", "oscar-static-cuda"):
        if best_bf16 and row.get(f"{m}_tokens_per_s"):
            row[f"{m}_vs_best_bf16"] = row[f"{m}_tokens_per_s"] / best_bf16
    log(f"generate {arch} L={length} B={batch}: " + ", ".join(
        f"{m} {row[f'{m}_tokens_per_s']:.1f} tok/s ({row[f'{m}_ms_per_step']:.1f} ms/step, GPU "
        f"{row.get(f'{m}_gpu_ms_per_step') or float('nan'):.1f}, roofline {row[f'{m}_roofline_ms']:.1f})"
        for m in caches if f"{m}_tokens_per_s" in row) + (f"  skipped {skipped}" if skipped else ""))
    del caches
    free()
    return row


def section_speed(device, archs, points, methods, new_tokens, rounds, copy_bw, on_row=None):
    """One row per (arch, point); `on_row(rows)` after each (the caller saves them: a call killed at its time limit
    keeps the points it measured)."""
    import oscar_hf  # noqa: F401  (registers the "oscar" attention)

    rows = []
    for arch in archs:
        model = tiny_qwen3(device) if arch == "tiny" else build_model(arch, device)  # tiny: the CPU smoke test
        for length, batch, only in points:
            if time.time() > DEADLINE:
                rows.append(dict(arch=arch, length=length, batch=batch, skipped={"all": "not run: out of device time"}))
                continue
            torch._dynamo.reset()  # compiled graphs and CUDA-graph pools of the previous point go
            free()
            rows.append(measure_point(model, arch, length, batch, [m for m in methods if not only or m in only],
                                      new_tokens, rounds, device, copy_bw))
            rows[-1]["format"] = storage_format_text(model)
            if on_row:
                on_row(rows)
    return rows


def measure_per_call(model, arch, length, batch, methods, new_tokens, rounds, device, copy_bw):
    """What a user who makes a cache per request waits for: each call gets a fresh cache (static ones too) and a real
    prefill of the prompt. First token: generate with max_new_tokens=1; decode: (t(N+1) − t(1)) / N, both from a
    fresh cache; methods interleaved, round 0 a warm-up, the best of `rounds`."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    times = {m: {"long": [], "short": []} for m in methods}
    skipped = {}
    for r in range(rounds + 1):
        for m in methods:
            if m in skipped:
                continue
            if time.time() > DEADLINE:
                skipped[m] = "not run: the device-time budget of this call ran out"
                continue
            try:
                for key, n in (("short", 1), ("long", new_tokens + 1)):
                    cache = make_cache(m, model, batch, length + new_tokens + 8)
                    dt = generate_once(model, cache, batch, length, n, m in COMPILED, device, method=m)
                    del cache
                    if r > 0:
                        times[m][key].append(dt)
            except Exception as e:
                skipped[m] = f"{type(e).__name__}: {str(e)[:300]}"
                log(traceback.format_exc()[-1500:])
            free()
    row = dict(arch=arch, length=length, batch=batch, new_tokens=new_tokens, rounds=rounds, protocol="per-call",
               skipped=skipped)
    for m in methods:
        if not times[m]["long"]:
            continue
        long_t, short_t = min(times[m]["long"]), min(times[m]["short"])
        row[f"{m}_first_token_s"] = short_t
        row[f"{m}_roofline_ms"] = 1000 * (weights + kv_bytes(m, model, batch, length)) / copy_bw
        if long_t <= short_t:
            skipped[m] = f"timing noise: generate of {new_tokens + 1} tokens took {long_t:.4f} s, of 1 token {short_t:.4f} s"
            continue
        row[f"{m}_tokens_per_s"] = batch * new_tokens / (long_t - short_t)
        row[f"{m}_ms_per_step"] = 1000 * (long_t - short_t) / new_tokens
    log(f"per call {arch} L={length} B={batch}: " + ", ".join(
        f"{m} first token {row[f'{m}_first_token_s']:.2f} s, {row.get(f'{m}_ms_per_step', float('nan')):.1f} ms/step"
        for m in methods if f"{m}_first_token_s" in row) + (f"  skipped {skipped}" if skipped else ""))
    return row


def section_per_call(device, archs, points, methods, new_tokens, rounds, copy_bw, on_row=None):
    """`measure_per_call` at each (arch, point), one row each; `on_row(rows)` after each, as `section_speed`."""
    import oscar_hf  # noqa: F401  (registers the "oscar" attention)

    rows = []
    for arch in archs:
        model = tiny_qwen3(device) if arch == "tiny" else build_model(arch, device)
        for length, batch, only in points:
            if time.time() > DEADLINE:
                rows.append(dict(arch=arch, length=length, batch=batch, protocol="per-call",
                                 skipped={"all": "not run: out of device time"}))
                continue
            torch._dynamo.reset()
            free()
            rows.append(measure_per_call(model, arch, length, batch, [m for m in methods if not only or m in only],
                                         new_tokens, rounds, device, copy_bw))
            if on_row:
                on_row(rows)
    return rows


def merge_speed_rows(old_rows, new):
    """The file's speed rows with `new` merged in: a point measured again keeps the methods this call did not run
    (an earlier call's, file given back)."""
    old = {(r["arch"], r["length"], r["batch"]): r for r in old_rows}
    for r in new:
        r = dict(r)
        key = (r["arch"], r["length"], r["batch"])
        if key in old:
            skipped = {**old[key].get("skipped", {}), **r.get("skipped", {})}
            r.update({k: v for k, v in old[key].items() if k not in r})
            measured = any(k.endswith("_tokens_per_s") for k in r)
            # a method skipped now but measured by an earlier call keeps that call's figures
            r["skipped"] = {m: why for m, why in skipped.items()
                            if f"{m}_tokens_per_s" not in r and not (m == "all" and measured)}
        old[key] = r
    return list(old.values())


def _warmed_cache(method, model, batch, length, new_tokens, device):
    """A fresh cache of `method` whose generate call has compiled and run once more (what the profiles measure)."""
    torch._dynamo.reset()
    free()
    for _ in range(2):  # compile, then one more warm run
        cache = reusable(method, model, batch, length + new_tokens + 8, locals().get("cache"))
        fill(cache, model, batch, length, device)
        generate_once(model, cache, batch, length, new_tokens + 1, method in COMPILED, device, method=method)
    return cache


def reusable(method, model, batch, max_len, cache=None):
    """`cache` itself where fill() resets it (static caches: their addresses are what a compiled step captured), else
    a new one: a dynamic cache only grows."""
    from transformers import StaticCache

    from oscar_hf import StaticOscarCache

    if isinstance(cache, (StaticCache, StaticOscarCache)):
        return cache
    return make_cache(method, model, batch, max_len)


def section_profile(device, arch, point, methods, new_tokens, out):
    """Where a compiled decode step's wall time goes outside the GPU: the Python profile (cProfile) of one generate
    call per method, after a warm-up that compiled it; the top functions by own time, per decode step, go to the log
    and to `profile_<method>.txt`."""
    import cProfile
    import io
    import pstats

    import oscar_hf  # noqa: F401

    model = tiny_qwen3(device) if arch == "tiny" else build_model(arch, device)
    length, batch, _ = point
    rows = []
    for m in methods:
        cache = reusable(m, model, batch, length + new_tokens + 8, _warmed_cache(m, model, batch, length, new_tokens, device))
        fill(cache, model, batch, length, device)
        profiler = cProfile.Profile()
        profiler.enable()
        wall = generate_once(model, cache, batch, length, new_tokens + 1, m in COMPILED, device, method=m)
        profiler.disable()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text).sort_stats("tottime")
        stats.print_stats(30)
        stats.sort_stats("cumulative").print_stats(40)  # where a cost that grows with the context sits
        name = f"profile_{m}.txt" if (length, batch) == (4096, 1) else f"profile_{m}_{length}x{batch}.txt"
        (out / name).write_text(f"{m} {arch} L={length} B={batch}: generate of {new_tokens + 1} tokens, "
                                              f"{wall * 1000:.1f} ms under cProfile\n" + text.getvalue())
        top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:12]
        per_step = [(f"{fn[0].split('/')[-1]}:{fn[1]}:{fn[2]}", 1000 * st[2] / new_tokens, st[1]) for fn, st in top]
        rows.append(dict(method=m, arch=arch, length=length, batch=batch, wall_ms_under_profile=wall * 1000,
                         top_own_ms_per_step=per_step))
        log(f"profile {m} L={length} B={batch}: {wall * 1000 / (new_tokens + 1):.2f} ms per token under cProfile; own time "
            "per step: " + "; ".join(f"{name} {ms:.3f} ms ({calls} calls)" for name, ms, calls in per_step[:8]))
        del cache
    return rows


# What the `runtime` section counts on the host: CUDA runtime/driver calls (a synchronising one stalls the host until
# the GPU drains: the launch queue then no longer hides the host's work) and the aten ops that read a device value.
RUNTIME_EVENTS = ("cuda", "cu", "aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::is_nonzero",
                  "aten::_to_copy", "aten::copy_")


def section_kernels(device, arch, point, methods, new_tokens, out, runtime=False):
    """What a compiled decode step runs on the GPU: the CUDA kernels of one generate call of N + 1 tokens minus one of
    N/2 + 1 tokens (both under torch.profiler, after a warm-up that compiled the step), per step: name, launches, µs,
    and where the GPU idles between kernels (`idle_gaps`). The table per method goes to the log and to
    `kernels_<method>.txt`. `runtime`: the host side instead, the `RUNTIME_EVENTS` calls per step with their host µs
    (`runtime_<method>.txt`): where an eager step waits."""
    from collections import defaultdict

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    import oscar_hf  # noqa: F401

    model = tiny_qwen3(device) if arch == "tiny" else build_model(arch, device)
    length, batch, _ = point
    rows = []
    for m in methods:
        cache = _warmed_cache(m, model, batch, length, new_tokens, device)
        tables, gap_tables = [], []
        # on the CPU (the smoke test) the table lists the CPU ops instead
        activity, kind = ((ProfilerActivity.CUDA, DeviceType.CUDA) if device.type == "cuda" and not runtime
                          else (ProfilerActivity.CPU, DeviceType.CPU))
        # two calls with decode steps, differenced: what each call does once (prefill, the first steps, in which
        # the compiled step warms up and records its CUDA graphs) cancels, and steady steps remain
        calls = (new_tokens + 1, new_tokens // 2 + 1)
        steps = calls[0] - calls[1]
        # Both calls run twice unprofiled first: an eager first step captures CUDA graphs for input addresses it has
        # not seen (`oscar_hf.graphs`: a new cache, or buffers that moved), and a capture inside one profiled call only
        # would not cancel (it showed as an extra pass of attention kernels and milliseconds of idle per layer).
        for n in calls * 2:
            cache = reusable(m, model, batch, length + new_tokens + 8, cache)
            fill(cache, model, batch, length, device)
            generate_once(model, cache, batch, length, n, m in COMPILED, device, method=m)
        captured = _captures(cache)
        for n in calls:
            cache = reusable(m, model, batch, length + new_tokens + 8, cache)
            fill(cache, model, batch, length, device)
            with prof(activities=[activity]) as p:
                generate_once(model, cache, batch, length, n, m in COMPILED, device, method=m)
            table = defaultdict(lambda: [0, 0.0])
            for e in p.events():
                if e.device_type == kind and (not runtime or e.name.startswith(RUNTIME_EVENTS)):
                    table[e.name][0] += 1
                    table[e.name][1] += e.time_range.elapsed_us()
            tables.append(table)
            if not runtime and kind == DeviceType.CUDA:
                gap_tables.append(idle_gaps(p.events(), kind))
            if runtime and n > 1:  # every host op of the long call by its own time: what the step's wall is made of
                (out / f"runtime_{m}_ops.txt").write_text(
                    p.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70))
        if _captures(cache) != captured:
            log(f"kernels {m}: {_captures(cache) - captured} CUDA graph captures inside the profiled calls: the "
                "table holds them")
        long, short = tables
        per_step = sorted(((name, (c - short.get(name, (0, 0))[0]) / steps, (us - short.get(name, (0, 0.0))[1]) / steps)
                           for name, (c, us) in long.items()), key=lambda r: -r[2])
        total = sum(r[2] for r in per_step)
        launches = sum(r[1] for r in per_step)
        text = "\n".join(f"{us:9.1f} us {cnt:7.1f}x  {name[:160]}" for name, cnt, us in per_step if abs(us) > 0.05)
        what = "runtime calls" if runtime else "kernels"
        idle = ""
        if gap_tables:  # per step, differenced like the kernels: the long call's gaps less the short call's
            pairs = {k: ((c - gap_tables[1].get(k, (0, 0.0))[0]) / steps,
                         (us - gap_tables[1].get(k, (0, 0.0))[1]) / steps) for k, (c, us) in gap_tables[0].items()}
            gaps = dict(us_per_step=sum(us for _, us in pairs.values()),
                        top=sorted(pairs.items(), key=lambda kv: -kv[1][1])[:15])
            idle = (f"\nidle: {gaps['us_per_step']:.1f} us per step between kernels; the largest gaps per step "
                    "(before -> after: us, count):\n"
                    + "\n".join(f"{us:9.1f} us {c:6.1f}x  {a[:70]} -> {b[:70]}" for (a, b), (c, us) in gaps["top"]))
        (out / f"{'runtime' if runtime else 'kernels'}_{m}.txt").write_text(
            f"{m} {arch} L={length} B={batch}: per decode step {total:.1f} us of {what} in {launches:.0f} calls\n{text}\n{idle}\n")
        walls = {}
        if runtime:  # the same step's wall without the profiler, with and without Python's cyclic garbage collector
            import gc

            for label in ("gc on", "gc off"):
                (gc.enable if label == "gc on" else gc.disable)()
                t = []
                for n in calls:
                    cache = reusable(m, model, batch, length + new_tokens + 8, cache)
                    fill(cache, model, batch, length, device)
                    t.append(generate_once(model, cache, batch, length, n, m in COMPILED, device, method=m))
                walls[label] = 1000 * (t[0] - t[1]) / steps
            gc.enable()
            log(f"runtime {m}: wall per step " + ", ".join(f"{k} {v:.2f} ms" for k, v in walls.items()))
        rows.append(dict(method=m, arch=arch, length=length, batch=batch, kernel_us_per_step=total, wall_ms=walls,
                         launches_per_step=launches, top=[(n[:120], c, u) for n, c, u in per_step[:40]]))
        if idle:
            rows[-1]["idle_gaps"] = dict(us_per_step=gaps["us_per_step"],
                                         top=[(a[:120], b[:120], c, us) for (a, b), (c, us) in gaps["top"]])
            log(f"kernels {m} {idle.strip()}")
        log(f"{'runtime' if runtime else 'kernels'} {m} L={length} B={batch}: {total:.1f} us in {launches:.0f} calls per step; top: " +
            "; ".join(f"{n[:60]} {u:.1f} us ({c:.0f}x)" for n, c, u in per_step[:12]))
        del cache
    return rows


def _captures(cache) -> int:
    """The eager decode CUDA graphs an OSCAR cache has captured so far (0 for other caches)."""
    graphs = getattr(cache, "graphs", None)
    return graphs.stats["captures"] if graphs is not None else 0


def idle_gaps(events, kind) -> dict:
    """Where the GPU waits: the gaps between consecutive kernels of a profiled call, summed by the pair of kernels
    around them: {(before, after): [count, µs]}."""
    from collections import defaultdict

    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events if e.device_type == kind)
    pairs = defaultdict(lambda: [0, 0.0])
    end, name = None, None
    for start, stop, n in spans:
        if end is not None and start > end:
            pairs[(name, n)][0] += 1
            pairs[(name, n)][1] += start - end
        if end is None or stop >= end:
            end, name = stop, n
    return dict(pairs)


# ------------------------------------------------------------------------------------------------ memory
def section_memory(device, arch, max_len=131072, prompt=4096, new_tokens=32):
    """What the CUDA allocator holds for a static cache of `max_len` tokens at batch 1 (buffers are allocated at the
    first store), in bits per KV element (layers x 2 x KV heads x head_dim x max_len), and whether it grows while
    `generate` decodes `new_tokens` more (it must not: every buffer is fixed)."""
    model = build_model(arch, device)
    cfg = model.config
    elements = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * max_len
    rows = []
    for m in ("bf16-static", "oscar-static-eager"):
        free()
        before = torch.cuda.memory_allocated(device)
        cache = make_cache(m, model, 1, max_len)
        fill(cache, model, 1, prompt, device)
        free()
        held = torch.cuda.memory_allocated(device) - before
        generate_once(model, cache, 1, prompt, new_tokens, False, device)
        free()
        grown = torch.cuda.memory_allocated(device) - before - held
        row = dict(arch=arch, method=m, max_cache_len=max_len, batch=1, allocated_bytes=held,
                   bits_per_element=8 * held / elements, grew_during_decode_bytes=grown)
        if hasattr(cache, "memory_report"):
            row["memory_report"] = cache.memory_report()
        rows.append(row)
        log(f"memory {arch} {m} max_cache_len={max_len}: {held / GIB:.3f} GiB, {row['bits_per_element']:.3f} bits per "
            f"element; after {new_tokens} decode steps {grown} bytes more")
        del cache
    return rows


# ------------------------------------------------------------------------------------------------ check
@contextlib.contextmanager
def eager_graphs(on: bool):
    """OSCAR_HF_EAGER_GRAPHS for the duration (graphs.py reads it at each call)."""
    before = os.environ.get("OSCAR_HF_EAGER_GRAPHS")
    os.environ["OSCAR_HF_EAGER_GRAPHS"] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["OSCAR_HF_EAGER_GRAPHS"]
        else:
            os.environ["OSCAR_HF_EAGER_GRAPHS"] = before


def section_check(device):
    """The decode kernel against its twin on a static cache's buffers (ring wrapped, padding mask), and the same
    greedy tokens from OscarCache, StaticOscarCache eager and StaticOscarCache compiled on a small real geometry."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import oscar_hf  # noqa: F401
    from oscar_hf import OscarCache, OscarConfig, OscarRotations, StaticOscarCache, ops

    rows = []
    torch.manual_seed(0)
    # 1. kernel vs twin on the buffers of a filled static cache
    for heads, groups, d, length in ((8, 4, 128, 5000), (4, 7, 64, 3001), (2, 8, 256, 777)):
        cfg = Qwen3Config(hidden_size=512, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=heads * groups,
                          num_key_value_heads=heads, head_dim=d, vocab_size=1000)
        with torch.device(device):
            model = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
        model.set_attn_implementation("oscar")
        cache = StaticOscarCache(model, oscar_rotations(model), OscarConfig(value_clip=0.92), max_cache_len=length + 64)
        cache.plan.advance(length)
        layer = cache.layers[0]
        k, v = random_kv(model, 2, length, device)
        layer.store(k, v)
        for _ in range(37):  # single steps: the ring wraps, blocks complete
            cache.plan.advance(1)
            kk, vv = random_kv(model, 2, 1, device)
            layer._store_token(kk, vv)
        q = torch.randn(2, heads, groups, d, device=device, dtype=torch.bfloat16)
        mask = torch.ones(2, length + 64, dtype=torch.bool, device=device)
        mask[1, :100] = False  # left padding
        args = (q, layer.decode_buffers(), layer.fmt, mask, layer.plan.lengths, 1, d ** -0.5)
        got = ops.decode_attention(*args, kernel=True).float()
        ref = ops.decode_attention_reference(*args).float()
        err = (got - ref).abs().max().item()
        scale = ref.abs().max().item()
        ok = err <= 2e-2 * max(scale, 1.0)
        keys = layer.fmt.keys
        blocks = list(keys.blocks)
        rows.append(dict(check="decode_attention kernel vs twin", heads=heads, groups=groups, head_dim=d, length=length + 37,
                         key_blocks=blocks, wide_rows=list(keys.wide_rows), wide_channels=list(keys.wide_channels),
                         max_abs_err=err, ref_scale=scale, ok=ok))
        log(f"check decode kernel H={heads} G={groups} d={d} L={length + 37} key blocks {blocks} wide key channels "
            f"{list(keys.wide_channels)}: err {err:.2e} "
            f"(scale {scale:.2f}) {'ok' if ok else 'FAIL'}")
    # 2. the same model through OscarCache, StaticOscarCache eager and StaticOscarCache compiled (a CUDA graph):
    #    greedy generate, and teacher-forced decode steps (same input tokens, compare the logits' argmax)
    cfg = Qwen3Config(hidden_size=1024, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=16,
                      num_key_value_heads=4, head_dim=128, vocab_size=2000)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    model.set_attn_implementation("oscar")
    rot = oscar_rotations(model)  # per-head key blocks (mixed), as in the speed section
    ids = torch.randint(10, 2000, (2, 700), device=device)
    padding = torch.ones_like(ids)
    padding[1, :37] = 0  # the second sequence left-padded: the key mask the decode graphs read
    static = lambda: StaticOscarCache(model, rot, OscarConfig(value_clip=0.92), max_cache_len=900)  # noqa: E731
    dynamic = lambda: OscarCache(model, rot, OscarConfig(value_clip=0.92))  # noqa: E731
    makers = {"dynamic": dynamic, "dynamic-no-graphs": dynamic,
              "static-eager": static,  # each layer's decode step replayed as CUDA graphs (graphs.py)
              "static-eager-no-graphs": static, "static-compiled": static}
    outs, steps, used = {}, {}, {}
    for name, make in makers.items():
        with torch.no_grad(), eager_graphs(not name.endswith("no-graphs")):
            used[name] = make()
            outs[name] = model.generate(ids, attention_mask=padding, cache=used[name], max_new_tokens=150,
                                        min_new_tokens=150, do_sample=False, disable_compile=name != "static-compiled",
                                        pad_token_id=0)
    forced = outs["dynamic"][:, 700:]
    for name, make in makers.items():
        cache = make()
        call = model.__call__ if name != "static-compiled" else torch.compile(model.__call__, mode="reduce-overhead",
                                                                               fullgraph=True)
        with torch.no_grad(), eager_graphs(not name.endswith("no-graphs")):
            logits = [model(ids, cache=cache).logits[:, -1]]
            for i in range(forced.shape[1] - 1):
                pos = torch.full((2, 1), 700 + i, device=device)
                logits.append(call(forced[:, i : i + 1], cache=cache, position_ids=pos).logits[:, -1].clone())
        steps[name] = torch.stack(logits, 1).float()
    # the graphs replay the very kernels the eager calls launch: the same tokens and logits, bit for bit
    # (equality as a boolean: a float32 mean of 1,700 equal tokens is 0.99999994)
    for name in ("static-eager", "dynamic"):  # the dynamic cache's mask grows by a key per step (padded generate)
        same = bool((outs[name] == outs[f"{name}-no-graphs"]).all())
        diff = (steps[name] - steps[f"{name}-no-graphs"]).abs().max().item()
        replays = dict(used[name].graphs.stats)  # captures and replays (graphs.DecodeGraphs)
        rows.append(dict(check=f"{name} CUDA graphs vs launches", generate_tokens_equal=same,
                         teacher_forced_max_abs_logit_diff=diff, graph_replays=replays, ok=same and diff == 0.0))
        log(f"check {name} graphs vs launches (padded generate): generate tokens all equal {same}, teacher-forced max "
            f"logit diff {diff:.2e}, replays {replays} {'ok' if same and diff == 0.0 else 'FAIL'}")
    for name in ("static-eager", "static-compiled"):
        same = (outs[name] == outs["dynamic"])[:, 700:]
        first = [int((~row).nonzero()[0]) if (~row).any() else row.numel() for row in same]
        ref, got = steps["dynamic"], steps[name]
        equal = got.argmax(-1) == ref.argmax(-1)
        agree = equal.float().mean().item()
        rel = ((got - ref).abs().max() / ref.abs().max()).item()
        # a random model's logits are near ties at many positions, where rounding alone flips the argmax (0.973-0.990
        # measured at an unchanged 1.1% logit difference): the argmax bound applies where the top-2 margin exceeds 4x
        # the RMS logit difference (as in bench_gpu's model check)
        top2 = ref.topk(2, dim=-1).values
        decisive = (top2[..., 0] - top2[..., 1]) > 4 * (got - ref).pow(2).mean().sqrt()
        agree_decisive = equal[decisive].float().mean().item() if decisive.any() else 1.0
        rows.append(dict(check=f"{name} vs dynamic OscarCache", generate_token_agreement=same.float().mean().item(),
                         generate_first_divergence=first, teacher_forced_argmax_agreement=agree,
                         teacher_forced_argmax_agreement_decisive=agree_decisive,
                         decisive_positions=int(decisive.sum()), teacher_forced_max_rel_logit_diff=rel,
                         ok=agree_decisive > 0.99 and rel < 0.05))
        log(f"check {name} vs dynamic: generate tokens equal {same.float().mean().item():.3f} (first divergence at "
            f"new token {first}), teacher-forced argmax {agree:.3f} ({agree_decisive:.3f} at the {int(decisive.sum())} "
            f"positions with a clear top-1), max logit diff {rel:.3f} of the logit range "
            f"{'ok' if agree_decisive > 0.99 and rel < 0.05 else 'FAIL'}")
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--sections", default="check,speed")
    parser.add_argument("--archs", default="qwen3-8b")
    parser.add_argument("--points", default="4096x1,32768x1,100000x1,32768x8,32768x16:bf16-eager:bf16-static,32768x32",
                        help="LENGTHxBATCH[:method:method...] (methods: all when none named)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--deadline", type=float, default=None)
    parser.add_argument("--key-blocks", default=None,
                        help="per-KV-head key blocks of every layer, cycled over the heads, or 'uniform' (64); default: "
                             "bench_gpu's mixed blocks")
    parser.add_argument("--no-wide-heads", action="store_true",
                        help="every head at 2 bits (default: the wide heads calibration's budget gives the geometry)")
    args = parser.parse_args(argv)
    global DEADLINE, KEY_BLOCKS, WIDE_HEADS
    KEY_BLOCKS = args.key_blocks or KEY_BLOCKS
    WIDE_HEADS = not args.no_wide_heads
    for name in ("recompile_limit", "cache_size_limit"):  # one compile per (method, shape): more than dynamo's default 8
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    # Each (cache type, shape) compiles its own static graph, as for a user who keeps one cache size; without this,
    # the second shape would recompile with dynamic shapes (slower, and an Inductor + cudagraph bug in torch 2.11).
    torch._dynamo.config.automatic_dynamic_shapes = False
    if args.deadline:
        DEADLINE = time.time() + args.deadline
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench_generate.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results["environment"] = environment(device)
    results["key_blocks"] = KEY_BLOCKS
    results["wide_heads"] = WIDE_HEADS
    results.setdefault("copy_bandwidth", copy_bandwidth(device))
    points = []
    for p in args.points.split(","):
        spec, *only = p.split(":")
        length, batch = (int(x) for x in spec.split("x"))
        points.append((length, batch, set(only)))
    methods = args.methods.split(",")
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        try:
            if name == "check":
                results["check"] = section_check(device)
            elif name == "profile":
                length, batch, only = points[0]
                results["profile"] = section_profile(device, args.archs.split(",")[0], points[0],
                                                     [m for m in methods if not only or m in only], args.new_tokens, out)
            elif name == "memory":
                results["memory"] = section_memory(device, args.archs.split(",")[0])
            elif name in ("kernels", "runtime"):
                results[name] = section_kernels(device, args.archs.split(",")[0], points[0],
                                                [m for m in methods if not points[0][2] or m in points[0][2]],
                                                args.new_tokens, out, runtime=name == "runtime")
            elif name == "speed":
                archs = args.archs.split(",")
                before = list(results.get("speed", []))

                def save(rows):
                    results["speed"] = merge_speed_rows(before, rows)
                    path.write_text(json.dumps(results, indent=1, default=str))

                save(section_speed(device, archs, points, methods, args.new_tokens, args.rounds,
                                   results["copy_bandwidth"], on_row=save))
            elif name == "per-call":
                before = list(results.get("per_call", []))

                def save_per_call(rows):
                    results["per_call"] = merge_speed_rows(before, rows)
                    path.write_text(json.dumps(results, indent=1, default=str))

                save_per_call(section_per_call(device, args.archs.split(","), points, methods, args.new_tokens,
                                               args.rounds, results["copy_bandwidth"], on_row=save_per_call))
            else:
                raise ValueError(f"unknown section {name!r}")
        except Exception:
            results.setdefault("errors", {})[name] = traceback.format_exc()[-3000:]
            log(f"section {name} FAILED:\n{traceback.format_exc()[-3000:]}")
        results.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)
        path.write_text(json.dumps(results, indent=1, default=str))
        log(f"-- section {name} done in {results['seconds'][name]} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
