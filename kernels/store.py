"""A static cache's decode-step store (Triton): the new token's key and value rotated (x·R_h) and written to its
sink or ring slot, in one launch.

The torch twin (`oscar_hf.ops.rotate_store_token_reference`) takes two GEMVs and four scatters; in a compiled decode
step each is a launch, and at 4K tokens launches, not bytes, are what the step is short of (docs/research-log.md, "Decode kernel").
One program per (batch·KV head, key or value, tile of BLOCK_E output columns): a 1×d row times d×BLOCK_E of R_h,
summed in float32 and rounded to the storage dtype once, like the twin's matmul. The position is read on the device
(the plan's `start`): a token at position p < S goes to sink slot p, any other to ring slot (p − S) mod R. Unlike
the twin, nothing is written to the scratch slots (S of the sink, R of the ring), which nothing reads. The rotated
rows are also returned (`[2, B, H, 1, d]`: keys, values) for the history's quantizer.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .quantize import to_storage


@triton.jit
def _rotate_store_one(x_ptr, sx_b, sx_h, sx_d, rot_ptr, sr_h, sr_i, sr_o, sink_ptr, ring_ptr, ss_b, ss_h, ss_t, ss_d,
                      sg_b, sg_h, sg_t, sg_d, out_ptr, so_b, so_h, so_d, b, h, cols, pos, n_sink, ring,
                      D: tl.constexpr, INTERPRET: tl.constexpr):
    d = tl.arange(0, D)
    x = tl.load(x_ptr + b * sx_b + h * sx_h + d * sx_d).to(tl.float32)
    r = tl.load(rot_ptr + h * sr_h + d[:, None] * sr_i + cols[None, :] * sr_o).to(tl.float32)
    y = to_storage(tl.sum(x[:, None] * r, axis=0), out_ptr.dtype.element_ty, INTERPRET)
    tl.store(out_ptr + b * so_b + h * so_h + cols * so_d, y)
    at = cols * 0 + pos  # the position as a vector: masks are vectors
    slot = (pos - n_sink) % ring
    sink_ok = at < n_sink
    ring_ok = at >= n_sink
    tl.store(sink_ptr + b * ss_b + h * ss_h + pos * ss_t + cols * ss_d, y, mask=sink_ok)
    tl.store(ring_ptr + b * sg_b + h * sg_h + slot * sg_t + cols * sg_d, y, mask=ring_ok)


@triton.jit
def _rotate_store_kernel(
    k_ptr, sk_b, sk_h, sk_d, v_ptr, sv_b, sv_h, sv_d,
    rk_ptr, srk_h, srk_i, srk_o, rv_ptr, srv_h, srv_i, srv_o,
    sink_k, sink_v, ss_b, ss_h, ss_t, ss_d,
    ring_k, ring_v, sg_b, sg_h, sg_t, sg_d,
    out_ptr, so_w, so_b, so_h, so_d,
    pos_ptr, heads, n_sink, ring,
    D: tl.constexpr, BLOCK_E: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid = tl.program_id(0)
    b, h = pid // heads, pid % heads
    cols = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    pos = tl.load(pos_ptr)
    if tl.program_id(2) == 0:
        _rotate_store_one(k_ptr, sk_b, sk_h, sk_d, rk_ptr, srk_h, srk_i, srk_o, sink_k, ring_k, ss_b, ss_h, ss_t, ss_d,
                          sg_b, sg_h, sg_t, sg_d, out_ptr, so_b, so_h, so_d, b, h, cols, pos, n_sink, ring, D, INTERPRET)
    else:
        _rotate_store_one(v_ptr, sv_b, sv_h, sv_d, rv_ptr, srv_h, srv_i, srv_o, sink_v, ring_v, ss_b, ss_h, ss_t, ss_d,
                          sg_b, sg_h, sg_t, sg_d, out_ptr + so_w, so_b, so_h, so_d, b, h, cols, pos, n_sink, ring, D,
                          INTERPRET)


def rotate_store_token_triton(keys, values, key_rotation, value_rotation, sink_k, sink_v, ring_k, ring_v, position,
                              sink_tokens: int, ring: int) -> torch.Tensor:
    """See `oscar_hf.ops.rotate_store_token_reference` for the contract. Returns `[2, B, H, 1, d]` (keys, values)."""
    b, h, n, d = keys.shape
    if n != 1 or values.shape != keys.shape:
        raise ValueError(f"rotate_store_token stores one token: keys {list(keys.shape)}, values {list(values.shape)}")
    if sink_k.stride() != sink_v.stride() or ring_k.stride() != ring_v.stride():
        raise ValueError("rotate_store_token: the key and value buffers of a segment must share their layout")
    out = torch.empty(2, b, h, 1, d, device=keys.device, dtype=keys.dtype)
    block_e = max(16, min(d, 4096 // d))  # a d×BLOCK_E tile of R of 4K elements: 32 registers a thread in 4 warps
    _rotate_store_kernel[(b * h, d // block_e, 2)](
        keys, keys.stride(0), keys.stride(1), keys.stride(3), values, values.stride(0), values.stride(1), values.stride(3),
        key_rotation, *key_rotation.stride(), value_rotation, *value_rotation.stride(),
        sink_k, sink_v, *sink_k.stride(), ring_k, ring_v, *ring_k.stride(),
        out, out.stride(0), out.stride(1), out.stride(2), out.stride(4),
        position, h, sink_tokens, ring, D=d, BLOCK_E=block_e, INTERPRET=os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=4,
    )
    return out
