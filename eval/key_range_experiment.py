"""Experiment (not a library option): channel-wise keys with the (minimum, maximum) of each channel and block
chosen to minimise the squared error (a grid of shrinks from each end) instead of the block's own min and max.

Same bits (the pair is still stored in 16 bits each). The library's quantizer is replaced for this process only, then
`oscar-hf` runs with the remaining arguments, e.g.

    python eval/key_range_experiment.py eval niah --model smollm2-135m --output /tmp/key-range --threads 1 \
        --methods oscar --lengths 4096 --depths 0.1,0.3,0.5,0.7,0.9 --seeds 0,1 --quiet

(CPU: the torch twin of the quantizer is what runs; the Triton kernels are not patched.) Result in eval/NOTES.md.
"""
import os, sys, torch
import oscar_hf.quant as Q, oscar_hf.ops as O, oscar_hf.storage as S

SHRINK = [float(s) for s in os.environ.get("SHRINK", "0,0.05,0.1,0.15,0.2,0.25,0.3").split(",")]
_orig = Q.quantize_channels

def quantize_channels(x, bits, block, meta_dtype="float16"):
    if isinstance(meta_dtype, str):
        meta_dtype = Q.DTYPES[meta_dtype]
    length, d = x.shape[-2], x.shape[-1]
    cols = x.float().reshape(*x.shape[:-2], length // block, block, d).transpose(-1, -2)  # [..., nb, d, block]
    lo, hi = cols.amin(-1, keepdim=True), cols.amax(-1, keepdim=True)
    rng = hi - lo
    levels = (1 << bits) - 1
    best_err = None
    for a in SHRINK:
        for b in SHRINK:
            l2, h2 = lo + a * rng, hi - b * rng
            s = ((h2 - l2) / levels).clamp(min=1e-8).to(meta_dtype).float()
            m = l2.to(meta_dtype).float()
            c = torch.round((cols - m) / s).clamp(0, levels)
            err = ((c * s + m - cols) ** 2).sum(-1, keepdim=True)
            if best_err is None:
                best_err, bs, bm = err, s, m
            else:
                take = err < best_err
                best_err = torch.where(take, err, best_err); bs = torch.where(take, s, bs); bm = torch.where(take, m, bm)
    codes = torch.round((cols - bm) / bs).clamp(0, levels).to(torch.uint8)
    codes = codes.transpose(-1, -2).reshape(x.shape)
    meta = torch.stack([bs.squeeze(-1).to(meta_dtype), bm.squeeze(-1).to(meta_dtype)], -1)
    return Q.QuantizedBlocks(Q.pack_codes(codes, bits), meta, bits, block)

Q.quantize_channels = O.quantize_channels = S.quantize_channels = quantize_channels

if __name__ == "__main__":
    x = torch.randn(2, 3, 128, 64)
    a = Q.dequantize_channels(_orig(x, 2, 64))
    b = Q.dequantize_channels(quantize_channels(x, 2, 64))
    print("Gaussian keys, squared error: min/max", ((a - x) ** 2).mean().item(), "searched", ((b - x) ** 2).mean().item())
    from oscar_hf.cli import main
    sys.exit(main(sys.argv[1:]))
