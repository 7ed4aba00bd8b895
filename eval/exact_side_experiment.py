"""Diagnostic (not a library option): which side of the default cache loses SmolLM2's needles, keys or values.

SIDE=keys keeps every history key exact (BF16, in the stored basis) and quantizes values as the default does;
SIDE=values the other way round. Same BF16 sink/window and rotations as the default; simulated in dense buffers
(`key_bits_experiment.install`), so the Triton kernels are not involved. Run on the trials the default misses:

    SIDE=keys python eval/exact_side_experiment.py eval niah --model smollm2-135m --output /tmp/exact-keys \
        --threads 1 --methods oscar --lengths 4096 --depths 0.3,0.5 --seeds 1 --quiet

Result in eval/NOTES.md.
"""
import os, sys
import oscar_hf.storage as S
from key_bits_experiment import install
from oscar_hf.quant import fake_quantize_channels

SIDE = os.environ.get("SIDE", "keys")
if SIDE == "keys":
    install(lambda history, rows: rows)
elif SIDE == "values":
    def default_keys(history, rows):
        out = rows.clone()
        for h in range(rows.shape[1]):
            out[:, h : h + 1] = fake_quantize_channels(rows[:, h : h + 1], 2, history.layout.blocks[h], history.scale_dtype)
        return out

    install(default_keys)
    import key_bits_experiment as K

    _simulated_append = S.QuantizedHistory.append

    def append(self, rows, bulk, rotation=None):  # values exact: the dense buffer stores them as they are
        if getattr(self, "simulated", False) and not self.channelwise:
            return K._append(self, rows if rotation is None else rows @ rotation, bulk)
        return _simulated_append(self, rows, bulk, rotation)

    S.QuantizedHistory.append = append
else:
    raise SystemExit(f"SIDE must be keys or values, got {SIDE!r}")

if __name__ == "__main__":
    from oscar_hf.cli import main

    sys.exit(main(sys.argv[1:]))
