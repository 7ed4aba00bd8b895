"""NIAH generation (seeded, needle placement) and the shared-prefill protocol against a from-scratch run."""

import torch
from transformers import DynamicCache

from conftest import char_tokenizer, tiny_model
from oscar_hf.evaluation.methods import Windows, main_methods
from oscar_hf.evaluation.niah import answer_matches, greedy_answer, haystack_stream, make_trial, run_trial
from oscar_hf.metrics import cache_kwarg

DOCS = ["Alpha beta gamma. Delta epsilon zeta! Eta theta iota? " * 30, "Kappa lambda mu. Nu xi omicron. " * 40]


def test_trials_are_seeded_and_place_the_needle_at_the_depth():
    tok = char_tokenizer()
    a = make_trial(tok, DOCS, 700, 0.5, seed=3)
    b = make_trial(tok, DOCS, 700, 0.5, seed=3)
    c = make_trial(tok, DOCS, 700, 0.5, seed=4)
    assert a.key == b.key and torch.equal(a.haystack_ids, b.haystack_ids)
    assert a.key != c.key
    text = tok.decode(a.haystack_ids[0], skip_special_tokens=True).replace(" ", "")
    assert f"Thespecialmagicnumberis{a.key}." in text
    n = a.haystack_ids.shape[1]
    assert n % 64 == 0 and n + a.question_ids.shape[1] <= 700
    assert abs(a.needle_token / n - 0.5) < 0.1
    early, late = make_trial(tok, DOCS, 700, 0.1, 0), make_trial(tok, DOCS, 700, 0.9, 0)
    assert early.needle_token < a.needle_token < late.needle_token
    # a stream tokenized once for many trials (what the runner passes) gives the same trial
    reused = make_trial(tok, DOCS, 700, 0.5, seed=3, stream=haystack_stream(tok, DOCS))
    assert reused.key == a.key and torch.equal(reused.haystack_ids, a.haystack_ids)


def test_answer_scoring_is_exact_match_on_the_first_number():
    assert answer_matches(" 48213. It is", "48213")
    assert not answer_matches(" 48212", "48213")
    assert not answer_matches(" 482134", "48213")
    assert not answer_matches(" none", "48213")


def test_shared_prefill_protocol_equals_running_each_method_from_scratch():
    """run_trial prefills once in BF16 and builds each method's cache from those K/V; running the method's own cache
    over the haystack, then the question, then greedy decoding must give the same answer tokens."""
    tok = char_tokenizer()
    model = tiny_model("llama")
    trial = make_trial(tok, DOCS, 600, 0.5, seed=1)
    methods = {k: v for k, v in main_methods(Windows(16, 32, 32)).items() if k in ("bf16", "naive-int2", "kivi2")}
    records = run_trial(model, tok, trial, methods, {}, max_new_tokens=6)
    kw = cache_kwarg(model)
    for record, (name, method) in zip(records, methods.items()):
        cache = method.make_cache(model)
        with torch.no_grad():
            model(input_ids=trial.haystack_ids, **{kw: cache})
        tokens = greedy_answer(model, cache, trial.question_ids, 6)
        assert record["answer"] == tok.decode(tokens, skip_special_tokens=True), name
        assert record["method"] == name and record["bits_per_element"] > 0
    bits = {r["method"]: r["bits_per_element"] for r in records}
    assert bits["naive-int2"] < bits["bf16"]


def test_prefill_cache_is_not_modified_by_the_methods():
    tok = char_tokenizer()
    model = tiny_model("gemma3")
    trial = make_trial(tok, DOCS, 500, 0.3, seed=0)
    methods = {k: v for k, v in main_methods(Windows(8, 16, 32)).items() if k in ("bf16", "naive-int2")}
    first = run_trial(model, tok, trial, methods, {}, max_new_tokens=4)
    second = run_trial(model, tok, trial, methods, {}, max_new_tokens=4)
    assert [r["answer"] for r in first] == [r["answer"] for r in second]
    assert isinstance(DynamicCache(config=model.config), DynamicCache)
