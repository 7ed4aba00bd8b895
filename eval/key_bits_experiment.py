"""Experiment (not a library option): channel-wise keys with the bits of each channel allocated per block.

The default gives every key channel 2 bits. Here each block of 64 demoted tokens shares the same 2·d bits per token,
but a channel gets 0-4 bits by greedy allocation on the block's own squared error (each step to the channel and
width with the largest error drop per bit; 0 bits store the channel's block mean). Side information: 3 bits per channel and block
(+3/64 bit per key element at blocks of 64). Values stay the default (token-wise 2 bits after the fitted clip).

Simulated: both histories are kept dense in this process and hold exactly what the quantizer would give back, so
attention sees the mixed-width keys; the Triton kernels are not involved. Runs `oscar-hf` with the remaining
arguments, e.g.

    python eval/key_bits_experiment.py eval niah --model smollm2-135m --output /tmp/key-bits --threads 1 \
        --methods oscar --lengths 4096 --depths 0.1,0.3,0.5,0.7,0.9 --seeds 0,1 --quiet

MAX_BITS (env, default 4) caps a channel's bits. Result in eval/NOTES.md.
"""
import os, sys, torch
import oscar_hf.cache as C
import oscar_hf.storage as S
from oscar_hf.quant import fake_quantize, fake_quantize_channels

MAX_BITS = int(os.environ.get("MAX_BITS", "4"))


def channel_errors(cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cols `[..., d, block]` -> squared error `[..., d, MAX_BITS + 1]` and reconstructions `[..., d, block, MAX_BITS + 1]`
    at 0..MAX_BITS bits (0 bits: the block mean, in 16 bits)."""
    recon = [cols.mean(-1, keepdim=True).half().float().expand_as(cols)]
    for b in range(1, MAX_BITS + 1):
        recon.append(fake_quantize(cols, b, cols.shape[-1]).float())
    recon = torch.stack(recon, -1)
    return ((recon - cols.unsqueeze(-1)) ** 2).sum(-2), recon


def mixed_channels(rows: torch.Tensor, block: int) -> torch.Tensor:
    """Rows `[B, H, n, d]` (n a multiple of `block`) -> their reconstruction with per-block allocated channel bits."""
    b, h, n, d = rows.shape
    cols = rows.float().reshape(b, h, n // block, block, d).transpose(-1, -2)  # [B, H, nb, d, block]
    err, recon = channel_errors(cols)
    bits = torch.zeros(cols.shape[:-1], dtype=torch.long, device=rows.device)
    spent = torch.zeros(bits.shape[:-1], dtype=torch.long, device=rows.device)
    levels = torch.arange(MAX_BITS + 1, device=rows.device)
    for _ in range(2 * d):  # each step takes the best error drop per bit over any higher width (1 bit can lose to 0)
        cur = err.gather(-1, bits.unsqueeze(-1))
        step = levels - bits.unsqueeze(-1)
        affordable = (step > 0) & (step <= (2 * d - spent)[..., None, None])
        rate = torch.where(affordable, (cur - err) / step.clamp(min=1), torch.full_like(err, -float("inf")))
        best_rate, best_level = rate.max(-1)  # per channel
        channel_rate, channel = best_rate.max(-1, keepdim=True)
        take = channel_rate.squeeze(-1) > -float("inf")
        new_level = best_level.gather(-1, channel)
        added = torch.where(take[..., None], new_level - bits.gather(-1, channel), torch.zeros_like(channel))
        bits.scatter_add_(-1, channel, added)
        spent += added.squeeze(-1)
    out = recon.gather(-1, bits[..., None, None].expand(*bits.shape, block, 1)).squeeze(-1)
    STATS.append(torch.bincount(bits.flatten(), minlength=MAX_BITS + 1))
    return out.transpose(-1, -2).reshape(rows.shape).to(rows.dtype)


STATS: list[torch.Tensor] = []
_init, _append = S.QuantizedHistory.__init__, S.QuantizedHistory.append


def install(reconstruct_keys) -> None:
    """Keeps 2-bit histories dense in this process, holding what the quantizer would give back: values the default
    (token-wise 2 bits after the fitted clip), keys `reconstruct_keys(history, rows)` for rotated rows `[B, H, n, d]`
    (whole blocks). `history.layer` is the owning `OscarLayer` (set at its creation)."""

    def __init__(self, bits, granularity, *args, **kwargs):
        _init(self, bits, granularity, *args, **kwargs)
        self.simulated = bits == 2
        if self.simulated:
            self.bits, self.granularity = 16, granularity  # dense buffers holding the reconstruction

    def append(self, rows, bulk, rotation=None):
        if rotation is not None:
            rows = torch.matmul(rows, rotation)
        if getattr(self, "simulated", False) and rows.shape[2]:
            if self.channelwise:
                rows = reconstruct_keys(self, rows)
            else:
                rows = fake_quantize(rows.float(), 2, self.group_size, self.clip_ratio, self.scale_dtype).to(rows.dtype)
        return _append(self, rows, bulk)

    reset = C.OscarLayer._reset_state

    def _reset_state(self):
        reset(self)
        self.history_keys.layer = self

    S.QuantizedHistory.__init__, S.QuantizedHistory.append = __init__, append
    C.OscarLayer._reset_state = _reset_state


if __name__ == "__main__":
    install(lambda history, rows: mixed_channels(rows, history.layout.blocks[0]))
    x = torch.randn(1, 1, 64, 64) * torch.logspace(-1, 1, 64)  # channels of very different ranges
    uniform = fake_quantize_channels(x, 2, 64)
    print("keys with ranges over two decades, squared error: 2 bits each", ((uniform - x) ** 2).mean().item(),
          "allocated", ((mixed_channels(x, 64) - x) ** 2).mean().item())
    STATS.clear()
    from oscar_hf.cli import main
    code = main(sys.argv[1:])
    if STATS:
        print("channel bits histogram (0..MAX_BITS):", torch.stack(STATS).sum(0).tolist())
    sys.exit(code)
