"""Experiment (not a library option): a few key tokens per block kept exact, the rest quantized over a tighter range.

KVQuant's dense-and-sparse idea, per token instead of per element, after OSCAR's rotation: in every channel-wise key
block (each KV head's own block from the rotation file) the N_OUT tokens with the largest SCORE are stored in BF16 and
left out of the block's per-channel (minimum, maximum), so the other tokens' 2-bit codes span a narrower range. Cost at
head_dim d and block b: N_OUT·(16·d + 8) / (b·d) bits per key element (BF16 row + 8-bit position), e.g. +0.25 at
N_OUT=1, b=64: history 2.625 bits at head_dim 64, 2.75 at N_OUT=2 (the size target's limit there).

SCORE (env): `zmax` (default) the token's largest |k - channel mean| / channel std over the block, `zsum` the sum of
squared z-scores, `norm` the key's L2 norm in the stored basis.

    N_OUT=1 python eval/key_outlier_tokens_experiment.py eval niah --model smollm2-135m --output /tmp/key-outliers \
        --threads 1 --methods oscar --lengths 4096 --depths 0.1,0.3,0.5,0.7,0.9 --seeds 0,1 --quiet

Simulated in dense buffers (`key_bits_experiment.install`); the Triton kernels are not involved. Result in
eval/NOTES.md.
"""
import os, sys, torch
from key_bits_experiment import install
from oscar_hf.quant import DTYPES, fake_quantize_channels

N_OUT = int(os.environ.get("N_OUT", "1"))
SCORE = os.environ.get("SCORE", "zmax")
KEPT: list[int] = [0, 0]  # tokens kept exact, tokens seen


def token_scores(cols: torch.Tensor) -> torch.Tensor:
    """cols `[..., block, d]` -> one score per token `[..., block]` (larger: more of an outlier)."""
    if SCORE == "norm":
        return cols.norm(dim=-1)
    z = (cols - cols.mean(-2, keepdim=True)) / cols.std(-2, keepdim=True).clamp(min=1e-6)
    return z.abs().amax(-1) if SCORE == "zmax" else (z * z).sum(-1)


def outlier_channels(rows: torch.Tensor, block: int, meta_dtype) -> torch.Tensor:
    """Rows `[B, 1, n, d]` (n a multiple of `block`) -> their reconstruction: per block, the N_OUT top-scored tokens
    exact (BF16), the others 2-bit channel-wise over the range of the remaining tokens (16-bit scale and minimum)."""
    if N_OUT == 0:
        return fake_quantize_channels(rows, 2, block, meta_dtype)
    meta_dtype = DTYPES[meta_dtype] if isinstance(meta_dtype, str) else meta_dtype
    b, h, n, d = rows.shape
    cols = rows.float().reshape(b, h, n // block, block, d)
    top = token_scores(cols).topk(N_OUT, dim=-1).indices  # [B, 1, nb, N_OUT]
    kept = torch.zeros(cols.shape[:-1], dtype=torch.bool, device=rows.device).scatter_(-1, top, True)[..., None]
    lo = torch.where(kept, torch.inf, cols).amin(-2, keepdim=True)
    hi = torch.where(kept, -torch.inf, cols).amax(-2, keepdim=True)
    finfo = torch.finfo(meta_dtype)
    s = ((hi - lo) / 3).clamp(min=finfo.tiny, max=finfo.max).to(meta_dtype).float()
    m = lo.clamp(min=finfo.min, max=finfo.max).to(meta_dtype).float()
    recon = torch.round((cols - m) / s).clamp(0, 3) * s + m
    recon = torch.where(kept, cols.to(torch.bfloat16).float(), recon)
    KEPT[0] += int(kept.sum()); KEPT[1] += kept.numel()
    return recon.reshape(rows.shape).to(rows.dtype)


def outlier_keys(history, rows):
    out = torch.empty_like(rows)
    for h in range(rows.shape[1]):
        out[:, h : h + 1] = outlier_channels(rows[:, h : h + 1], history.layout.blocks[h], history.scale_dtype)
    return out


install(outlier_keys)

if __name__ == "__main__":
    x = torch.randn(1, 1, 128, 64)
    x[0, 0, 5] *= 8  # one outlier token
    n_out, N_OUT = N_OUT, 0
    base = outlier_channels(x, 64, "float16")
    assert torch.equal(base, fake_quantize_channels(x, 2, 64)), "N_OUT=0 must be the default quantizer"
    N_OUT = max(n_out, 1)
    mask = torch.ones(128, dtype=torch.bool); mask[5] = False
    print(f"one outlier token in 128 Gaussian keys, squared error of the others: default "
          f"{((base - x)[0, 0, mask] ** 2).mean():.4f}, outlier kept {((outlier_channels(x, 64, 'float16') - x)[0, 0, mask] ** 2).mean():.4f}")
    N_OUT = n_out
    KEPT[:] = [0, 0]
    from oscar_hf.cli import main
    code = main(sys.argv[1:])
    print(f"key tokens kept exact: {KEPT[0]} of {KEPT[1]} ({KEPT[0] / max(KEPT[1], 1):.2%})", file=sys.stderr)
    sys.exit(code)
