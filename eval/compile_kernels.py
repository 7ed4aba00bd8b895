"""Compiles every variant of the Triton kernels for an sm_90 target without a GPU, and reports registers, spills and
shared memory from ptxas: catches compile errors and spills before spending device time.

    python eval/compile_kernels.py          # every variant (generic integer arguments)
    python eval/compile_kernels.py --sass   # the decode kernel as a real launch specializes it: registers and
                                            # the SASS instruction mix of each loop (the no-GPU profile)
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

TARGET = GPUTarget("cuda", 90, 32)
POINTERS = {"q_ptr": "*{q}", "o_ptr": "*fp32", "lse_ptr": "*fp32", "sink_k": "*{q}", "sink_v": "*{q}", "codes_k": "*u8",
            "codes_v": "*u8", "meta_k": "*fp16", "meta_v": "*fp16", "rec_k": "*{q}", "rec_v": "*{q}", "ext_k": "*{q}",
            "ext_v": "*{q}", "mask_ptr": "*u8", "x_ptr": "*{q}", "rot_ptr": "*{q}", "codes_ptr": "*u8", "meta_ptr": "*fp16",
            "len_ptr": "*i32"}


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


def sass_profile(batch=1, kv_heads=8, gqa=4, length=100_000, head_dim=128, dtype=torch.bfloat16) -> None:
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
        codes = torch.zeros(batch, kv_heads, length, head_dim // 4, dtype=torch.uint8)
        meta = torch.zeros(batch, kv_heads, length, 1, 2, dtype=torch.float16)
        meta_k = torch.zeros(batch, kv_heads, length // 64, head_dim, 2, dtype=torch.float16)  # the default layout
        extra = bf[:, :, :0]
        attention.segment_attention_triton(q, bf, bf, codes, meta_k, codes, meta, bf, bf, extra, extra, None,
                                           64, length // 64 * 64, 256, 0, 1, length + 320, head_dim ** -0.5, 64)
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
    options = {k: kw[k] for k in ("num_warps", "num_stages")}
    k = triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs), target=TARGET, options=options)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        print(f"decode kernel B={batch} H_kv={kv_heads} GQA={gqa} L={length:,} d={head_dim} grid={grid} {options}: "
              f"{ptxas_report(k, cubin)}")
        cuobjdump = shutil.which("cuobjdump") or os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True).stdout
    lines = [(int(a, 16), ins) for a, ins in re.findall(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", sass, re.M)]
    for address, ins in lines:
        target = re.search(r"BRA .*?0x([0-9a-f]+)", ins)
        if target and int(target.group(1), 16) < address:  # a backward branch closes a loop
            body = [i for a, i in lines if int(target.group(1), 16) <= a <= address]
            mix = collections.Counter(re.match(r"(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", i).group(1) for i in body)
            kind = "INT2 history" if mix.get("HADD2") else "BF16 segment"
            print(f"  loop ({kind}): {len(body)} instructions per tile per thread: "
                  + ", ".join(f"{op} {n}" for op, n in mix.most_common(14)))


def main():
    if "--sass" in sys.argv:
        sass_profile()
        return 0
    failures = 0
    variants = [(d, g, 16, 64, "bf16", False, kb) for d in (64, 128, 256) for g in (1, 2, 4) for kb in (0, 64)]
    variants += [(128, 1, 16, bn, "bf16", False, kb) for bn in (32, 128) for kb in (0, 64)]
    variants += [(128, 1, 64, 64, "bf16", True, 64), (128, 1, 16, 64, "fp16", True, 0), (64, 2, 64, 32, "fp16", False, 64)]
    for d, groups, block_m, block_n, qtype, mask, key_block in variants:
        prefetch = key_block > 0 and groups == 1 and block_m == 16 and d <= 128  # the launcher's choice
        const = dict(D=d, GROUPS=groups, KEY_BLOCK=key_block, BLOCK_M=block_m, BLOCK_N=block_n, HAS_MASK=mask, UPCAST=False,
                     DEVICE_LENGTHS=key_block > 0, PTX_UNPACK=True, META_WORDS=prefetch, PREFETCH=prefetch, L2_AHEAD=0)
        sig = signature(attention._segment_attention_kernel, const, qtype)
        if prefetch:
            sig.update(meta_k="*i32", meta_v="*i32")
        try:
            k = triton.compile(ASTSource(attention._segment_attention_kernel, sig, constexprs=const), target=TARGET)
            if True:
                print(f"attention d={d} G={groups} KB={key_block} BM={block_m} BN={block_n} {qtype} mask={mask} "
                      f"prefetch={prefetch}: "
                      f"{ptxas_report(k)}", flush=True)
        except Exception as e:
            failures += 1
            print(f"attention d={d} G={groups} KB={key_block} BM={block_m} BN={block_n} {qtype} mask={mask}: FAILED "
                  f"{str(e)[-400:]}")
    qvariants = [(d, 1, r, True, True, False) for d in (64, 128, 256) for r in (False, True)]
    qvariants += [(128, 2, True, False, False, True), (64, 4, False, True, False, False)]
    for d, groups, rotate, clip, bf16, meta_bf16 in qvariants:
        const = dict(D=d, GROUPS=groups, BLOCK_T=16 if d >= 256 else 32, ROTATE=rotate, CLIP=clip, STORE_BF16=bf16,
                     META=int(meta_bf16), UPCAST=False, SORT_BITS=16, TILES=8)
        qtype = "bf16" if bf16 else "fp16"
        try:
            k = triton.compile(ASTSource(quantize._quantize_pack_kernel, signature(quantize._quantize_pack_kernel, const, qtype),
                                         constexprs=const), target=TARGET)
            if True:
                print(f"quantize d={d} rotate={rotate} clip={clip}: {ptxas_report(k)}")
        except Exception as e:
            failures += 1
            print(f"quantize d={d} G={groups} rotate={rotate} clip={clip} bf16={bf16}: FAILED {str(e)[-400:]}")
    for d in (64, 128, 256):
        for rotate in (False, True):
            const = dict(D=d, BLOCK=64, SUB=16 if d >= 256 else 32, ROTATE=rotate, STORE_BF16=True, META=0, UPCAST=False)
            try:
                k = triton.compile(ASTSource(quantize._quantize_pack_channels_kernel,
                                             signature(quantize._quantize_pack_channels_kernel, const, "bf16"),
                                             constexprs=const), target=TARGET, options={"num_stages": 1})
                print(f"quantize channel-wise d={d} rotate={rotate}: {ptxas_report(k)}")
            except Exception as e:
                failures += 1
                print(f"quantize channel-wise d={d} rotate={rotate}: FAILED {str(e)[-400:]}")
    print("failures:", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
