"""RULER through every method's cache with one prefill per prompt: what `oscar-hf eval ruler` runs.

lm-eval makes the prompts and scores the answers, as `oscar-hf lm-eval` would: `Task.build_all_requests` gives each
request's context and generation settings (RULER's data made offline by `ruler.py`), `OscarLM` encodes the context
and decodes the answer as lm-eval's HF model does, and `Task.process_results` scores it. In between, the context but
its last token is prefilled once in the model's dtype, each method's cache is filled from those keys and values
(`methods.fill_from_prefill`), and the last token and the greedy answer go through that cache, so the answer attends
to the stored history. A comparison of M methods then costs one prefill and M decodes, not M prefills.

This differs from `oscar-hf lm-eval --model oscar` only in the last context token, which here reads the stored
(quantized) history instead of attending within the prefill: the stricter of the two for a 2-bit cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..metrics import cache_kwarg
from .methods import Method, cache_bits, fill_from_prefill
from .niah import prefill


@dataclass
class RulerRequest:
    """One lm-eval request of a RULER task: its document (`doc_id` in the task's test set, `length` the RULER length
    it was built for), the context lm-eval would hand the model, and the generation settings of the task."""

    task: str
    doc_id: int
    length: int
    context: str
    generation_kwargs: dict
    doc: dict


LM_EVAL_SEEDS = {"random": 0, "numpy": 1234, "torch": 1234}  # `lm_eval.simple_evaluate`'s defaults


def ruler_requests(task_name: str, manager, limit: int | None = None):
    """`(task, [RulerRequest])`: lm-eval's task `task_name` from `manager` (`lm_eval_model.task_manager(metadata=...)`,
    whose metadata sets `max_seq_lengths`) and its first `limit` requests, as lm-eval builds them. RULER draws its
    samples at random: the generators are seeded as `simple_evaluate` seeds them, so the requests are those of
    `oscar-hf lm-eval --tasks TASK` with that one task and length, the same in every run."""
    import random

    import numpy as np
    from lm_eval.tasks import get_task_dict

    random.seed(LM_EVAL_SEEDS["random"])
    np.random.seed(LM_EVAL_SEEDS["numpy"])
    torch.manual_seed(LM_EVAL_SEEDS["torch"])
    task = get_task_dict([task_name], manager)[task_name]
    if task.OUTPUT_TYPE != "generate_until":
        raise ValueError(f"{task_name} is a {task.OUTPUT_TYPE} task; the RULER runs take generate_until tasks")
    task.build_all_requests(limit=limit, rank=0, world_size=1)
    requests = [RulerRequest(task_name, instance.doc_id, int(instance.doc["max_length"]), *instance.args, instance.doc)
                for instance in task.instances]
    return task, requests


@torch.no_grad()
def greedy_until(lm, cache, last_token: torch.Tensor, max_new_tokens: int, stop: list[str]) -> list[int]:
    """Feeds `last_token` `[1, 1]` through `cache`, then decodes greedily: at most `max_new_tokens` tokens, ending
    after lm-eval's end-of-text token or once the decoded answer contains a stop string (as lm-eval's stopping
    criteria do). Returns the new tokens."""
    model = lm.model
    kwarg = cache_kwarg(model)
    device = model.get_input_embeddings().weight.device
    logits = model(input_ids=last_token.to(device), use_cache=True, **{kwarg: cache}).logits
    tokens: list[int] = []
    for _ in range(max_new_tokens):
        token = int(logits[0, -1].argmax())
        tokens.append(token)
        if token == lm.eot_token_id or (stop and any(s in lm.tok_decode(tokens) for s in stop if s)):
            break
        logits = model(input_ids=torch.tensor([[token]], device=device), use_cache=True, **{kwarg: cache}).logits
    return tokens


def run_request(lm, task, request: RulerRequest, methods: dict[str, Method], rotations: dict) -> list[dict]:
    """Every method on one request, from one shared prefill; one record per method (its answer, its score for the
    request's length, the cache's bits per element, seconds)."""
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

    settings = normalize_gen_kwargs(dict(request.generation_kwargs), lm.max_gen_toks)
    stop = handle_stop_sequences(settings.pop("until", None), eos=lm.tok_decode(lm.eot_token_id,
                                                                             skip_special_tokens=False))
    max_new_tokens = settings.pop("max_gen_toks")
    ids, _ = lm.tok_batch_encode([request.context], left_truncate_len=lm.max_length - max_new_tokens)
    if ids.shape[1] < 2:
        raise ValueError(f"{request.task} document {request.doc_id}: the context is {ids.shape[1]} token(s) long")
    start = time.perf_counter()
    source = prefill(lm.model, ids[:, :-1])
    prefill_seconds = time.perf_counter() - start
    records = []
    for name, method in methods.items():
        start = time.perf_counter()
        cache = fill_from_prefill(method.make_cache(lm.model, rotations.get(name)), source)
        bits = cache_bits(cache)["bits_per_element"]
        tokens = greedy_until(lm, cache, ids[:, -1:], max_new_tokens, stop)
        answer = postprocess_generated_text(lm.tok_decode(tokens), stop, None)
        score = task.process_results(request.doc, [answer])[str(request.length)]
        records.append({"task": request.task, "length": request.length, "doc_id": request.doc_id, "method": name,
                        "answer": answer, "score": score, "context_tokens": int(ids.shape[1]),
                        "bits_per_element": bits, "seconds": round(time.perf_counter() - start, 2),
                        "prefill_seconds": round(prefill_seconds, 2)})
        del cache
    return records


def summarize(records: list[dict]) -> dict:
    """`{length: {method: {task: mean score, ..., "average": mean over the tasks}}}` of per-request records (scores
    as RULER's `process_results` gives them, 0-1), with the requests counted per task."""
    cells: dict = {}
    for r in records:
        cells.setdefault(r["length"], {}).setdefault(r["method"], {}).setdefault(r["task"], []).append(r["score"])
    out = {}
    for length, methods in sorted(cells.items()):
        out[length] = {}
        for method, tasks in methods.items():
            means = {task: sum(scores) / len(scores) for task, scores in sorted(tasks.items())}
            out[length][method] = {**means, "average": sum(means.values()) / len(means),
                                   "requests": {task: len(scores) for task, scores in sorted(tasks.items())}}
    return out
