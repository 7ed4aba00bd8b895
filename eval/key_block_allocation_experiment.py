"""Experiment: the key block of each layer (or KV head) chosen at calibration, at equal bits. UNIT=head is now the
library's default (`OscarConfig.key_block_allocation="fitted"`, exact rather than greedy); this simulation is kept
for the per-layer variant and to reproduce the trials recorded with it.

The default gives every layer channel-wise keys over blocks of 64 tokens (2 + 32/64 = 2.5 bits per key element with
16-bit scale and minimum). Here a layer gets blocks of 32, 64 or 128 (3, 2.5 or 2.25 bits) so that the average stays
2.5: starting from 128 everywhere, the budget goes step by step to the upgrade (128→64, 64→32 or 128→32) with the
largest drop in held-out attention-output error per bit. The errors are those `calibrate` already uses to choose the key
basis (`key_basis_errors`: relative error of each KV head's attention output, in its stored basis, on the held-out
calibration tokens, disjoint from every evaluation text). UNIT=layer (default; one block per layer, which a per-layer
kernel launch could follow) or UNIT=head; BLOCKS (default 128,64,32, largest first) the block sizes allowed;
BUDGET_BITS (default: the bits of the config's key_block) the average key bits per element to allocate.

    python eval/key_block_allocation_experiment.py eval niah --model smollm2-135m --output /tmp/key-blocks \
        --threads 1 --methods oscar --lengths 4096 --depths 0.1,0.3,0.5,0.7,0.9 --seeds 0,1 --quiet

Simulated in dense buffers (`key_bits_experiment.install`); the Triton kernels are not involved. Result in
eval/NOTES.md.
"""
import os, sys, torch
import oscar_hf.cache as C
from key_bits_experiment import install
from head_precision_experiment import heldout_record
from oscar_hf.calibrate import key_basis_errors
from oscar_hf.quant import fake_quantize_channels

UNIT = os.environ.get("UNIT", "layer")
BLOCKS = tuple(int(b) for b in os.environ.get("BLOCKS", "128,64,32").split(","))  # largest first
BUDGET_BITS = os.environ.get("BUDGET_BITS")
BLOCK: dict[tuple[int, int], int] = {}  # (layer, head) -> key block
_cache_init = C.OscarCache.__init__


def bits(block: int) -> float:
    return 2 + 32 / block


def allocate(errors: dict[int, dict[int, torch.Tensor]], budget_bits: float) -> dict[tuple[int, int], int]:
    """errors[layer][block] `[H]` -> block per (layer, head), average key bits <= budget_bits (greedy by error drop
    per bit)."""
    units = ([(layer, None) for layer in errors] if UNIT == "layer"
             else [(layer, h) for layer in errors for h in range(len(errors[layer][BLOCKS[0]]))])

    def err(unit, block):
        e = errors[unit[0]][block]
        return float(e.sum() if unit[1] is None else e[unit[1]])

    chosen = {u: BLOCKS[0] for u in units}
    spare = (budget_bits - bits(BLOCKS[0])) * len(units)
    while True:
        best = None
        for u in units:
            for b in BLOCKS:
                cost = bits(b) - bits(chosen[u])
                if b < chosen[u] and cost <= spare + 1e-9:
                    rate = (err(u, chosen[u]) - err(u, b)) / cost
                    if best is None or rate > best[0]:
                        best = (rate, u, b, cost)
        if best is None or best[0] <= 0:
            break
        _, u, b, cost = best
        chosen[u], spare = b, spare - cost
    heads = len(next(iter(errors.values()))[BLOCKS[0]])
    return {(layer, h): chosen[(layer, None) if UNIT == "layer" else (layer, h)] for layer in errors for h in range(heads)}


def _allocate_for(self, model, rotations, config):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model.config._name_or_path)
    errors = {}
    for layer, (q, k, v, scale) in heldout_record(model, tokenizer, config).items():
        basis = {"stored": rotations.key_rotations[layer].to(q.device)}
        errors[layer] = {b: key_basis_errors(q, k, v, basis, scale, config.replace(key_block=b, key_block_allocation="uniform"))["stored"]
                         for b in BLOCKS}
    BLOCK.update(allocate(errors, float(BUDGET_BITS) if BUDGET_BITS else bits(config.key_block)))
    counts = {b: sum(1 for v in BLOCK.values() if v == b) for b in BLOCKS}
    average = sum(bits(v) for v in BLOCK.values()) / len(BLOCK)
    print(f"key blocks per {UNIT}: {counts} (KV heads), average key bits {average:.4f}", file=sys.stderr)


def _init(self, model, rotations, config=None, *args, **kwargs):
    _cache_init(self, model, rotations, config, *args, **kwargs)
    if not BLOCK:
        _allocate_for(self, model, rotations, self.oscar_config)
    for i, layer in enumerate(self.layers):
        layer.experiment_index = i


def allocated_keys(history, rows):
    layer = history.layer.experiment_index
    out = torch.empty_like(rows)
    n = rows.shape[2]
    for h in range(rows.shape[1]):
        block = BLOCK[(layer, h)]
        full = n // block * block  # a bulk append is whole 64-blocks: a larger block keeps its tail at 64
        parts = [fake_quantize_channels(rows[:, h : h + 1, :full], 2, block, history.scale_dtype)] if full else []
        if n > full:
            parts.append(fake_quantize_channels(rows[:, h : h + 1, full:], 2, history.layout.blocks[0], history.scale_dtype))
        out[:, h : h + 1] = torch.cat(parts, dim=2)
    return out


C.OscarCache.__init__ = _init
install(allocated_keys)

if __name__ == "__main__":
    from oscar_hf.cli import main

    sys.exit(main(sys.argv[1:]))
