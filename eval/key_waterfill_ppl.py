"""Experiment (not a library option): perplexity with attention-aware key channel bits (`key_waterfill_experiment.py`).

Runs `oscar-hf` (e.g. `eval ppl`) with the OSCAR cache's 2-bit histories simulated in dense buffers
(`key_bits_experiment.install`): values token-wise at 2 bits after the fitted clip in every head (the values of
wide heads with 4-bit keys only), keys by KEYS (env):

- `default`: as the default stores them (its basis and per-head blocks, 2 bits; 4 bits in the wide heads);
- `water`: raw post-RoPE channels with the bits `key_waterfill_experiment.allocate` gives them on calibration's
  held-out sequence (widths WIDTHS, default 024; KEY_BITS code bits per channel on average in a 2-bit head, default
  2; 4 in the wide heads), over the default's per-head blocks.

    KEYS=water KEY_BITS=2.25 python eval/key_waterfill_ppl.py eval ppl --model smollm2-135m --output /tmp/wf-ppl \
        --threads 2 --methods oscar --sequences 3 --quiet [--domain python|shakespeare]

Result in eval/NOTES.md.
"""
import os
import sys

import torch

import oscar_hf.cache as C
from key_bits_experiment import install
from head_precision_experiment import heldout_record
from key_waterfill_experiment import block_reconstructions, layer_allocation, query_energy

KEYS = os.environ.get("KEYS", "water")
WIDTHS = tuple(int(c) for c in os.environ.get("WIDTHS", "024"))
KEY_BITS = float(os.environ.get("KEY_BITS", "2"))
TABLE: dict[int, torch.Tensor] = {}  # layer -> bits [H, d]
_cache_init = C.OscarCache.__init__


@torch.no_grad()
def _allocate_for(model, rotations, config) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model.config._name_or_path)
    wide = set(map(tuple, rotations.wide_heads))
    for layer, (q, k, _, _) in heldout_record(model, tokenizer, config).items():
        h, d = k.shape[0], k.shape[-1]
        blocks = rotations.key_blocks[layer] if rotations.key_blocks else (config.key_block,) * h
        kr = k[:, config.sink_tokens:]
        kr = kr[:, : kr.shape[1] // config.demotion_block * config.demotion_block]
        budgets = [round((4 if (layer, x) in wide else KEY_BITS) * d) for x in range(h)]
        TABLE[layer] = layer_allocation(query_energy(q, torch.eye(d).expand(h, d, d)), kr, blocks, budgets, WIDTHS)
    hist = torch.bincount(torch.cat([t.flatten() for t in TABLE.values()]), minlength=5).tolist()
    print(f"key channel bits 0..4: {hist}", file=sys.stderr)


def _init(self, model, rotations, config=None, *args, **kwargs):
    _cache_init(self, model, rotations, config, *args, **kwargs)
    if KEYS == "water" and not TABLE:
        _allocate_for(model, rotations, self.oscar_config)
    for i, layer in enumerate(self.layers):
        layer.experiment_index = i
        layer.experiment_wide = set(h for (l, h) in rotations.wide_heads if l == i)


def reconstructed_keys(history, rows):
    """Rows `[B, H, n, d]` in the head's stored basis (whole chunks) -> what the simulated history gives back."""
    layer = history.layer
    blocks = history.layout.blocks
    out = torch.empty_like(rows)
    for b in range(rows.shape[0]):
        if KEYS == "default":
            for h, block in enumerate(blocks):
                bits = 4 if h in layer.experiment_wide else 2
                out[b, h] = block_reconstructions(rows[b, h : h + 1].float(), (block,))[bits, 0].to(rows.dtype)
            continue
        rotation = layer.key_rotation.float()  # [H, d, d]: rows = k·R
        raw = torch.matmul(rows[b].float(), rotation.transpose(-1, -2))
        recon = block_reconstructions(raw, blocks)  # [widths, H, n, d]
        bits = TABLE[layer.experiment_index].to(rows.device)
        chosen = recon.gather(0, bits[None, :, None, :].expand(1, -1, raw.shape[1], -1)).squeeze(0)
        out[b] = torch.matmul(chosen, rotation).to(rows.dtype)
    return out


C.OscarCache.__init__ = _init
install(reconstructed_keys)

if __name__ == "__main__":
    from oscar_hf.cli import main

    sys.exit(main(sys.argv[1:]))
