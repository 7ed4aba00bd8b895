"""Needle-in-a-haystack retrieval through a KV cache, generated synthetically with a seed.

Trial: the evaluation essays (never the calibration essays) cut to about `length` tokens, a needle sentence
" The special magic number is NNNNN. " inserted at a sentence boundary near `depth` (0 = start, 1 = end), then the
question "What is the special magic number mentioned in the text above?" and the answer prefix. Hit = the first
number in the greedy answer equals the 5-digit key (exact match).

Protocol (`run_trial`), equivalent to running each method from scratch, at a fraction of the cost:
1. The haystack (everything before the question) is prefilled ONCE with a BF16 `DynamicCache`. Every cache compared
   here lets the tokens of one forward pass attend to each other exactly, so a method's own prefill would produce the
   very same keys/values; only what it stores differs.
2. Per method, its cache is built from those keys/values with `cache.update(k, v, layer)`, layer by layer
   (`methods.fill_from_prefill`): exactly what the model's prefill would have called.
3. The question is fed as a separate forward pass, so its tokens attend to the haystack *as the method stores it*
   (sink / quantized history / window); the answer is then decoded greedily token by token through the same cache.
   The answer's first token therefore never comes from a full-precision pass over the needle.
`tests/test_evaluation_niah.py` checks that this gives the same logits as running the method's cache from scratch.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import asdict, dataclass

import torch
from transformers import DynamicCache

from ..data import sequence_prefix
from ..metrics import cache_kwarg
from .methods import Method, cache_bits, fill_from_prefill

NEEDLE = " The special magic number is {key}. "
QUESTION = "\nWhat is the special magic number mentioned in the text above?\nAnswer: The special magic number is"
# The harder variant: several needles of the same pattern, different names and numbers; one is asked for.
NAMED_NEEDLE = " The special magic number for {name} is {key}. "
NAMED_QUESTION = ("\nWhat is the special magic number for {name} mentioned in the text above?\n"
                  "Answer: The special magic number for {name} is")
NAMES = ("Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Quebec", "Tbilisi", "Perth", "Bergen", "Cusco", "Dakar", "Kyoto")


@dataclass
class Trial:
    """One retrieval prompt: `haystack_ids` (prefilled), then `question_ids` (fed through the cache)."""

    length: int
    depth: float
    seed: int
    key: str
    needle_token: int  # position of the needle's first token in the haystack
    haystack_ids: torch.Tensor  # [1, n]
    question_ids: torch.Tensor  # [1, q]
    needles: int = 1  # needles in the haystack (one is asked for)

    def describe(self) -> dict:
        return {"length": self.length, "depth": self.depth, "seed": self.seed, "key": self.key, "needles": self.needles,
                "needle_token": self.needle_token, "haystack_tokens": self.haystack_ids.shape[1],
                "question_tokens": self.question_ids.shape[1]}


def haystack_stream(tokenizer, documents: list[str]) -> list[int]:
    """The haystack text as token ids: `documents` joined by blank lines."""
    return tokenizer("\n\n".join(documents), add_special_tokens=False)["input_ids"]


def make_trial(tokenizer, documents: list[str], length: int, depth: float, seed: int, needles: int = 1,
               stream: list[int] | None = None) -> Trial:
    """A seeded trial of about `length` tokens (haystack + needle + question) with the needle near `depth`.

    `stream`: `haystack_stream(tokenizer, documents)`, when the caller tokenized it once for many trials (the
    Shakespeare haystack is 2M tokens, seconds per trial).

    The haystack text starts at a seed-dependent essay offset, so different seeds use different text and keys.
    With `needles` > 1, every needle reads "The special magic number for NAME is NNNNN" (distinct names and numbers,
    the others at seeded random depths) and the question names the one at `depth`.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    if not 1 <= needles <= len(NAMES):
        raise ValueError(f"needles must lie in [1, {len(NAMES)}], got {needles}")
    rng = random.Random(f"niah-{seed}-{length}-{depth}" + (f"-{needles}" if needles > 1 else ""))
    keys = [str(k) for k in rng.sample(range(10000, 100000), needles)]
    key = keys[0]
    if needles == 1:
        texts, question = [NEEDLE.format(key=key)], QUESTION
        depths = [depth]
    else:
        names = rng.sample(NAMES, needles)
        texts = [NAMED_NEEDLE.format(name=n, key=k) for n, k in zip(names, keys)]
        question = NAMED_QUESTION.format(name=names[0])
        depths = [depth] + [rng.uniform(0.05, 0.95) for _ in range(needles - 1)]
    prefix = sequence_prefix(tokenizer)
    question_ids = tokenizer(question, add_special_tokens=False)["input_ids"]
    needle_ids = [tokenizer(t.rstrip(" "), add_special_tokens=False)["input_ids"] for t in texts]
    # The haystack (prefix + body + needles) is a multiple of 64 tokens: transformers' QuantizedCache fails on other
    # lengths (HQQ packs groups in fours, quanto needs the group size to divide the token count).
    haystack_tokens = (length - len(question_ids)) // 64 * 64
    body_tokens = haystack_tokens - len(prefix) - sum(len(n) for n in needle_ids)
    if body_tokens < 16:
        raise ValueError(f"length {length} is too short for a needle and a question")
    stream = haystack_stream(tokenizer, documents) if stream is None else stream
    if len(stream) < body_tokens:
        raise ValueError(f"the haystack text has {len(stream)} tokens, fewer than the {body_tokens} needed")
    start = rng.randint(0, len(stream) - body_tokens)
    body = stream[start : start + body_tokens]
    # Insert after the sentence end (a token decoding to text ending in . ! ?) nearest to each target depth; the
    # haystack stays in token space, so its length is exact.
    cuts = [_sentence_end(tokenizer, body, d) for d in depths]
    order = sorted(range(needles), key=lambda i: (cuts[i], i))
    haystack, last, needle_token = list(prefix), 0, 0
    for i in order:
        haystack += body[last : cuts[i]]
        if i == 0:
            needle_token = len(haystack)
        haystack += needle_ids[i]
        last = cuts[i]
    haystack += body[last:]
    return Trial(length, depth, seed, key, needle_token, torch.tensor([haystack]), torch.tensor([question_ids]), needles)


