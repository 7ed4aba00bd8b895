"""The one state machine of both caches: where each token of a sequence is stored, as a function of the token count.

With S sink tokens, a window of W tokens and demotion blocks of b tokens, after L tokens:

    n_sink = min(L, S)
    n_hist = max(0, ⌊(L − S − W) / b⌋)·b        history rows [0, n_hist) hold positions [S, S + n_hist)
    recent = positions [S + n_hist, L)          W .. W + b − 1 tokens once the history has begun

so the window demotes its oldest b tokens whenever it reaches W + b. The recent tokens live in a ring of
R = W + 2b slots, position p >= S at slot (p − S) mod R: the ring also holds the b + 1 tokens before the window,
so `crop` can roll back exactly (assisted decoding). After a crop, a position that is recent again is read from its
ring slot if the slot still holds it, and otherwise (a position R or more later was stored after it) from the
history, as stored: `ring_positions` records which position each slot holds.

Values (and token-wise keys) get their history row when they arrive (row p − S), channel-wise key blocks when they
complete (from the ring): attention reads a history row only once n_hist covers it, so both are invisible until the
window demotes them. `PositionPlan` holds L for one cache on the host (when Python runs every step) and on the device
(what a compiled or CUDA-graph step reads): FlashInfer's "plan once per step, run per layer".
"""

from __future__ import annotations

import torch


