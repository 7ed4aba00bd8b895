"""GPU benchmark and check of oscar-hf's kernels: one script that checks, tunes and times everything in one call.

    python eval/bench_gpu.py --out DIR [--sections check,tune,micro,quant,memory,e2e,budget] [--quick]

Sections (results go to DIR/bench_gpu.json after each section, a summary table is printed at the end):
  check   kernels vs their torch twins at realistic shapes (head_dim 64/128, GQA 4/8, up to 128K tokens, batch 1-32),
          fresh random inputs, outputs poisoned, tolerance scaled by the bf16 reference's own error; then a random
          Qwen3-shaped model through OscarCache with the kernels vs the twins, five layouts (over 200 s on an H100:
          `model-check` runs that part alone, so a call can give each part its own time limit)
  tune    a small sweep of the decode kernel's launch parameters; the best is used below
  micro   decode attention per layer (Qwen3-8B geometry: 32 query / 8 KV heads, head_dim 128) at 4K-128K tokens,
          batch 1/8/32: time, bytes it must read, achieved bandwidth vs the measured copy bandwidth, vs BF16 sdpa
  history the CUDA history kernel (OSCAR_HF_DECODE_KERNEL=cuda) against its twin, then against the Triton
          kernel per layer, interleaved (points: --micro-points)
  quant   the demotion (64 tokens per layer, every 64 steps) and prefill quantization cost
  memory  KV bytes really allocated (CUDA allocator) and bits per element at 32K and 128K
  e2e     decode step of random-weight Qwen3-4B / Qwen3-8B: DynamicCache BF16 vs OscarCache vs transformers'
          QuantizedCache (HQQ, 2 bits), interleaved step by step where they fit together; wall and GPU time
  budget  the largest batch within a 40 GB KV budget at 32K and 100K, and its decode tokens/s, BF16 vs OSCAR
Speed does not depend on weight or KV values, so models and caches are filled with random numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

GIB = 1024**3
DEADLINE = float("inf")  # wall-clock time (time.time()) by which sections stop starting new measurements
QWEN3 = {  # published architecture configs (no hub needed)
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
}
SINK, WINDOW = 64, 256
# The default layout: channel-wise keys entering the history in chunks of KEY_CHUNK tokens (OscarConfig.demotion_block),
# every KV head over blocks of KEY_BLOCK tokens (OscarConfig.key_block). "mixed": per-head blocks as a fitted
# allocation gives them (half, twice or equal to KEY_BLOCK), at the same meta rows per chunk as uniform blocks for
# 8 KV heads (R = 16): the kernel tiles at 64 tokens, the 32-token heads reading two meta rows per tile
# (`kernels/attention.py:key_tile`).
KEY_CHUNK = 128
KEY_BLOCK = 64
WIDE_HEADS = (1, 6)  # the "wide" layout's 4-bit heads (2 of 8: more than calibration gives a head_dim-128 model)
MIXED_KEY_BLOCKS = (32, 128, 64, 128, 32, 128, 64, 128)


def key_layout(kv_heads: int, layout: str = "default") -> tuple[tuple[int, ...], int]:
    """(per-head key blocks, key chunk) of a named layout: "default" (KEY_BLOCK for every head in chunks of
    KEY_CHUNK), "mixed" (MIXED_KEY_BLOCKS, cycled), "wide" (the mixed blocks with WIDE_HEADS at 4 bits: `wide_layout`),
    "channels" (the wide layout with wide key channels in the other heads: `wide_channel_layout`), "block128" (one
    block per chunk), "token" (token-wise keys) or "token-wide" (token-wise rows with WIDE_HEADS at 4 bits: the
    values of the wide layout)."""
    if layout in ("token", "token-wide"):
        return (), 0
    if layout in ("mixed", "wide", "channels"):
        return tuple(MIXED_KEY_BLOCKS[i % len(MIXED_KEY_BLOCKS)] for i in range(kv_heads)), KEY_CHUNK
    if layout == "block128":
        return (128,) * kv_heads, KEY_CHUNK
    if layout != "default":
        raise ValueError(f"unknown key layout {layout!r}")
    return (KEY_BLOCK,) * kv_heads, KEY_CHUNK


def wide_layout(kv_heads: int, layout: str) -> tuple[int, ...]:
    """`format.wide_rows` of a named layout: WIDE_HEADS (the first that exist) at 4 bits in "wide", "channels" and
    "token-wide", none elsewhere."""
    from oscar_hf.format import WIDE_BITS, wide_rows

    if layout not in ("wide", "channels", "token-wide"):
        return ()
    return wide_rows([WIDE_BITS if h in WIDE_HEADS else 2 for h in range(kv_heads)])


def wide_channel_layout(kv_heads: int, layout: str, head_dim: int) -> tuple[int, ...]:
    """Wide key channels per KV head of a named layout: in "channels", `wide_channel_counts` with WIDE_HEADS at 4
    bits; none elsewhere."""
    if layout != "channels":
        return ()
    return wide_channel_counts(head_dim, [4 if h in WIDE_HEADS else 2 for h in range(kv_heads)])


def wide_channel_counts(head_dim: int, head_bits) -> tuple[int, ...]:
    """Wide key channels per KV head (format 6): 0 in the 4-bit heads, between head_dim/8 and head_dim/3 in the 2-bit
    ones (what calibration gives SmolLM2's 2-bit heads: 15-24 of 64)."""
    lo, hi = head_dim // 8, head_dim // 3
    return tuple(0 if b != 2 else lo + (5 * h) % (hi - lo + 1) for h, b in enumerate(head_bits))


def key_meta_rows(key_blocks, key_chunk: int) -> int:
    """R: channel-wise key meta rows per chunk, all KV heads together."""
    return sum(key_chunk // b for b in key_blocks)


def stream_format(kv_heads: int, head_dim: int, key_blocks=(), key_chunk: int = 0, wide=(), channels=(),
                  meta_groups: int = 1, clip: float = 1.0):
    """The 2-bit `format.StreamFormat` that the kernels' flat arguments (key_blocks, key_chunk, wide_rows,
    wide_channels) describe: channel-wise with `key_chunk` > 0, else token-wise in `meta_groups` groups per row."""
    from oscar_hf.format import StreamFormat

    common = dict(heads=kv_heads, head_dim=head_dim, bits=2, group_size=head_dim // meta_groups, wide_rows=tuple(wide),
                  clip=clip)
    if key_chunk:
        return StreamFormat(granularity="channel", blocks=tuple(key_blocks), chunk=key_chunk,
                            wide_channels=tuple(channels), **common)
    return StreamFormat(**common)


def twin_inputs(args):
    """`random_segments`' flat kernel arguments as the torch twins take them: `(LayerFormat, Segments)` (the
    segments cut to their lengths, as `ops.Segments` carries them)."""
    from oscar_hf.format import LayerFormat
    from oscar_hf.ops import Segments
    from oscar_hf.quant import Packed

    q, sk, sv, ck, mk, cv, mv, rk, rv, ek, ev, _, ns, nh, nr, ne = args[:16]
    blocks, chunk, wide, channels = args[19:23]
    d = q.shape[-1]
    fmt = LayerFormat(stream_format(q.shape[1], d, blocks, chunk, wide, channels, 1 if chunk else mk.shape[-2]),
                      stream_format(q.shape[1], d, wide=wide, meta_groups=mv.shape[-2]))
    meta_k = mk[:, : -(-nh // chunk)] if chunk else mk[:, :, :nh]
    seg = Segments(sk[:, :, :ns], sv[:, :, :ns], Packed(ck[:, :, :nh], meta_k, fmt.keys),
                   Packed(cv[:, :, :nh], mv[:, :, :nh], fmt.values), rk[:, :, :nr], rv[:, :, :nr], ek[:, :, :ne],
                   ev[:, :, :ne])
    return fmt, seg


def segment_reference(args, emulate_bf16=False):
    """`ops.segment_attention_reference` on `random_segments`' flat kernel arguments: `(out, lse)`."""
    from oscar_hf.ops import segment_attention_reference

    _, seg = twin_inputs(args)
    q, mask, t, q_start, scale = args[0], args[11], args[16], args[17], args[18]
    return segment_attention_reference(q, seg, mask, t, q_start, scale, emulate_bf16=emulate_bf16)


# ------------------------------------------------------------------------------------------------ helpers
def log(*a):
    print(*a, flush=True)


def bench(fn, rep_ms=200) -> float:
    """Median time of fn() in microseconds (CUDA events via triton's do_bench; a host timer on the CPU)."""
    if torch.cuda.is_available():
        import triton.testing

        return 1000 * triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")
    fn()
    t = time.perf_counter()
    n = 3
    for _ in range(n):
        fn()
    return 1e6 * (time.perf_counter() - t) / n


def bench_graph(fn) -> float:
    """Median GPU time of fn() in microseconds, replayed from a CUDA graph (no launch gaps); host timer on the CPU."""
    if torch.cuda.is_available():
        import triton.testing

        with torch.cuda.stream(torch.cuda.Stream()):
            return 1000 * triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    return bench(fn)


def kernel_breakdown(fn, replays: int = 20) -> dict:
    """Microseconds per call of each CUDA kernel fn() launches, from a CUDA graph of one call replayed under the
    profiler (what bench_graph's time is made of; the rest is the gaps between kernels). Empty without a GPU."""
    if not torch.cuda.is_available():
        return {}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the capture (compilation, module loads)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        sync()
    totals: dict = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            totals[e.name] = totals.get(e.name, 0.0) + e.time_range.elapsed_us() / replays
    del graph
    return {name[:60]: round(us, 2) for name, us in sorted(totals.items(), key=lambda kv: -kv[1])}


@contextlib.contextmanager
def decode_kernel(name: str | None):
    """OSCAR_HF_DECODE_KERNEL=name ("auto", "cuda" or "triton") inside the block; None leaves the process's."""
    from oscar_hf.kernels import cuda_history

    if name is None:
        yield
        return
    saved = os.environ.get(cuda_history.ENV)
    os.environ[cuda_history.ENV] = name
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(cuda_history.ENV)
        else:
            os.environ[cuda_history.ENV] = saved


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def copy_bandwidth(device) -> float:
    """Device-to-device copy, bytes read + written per second."""
    n = (2 * GIB if device.type == "cuda" else 64 * 1024**2) // 2
    a = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    us = bench(lambda: b.copy_(a))
    del a, b
    free()
    return 2 * n * 2 / (us * 1e-6)


def random_segments(batch, kv_heads, groups_q, length, d, t=1, device="cuda", sink=SINK, window=WINDOW, meta_groups=1,
                    layout="default"):
    """Random rotated q and cache segments of a cache holding `length` tokens with keys in `layout` (`key_layout`:
    channel-wise, per-head blocks in chunks of KEY_CHUNK, meta `[B, n_chunks, R, d, 2]`; "token": token-wise keys);
    returns the op's argument tuple."""
    key_blocks, key_chunk = key_layout(kv_heads, layout)
    wide = wide_layout(kv_heads, layout)
    channels = wide_channel_layout(kv_heads, layout, d)
    rows = kv_heads + sum(r >= 0 for r in wide)  # the codes' head rows: wide heads' low planes after the KV heads
    n_sink = min(sink, length)
    unit = key_chunk or 8
    n_hist = max(length - n_sink - window, 0) // unit * unit
    n_recent = max(length - n_sink - n_hist, 0)
    bf = dict(device=device, dtype=torch.bfloat16)
    q = torch.randn(batch, kv_heads, groups_q * t, d, **bf)
    sink_k, sink_v = torch.randn(batch, kv_heads, sink, d, **bf), torch.randn(batch, kv_heads, sink, d, **bf)
    rec_k = torch.randn(batch, kv_heads, window + unit, d, **bf)
    rec_v = torch.randn(batch, kv_heads, window + unit, d, **bf)
    codes_k = torch.randint(0, 256, (batch, rows, n_hist, d // 4), device=device, dtype=torch.uint8)
    codes_v = torch.randint(0, 256, (batch, rows, n_hist, d // 4), device=device, dtype=torch.uint8)

    def meta(*shape):
        m = torch.empty(*shape, 2, device=device, dtype=torch.float16)
        m[..., 0].uniform_(0.05, 1.0)
        m[..., 1].normal_(0, 1)
        return m

    if key_chunk:
        meta_k = meta(batch, -(-n_hist // key_chunk), key_meta_rows(key_blocks, key_chunk), d)
    else:
        meta_k = meta(batch, kv_heads, n_hist, meta_groups)
    empty = q.new_empty(batch, kv_heads, 0, d)
    return (q, sink_k, sink_v, codes_k, meta_k, codes_v, meta(batch, kv_heads, n_hist, meta_groups), rec_k, rec_v, empty,
            empty, None, n_sink, n_hist, n_recent, 0, t, length - t, d ** -0.5, list(key_blocks), key_chunk, list(wide),
            list(channels))


def bytes_read(args) -> int:
    """Bytes the decode attention must read: packed history + its metadata + the BF16 windows + q."""
    q, sk, sv, ck, mk, cv, mv, rk, rv, ek, ev, mask, ns, nh, nr, ne = args[:16]
    key_blocks, key_chunk = (args[19], args[20]) if len(args) > 20 else ((), 0)
    b, h, _, d = q.shape
    codes = 2 * nh * ck.shape[-1] * ck.shape[1] // h  # wide heads' low planes included
    if key_chunk:  # per chunk, R rows (all heads) of d (scale, minimum) pairs
        meta_k = -(-nh // key_chunk) * key_meta_rows(key_blocks, key_chunk) * d * 2 * mk.element_size()
    else:
        meta_k = h * nh * mk.shape[-2] * 2 * mk.element_size()
    meta_v = nh * mv.shape[-2] * 2 * mv.element_size()
    windows = (ns + nr + ne) * d * 2 * 2
    return b * h * (codes + meta_v + windows) + b * meta_k + q.numel() * 2


# ------------------------------------------------------------------------------------------------ sections
def joined_codes(planes: torch.Tensor, wide: list[int], channels=()) -> torch.Tensor:
    """Unpacked 2-bit rows `[B, H + U, L, d]` -> each KV head's codes `[B, H, L, d]`, a wide head's as 4·high + low,
    a head's n wide key channels as 4·high + low in their slots and 0 in the last n (their block means are meta)."""
    heads = planes.shape[1] - sum(r >= 0 for r in wide)
    codes = planes[:, :heads].clone()
    for h, r in enumerate(wide):
        if r >= 0:
            codes[:, h] = planes[:, h] * 4 + planes[:, r]
    d = codes.shape[-1]
    for h, n in enumerate(channels):
        if n:
            codes[:, h, :, :n] = planes[:, h, :, :n] * 4 + planes[:, h, :, d - n :]
            codes[:, h, :, d - n :] = 0
    return codes


def section_check(device, quick):
    from oscar_hf.kernels.attention import segment_attention_triton
    from oscar_hf.ops import quantize_pack_reference
    from oscar_hf.quant import unpack_2bit_u8

    shapes = [  # (batch, kv_heads, gqa, length, head_dim, queries per group, value meta groups, key layout)
        (1, 8, 4, 131072, 128, 1, 1, "default"), (8, 8, 4, 32768, 128, 1, 1, "default"),
        (32, 8, 8, 4096, 64, 1, 1, "default"), (4, 2, 7, 16384, 64, 1, 1, "default"),
        (2, 1, 4, 8192, 256, 1, 1, "default"), (1, 8, 4, 32768, 128, 16, 2, "default"),
        (1, 8, 4, 131072, 128, 1, 1, "mixed"), (8, 8, 4, 32768, 128, 1, 1, "mixed"), (4, 8, 4, 16384, 128, 16, 1, "mixed"),
        (2, 8, 4, 8192, 128, 1, 4, "block128"), (1, 8, 4, 32768, 128, 1, 1, "token"), (2, 8, 4, 8192, 128, 1, 4, "token"),
        (1, 8, 4, 131072, 128, 1, 1, "wide"), (8, 8, 4, 32768, 128, 1, 1, "wide"), (4, 8, 4, 16384, 128, 16, 1, "wide"),
        (4, 2, 7, 16384, 64, 1, 1, "wide"), (2, 2, 4, 8192, 256, 1, 1, "wide"),
        (1, 8, 4, 131072, 128, 1, 1, "channels"), (8, 8, 4, 32768, 128, 1, 1, "channels"),
        (4, 8, 4, 16384, 128, 16, 1, "channels"), (4, 3, 3, 16384, 64, 1, 1, "channels"),
        (2, 2, 4, 8192, 256, 1, 1, "channels"),
    ]
    if quick:
        shapes = [(1, 2, 4, 1500, 64, 1, 1, "default"), (1, 4, 4, 1500, 64, 1, 1, "mixed"), (2, 2, 2, 700, 128, 3, 2, "token"),
                  (1, 4, 4, 1500, 64, 1, 1, "wide"), (1, 4, 4, 1500, 64, 1, 1, "channels")]
    rows = []
    for (b, h, g, length, d, t, mg, kb) in shapes:
        torch.manual_seed(length + b)
        args = random_segments(b, h, g, length, d, t=t, device=device, meta_groups=mg, layout=kb)
        ref, ref_lse = segment_reference(args)
        lowp, _ = segment_reference(args, emulate_bf16=True)
        poison = torch.full((256 * 1024**2,), float("nan"), device=device)  # reused memory comes back as NaN
        del poison
        out, lse = segment_attention_triton(*args)
        sync()
        ok = torch.isfinite(ref_lse)
        err = (out.float() - ref.float())[ok].abs().max().item()
        lowp_err = (lowp.float() - ref.float())[ok].abs().max().item()
        rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        passed = bool(torch.isfinite(out).all()) and err <= 3 * lowp_err + 1e-2
        rows.append(dict(kind="segment_attention", batch=b, kv_heads=h, gqa=g, length=length, head_dim=d, queries=t,
                         meta_groups=mg, key_layout=kb, key_blocks=args[19], key_chunk=args[20], max_err=err,
                         bf16_ref_err=lowp_err, rel_err=rel, passed=passed))
        log(f"check attention B={b} H={h} g={g} L={length} d={d} T={t} G={mg} keys {kb}: err {err:.2e} (bf16 ref {lowp_err:.2e}) "
            f"rel {rel:.1e} {'ok' if passed else 'FAIL'}")
        del args, ref, lowp, out
        free()
    cases = [(4, 8, 16384, 128, True, "token"), (32, 8, 8, 128, False, "token"), (2, 2, 4096, 64, True, "token"),
             (4, 8, 16384, 128, True, "default"), (32, 8, 128, 128, False, "default"), (2, 1, 4096, 256, True, "default"),
             (4, 8, 16384, 128, True, "mixed"), (32, 8, 128, 128, False, "mixed"), (2, 2, 4096, 64, False, "block128"),
             (4, 8, 16384, 128, True, "wide"), (32, 8, 128, 128, False, "wide"), (2, 2, 4096, 64, True, "wide"),
             (4, 8, 16384, 128, True, "channels"), (32, 8, 128, 128, False, "channels"),
             (2, 3, 4096, 64, True, "channels"), (2, 2, 4096, 256, False, "channels"),
             (4, 8, 16384, 128, True, "token-wide"), (32, 8, 8, 128, False, "token-wide"),  # wide heads unclipped
             (4, 8, 16384, 128, True, "token-clip0.6")]  # a low clip: the clip search's longest bracket
    for (b, h, n, d, rotate, layout) in (cases if not quick else [(2, 2, 320, 64, True, "token"),
                                                                    (2, 2, 256, 64, True, "default"),
                                                                    (2, 4, 256, 64, True, "mixed"),
                                                                    (2, 4, 256, 64, True, "wide"),
                                                                    (2, 4, 256, 64, True, "token-wide"),
                                                                    (2, 4, 256, 64, True, "channels")]):
        layout, _, low_clip = layout.partition("-clip")
        key_blocks, chunk = key_layout(h, layout)
        wide = list(wide_layout(h, layout))
        channels = list(wide_channel_layout(h, layout, d))
        rows_k = h + sum(r >= 0 for r in wide)
        x = (torch.randn(b, h, n, d, device=device) * 3 + torch.randn(d, device=device)).to(torch.bfloat16)
        rot = torch.linalg.qr(torch.randn(h, d, d, device=device))[0].to(torch.bfloat16) if rotate else None
        start = chunk or 3
        clip = 1.0 if chunk else float(low_clip or 0.96)
        fmt = stream_format(h, d, key_blocks, chunk, wide, channels, clip=clip)
        outs = []
        for kernel in (False, True):
            codes = torch.full((b, rows_k, n + start, d // 4), 0xAA, device=device, dtype=torch.uint8)
            meta_shape = (b, (n + start) // chunk, key_meta_rows(key_blocks, chunk), d, 2) if chunk else (b, h, n + start, 1, 2)
            meta = torch.full(meta_shape, float("nan"), device=device, dtype=torch.float16)
            if kernel:
                torch.ops.oscar.quantize_pack(x, rot, clip, codes, meta, start, list(key_blocks), chunk, wide, channels)
            else:
                quantize_pack_reference(x, rot, codes, meta, start, fmt)
            outs.append((codes, meta))
        # compare whole codes: a wide head's 4-bit code off by one can flip both of its 2-bit planes
        a, r = (joined_codes(unpack_2bit_u8(o[0][:, :, start:]).int(), wide, channels) for o in outs)
        differ = (a != r).float().mean().item()
        written_meta = outs[1][1][:, 1:] if chunk else outs[1][1][:, :, start:]
        written = bool((outs[1][0][:, :, :start] == 0xAA).all()) and not bool(torch.isnan(written_meta).any())
        passed = written and differ < 0.01 and (a - r).abs().max().item() <= 1
        rows.append(dict(kind="quantize_pack", batch=b, kv_heads=h, tokens=n, head_dim=d, rotate=rotate, key_layout=layout,
                         clip=clip, key_blocks=list(key_blocks), key_chunk=chunk, codes_differing=differ, passed=passed))
        log(f"check quantize B={b} H={h} n={n} d={d} rotate={rotate} keys {layout} clip {clip}: {differ:.2e} of codes differ "
            f"{'ok' if passed else 'FAIL'}")
        free()
    # the static cache's decode writes: first row read on the device, negative = nothing written
    for (b, h, n, d, layout, start) in ((4, 8, 1, 128, "token", 700), (4, 8, 1, 128, "token", -1), (2, 1, 1, 256, "token", 5),
                                        (4, 8, 128, 128, "mixed", 256), (4, 8, 128, 128, "mixed", -1),
                                        (2, 1, 128, 256, "default", 128), (4, 8, 128, 128, "channels", 256),
                                        (4, 8, 128, 128, "channels", -1)):
        key_blocks, chunk = key_layout(h, layout) if layout != "token" else ((), 0)
        wide, channels = list(wide_layout(h, layout)), list(wide_channel_layout(h, layout, d))
        clip = 1.0 if chunk else 0.96
        fmt = stream_format(h, d, key_blocks, chunk, wide, channels, clip=clip)
        x = (torch.randn(b, h, n, d, device=device) * 3 + torch.randn(d, device=device)).to(torch.bfloat16)
        cap = 1024
        outs = []
        for fn in ("reference", "kernel"):
            codes = torch.full((b, h + sum(r >= 0 for r in wide), cap, d // 4), 0xAA, device=device, dtype=torch.uint8)
            meta_shape = (b, cap // chunk, key_meta_rows(key_blocks, chunk), d, 2) if chunk else (b, h, cap, 1, 2)
            meta = torch.full(meta_shape, float("nan"), device=device, dtype=torch.float16)
            if fn == "kernel":
                torch.ops.oscar.quantize_pack_at(x, clip, codes, meta, torch.tensor([start], device=device),
                                                 list(key_blocks), chunk, 0, wide, channels)
            elif start >= 0:
                quantize_pack_reference(x, None, codes, meta, start, fmt)
            sync()
            outs.append((codes, meta))
        (rc, rm), (kc, km) = outs

        differ = (joined_codes(unpack_2bit_u8(kc).int(), wide, channels)
                  != joined_codes(unpack_2bit_u8(rc).int(), wide, channels)).float().mean().item()
        same_meta = torch.equal(km.isnan(), rm.isnan()) and torch.allclose(km.nan_to_num().float(), rm.nan_to_num().float(),
                                                                           rtol=1e-2, atol=1e-3)
        passed = same_meta and differ < 1e-3
        rows.append(dict(kind="quantize_pack_at", batch=b, kv_heads=h, tokens=n, head_dim=d, key_layout=layout,
                         start=start, codes_differing=differ, passed=passed))
        log(f"check quantize_pack_at B={b} H={h} n={n} d={d} keys {layout} start {start}: {differ:.2e} of codes differ, "
            f"meta {'same' if same_meta else 'DIFFERENT'} {'ok' if passed else 'FAIL'}")
        free()
    rows += check_static_decode(device, quick)
    return rows


def check_static_decode(device, quick):
    """The static cache's decode-step ops against their twins: `rotate_store_token` (a sink and a ring position,
    head_dim 64/128/256) and `decode_attention` over a static history with the output un-rotated in the merge."""
    from oscar_hf.ops import DecodeBuffers, decode_attention_reference, rotate_store_token_reference

    rows = []
    for (b, h, d, position) in ((1, 8, 128, 5), (8, 8, 128, 4100), (2, 1, 256, 70), (4, 2, 64, 63)):
        s, r = 64, 512
        keys = torch.randn(b, h, 1, d, device=device).to(torch.bfloat16)
        values = torch.randn(b, 1, h, d, device=device).to(torch.bfloat16).transpose(1, 2)
        rk = torch.linalg.qr(torch.randn(h, d, d, device=device))[0].to(torch.bfloat16)
        rv = torch.linalg.qr(torch.randn(h, d, d, device=device))[0].to(torch.bfloat16)
        pos = torch.tensor(position, device=device)
        outs = []
        for fn in (rotate_store_token_reference, torch.ops.oscar.rotate_store_token):
            buffers = [torch.zeros(b, h, n, d, device=device, dtype=torch.bfloat16) for n in (s + 1, s + 1, r + 1, r + 1)]
            out = fn(keys, values, rk, rv, *buffers, pos, s, r)
            sync()
            outs.append((out, [t[:, :, :-1] for t in buffers]))  # scratch slots: the twin's alone
        (ref, ref_bufs), (out, bufs) = outs
        err = ((out.float() - ref.float()).abs() / ref.float().abs().clamp(min=1e-2)).max().item()
        slots_err = max(((a.float() - c.float()).abs() / c.float().abs().clamp(min=1e-2)).max().item()
                        for a, c in zip(bufs, ref_bufs))
        passed = err <= 2 ** -7 and slots_err <= 2 ** -7  # at most one bf16 rounding apart (summation order)
        rows.append(dict(kind="rotate_store_token", batch=b, kv_heads=h, head_dim=d, position=position, rel_err=err,
                         slots_rel_err=slots_err, passed=passed))
        log(f"check rotate_store_token B={b} H={h} d={d} position {position}: rel err {err:.1e}, slots {slots_err:.1e} "
            f"{'ok' if passed else 'FAIL'}")
        free()
    shapes = ((1, 8, 4, 32768, 128, "mixed"), (8, 8, 4, 4096, 128, "default"), (2, 1, 4, 8192, 256, "default"),
              (1, 8, 4, 32768, 128, "wide"), (1, 8, 4, 32768, 128, "channels"), (4, 3, 3, 8192, 64, "channels"))
    for (b, h, g, length, d, layout) in (shapes if not quick else ((1, 4, 4, 1500, 64, "mixed"), (1, 4, 4, 1500, 64, "wide"),
                                                                   (1, 4, 4, 1500, 64, "channels"))):
        torch.manual_seed(length + b)
        args = random_segments(b, h, g, length, d, device=device, layout=layout)
        q, sk, sv, ck, mk, cv, mv, rec_k, rec_v = args[:9]
        n_sink, n_hist, n_recent, t, q_start, scale, blocks, chunk, wide, channels = (*args[12:15], args[16], args[17],
                                                                                       *args[18:23])
        lengths = torch.tensor([n_sink, n_hist, n_recent, 0, q_start], device=device, dtype=torch.int32)
        rot = torch.linalg.qr(torch.randn(h, d, d, device=device))[0].to(torch.bfloat16)
        dargs = (q, sk, sv, ck, mk, cv, mv, rec_k, rec_v, None, lengths, t, scale, blocks, chunk, wide, channels, rot)
        fmt, _ = twin_inputs(args)

        def twin(low: bool):  # low: every floating input (the metadata too) in bfloat16
            cast = lambda a: a.to(torch.bfloat16) if low and a is not None and a.is_floating_point() else a  # noqa: E731
            buffers = DecodeBuffers(*(cast(a) for a in (sk, sv, ck, mk, cv, mv, rec_k, rec_v)))
            return decode_attention_reference(cast(q), buffers, fmt, None, lengths, t, scale, cast(rot)).float()

        ref, lowp = twin(False), twin(True)
        out = torch.ops.oscar.decode_attention(*dargs).float()
        sync()
        err, lowp_err = (out - ref).abs().max().item(), (lowp - ref).abs().max().item()
        passed = bool(torch.isfinite(out).all()) and err <= 3 * lowp_err + 1e-2
        rows.append(dict(kind="decode_attention_rotated", batch=b, kv_heads=h, gqa=g, length=length, head_dim=d,
                         key_layout=layout, max_err=err, bf16_ref_err=lowp_err, passed=passed))
        log(f"check decode_attention + merge un-rotation B={b} H={h} g={g} L={length} d={d} keys {layout}: err {err:.2e} "
            f"(bf16 ref {lowp_err:.2e}) {'ok' if passed else 'FAIL'}")
        free()
    return rows


def section_model_check(device, quick):
    """A random Qwen3-shaped model (head_dim 128) through OscarCache with the kernels vs the torch twins: prefill,
    decode steps, a chunk longer than the window onto the filled cache, a left-padded batch."""
    from oscar_hf import OscarCache, OscarConfig, OscarRotations
    from oscar_hf.metrics import cache_kwarg

    model = tiny_qwen3(device)
    kw = cache_kwarg(model)
    n = 3000 if not quick else 700
    ids = torch.randint(0, 1000, (2, n + 330), device=device)
    mask = torch.ones_like(ids)
    mask[1, :100] = 0
    uniform = OscarRotations.data_free(model, "hadamard")
    mixed = OscarRotations.data_free(model, "hadamard")
    heads = model.config.num_key_value_heads
    mixed.key_blocks = {layer: tuple(MIXED_KEY_BLOCKS[h % len(MIXED_KEY_BLOCKS)] for h in range(heads))
                        for layer in mixed.layers}
    wide = OscarRotations.data_free(model, "hadamard")  # the per-head blocks and WIDE_HEADS at 4 bits
    wide.key_blocks = dict(mixed.key_blocks)
    wide.head_bits = {layer: tuple(4 if h in WIDE_HEADS else 2 for h in range(heads)) for layer in wide.layers}
    channels = OscarRotations.data_free(model, "identity")  # ... and wide key channels in the raw channels of the others
    channels.key_blocks, channels.head_bits = dict(wide.key_blocks), dict(wide.head_bits)
    channels.key_wide_channels = {layer: wide_channel_layout(heads, "channels", model.config.head_dim)
                                  for layer in channels.layers}
    rows = []
    for layout in ("channel", "channel (per-head blocks)", "channel (per-head blocks, wide heads)",
                   "channel (per-head blocks, wide heads, wide key channels)", "token"):
        rot = (channels if "wide key channels" in layout else wide if "wide" in layout else mixed if "per-head" in layout
               else uniform)
        config = OscarConfig(value_clip=0.92) if layout != "token" else OscarConfig(
            key_granularity="token", demotion_block=8, key_clip=0.96, value_clip=0.92)
        logits = {}
        for mode in ("0", "1"):
            os.environ["OSCAR_HF_KERNELS"] = mode
            cache = OscarCache(model, rot, config)
            out = []
            with torch.no_grad():
                for a, b in [(0, n), (n, n + 1), (n + 1, n + 2), (n + 2, n + 302), (n + 302, n + 303), (n + 303, n + 330)]:
                    out.append(model(input_ids=ids[:, a:b], attention_mask=mask[:, :b], use_cache=True, **{kw: cache}).logits.float())
            logits[mode] = torch.cat(out[1:], 1)  # the first prefill is sdpa in both modes
        os.environ.pop("OSCAR_HF_KERNELS")
        ref = logits["0"]
        rel = ((logits["1"] - ref).norm() / ref.norm()).item()
        same = logits["1"].argmax(-1) == ref.argmax(-1)
        top1 = same.float().mean().item()
        # A random model's logits are near ties at many positions, where bf16 rounding alone can flip the argmax: the
        # top-1 bound applies where the twin's top-2 margin exceeds 4x the RMS logit difference between the two paths.
        top2 = ref.topk(2, dim=-1).values
        decisive = (top2[..., 0] - top2[..., 1]) > 4 * (logits["1"] - ref).pow(2).mean().sqrt()
        top1_decisive = same[decisive].float().mean().item() if decisive.any() else 1.0
        passed = rel < 0.02 and top1_decisive > 0.99
        log(f"check model ({layout} keys): kernels vs torch twins, relative logit error {rel:.2e}, top-1 agreement "
            f"{top1:.4f} ({top1_decisive:.4f} at the {int(decisive.sum())} of {decisive.numel()} positions with a clear "
            f"top-1) {'ok' if passed else 'FAIL'}")
        rows.append(dict(kind="model", layout=layout, tokens=n + 330, rel_logit_err=rel, top1_agreement=top1,
                         top1_agreement_decisive=top1_decisive, decisive_positions=int(decisive.sum()), passed=passed))
    return rows


def section_devmap(device, quick, tmp):
    """Calibration of a model whose layers sit on different devices (accelerate device_map: GPU and CPU)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from oscar_hf import CalibrationConfig
    from oscar_hf.calibrate import calibrate

    import string
    vocab = {"<unk>": 0, "</s>": 1}
    for ch in string.printable:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    model = tiny_qwen3("cpu")
    model.save_pretrained(tmp / "tiny")
    device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cpu", "model.norm": "cpu",
                  "model.rotary_emb": "cpu", "lm_head": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(tmp / "tiny", device_map=device_map, dtype=torch.bfloat16)
    text = tmp / "calib.txt"
    text.write_text(("The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 200))
    rot = calibrate(model, tokenizer, data=str(text), progress=False,
                    calibration=CalibrationConfig(tokens=1024, sequence_length=512, heldout_tokens=512))
    devices = {layer: str(s.sums["query"].device) for layer, s in rot.statistics.items()}
    # accelerate runs CPU-offloaded layers on the GPU (weights stream in), so statistics sit where attention ran
    passed = sorted(devices) == [0, 1] and len(rot.key_rotations) == 2
    log(f"check device_map calibration: statistics on {devices} {'ok' if passed else 'FAIL'}")
    return dict(kind="device_map_calibration", statistics_devices=devices, passed=passed)


def decode_args(b, length, device, g=4, h=8, d=128, layout="default"):
    torch.manual_seed(b * 7 + length)
    return random_segments(b, h, g, length, d, device=device, layout=layout)


def section_tune(device, quick):
    from oscar_hf.kernels.attention import DEFAULT_LAUNCH, segment_attention_triton

    points = [(1, 100_000), (8, 32_768), (32, 131_072)] if not quick else [(1, 4096)]
    # The default storage format (format 6, "channels"). v6's sweep settled the unpacking (inline PTX) and how bytes
    # stay in flight (tiles asked for in L2 two steps ahead); this one sweeps warps and programs per SM around them.
    # `maxnreg`: None is the default cap (`decode_maxnreg`, 168 registers: 3 programs of 4 warps per SM), 128 gives 4
    # (with spills), 255 leaves the compiler's own 192 (2 programs).
    grid = [dict(num_warps=nw, programs_per_sm=tp, prefetch=False, l2_ahead=2, ptx_unpack=True, maxnreg=reg)
            for nw in (2, 4) for tp in (4, 8, 12, 16, 24) for reg in (None, 128, 255)]
    if quick:
        grid = grid[:3]
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    results = []
    for (b, length) in points:
        args = decode_args(b, length, device, layout="channels")
        for cfg in grid:
            saved = {k: DEFAULT_LAUNCH[k] for k in ("ptx_unpack", "maxnreg")}
            DEFAULT_LAUNCH.update(ptx_unpack=cfg["ptx_unpack"], maxnreg=cfg["maxnreg"])
            try:
                fn = lambda: segment_attention_triton(  # noqa: E731
                    *args, block_n=64, num_warps=cfg["num_warps"], num_stages=1,
                    target_programs=cfg["programs_per_sm"] * sms, prefetch=cfg["prefetch"], l2_ahead=cfg["l2_ahead"])
                fn()
                us = bench_graph(fn)
            except Exception as e:  # a configuration the compiler rejects
                us = float("inf")
                log(f"tune {cfg}: {type(e).__name__}: {str(e)[:200]}")
            finally:
                DEFAULT_LAUNCH.update(saved)
            results.append(dict(batch=b, length=length, block_n=64, num_stages=1, **cfg, us=us))
        del args
        free()

    def score(cfg):  # geometric-mean time over the points
        ts = [r["us"] for r in results if all(r[k] == v for k, v in cfg.items())]
        return math.exp(sum(math.log(t) for t in ts) / len(ts))

    best = min(grid, key=score)
    log(f"tune: best {best} ({score(best):.1f} us geometric mean)")
    return {"sweep": results, "best": dict(block_n=64, num_stages=1, **best)}


def _kernel_kwargs(tuned, device):
    if not tuned:
        return {}
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return dict(block_n=tuned["block_n"], num_warps=tuned["num_warps"], num_stages=tuned["num_stages"],
                target_programs=tuned["programs_per_sm"] * sms, prefetch=tuned.get("prefetch"),
                l2_ahead=tuned.get("l2_ahead"))


class _Module(torch.nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def section_micro(device, quick, tuned, copy_bw, points=None):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from oscar_hf.kernels.attention import DEFAULT_LAUNCH, segment_attention_triton

    lengths = [4096, 32768, 100_000, 131072] if not quick else [2048]
    batches = [1, 8, 32] if not quick else [1, 2]
    kw = _kernel_kwargs(tuned, device)
    for name in ("ptx_unpack", "maxnreg"):
        if tuned and name in tuned:
            DEFAULT_LAUNCH[name] = tuned[name]
    h, g, d = 8, 4, 128
    rk = torch.linalg.qr(torch.randn(h, d, d, device=device))[0].to(torch.bfloat16)
    rows = []
    # the default storage format (format 6: "channels") at every length; at two, the same without wide key channels
    # (format 5: "wide") and with every head at 2 bits over uniform blocks ("default"): what each layer of the
    # format costs
    compared = [32768, 100_000] if not quick else lengths
    plan = [(b, n, layout) for b in batches for n, layout in ([(n, "channels") for n in lengths]
                                                               + [(n, "wide") for n in compared]
                                                               + [(n, "default") for n in compared])]
    if points:  # --micro-points: LENGTHxBATCH:layout,...
        plan = [(int(p.split(":")[0].split("x")[1]), int(p.split(":")[0].split("x")[0]), p.split(":")[1])
                for p in points.split(",")]
    for b, length, layout in plan:
        if time.time() > DEADLINE:
            log(f"micro: deadline reached before B={b} L={length} {layout}")
            return rows
        row = dict(batch=b, length=length, key_layout=layout, launch=tuned or {k: DEFAULT_LAUNCH[k] for k in (
            "block_n", "num_warps_channel_keys", "num_stages", "programs_per_sm", "programs_per_sm_long",
            "long_split_tokens", "prefetch", "l2_ahead", "ptx_unpack", "maxnreg")})
        args = decode_args(b, length, device, layout=layout)
        row["key_blocks"], row["key_chunk"] = args[19], args[20]
        q_plain = torch.randn(b, h * g, 1, d, device=device, dtype=torch.bfloat16)

        def kernel_only():
            return segment_attention_triton(*args, **kw)

        def full_layer():  # q·R_K, the kernel, o·R_Vᵀ: what the attention does per layer
            q = torch.matmul(q_plain.view(b, h, g, 1, d), rk.unsqueeze(1)).view(b, h, g, d)
            out, _ = segment_attention_triton(*((q,) + args[1:]), **kw)
            return torch.matmul(out.view(b, h, g, 1, d), rk.transpose(-1, -2).unsqueeze(1))

        nbytes = bytes_read(args)
        row["oscar_kernel_us"] = bench_graph(kernel_only)
        row["oscar_layer_us"] = bench_graph(full_layer)
        row["oscar_layer_eager_us"] = bench(full_layer)
        row["oscar_bytes"] = nbytes
        row["oscar_gbps"] = nbytes / (row["oscar_kernel_us"] * 1e-6) / 1e9
        row["oscar_fraction_of_copy_bw"] = nbytes / (row["oscar_kernel_us"] * 1e-6) / copy_bw
        del args
        free()
        bf16_bytes = 2 * b * h * length * d * 2
        if layout == "channels" and (bf16_bytes < 60 * GIB or device.type != "cuda"):
            k = torch.randn(b, h, length, d, device=device, dtype=torch.bfloat16)
            v = torch.randn(b, h, length, d, device=device, dtype=torch.bfloat16)
            mod = _Module(g)
            row["bf16_sdpa_us"] = bench_graph(lambda: sdpa_attention_forward(mod, q_plain, k, v, None, scaling=d ** -0.5))
            row["bf16_sdpa_eager_us"] = bench(lambda: sdpa_attention_forward(mod, q_plain, k, v, None, scaling=d ** -0.5))
            row["bf16_bytes"] = bf16_bytes
            row["bf16_gbps"] = bf16_bytes / (row["bf16_sdpa_us"] * 1e-6) / 1e9
            row["speedup_vs_bf16"] = row["bf16_sdpa_us"] / row["oscar_layer_us"]
            del k, v
            free()
        log(f"micro B={b:2d} L={length:6d} keys {layout}: OSCAR kernel {row['oscar_kernel_us']:8.1f} us "
            f"({row['oscar_gbps']:6.0f} GB/s, {100 * row['oscar_fraction_of_copy_bw']:5.1f}% of copy), layer "
            f"{row['oscar_layer_us']:8.1f} us | BF16 sdpa {row.get('bf16_sdpa_us', float('nan')):9.1f} us "
            f"({row.get('bf16_gbps', float('nan')):6.0f} GB/s) | x{row.get('speedup_vs_bf16', float('nan')):.2f}")
        rows.append(row)
    return rows


HISTORY_WARPS_PER_SM = (None, 6, 8)  # the CUDA kernel's split plan, swept by the history section (None: resident)


def section_history(device, quick, copy_bw, points=None, check=True):
    """The CUDA history kernel (`OSCAR_HF_DECODE_KERNEL=cuda`, kernels/cuda_history.py) against the Triton kernel:
    first each against the torch twin (host lengths, device lengths, a CUDA-graph replay, a mask with holes), then
    decode attention per layer (stage 1 + merge, graph-replayed) with both kernels interleaved, Qwen3-8B geometry:
    "channels" (the default storage format: per-head blocks, wide heads, wide key channels), "wide" (without wide
    key channels), "default" (uniform blocks of 64), "mixed" (per-head blocks only)."""
    from oscar_hf.kernels.attention import DEFAULT_LAUNCH, decode_attention_triton, segment_attention_triton

    def with_kernel(name, fn):
        with decode_kernel(name):
            return fn()

    rows = []
    checks = [(1, 4096, "channels", 1), (3, 33000, "mixed", 1), (2, 9000, "channels", 2), (1, 100_000, "wide", 1),
              (1, 20000, "default", 1)]
    for b, length, layout, t in (checks[:2] if quick else checks) if check else ():
        args = list(random_segments(b, 8, 4, length, 128, t=t, device=device, layout=layout))
        n = length + t
        mask = torch.ones(b, n, dtype=torch.bool, device=device)
        mask[-1, : 9 + SINK + 300] = False  # a left-padded row: sink and the first 300 history tokens hidden
        args[11] = mask
        ref, _ = segment_reference(args)
        low, _ = segment_reference(args, emulate_bf16=True)
        tri, _ = with_kernel("triton", lambda: segment_attention_triton(*args))
        cud, _ = with_kernel("cuda", lambda: segment_attention_triton(*args))
        # device lengths (a static cache's decode step), the recent window as a ring from slot 0, in a CUDA graph
        q, sk, sv, ck, mk, cv, mv, rk, rv = args[:9]
        lengths = torch.tensor([args[12], args[13], args[14], 0, args[17]], dtype=torch.int32, device=device)
        step = lambda: decode_attention_triton(q, sk, sv, ck, mk, cv, mv, rk, rv, mask, lengths, t, args[18],  # noqa: E731
                                                args[19], args[20], wide_rows=args[21], wide_channels=args[22])
        dev = with_kernel("cuda", step)
        replayed = dev
        if device.type == "cuda":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                replayed = with_kernel("cuda", step)
            replayed.zero_()
            graph.replay()
            sync()
            del graph
        err = lambda x: (x.float() - ref.float()).abs().max().item()  # noqa: E731
        bound = 2 * max(err(low), err(tri)) + 1e-3
        row = dict(kind="history_check", batch=b, length=length, layout=layout, t=t, err_cuda=err(cud),
                   err_triton=err(tri), err_bf16_twin=err(low), err_device_lengths=err(dev), err_graph=err(replayed),
                   bound=bound)
        row["passed"] = all(row[k] <= bound for k in ("err_cuda", "err_device_lengths", "err_graph"))
        log(f"history check B={b} L={length} {layout} t={t}: cuda {row['err_cuda']:.2e} device lengths "
            f"{row['err_device_lengths']:.2e} graph {row['err_graph']:.2e} | triton {row['err_triton']:.2e} bf16 twin "
            f"{row['err_bf16_twin']:.2e} -> {'PASS' if row['passed'] else 'FAIL'}")
        rows.append(row)
        del args, mask, ref, low, tri, cud, dev, replayed
        free()
    plan = [(1, 100_000, "channels"), (8, 32768, "channels"), (1, 32768, "channels"), (1, 4096, "channels"),
            (1, 100_000, "default"), (8, 32768, "default"), (32, 32768, "channels"), (1, 100_000, "mixed")]
    if points:
        plan = [(int(p.split(":")[0].split("x")[1]), int(p.split(":")[0].split("x")[0]), p.split(":")[1])
                for p in points.split(",")]
    for b, length, layout in (plan[:1] if quick else plan):
        if time.time() > DEADLINE:
            log(f"history: deadline reached before B={b} L={length} {layout}")
            break
        args = decode_args(b, length, device, layout=layout)
        nbytes = bytes_read(args)
        row = dict(kind="history_speed", batch=b, length=length, layout=layout, bytes=nbytes,
                   cuda_warps_per_sm=HISTORY_WARPS_PER_SM)
        default_warps = DEFAULT_LAUNCH["cuda_history_warps_per_sm"]
        label = lambda n: "resident" if n is None else n  # noqa: E731
        for rep in range(2):  # interleaved: triton, cuda at each split plan, again; the best of each
            us = with_kernel("triton", lambda: bench_graph(lambda: segment_attention_triton(*args)))
            row["triton_us"] = min(row.get("triton_us", float("inf")), us)
            for warps in HISTORY_WARPS_PER_SM:
                DEFAULT_LAUNCH["cuda_history_warps_per_sm"] = warps
                us = with_kernel("cuda", lambda: bench_graph(lambda: segment_attention_triton(*args)))
                row[f"cuda_{label(warps)}_us"] = min(row.get(f"cuda_{label(warps)}_us", float("inf")), us)
        DEFAULT_LAUNCH["cuda_history_warps_per_sm"] = default_warps
        row["cuda_us"] = row.get(f"cuda_{label(default_warps)}_us")
        # where a layer's time goes: each kernel's microseconds (the Triton stage 1, the CUDA history kernel, the
        # merge), the rest being gaps between them
        for name in ("triton", "cuda"):
            row[f"{name}_kernels_us"] = with_kernel(name, lambda: kernel_breakdown(lambda: segment_attention_triton(*args)))
            log(f"  {name} kernels: " + ", ".join(f"{k} {v:.1f}" for k, v in row[f"{name}_kernels_us"].items()))
        best = min(HISTORY_WARPS_PER_SM, key=lambda n: row[f"cuda_{label(n)}_us"])
        row["cuda_best_warps_per_sm"], row["cuda_best_us"] = label(best), row[f"cuda_{label(best)}_us"]
        for name in ("triton", "cuda", "cuda_best"):
            row[f"{name}_fraction_of_copy_bw"] = nbytes / (row[f"{name}_us"] * 1e-6) / copy_bw
        row["speedup"] = row["triton_us"] / row["cuda_us"]
        row["speedup_best"] = row["triton_us"] / row["cuda_best_us"]
        log(f"history B={b:2d} L={length:6d} {layout}: triton {row['triton_us']:8.1f} us "
            f"({100 * row['triton_fraction_of_copy_bw']:5.1f}% of copy) | cuda by warps per SM "
            + " ".join(f"{label(n)}: {row[f'cuda_{label(n)}_us']:.1f}" for n in HISTORY_WARPS_PER_SM)
            + f" | default {row['cuda_us']:.1f} us ({100 * row['cuda_fraction_of_copy_bw']:5.1f}%) x{row['speedup']:.2f}"
            f" | best {row['cuda_best_us']:.1f} us x{row['speedup_best']:.2f}")
        rows.append(row)
        del args
        free()
    return rows


def section_quant(device, quick):
    rows = []
    for b in ([1, 8, 32] if not quick else [1]):
        h, d = 8, 128
        for layout in ("default", "mixed"):
            key_blocks, blk = key_layout(h, layout)  # one chunk demoted at a time
            key_blocks = list(key_blocks)
            rows_rot = torch.randn(b, h, blk, d, device=device, dtype=torch.bfloat16)
            codes = torch.empty(b, h, 4 * blk, d // 4, device=device, dtype=torch.uint8)
            meta_k = torch.empty(b, 4, key_meta_rows(key_blocks, blk), d, 2, device=device, dtype=torch.float16)
            meta_v = torch.empty(b, h, 4 * blk, 1, 2, device=device, dtype=torch.float16)
            us = bench_graph(lambda: (torch.ops.oscar.quantize_pack(rows_rot, None, 1.0, codes, meta_k, blk, key_blocks, blk, [],
                                                                    []),
                                      torch.ops.oscar.quantize_pack(rows_rot, None, 0.92, codes, meta_v, blk, [], 0, [], [])))
            rows.append(dict(kind="demotion", key_layout=layout, batch=b, tokens=blk, us_per_layer_per_demotion=us,
                             us_per_layer_per_step=us / blk))
            log(f"quant demotion B={b} keys {layout}: {us:.1f} us per layer per demotion of {blk} tokens "
                f"({us / blk:.2f} us per layer per decode step)")
    n = 100_000 if not quick else 2000
    x = torch.randn(1, 8, n, 128, device=device, dtype=torch.bfloat16)
    rot = torch.linalg.qr(torch.randn(8, 128, 128, device=device))[0].to(torch.bfloat16)
    n = n // KEY_CHUNK * KEY_CHUNK
    x = x[:, :, :n]
    codes = torch.empty(1, 8, n, 32, device=device, dtype=torch.uint8)
    meta = torch.empty(1, 8, n, 1, 2, device=device, dtype=torch.float16)
    key_blocks, chunk = key_layout(8, "default")
    key_blocks = list(key_blocks)
    meta_k = torch.empty(1, n // chunk, key_meta_rows(key_blocks, chunk), 128, 2, device=device, dtype=torch.float16)
    for kind, fn, meta_bytes in (
            ("prefill values (token-wise: rotate+clip+quantize+pack)",
             lambda: torch.ops.oscar.quantize_pack(x, rot, 0.96, codes, meta, 0, [], 0, [], []), meta.numel() * 2),
            ("prefill keys (channel-wise: rotate+quantize+pack)",
             lambda: torch.ops.oscar.quantize_pack(x, rot, 1.0, codes, meta_k, 0, key_blocks, chunk, [], []),
             meta_k.numel() * 2)):
        us = bench_graph(fn)
        moved = x.numel() * 2 + codes.numel() + meta_bytes
        row = dict(kind=kind, tokens=n, kv_heads=8, us=us, gbps=moved / (us * 1e-6) / 1e9)
        if kind.startswith("prefill values") and device.type == "cuda":
            # the token-wise kernel with 1 row tile per program (v5) and with 8, in the same run
            from oscar_hf.kernels.quantize import QUANTIZE_LAUNCH

            saved = dict(QUANTIZE_LAUNCH)
            for tiles in (1, 8):
                QUANTIZE_LAUNCH.update(tiles_per_program=tiles)
                row[f"us_{tiles}_tiles_per_program"] = bench_graph(fn)
            QUANTIZE_LAUNCH.update(saved)
        rows.append(row)
        log(f"quant {kind}, {n} tokens x 8 heads: {us:.1f} us ({moved / (us * 1e-6) / 1e9:.0f} GB/s)"
            + "".join(f"; {k[3:]} {v:.1f} us" for k, v in row.items() if k.startswith("us_")))
    return rows


# ------------------------------------------------------------------------------------------------ model level
def build_model(arch, device):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import oscar_hf  # noqa: F401

    if arch in _MODELS:
        return _MODELS[arch]
    cfg = Qwen3Config(**QWEN3[arch], max_position_embeddings=262144, rope_theta=1e6)
    cfg._attn_implementation = "oscar"
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    model.set_attn_implementation("oscar")
    _MODELS.clear()  # keep one model resident at a time
    free()
    _MODELS[arch] = model
    return model


_MODELS: dict = {}


def kv_bytes_bf16(cfg, batch, length):
    return cfg.num_hidden_layers * 2 * batch * cfg.num_key_value_heads * length * cfg.head_dim * 2


def chunks(length, chunk):
    """Sizes of the chunks that store `length` tokens, at most `chunk` each and none of one token (an `OscarCache`
    stores chunks of several tokens: `OscarCache.store`)."""
    sizes, done = [], 0
    while done < length:
        n = min(chunk, length - done)
        if length - done - n == 1 and n > 2:
            n -= 1
        sizes.append(n)
        done += n
    return sizes


def fill_cache(model, cache, batch, length, device, chunk=16384):
    """Writes `length` random tokens into every layer of `cache` chunk by chunk, each chunk through all layers (what
    a prefill does: the OSCAR layers share one position plan, advanced at the first layer of each pass). One random
    chunk is reused: speed does not depend on the values."""
    from oscar_hf import OscarCache

    cfg = model.config
    k = torch.randn(batch, cfg.num_key_value_heads, min(chunk, length), cfg.head_dim, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    for n in chunks(length, chunk):
        for layer in range(cfg.num_hidden_layers):
            if isinstance(cache, OscarCache):  # store without preparing an attention view
                cache.store(k[:, :, :n], v[:, :, :n], layer)
            else:
                cache.update(k[:, :, :n], v[:, :, :n], layer)
    sync()


def make_cache(kind, model, batch, length, device, max_cache_len=None):
    from transformers import DynamicCache, QuantizedCache

    from oscar_hf import OscarCache, OscarConfig, OscarRotations

    if kind == "bf16":
        cache = DynamicCache(config=model.config)
        cfg = model.config
        for layer in range(cfg.num_hidden_layers):  # one allocation per layer, like a prefill leaves it
            k = torch.randn(batch, cfg.num_key_value_heads, length, cfg.head_dim, device=device, dtype=torch.bfloat16)
            cache.update(k, torch.randn_like(k), layer)
        return cache
    if kind == "oscar":
        rot = OscarRotations.data_free(model, "hadamard")
        cache = OscarCache(model, rot, OscarConfig(value_clip=0.92), max_cache_len=max_cache_len)
    elif kind == "hf_quantized":
        cache = QuantizedCache(backend="hqq", config=model.config, nbits=2, axis_key=1, axis_value=1,
                               q_group_size=64, residual_length=128)
    else:
        raise ValueError(kind)
    # transformers' QuantizedCache re-quantizes its whole history whenever its residual fills: fill it in one chunk
    fill_cache(model, cache, batch, length, device, chunk=length if kind == "hf_quantized" else 16384)
    return cache


def decode_step(model, cache, batch, device):
    from oscar_hf.metrics import cache_kwarg

    ids = torch.randint(0, 1000, (batch, 1), device=device)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})


def gpu_time_per_step(model, cache, batch, device, steps=3) -> float:
    """Sum of CUDA kernel times per decode step (profiler), in microseconds: the step without Python/launch gaps."""
    if device.type != "cuda":
        return float("nan")
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            decode_step(model, cache, batch, device)
        sync()
    # GPU-side events only (kernels, memcpy, memset): their summed durations, without launch gaps
    total = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    return total / steps


def time_methods(model, caches: dict, batch, device, steps):
    """Interleaves decode steps of the given caches; returns per-method median wall time (ms) and GPU time (us)."""
    walls = {k: [] for k in caches}
    for k in caches:  # warm-up (compilation, allocator)
        decode_step(model, caches[k], batch, device)
    sync()
    for _ in range(steps):
        for k, cache in caches.items():
            sync()
            t = time.perf_counter()
            decode_step(model, cache, batch, device)
            sync()
            walls[k].append(1000 * (time.perf_counter() - t))
    out = {}
    for k, cache in caches.items():
        w = sorted(walls[k])
        out[k] = dict(wall_ms=w[len(w) // 2], gpu_us=gpu_time_per_step(model, cache, batch, device))
    return out


def _default_launch() -> dict:
    from oscar_hf.kernels.attention import DEFAULT_LAUNCH

    return dict(DEFAULT_LAUNCH)


def section_e2e(device, quick, archs=("qwen3-8b", "qwen3-4b"), methods=("bf16", "oscar", "hf_quantized")):
    archs = list(archs) if not quick else ["tiny"]
    points = [(4096, 1), (4096, 8), (4096, 32), (32768, 1), (32768, 8), (32768, 32), (100_000, 1), (100_000, 8), (100_000, 32)]
    if quick:
        points = [(600, 1), (600, 2)]
    rows = []
    for arch in archs:
        model = build_model(arch, device) if arch != "tiny" else tiny_qwen3(device)
        cfg = model.config
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        for length, batch in points:
            if time.time() > DEADLINE - 40:
                rows.append(dict(arch=arch, length=length, batch=batch, skipped={"all": "not run: the device-time budget of this call ran out"}))
                continue
            budget = (torch.cuda.get_device_properties(device).total_memory - weights - 12 * GIB) if device.type == "cuda" else 8 * GIB
            need = {"bf16": kv_bytes_bf16(cfg, batch, length), "oscar": kv_bytes_bf16(cfg, batch, length) * 2.6 / 16,
                    "hf_quantized": kv_bytes_bf16(cfg, batch, length) * 5 / 16}
            runnable = [m for m in methods if need[m] < budget]
            skipped = {m: f"needs {need[m] / GIB:.0f} GiB of KV, more than the {budget / GIB:.0f} GiB free" for m in methods
                       if m not in runnable}
            together = sum(need[m] for m in runnable) < budget
            steps = 8 if length < 50_000 else 5
            result = {}
            try:
                if together:
                    caches = {m: make_cache(m, model, batch, length, device) for m in runnable}
                    result = time_methods(model, caches, batch, device, steps)
                    del caches
                else:
                    for m in runnable:
                        caches = {m: make_cache(m, model, batch, length, device)}
                        result.update(time_methods(model, caches, batch, device, steps))
                        del caches
                        free()
            except torch.OutOfMemoryError as e:
                skipped["error"] = f"OOM: {str(e)[:200]}"
            except Exception as e:  # e.g. a baseline backend missing on this machine
                skipped["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                log(traceback.format_exc()[-1500:])
            free()
            row = dict(arch=arch, length=length, batch=batch, interleaved=together, skipped=skipped, launch=_default_launch(), **{
                f"{m}_{k}": v for m, r in result.items() for k, v in r.items()})
            for m in result:
                row[f"{m}_tokens_per_s"] = batch / (result[m]["wall_ms"] / 1000)
            if "oscar" in result:
                for m in ("bf16", "hf_quantized"):
                    if m in result:
                        row[f"oscar_speedup_vs_{m}_wall"] = result[m]["wall_ms"] / result["oscar"]["wall_ms"]
                        row[f"oscar_speedup_vs_{m}_gpu"] = result[m]["gpu_us"] / result["oscar"]["gpu_us"]
            log(f"e2e {arch} L={length} B={batch}: " + ", ".join(
                f"{m} {r['wall_ms']:.1f} ms wall / {r['gpu_us'] / 1000:.1f} ms GPU" for m, r in result.items())
                + (f"  skipped {skipped}" if skipped else ""))
            rows.append(row)
    return rows


def tiny_qwen3(device):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=128, vocab_size=1000)
    cfg._attn_implementation = "oscar"
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    model.set_attn_implementation("oscar")
    return model


def section_memory(device, quick):
    model = build_model("qwen3-8b", device) if not quick else tiny_qwen3(device)
    cfg = model.config
    rows = []
    for length in ([32768, 131072] if not quick else [1000]):
        for kind in ("bf16", "oscar"):
            free()
            before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            cache = make_cache(kind, model, 1, length, device, max_cache_len=length)
            free()
            after = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            elements = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * length
            row = dict(kind=kind, length=length, allocated_bytes=after - before, bits_per_element=8 * (after - before) / elements)
            if kind == "oscar":
                row["memory_report"] = cache.memory_report()
            rows.append(row)
            log(f"memory L={length} {kind}: {(after - before) / GIB:.3f} GiB allocated, "
                f"{row['bits_per_element']:.3f} bits/element")
            del cache
    return rows


def section_budget(device, quick, memory_rows, budget_gib=40):
    """Max batch within `budget_gib` of KV at 32K and 100K, from the measured bytes per token, and its tokens/s."""
    per_token = {}
    for r in memory_rows:
        per_token.setdefault(r["kind"], []).append(r["allocated_bytes"] / r["length"])
    per_token = {k: max(v) for k, v in per_token.items()}  # the longer context has the lower window overhead; be safe
    model = build_model("qwen3-8b", device) if not quick else tiny_qwen3(device)
    rows = []
    for length in ([32768, 100_000] if not quick else [800]):
        row = dict(length=length, budget_gib=budget_gib)
        for kind in ("bf16", "oscar"):
            batch = int(budget_gib * GIB // (per_token[kind] * length)) if not quick else 2
            row[f"{kind}_batch"] = batch
            if batch == 0:
                continue
            try:
                cache = make_cache(kind, model, batch, length, device)
                res = time_methods(model, {kind: cache}, batch, device, steps=5)[kind]
                row[f"{kind}_wall_ms"] = res["wall_ms"]
                row[f"{kind}_gpu_us"] = res["gpu_us"]
                row[f"{kind}_tokens_per_s"] = batch / (res["wall_ms"] / 1000)
                row[f"{kind}_tokens_per_s_gpu"] = batch / (res["gpu_us"] / 1e6) if res["gpu_us"] == res["gpu_us"] else None
                del cache
            except torch.OutOfMemoryError as e:
                row[f"{kind}_error"] = f"OOM: {str(e)[:200]}"
            free()
        if row.get("bf16_tokens_per_s") and row.get("oscar_tokens_per_s"):
            row["batch_ratio"] = row["oscar_batch"] / row["bf16_batch"]
            row["tokens_per_s_ratio"] = row["oscar_tokens_per_s"] / row["bf16_tokens_per_s"]
            if row.get("bf16_tokens_per_s_gpu") and row.get("oscar_tokens_per_s_gpu"):
                row["tokens_per_s_ratio_gpu"] = row["oscar_tokens_per_s_gpu"] / row["bf16_tokens_per_s_gpu"]
        log(f"budget {budget_gib} GiB L={length}: " + json.dumps({k: v for k, v in row.items() if "ratio" in k or "batch" in k}))
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------ main
def environment(device):
    import transformers
    import triton

    info = dict(python=platform.python_version(), torch=torch.__version__, triton=triton.__version__,
                transformers=transformers.__version__, command=" ".join(sys.argv))
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(gpu=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / GIB, 1),
                    cuda=torch.version.cuda)
    return info


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--sections", default="check,tune,micro,quant,memory,e2e,budget")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run, also on the CPU)")
    parser.add_argument("--tuned", default=None, help="JSON of kernel launch parameters to use instead of tuning")
    parser.add_argument("--archs", default="qwen3-8b,qwen3-4b", help="model architectures of the e2e section")
    parser.add_argument("--deadline", type=float, default=None, help="seconds after which no new measurement starts")
    parser.add_argument("--micro-points", default=None,
                        help="the micro section's points, LENGTHxBATCH:layout,... (default: every length and batch)")
    args = parser.parse_args(argv)
    global DEADLINE
    if args.deadline:
        DEADLINE = time.time() + args.deadline
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "bench_gpu.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results["environment"] = environment(device)
    # a results file can be continued by later calls (a device call has a time limit): record each call
    results.setdefault("runs", []).append(dict(call=len(results.get("runs", [])) + 1, command=results["environment"]["command"]))
    import oscar_hf.kernels  # noqa: F401

    if "copy_bandwidth" not in results:
        results["copy_bandwidth"] = copy_bandwidth(device)
        log(f"copy bandwidth {results['copy_bandwidth'] / 1e9:.0f} GB/s (read + write)")
    # launch parameters: --tuned, or this call's tune section; otherwise the kernel's DEFAULT_LAUNCH (an earlier
    # call's tune in the results file may be of another kernel version)
    tuned = json.loads(args.tuned) if args.tuned else None
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        try:
            if name == "check":
                results["check"] = section_check(device, args.quick)
                results["check"].extend(section_model_check(device, args.quick))
                if device.type == "cuda":  # its model and text in a temporary folder, not in --out: a device call
                    # brings back at most 8 files from there, for the logs, the JSON and gpu_check.sh's test log
                    results["check"].append(section_devmap(device, args.quick, Path(tempfile.mkdtemp())))
            elif name == "model-check":  # only the model-level check (kernels vs twins through OscarCache)
                results["model_check"] = section_model_check(device, args.quick)
            elif name == "tune":
                results["tune"] = section_tune(device, args.quick)
                tuned = results["tune"]["best"]
                (out_dir / "tuned.json").write_text(json.dumps(tuned))
            elif name == "micro":  # at the kernel's DEFAULT_LAUNCH, or at launch parameters tuned here or given
                results["micro_tuned" if tuned else "micro"] = section_micro(device, args.quick, tuned,
                                                                             results["copy_bandwidth"],
                                                                             args.micro_points)
            elif name in ("history", "history-speed"):  # history-speed: the timings without the check
                results[name] = section_history(device, args.quick, results["copy_bandwidth"], args.micro_points,
                                                check=name == "history")
            elif name == "quant":
                results["quant"] = section_quant(device, args.quick)
            elif name == "memory":
                results["memory"] = section_memory(device, args.quick)
            elif name == "e2e":
                archs = args.archs.split(",")
                # rows of other architectures (an earlier call's, this file given back) are kept
                kept = [r for r in results.get("e2e", []) if r["arch"] not in archs]
                results["e2e"] = kept + section_e2e(device, args.quick, archs)
            elif name == "budget":
                results["budget"] = section_budget(device, args.quick, results["memory"])
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
