"""Quality measurements through a cache: teacher-forced perplexity where every scored token attends to the cache's
stored (quantized) history, not to a full-precision prefill.

Protocol (`perplexity`): for each sequence, the first `context` tokens go into a fresh cache in one forward pass
(their keys/values beyond the sink and recent window are quantized on the way in); then the rest is fed in chunks of
`chunk` tokens. Each chunk attends to itself exactly and to everything before it as the cache stores it, which is
what decoding does as long as `chunk` <= the recent window. Scored: the tokens predicted by positions >= `context`,
i.e. only predictions computed against the cache.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from transformers import DynamicCache


def cache_kwarg(model) -> str:
    """The keyword under which this transformers version takes a cache: `cache` (5.2x) or `past_key_values`."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.no_grad()
def sequence_nll(
    model, input_ids: torch.Tensor, make_cache: Callable[[], object] | None, context: int, chunk: int
) -> tuple[float, int]:
    """Summed negative log-likelihood (nats) and token count for one sequence `[1, N]` through a fresh cache."""
    if input_ids.ndim == 1:
        input_ids = input_ids.unsqueeze(0)
    n = input_ids.shape[1]
    if not 0 < context < n - 1:
        raise ValueError(f"context ({context}) must lie in (0, sequence length - 1 = {n - 1})")
    device = model.get_input_embeddings().weight.device
    ids = input_ids.to(device)
    cache = make_cache() if make_cache is not None else DynamicCache(config=model.config)
    kwarg = cache_kwarg(model)
    model(input_ids=ids[:, :context], use_cache=True, **{kwarg: cache})
    total, count = 0.0, 0
    for start in range(context, n - 1, chunk):
        end = min(start + chunk, n - 1)
        logits = model(input_ids=ids[:, start:end], use_cache=True, **{kwarg: cache}).logits
        targets = ids[:, start + 1 : end + 1]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        total -= logprobs.gather(-1, targets.unsqueeze(-1)).double().sum().item()
        count += targets.numel()
    return total, count


def perplexity(
    model, sequences: list[torch.Tensor], make_cache: Callable[[], object] | None = None, context: int = 512, chunk: int = 128
) -> dict:
    """Perplexity over `sequences` through caches from `make_cache()` (default: BF16 `DynamicCache`)."""
    nll, count = 0.0, 0
    for ids in sequences:
        s, c = sequence_nll(model, ids, make_cache, context, chunk)
        nll, count = nll + s, count + c
    return {"perplexity": math.exp(nll / count), "nll": nll / count, "tokens": count, "context": context, "chunk": chunk}
