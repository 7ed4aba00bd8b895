"""Experiment (not a library option): channel-wise keys quantized *before* RoPE (KVQuant's pre-RoPE per-channel keys).

The default quantizes post-RoPE keys per channel over 64-token blocks, in the basis chosen per head. RoPE turns each
channel pair of a key by an angle that grows with its position, so within a block a fast-turning pair sweeps its whole
circle and its per-channel range covers ±|pair|; before RoPE the same channels hold still. Here each demoted block is
un-rotated (R_Kᵀ), un-RoPE'd at its positions, quantized per channel (2 bits, one 16-bit scale and minimum per channel
and block: the same bits as the default), then RoPE'd and rotated back, so attention sees exactly what a pre-RoPE
store would give (a kernel would apply RoPE to the dequantized keys, or turn the query per position). Values stay the
default. BASIS=identity (default) quantizes the raw pre-RoPE channels; BASIS=rotated applies the head's R_K first.

    python eval/pre_rope_keys_experiment.py eval niah --model smollm2-135m --output /tmp/pre-rope --threads 1 \
        --methods oscar --lengths 4096 --depths 0.1,0.3,0.5,0.7,0.9 --seeds 0,1 --quiet

Simulated in dense buffers (`key_bits_experiment.install`); the Triton kernels are not involved. Result in
eval/NOTES.md.
"""
import os, sys, torch
import oscar_hf.cache as C
from key_bits_experiment import install
from oscar_hf.quant import fake_quantize_channels

BASIS = os.environ.get("BASIS", "identity")
ROTARY = {}
_cache_init = C.OscarCache.__init__


def _capture_rotary(self, model, *args, **kwargs):
    rotary = next((m for name, m in model.named_modules() if name.endswith("rotary_emb")), None)
    if rotary is None or getattr(rotary, "attention_scaling", 1.0) != 1.0:
        raise SystemExit("pre-RoPE experiment: needs a model with one plain rotary embedding")
    ROTARY["module"] = rotary
    _cache_init(self, model, *args, **kwargs)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def un_rope(history, rows):
    """Rotated post-RoPE rows `[B, H, n, d]` about to enter `history` -> (pre-RoPE keys, cos, sin, R_K) in float32."""
    layer = history.layer
    if layer.key_mean is not None:
        raise SystemExit("pre-RoPE experiment: key centering is not supported")
    start = layer.n_sink + history.length  # positions of these rows: after the sink and the stored history
    positions = torch.arange(start, start + rows.shape[2], device=rows.device)[None]
    cos, sin = ROTARY["module"](rows.float(), positions)  # [1, n, d]
    cos, sin = cos[:, None], sin[:, None]
    r = layer.key_rotation.float()[None]  # [1, H, d, d]
    post = torch.matmul(rows.float(), r.transpose(-1, -2))  # un-rotate: post-RoPE keys
    return post * cos - _rotate_half(post) * sin, cos, sin, r


def pre_rope_keys(history, rows):
    pre, cos, sin, r = un_rope(history, rows)
    if BASIS == "rotated":
        pre_hat = torch.matmul(fake_quantize_channels(torch.matmul(pre, r), 2, history.layout.blocks[0], history.scale_dtype),
                               r.transpose(-1, -2))
    else:
        pre_hat = fake_quantize_channels(pre, 2, history.layout.blocks[0], history.scale_dtype)
    post_hat = pre_hat * cos + _rotate_half(pre_hat) * sin
    return torch.matmul(post_hat, r).to(rows.dtype)


C.OscarCache.__init__ = _capture_rotary
install(pre_rope_keys)

if __name__ == "__main__":
    from oscar_hf.cli import main

    sys.exit(main(sys.argv[1:]))
