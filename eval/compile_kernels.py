"""Compiles every variant of the Triton kernels for an sm_90 target without a GPU, and reports registers, spills and
shared memory from ptxas: catches compile errors and spills before spending device time.

    python eval/compile_kernels.py
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import oscar_hf.kernels.attention as attention
import oscar_hf.kernels.quantize as quantize

TARGET = GPUTarget("cuda", 90, 32)
POINTERS = {"q_ptr": "*{q}", "o_ptr": "*fp32", "lse_ptr": "*fp32", "sink_k": "*{q}", "sink_v": "*{q}", "codes_k": "*u8",
            "codes_v": "*u8", "meta_k": "*fp16", "meta_v": "*fp16", "rec_k": "*{q}", "rec_v": "*{q}", "ext_k": "*{q}",
            "ext_v": "*{q}", "mask_ptr": "*u8", "x_ptr": "*{q}", "rot_ptr": "*{q}", "codes_ptr": "*u8", "meta_ptr": "*fp16"}


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


def ptxas_report(kernel) -> str:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull], capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", out.stderr)
    spill = re.search(r"(\d+) bytes spill stores", out.stderr)
    return f"regs={regs.group(1) if regs else '?'} spill_stores={spill.group(1) if spill else '?'} smem={kernel.metadata.shared}"


def main():
    failures = 0
    variants = [(d, g, 16, 64, "bf16", False) for d in (64, 128, 256) for g in (1, 2, 4)]
    variants += [(128, 1, 16, bn, "bf16", False) for bn in (32, 128)] + [(256, 1, 16, 64, "bf16", False)]
    variants += [(128, 1, 64, 64, "bf16", True), (128, 1, 16, 64, "fp16", True), (64, 2, 64, 32, "fp16", False)]
    for d, groups, block_m, block_n, qtype, mask in variants:
        const = dict(D=d, GROUPS=groups, BLOCK_M=block_m, BLOCK_N=block_n, HAS_MASK=mask, UPCAST=False)
        try:
            k = triton.compile(ASTSource(attention._segment_attention_kernel, signature(attention._segment_attention_kernel, const, qtype),
                                         constexprs=const), target=TARGET)
            if True:
                print(f"attention d={d} G={groups} BM={block_m} BN={block_n} {qtype} mask={mask}: {ptxas_report(k)}", flush=True)
        except Exception as e:
            failures += 1
            print(f"attention d={d} G={groups} BM={block_m} BN={block_n} {qtype} mask={mask}: FAILED {str(e)[-400:]}")
    qvariants = [(d, 1, r, True, True, False) for d in (64, 128, 256) for r in (False, True)]
    qvariants += [(128, 2, True, False, False, True), (64, 4, False, True, False, False)]
    for d, groups, rotate, clip, bf16, meta_bf16 in qvariants:
        const = dict(D=d, GROUPS=groups, BLOCK_T=16 if d >= 256 else 32, ROTATE=rotate, CLIP=clip, STORE_BF16=bf16,
                     META_BF16=meta_bf16, UPCAST=False)
        qtype = "bf16" if bf16 else "fp16"
        try:
            k = triton.compile(ASTSource(quantize._quantize_pack_kernel, signature(quantize._quantize_pack_kernel, const, qtype),
                                         constexprs=const), target=TARGET)
            if True:
                print(f"quantize d={d} rotate={rotate}: {ptxas_report(k)}")
        except Exception as e:
            failures += 1
            print(f"quantize d={d} G={groups} rotate={rotate} clip={clip} bf16={bf16}: FAILED {str(e)[-400:]}")
    print("failures:", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
