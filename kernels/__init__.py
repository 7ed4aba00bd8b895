"""Triton kernels of oscar-hf, installed as `oscar_hf.kernels` (see `custom_ops.py` for the ops they provide).

The top-level import name `kernels` belongs to Hugging Face's `kernels` package, which transformers probes (and, in
some versions, imports) at start-up. When this folder is reachable under that name — Python started from the
repository root, e.g. `python -m ...` — it must stay inert, so everything happens only under `oscar_hf.kernels`.
"""

if __name__ == "oscar_hf.kernels":
    from .custom_ops import (decode_attention, quantize_pack, quantize_pack_at, rotate_store_token,  # noqa: F401
                             segment_attention)  # (registers torch.ops.oscar.*)

    __all__ = ["decode_attention", "quantize_pack", "quantize_pack_at", "rotate_store_token", "segment_attention"]