def _sentence_end(tokenizer, body: list[int], depth: float) -> int:
    """The token index after the sentence end nearest to `depth` of `body` (exactly `depth` at 0 and 1)."""
    target = round(depth * len(body))
    lo, hi = max(target - 256, 1), min(target + 256, len(body))
    pieces = tokenizer.batch_decode([[t] for t in body[lo - 1 : hi - 1]])
    ends = [lo + i for i, p in enumerate(pieces) if p.rstrip().endswith((".", "!", "?"))]
    return min(ends, key=lambda c: abs(c - target)) if ends and 0.0 < depth < 1.0 else target


def answer_matches(text: str, key: str) -> bool:
    """Exact match: the first number in the greedy answer is the key."""
    found = re.search(r"\d+", text)
    return found is not None and found.group(0) == key


@torch.no_grad()
def greedy_answer(model, cache, question_ids: torch.Tensor, max_new_tokens: int) -> list[int]:
    """Feeds `question_ids` `[1, q]` through `cache` as one pass, then decodes greedily; returns the new tokens."""
    kwarg = cache_kwarg(model)
    device = model.get_input_embeddings().weight.device
    logits = model(input_ids=question_ids.to(device), use_cache=True, logits_to_keep=1, **{kwarg: cache}).logits
    tokens: list[int] = []
    for _ in range(max_new_tokens):
        token = int(logits[0, -1].argmax())
        tokens.append(token)
        if token == getattr(model.generation_config, "eos_token_id", None):
            break
        logits = model(input_ids=torch.tensor([[token]], device=device), use_cache=True, **{kwarg: cache}).logits
    return tokens


@torch.no_grad()
def prefill(model, ids: torch.Tensor) -> DynamicCache:
    """BF16 (model dtype) prefill of `ids` `[1, n]` into a `DynamicCache`, computing only the last logits."""
    cache = DynamicCache(config=model.config)
    device = model.get_input_embeddings().weight.device
    model(input_ids=ids.to(device), use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache})
    return cache


def run_trial(model, tokenizer, trial: Trial, methods: dict[str, Method], rotations: dict, max_new_tokens: int = 8) -> list[dict]:
    """Runs every method on one trial (one shared BF16 prefill); returns one record per method."""
    start = time.perf_counter()
    source = prefill(model, trial.haystack_ids)
    prefill_seconds = time.perf_counter() - start
    records = []
    for name, method in methods.items():
        start = time.perf_counter()
        cache = fill_from_prefill(method.make_cache(model, rotations.get(name)), source)
        bits = cache_bits(cache)
        tokens = greedy_answer(model, cache, trial.question_ids, max_new_tokens)
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        records.append({
            **trial.describe(), "method": name, "answer": text, "hit": answer_matches(text, trial.key),
            "bits_per_element": bits["bits_per_element"], "seconds": round(time.perf_counter() - start, 2),
            "prefill_seconds": round(prefill_seconds, 2),
        })
        del cache
    return records


@dataclass
class NiahSettings:
    lengths: tuple[int, ...] = (2048, 4096, 8000)
    depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    seeds: tuple[int, ...] = (0,)
    max_new_tokens: int = 8

    def describe(self) -> dict:
        return asdict(self)
