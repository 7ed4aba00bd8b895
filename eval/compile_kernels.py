"""Compiles every variant of the Triton kernels for an sm_90 target without a GPU, and reports registers, spills and
shared memory from ptxas: catches compile errors and spills before spending device time.

    python eval/compile_kernels.py          # every variant (generic integer arguments)
    python eval/compile_kernels.py --sass   # the decode kernel as a real launch specializes it: registers and
                                            # the SASS instruction mix of each loop (the no-GPU profile)
    python eval/compile_kernels.py --sass --blocks 32,64,128,64,64,64,128,64   # per-head key blocks (calibrated)
    python eval/compile_kernels.py --sass --wide 1,6     # KV heads 1 and 6 wide (4-bit histories, `format.wide_rows`)
    python eval/compile_kernels.py --sass --wide 1,6 --channels 16,0,26,31,36,41,0,24   # wide key channels per head
"""

from __future__ import annotations

import inspect
import os
import re
import shutil
import subprocess
import sys
import tempfile

import collections

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import oscar_hf.kernels.attention as attention
import oscar_hf.kernels.quantize as quantize
import oscar_hf.kernels.store as store

TARGET = GPUTarget("cuda", 90, 32)
POINTERS = {"q_ptr": "*{q}", "o_ptr": "*fp32", "lse_ptr": "*fp32", "sink_k": "*{q}", "sink_v": "*{q}", "codes_k": "*u8",
            "codes_v": "*u8", "meta_k": "*fp16", "meta_v": "*fp16", "rec_k": "*{q}", "rec_v": "*{q}", "ext_k": "*{q}",
            "ext_v": "*{q}", "mask_ptr": "*u8", "x_ptr": "*{q}", "rot_ptr": "*{q}", "codes_ptr": "*u8", "meta_ptr": "*fp16",
            "len_ptr": "*i32", "key_table": "*i32", "table_ptr": "*i32", "wide_ptr": "*i32", "wide_table": "*i32",
            "start_ptr": "*i64", "channels_ptr": "*i32", "channel_table": "*i32", "out_ptr": "*{q}",
            "lse_out_ptr": "*fp32", "k_ptr": "*{q}", "v_ptr": "*{q}", "rk_ptr": "*{q}", "rv_ptr": "*{q}", "ring_k": "*{q}",
            "ring_v": "*{q}", "pos_ptr": "*i64"}


def signature(fn, constexprs, qtype):
    sig = {}
    for p in inspect.signature(fn.fn).parameters:
        if p in constexprs:
            sig[p] = "constexpr"
        elif p in POINTERS:
            sig[p] = POINTERS[p].format(q=qtype)
        elif p == "scale":
            sig[p] = "fp32"
        else:
            sig[p] = "i32"
    return sig


def _ptxas() -> str:
    return shutil.which("ptxas") or os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def _ptx_for_local_ptxas(ptx: str) -> str:
    # Triton's LLVM may emit a newer PTX ISA version than the local ptxas knows; the kernels use nothing newer than 8.7
    return re.sub(r"^\.version \d+\.\d+", ".version 8.7", ptx, flags=re.M)


