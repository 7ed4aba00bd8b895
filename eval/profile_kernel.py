"""Launches the INT2 decode kernel a few times at one shape, for a profiler to read (GPU only):

    ncu --clock-control none --kernel-name regex:_segment_attention --launch-skip 2 --launch-count 1 \
        --section WarpStateStats --section SchedulerStats --section Occupancy --section MemoryWorkloadAnalysis \
        python3 eval/profile_kernel.py --batch 1 --length 100000 --launch '{"num_warps": 4, "prefetch": true}'

The shape and the random segments are those of `bench_gpu.py`'s micro section (Qwen3-8B geometry).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_gpu import decode_args  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--length", type=int, default=100_000)
    parser.add_argument("--launch", default="{}", help="segment_attention_triton keyword arguments (JSON); "
                        "programs_per_sm becomes target_programs")
    parser.add_argument("--launches", type=int, default=4)
    args = parser.parse_args()
    from oscar_hf.kernels.attention import segment_attention_triton

    kw = json.loads(args.launch)
    if "programs_per_sm" in kw:
        kw["target_programs"] = kw.pop("programs_per_sm") * torch.cuda.get_device_properties(0).multi_processor_count
    seg = decode_args(args.batch, args.length, torch.device("cuda"))
    for _ in range(args.launches):
        segment_attention_triton(*seg, **kw)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