def history_rows(length: int, sink: int, window: int, block: int) -> int:
    """n_hist: tokens in the quantized history when `length` tokens are stored."""
    return max(0, (length - sink - window) // block) * block


class PositionPlan:
    """Token counts of one cache, shared by its OSCAR layers, advanced once per forward pass by its first OSCAR layer.

    Attributes:
        sink, window, block, ring: S, W, b and R = W + 2b.
        max_length: the most tokens the cache may hold (None: unbounded).
        host_length: L as a Python int, or None while only the device knows it (after compiled decode steps).
        ring_positions: the position each ring slot holds (−1: none), as of `recorded` tokens: the tokens
            [recorded, L) were stored in order since (a compiled step advances only the device's L), so the record is
            brought up to date when a crop needs it.
        host_start: L before the current pass, on the host (None after a compiled step).
        length, start: int64 device scalars: L after and before the current pass.
        lengths: int32 `[5]` on the device for the decode attention: (n_sink, n_hist, n_recent, ring_lo, q_start),
            ring_lo the ring slot of the first recent position.
        write_rows: int64 `[2]`, a single-token pass's history writes: (the token's history row, or −1 for a sink
            token; the first row of the channel-wise key block it completes, or −1).
    """

    def __init__(self, sink: int, window: int, block: int, max_length: int | None = None):
        self.sink, self.window, self.block, self.max_length = sink, window, block, max_length
        self.ring = window + 2 * block
        self.host_length: int | None = 0
        self.host_start: int | None = None
        self.ring_positions = [-1] * self.ring
        self.recorded = 0
        self.length = torch.zeros((), dtype=torch.int64)
        self.start = torch.zeros((), dtype=torch.int64)
        self.lengths = torch.zeros(5, dtype=torch.int32)
        self.write_rows = torch.full((2,), -1, dtype=torch.int64)
        self.device = None

    # ------------------------------------------------------------------ arithmetic (host)
    def history_rows(self, length: int) -> int:
        return history_rows(length, self.sink, self.window, self.block)

    def counts(self, length: int) -> tuple[int, int, int]:
        """(n_sink, n_hist, n_recent) after `length` tokens."""
        n_hist = self.history_rows(length)
        return min(length, self.sink), n_hist, max(length - self.sink - n_hist, 0)

    def slots(self, first: int, last: int, device=None) -> torch.Tensor:
        """Ring slots of positions [first, last) (all >= S)."""
        return (torch.arange(first, last, device=device) - self.sink) % self.ring

    def recent_positions(self, length: int) -> tuple[int, int]:
        """[first, last) of the recent positions after `length` tokens."""
        return self.sink + self.history_rows(length), max(length, self.sink + self.history_rows(length))

    def token_rows(self, host: bool) -> tuple[int, int] | tuple[torch.Tensor, torch.Tensor]:
        """`write_rows` of the current single-token pass: as ints where `host` and the host knows the position, else as
        the device's one-element tensors."""
        start = self.host_start
        if not host or start is None:
            return self.write_rows[0:1], self.write_rows[1:2]
        n_hist = self.history_rows(start)
        return start - self.sink if start >= self.sink else -1, n_hist if self.history_rows(start + 1) > n_hist else -1

    # ------------------------------------------------------------------ state
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.length, self.start, self.lengths, self.write_rows

    def initialize(self, device) -> None:
        if self.device is not None:
            return
        self.length, self.start, self.lengths, self.write_rows = (t.to(device) for t in self.tensors())
        self.device = device
        if not torch.compiler.is_compiling():
            for t in self.tensors():
                torch._dynamo.mark_static_address(t)

    def current_length(self) -> int:
        """L on the host (one synchronisation when only the device knows it)."""
        if self.host_length is None:
            self.host_length = int(self.length)
        return self.host_length

    def advance(self, tokens: int) -> None:
        """A forward pass of `tokens` tokens begins. Multi-token passes run eagerly and know L on the host; a
        single-token pass updates only the device tensors under torch.compile (a compiled step replays it in place,
        with no host synchronisation)."""
        if torch.compiler.is_compiling() and (tokens == 1 or self.host_length is None):
            self.host_length = self.host_start = None
        else:
            self.host_start = self.current_length() if tokens > 1 or self.host_length is not None else None
            if self.host_start is not None:
                self.host_length = self.host_start + tokens
                if self.max_length is not None and self.host_length > self.max_length:
                    self.host_length = self.host_start
                    raise ValueError(f"the cache holds max_cache_len={self.max_length} tokens; this pass would "
                                     f"store {self.host_start + tokens}: create it with a larger max_cache_len")
        self.start.copy_(self.length)
        self.length.add_(tokens)
        if self.max_length is not None:
            # a device-side check (capturable, no synchronisation): writing past the buffers must fail loudly
            torch._assert_async(self.length <= self.max_length,
                                f"the cache is full: it holds max_cache_len={self.max_length} tokens")
        s, w, b = self.sink, self.window, self.block
        n_sink = self.length.clamp(max=s)
        n_hist = torch.div(self.length - s - w, b, rounding_mode="floor").clamp(min=0) * b
        n_recent = (self.length - s - n_hist).clamp(min=0)
        self.lengths.copy_(torch.stack([n_sink, n_hist, n_recent, n_hist % self.ring, self.start]).to(torch.int32))
        if tokens == 1:  # planned once here rather than in each layer (fewer kernels in a compiled step)
            pos = self.start
            # a key block completes when this token brings the window to W + b: rows [k·b, (k+1)·b), still in the ring
            excess = self.length - s - w
            k = torch.div(excess, b, rounding_mode="floor") - 1
            due = (k >= 0) & (excess % b == 0)
            self.write_rows.copy_(torch.stack([torch.where(pos < s, -1, pos - s), torch.where(due, k * b, -1)]))

    def rollback(self, keep: int) -> list[int]:
        """L goes back to `keep` tokens (crop). Returns the positions that become recent again whose ring slots later
        tokens overwrote: the layers write them back from the history (as stored), and the ring holds them again."""
        length = self.current_length()
        for p in range(max(self.recorded, self.sink, length - self.ring), length):
            self.ring_positions[(p - self.sink) % self.ring] = p
        first, last = self.recent_positions(keep)
        lost = [p for p in range(first, last) if self.ring_positions[(p - self.sink) % self.ring] != p]
        for p in lost:
            self.ring_positions[(p - self.sink) % self.ring] = p
        self._set_length(keep)
        return lost

    def reset(self) -> None:
        """No tokens: nothing in the ring."""
        self.ring_positions = [-1] * self.ring
        self._set_length(0)

    def _set_length(self, length: int) -> None:
        self.recorded = length
        self.length.fill_(length)
        self.start.fill_(length)
        self.host_length, self.host_start = length, None