def ptxas_report(kernel, cubin: str = os.devnull) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(_ptx_for_local_ptxas(kernel.asm["ptx"]))
    out = subprocess.run([_ptxas(), "-v", "--gpu-name", "sm_90a", f.name, "-o", cubin], capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", out.stderr)
    spill = re.search(r"(\d+) bytes spill stores", out.stderr)
    return f"regs={regs.group(1) if regs else '?'} spill_stores={spill.group(1) if spill else '?'} smem={kernel.metadata.shared}"


def sass_profile(batch=1, kv_heads=8, gqa=4, length=100_000, head_dim=128, dtype=torch.bfloat16, blocks=None,
                 wide_heads=(), wide_channels=()) -> None:
    """Compiles the decode kernel exactly as `segment_attention_triton` would launch it for this shape (Triton's own
    specialization of each argument: integers equal to 1 become constants, multiples of 16 are marked divisible) and
    prints registers, spills and the SASS instruction mix of each loop."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    launches = []

    class Capture:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((self.fn, grid, args, kw))

    kernel, merge = attention._segment_attention_kernel, attention._merge_kernel
    attention._segment_attention_kernel, attention._merge_kernel = Capture(kernel), Capture(merge)
    try:
        q = torch.zeros(batch, kv_heads, gqa, head_dim, dtype=dtype)
        bf = torch.zeros(batch, kv_heads, 256, head_dim, dtype=dtype)
        from oscar_hf.format import wide_rows

        wide = wide_rows([4 if h in wide_heads else 2 for h in range(kv_heads)])
        codes = torch.zeros(batch, kv_heads + len(wide_heads), length, head_dim // 4, dtype=torch.uint8)
        meta = torch.zeros(batch, kv_heads, length, 1, 2, dtype=torch.float16)
        # the default layout: channel-wise keys, blocks of 64 tokens for every head in chunks of 128 (R = 2 per head)
        blocks, chunk = list(blocks or [64] * kv_heads), 128
        rows = sum(chunk // bk for bk in blocks)
        meta_k = torch.zeros(batch, length // chunk, rows, head_dim, 2, dtype=torch.float16)
        extra = bf[:, :, :0]
        attention.segment_attention_triton(q, bf, bf, codes, meta_k, codes, meta, bf, bf, extra, extra, None,
                                           64, length // chunk * chunk, 256, 0, 1, length + 320, head_dim ** -0.5,
                                           blocks, chunk, wide, wide_channels)
    finally:
        attention._segment_attention_kernel, attention._merge_kernel = kernel, merge
    fn, grid, args, kw = launches[0]
    params = list(inspect.signature(fn.fn).parameters)
    sig, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(params):
        if i >= len(args):
            sig[name], constexprs[name] = "constexpr", kw[name]
            continue
        kind, spec = native_specialize_impl(BaseBackend, args[i], False, True, True)
        if kind == "constexpr":
            sig[name], constexprs[name] = "constexpr", spec
        else:
            sig[name] = kind
            if spec == "D":
                attrs[(i,)] = [["tt.divisibility", 16]]
    options = {k: kw[k] for k in ("num_warps", "num_stages", "maxnreg") if k in kw}
    k = triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs), target=TARGET, options=options)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        print(f"decode kernel B={batch} H_kv={kv_heads} GQA={gqa} L={length:,} d={head_dim} grid={grid} BLOCK_N={kw['BLOCK_N']} "
              f"KEY_SPLIT={kw.get('KEY_SPLIT')} WIDE={kw.get('WIDE')} {options}: "
              f"{ptxas_report(k, cubin)}")
        cuobjdump = shutil.which("cuobjdump") or os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True).stdout
    lines = [(int(a, 16), ins) for a, ins in re.findall(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", sass, re.M)]
    for address, ins in lines:
        target = re.search(r"BRA .*?0x([0-9a-f]+)", ins)
        if target and int(target.group(1), 16) < address:  # a backward branch closes a loop
            body = [(a, i) for a, i in lines if int(target.group(1), 16) <= a <= address]
            for paths, path in _loop_paths(body):
                mix = collections.Counter(re.match(r"(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", i).group(1) for i in path)
                kind = "INT2 history" if mix.get("HADD2") else "BF16 segment"
                print(f"  loop ({kind}{paths}): {len(path)} instructions per tile per thread: "
                      + ", ".join(f"{op} {n}" for op, n in mix.most_common(14)))


def _loop_paths(body):
    """The instructions one pass through a loop body executes, per path: a runtime branch inside the loop (`if split:`
    in the kernel) is a forward `@P BRA`; branches on the same predicate are taken together (one assignment of each
    predicate per path; the compiler may flip one: `@!P`). Yields (label, instructions); one path when no branch."""
    import itertools

    branches = {}
    for a, ins in body:
        m = re.match(r"@(!?)(U?P\d+)\s+BRA\s.*?0x([0-9a-f]+)", ins)
        if m and int(m.group(3), 16) > a:
            branches.setdefault(m.group(2), None)
    preds = list(branches)
    for values in itertools.product((False, True), repeat=len(preds)):
        assign = dict(zip(preds, values))
        path, k, addresses = [], 0, [a for a, _ in body]
        while k < len(body):
            a, ins = body[k]
            path.append(ins)
            m = re.match(r"(?:@(!?)(U?P\d+)\s+)?BRA\s.*?0x([0-9a-f]+)", ins)
            if m and int(m.group(3), 16) > a and (m.group(2) is None or assign.get(m.group(2)) != bool(m.group(1))):
                k = addresses.index(int(m.group(3), 16))
                continue
            k += 1
        label = "" if not preds else ", " + " ".join(f"{p}={int(v)}" for p, v in assign.items())
        yield label, path


def main():
    if "--sass" in sys.argv:
        blocks = None
        if "--blocks" in sys.argv:
            blocks = [int(bk) for bk in sys.argv[sys.argv.index("--blocks") + 1].split(",")]
        wide = ()
        if "--wide" in sys.argv:
            wide = tuple(int(h) for h in sys.argv[sys.argv.index("--wide") + 1].split(","))
        channels = ()
        if "--channels" in sys.argv:  # wide key channels per KV head (format 6), e.g. 16,0,26,31,36,41,0,24
            channels = tuple(int(n) for n in sys.argv[sys.argv.index("--channels") + 1].split(","))
        sass_profile(blocks=blocks, kv_heads=len(blocks) if blocks else 8, wide_heads=wide, wide_channels=channels)
        return 0
    failures = 0
    # key_chunk: 0 token-wise keys, else channel-wise keys in chunks of that many tokens (per-head blocks are runtime
    # values, read from the key table); l2: the decode loop's L2 look-ahead (the default launch: 2), else the
    # register prefetch
    variants = [(d, g, 16, 64, "bf16", False, kc, 0) for d in (64, 128, 256) for g in (1, 2, 4) for kc in (0, 128)]
    variants += [(128, 1, 16, bn, "bf16", False, kc, 0) for bn in (32, 128) for kc in (0, 128)]
    variants += [(128, 1, 16, bn, "bf16", False, 128, 2) for bn in (32, 64, 128)] + [(64, 1, 16, 128, "bf16", True, 64, 2)]
    variants += [(128, 1, 64, 64, "bf16", True, 128, 0), (128, 1, 16, 64, "fp16", True, 0, 0),
                 (64, 2, 64, 32, "fp16", False, 128, 0)]
    variants = [v + (False, False) for v in variants]
    # mixed per-head blocks (`attention.key_tile`): tiles of twice the smallest block, split per head at run time;
    # every channel-wise loop (L2 look-ahead, register prefetch, the plain loop at one or two groups and 64-row tiles)
    variants += [(128, 1, 16, bn, "bf16", False, 128, l2, True, False) for bn in (64, 128) for l2 in (0, 2)]
    variants += [(64, 1, 16, 32, "bf16", True, 128, 2, True, False), (256, 1, 16, 64, "bf16", False, 128, 0, True, False),
                 (128, 2, 16, 64, "bf16", False, 128, 0, True, False), (128, 1, 64, 64, "bf16", True, 128, 0, True, False)]
    # wide heads (4-bit histories as two 2-bit planes, a runtime branch per program): every loop they take
    variants += [(d, 1, 16, 64, "bf16", False, 128, l2, split, True) for d in (64, 128) for l2 in (0, 2)
                 for split in (False, True)]
    variants += [(256, 1, 16, 64, "bf16", False, 128, 0, True, True), (128, 1, 64, 64, "bf16", True, 128, 0, True, True)]
    variants = [v + (False,) for v in variants]
    # wide key channels (the gathered query planes) beside wide heads, as format-6 layers hold them
    variants += [(d, 1, 16, 64, "bf16", False, 128, 0, split, True, True) for d in (64, 128) for split in (False, True)]
    variants += [(256, 1, 16, 64, "bf16", False, 128, 0, True, True, True), (128, 1, 64, 64, "bf16", True, 128, 0, True, True, True)]
    for d, groups, block_m, block_n, qtype, mask, key_chunk, l2, split, wide, channels in variants:
        words = key_chunk > 0 and groups == 1 and block_m == 16 and d <= 128  # the launcher's choice
        prefetch = words and not l2
        const = dict(D=d, GROUPS=groups, KEY_CHUNK=key_chunk, BLOCK_M=block_m, BLOCK_N=block_n, HAS_MASK=mask,
                     UPCAST=False, DEVICE_LENGTHS=key_chunk > 0, PTX_UNPACK=True, META_WORDS=words, PREFETCH=prefetch,
                     L2_AHEAD=l2 if words else 0, KEY_SPLIT=split, WIDE=wide, WIDE_CHANNELS=channels)
        sig = signature(attention._segment_attention_kernel, const, qtype)
        if words:
            sig.update(meta_k="*i32", meta_v="*i32")
        name = (f"attention d={d} G={groups} KC={key_chunk} BM={block_m} BN={block_n} {qtype} mask={mask} "
                f"prefetch={prefetch} l2_ahead={const['L2_AHEAD']} key_split={split} wide={wide} wide_channels={channels}")
        try:
            k = triton.compile(ASTSource(attention._segment_attention_kernel, sig, constexprs=const), target=TARGET)
            print(f"{name}: {ptxas_report(k)}", flush=True)
        except Exception as e:
            failures += 1
            print(f"{name}: FAILED {str(e)[-400:]}")
    # the split-K merge (one program per query row over the splits' partial results), at the split counts of larger
    # batches (BLOCK_S 64), of batch 1 (about 200 at 32K with 8 KV heads: 256) and of one KV head (2048)
    for d, block_s, rotate in [(d, s, r) for d in (64, 128, 256) for s in (64, 256, 2048) for r in (False, True)]:
        const = dict(D=d, BLOCK_S=block_s, ROTATE=rotate, BLOCK_E=max(16, min(d, 4096 // d)), INTERPRET_ROUNDING=False,
                     CHUNK_S=attention.merge_chunk(block_s, d))
        sig = signature(attention._merge_kernel, const, "bf16")
        try:
            k = triton.compile(ASTSource(attention._merge_kernel, sig, constexprs=const), target=TARGET)
            print(f"merge d={d} BLOCK_S={block_s} CHUNK_S={const['CHUNK_S']} rotate={rotate}: {ptxas_report(k)}",
                  flush=True)
        except Exception as e:
            failures += 1
            print(f"merge d={d} BLOCK_S={block_s} rotate={rotate}: FAILED {str(e)[-400:]}")
    # a static cache's decode-step store (one token rotated into its sink or ring slot)
    for d in (64, 128, 256):
        const = dict(D=d, BLOCK_E=max(16, min(d, 4096 // d)), INTERPRET=False)
        try:
            k = triton.compile(ASTSource(store._rotate_store_kernel, signature(store._rotate_store_kernel, const, "bf16"),
                                         constexprs=const), target=TARGET)
            print(f"rotate_store d={d}: {ptxas_report(k)}", flush=True)
        except Exception as e:
            failures += 1
            print(f"rotate_store d={d}: FAILED {str(e)[-400:]}")
    qvariants = [(d, 1, r, True, True, False, False) for d in (64, 128, 256) for r in (False, True)]
    qvariants += [(128, 2, True, False, False, True, False), (64, 4, False, True, False, False, False)]
    qvariants += [(d, 1, r, True, True, False, True) for d in (64, 128) for r in (False, True)]  # wide heads
    for d, groups, rotate, clip, bf16, meta_bf16, wide in qvariants:
        const = dict(D=d, GROUPS=groups, BLOCK_T=64 if rotate and d <= 128 else 16 if d >= 256 else 32, ROTATE=rotate, CLIP=clip, STORE_BF16=bf16,
                     META=int(meta_bf16), UPCAST=False, SORT_BITS=16, TILES=8, DEVICE_START=False, WIDE=wide)
        qtype = "bf16" if bf16 else "fp16"
        try:
            k = triton.compile(ASTSource(quantize._quantize_pack_kernel, signature(quantize._quantize_pack_kernel, const, qtype),
                                         constexprs=const), target=TARGET)
            if True:
                print(f"quantize d={d} rotate={rotate} clip={clip} wide={wide}: {ptxas_report(k)}")
        except Exception as e:
            failures += 1
            print(f"quantize d={d} G={groups} rotate={rotate} clip={clip} bf16={bf16}: FAILED {str(e)[-400:]}")
    for d, rotate, wide, channels in [(d, r, w, c) for d in (64, 128, 256) for r in (False, True) for w in (False, True)
                                      for c in (False, True)]:
        if True:
            const = dict(D=d, KEY_CHUNK=128, SUB=16 if d >= 256 else 32, ROTATE=rotate, STORE_BF16=True, META=0,
                         UPCAST=False, DEVICE_START=False, X_RING=False, WIDE=wide, WIDE_CHANNELS=channels)
            try:
                k = triton.compile(ASTSource(quantize._quantize_pack_channels_kernel,
                                             signature(quantize._quantize_pack_channels_kernel, const, "bf16"),
                                             constexprs=const), target=TARGET, options={"num_stages": 1})
                print(f"quantize channel-wise d={d} rotate={rotate} wide={wide} wide_channels={channels}: "
                      f"{ptxas_report(k)}")
            except Exception as e:
                failures += 1
                print(f"quantize channel-wise d={d} rotate={rotate} wide={wide}: FAILED {str(e)[-400:]}")
    print("failures:", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
