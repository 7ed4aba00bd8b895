"""RULER's 11 offline tasks from lm-eval 0.4.13, with no network: the `niah_*` tasks, `ruler_vt`, `ruler_cwe` and
`ruler_fwe` (not RULER's QA tasks, whose data are Hub datasets).

    oscar-hf lm-eval --model oscar --model_args pretrained=offline:qwen2.5-coder-0.5b,method=naive-int2 \\
        --tasks niah_single_1 --metadata '{"max_seq_lengths":[4096]}' --limit 10

What lm-eval's own RULER fetches, and what replaces it here:
- the essay haystack (`niah_single_2/3`, `niah_multikey_1`, `niah_multivalue`, `niah_multiquery`): lm-eval loads the
  Hub dataset `baber/paul_graham_essays`; here it is the bundled evaluation essays (`assets.essay_split("eval")`,
  never the calibration essays), or the UTF-8 text file named by the task metadata key `haystack_file`
  (`--metadata '{"max_seq_lengths":[4096],"haystack_file":"/path/file.txt"}'`), which the results record;
- sentence splitting of that haystack (where the needles go): lm-eval calls nltk's `sent_tokenize`, which needs the
  `punkt_tab` data, and downloads it when it imports `prepare_niah`; here `split_sentences`, a regex, is used
  instead (with or without `punkt_tab`), and `nltk.download` is never called.
The other tasks (`niah_single_1`, `niah_multikey_2/3`, `ruler_vt`, `ruler_cwe`, `ruler_fwe`) generate their text
locally already; they are registered here too because lm-eval's task files all include `niah_single_1.yaml`, whose
loading imports `prepare_niah` (the download). Each task needs a tokenizer to size its prompts: `pretrained` or
`tokenizer` in the metadata (`oscar-hf lm-eval` puts `--model_args`' `pretrained` there, resolved to a local folder;
`offline:NAME` is resolved here as well).

How: `write_task_files(folder)` writes, for each task, lm-eval's own YAML with `custom_dataset` pointing at the
function of the same name below; the `--include_path` of `oscar-hf lm-eval` and `lm_eval_model.task_manager()` then
take these names over from lm-eval's (`quiet_task_takeover` drops lm-eval's warning about it, one per task). That
function imports lm-eval's RULER module and calls its dataset function, while two of lm-eval's module globals are
swapped for the call only: `prepare_niah.cached_sent_tokenize` (-> `split_sentences`) and `niah_utils.get_haystack`
(-> the local essays); `nltk.download` is a no-op while `prepare_niah` is first imported. Nothing else of lm-eval is
changed; lm-eval's scoring (`common_utils`), prompts and sampling are its own.

Extra packages: `wonderwords` and `nltk` (>= 3.9.1, lm-eval's minimum), `pip install 'oscar-hf[ruler]'`; without them
a RULER task stops with one line saying so.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

logger = logging.getLogger("lm_eval.oscar")  # lm-eval's command line shows its "lm_eval" loggers

HAYSTACK_KEY = "haystack_file"  # task metadata key: a UTF-8 text file to use as the essay haystack
INSTALL_HINT = "pip install 'oscar-hf[ruler]'"
RULER_PACKAGE = "lm_eval.tasks.ruler"
LM_EVAL_VERSION = "0.4.13"  # the lm-eval whose RULER internals this module was written against
NLTK_MIN_VERSION = (3, 9, 1)  # lm-eval's prepare_niah refuses older nltk (a remote-code-execution fix)


@dataclass(frozen=True)
class RulerTask:
    """One of lm-eval's RULER tasks: its YAML file and dataset function in `lm_eval/tasks/ruler/`, and the packages
    that function's module imports beyond lm-eval's own dependencies."""

    yaml_file: str
    module: str
    function: str
    packages: tuple[str, ...]


_NIAH = ("wonderwords", "nltk")
OFFLINE_TASKS = {
    "niah_single_1": RulerTask("niah_single_1.yaml", "niah_utils", "niah_single_1", _NIAH),
    "niah_single_2": RulerTask("niah_single_2.yaml", "niah_utils", "niah_single_2", _NIAH),
    "niah_single_3": RulerTask("niah_single_3.yaml", "niah_utils", "niah_single_3", _NIAH),
    "niah_multikey_1": RulerTask("niah_multikey_1.yaml", "niah_utils", "niah_multikey_1", _NIAH),
    "niah_multikey_2": RulerTask("niah_multikey_2.yaml", "niah_utils", "niah_multikey_2", _NIAH),
    "niah_multikey_3": RulerTask("niah_multikey_3.yaml", "niah_utils", "niah_multikey_3", _NIAH),
    "niah_multivalue": RulerTask("niah_multivalue.yaml", "niah_utils", "niah_multivalue", _NIAH),
    "niah_multiquery": RulerTask("niah_multiquery.yaml", "niah_utils", "niah_multiquery", _NIAH),
    "ruler_vt": RulerTask("vt.yaml", "vt_utils", "get_vt_dataset", ()),
    "ruler_cwe": RulerTask("cwe.yaml", "cwe_utils", "get_cw_dataset", ("wonderwords",)),
    "ruler_fwe": RulerTask("fwe.yaml", "fwe_utils", "fwe_download", ()),
}


# ------------------------------------------------------------------------------------------------ sentences
# A possible sentence end: . ! or ?, any closing quotes or brackets, then whitespace.
_SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*\s+")
_OPENERS = "\"'\u201c\u2018(["


def split_sentences(text: str) -> list[str]:
    """`text` cut into sentences, each stripped, none empty; needs no data files (it stands in for nltk's
    `sent_tokenize` here). A sentence ends at . ! or ? (with any closing quotes or brackets) followed by whitespace,
    unless the next word starts in lower case ("e.g. the"). Abbreviations before a capital ("Mr. Smith") are cut
    too, which only moves where a needle may be inserted."""
    sentences, start = [], 0
    for end in _SENTENCE_END.finditer(text):
        following = text[end.end() : end.end() + 3].lstrip(_OPENERS)[:1]
        if not following.islower():
            sentences.append(text[start : end.end()].strip())
            start = end.end()
    sentences.append(text[start:].strip())
    return [sentence for sentence in sentences if sentence]


@functools.lru_cache(maxsize=16)
def _split_sentences_cached(text: str) -> list[str]:
    # RULER splits the same haystack prefix once per attempt and per sample (500 samples a length)
    return split_sentences(text)


# ------------------------------------------------------------------------------------------------ haystack
def haystack_text(path: str | Path | None = None) -> str:
    """The essay haystack's text: the UTF-8 file at `path`, or by default the bundled evaluation essays (the 37 of
    `assets.essay_split("eval")`, disjoint from the calibration essays), joined in their sorted order."""
    if path is None:
        from ..assets import essay_split

        return "\n".join(essay_split("eval").values())
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"RULER haystack file {str(path)!r} (metadata {HAYSTACK_KEY!r}) does not exist")
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"RULER haystack file {str(path)!r} (metadata {HAYSTACK_KEY!r}) is empty")
    return text


def essay_haystack(path: str | Path | None = None) -> list[str]:
    """The haystack as lm-eval's `get_haystack("essay")` returns it: the text's words, in order."""
    return haystack_text(path).split()


def _haystack(path, lm_eval_get_haystack, type_haystack):
    """Stands in for lm-eval's `get_haystack`: "essay" comes from `essay_haystack(path)`; the synthetic haystacks
    ("repeat", "needle") are lm-eval's own."""
    if type_haystack == "essay":
        return essay_haystack(path)
    return lm_eval_get_haystack(type_haystack)


# ------------------------------------------------------------------------------------------------ lm-eval's RULER
def require_packages(packages) -> None:
    """Imports `packages`; a missing one (or an nltk older than lm-eval accepts) raises ImportError in one line that
    names the extra to install."""
    for name in packages:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ImportError(f"RULER tasks need the '{name}' package ({reason}): {INSTALL_HINT}") from None
        if name == "nltk":
            found = tuple(int(p) for p in re.findall(r"\d+", module.__version__)[:3])
            if found < NLTK_MIN_VERSION:
                raise ImportError(f"RULER tasks need nltk >= {'.'.join(map(str, NLTK_MIN_VERSION))}, found "
                                  f"{module.__version__}: {INSTALL_HINT}")


def _missing_internal(what: str) -> ImportError:
    import lm_eval

    return ImportError(f"lm-eval {getattr(lm_eval, '__version__', '?')} has no {what}, which oscar-hf's offline "
                       f"RULER relies on: pip install lm-eval=={LM_EVAL_VERSION}")


def _internal(module, name: str):
    """`module.name`, one of lm-eval's RULER internals this module relies on; ImportError in one line if absent."""
    if not hasattr(module, name):
        raise _missing_internal(f"{module.__name__}.{name}")
    return getattr(module, name)


@contextlib.contextmanager
def _swapped(owner, name: str, value):
    """`owner.name` is `value` inside the block, then what it was before."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def _ruler_module(name: str):
    """lm-eval's `lm_eval.tasks.ruler.<name>` (the module its task loader finds too); one-line ImportError if absent."""
    full = f"{RULER_PACKAGE}.{name}"
    try:
        return importlib.import_module(full)
    except ModuleNotFoundError as e:
        if e.name not in (full, RULER_PACKAGE, "lm_eval.tasks"):
            raise
        raise _missing_internal(full) from None


def import_prepare_niah():
    """lm-eval's `prepare_niah`, imported without its download: at import it calls `nltk.download("punkt_tab")` when
    that data is missing (then prints that it downloaded it); here `nltk.download` is a no-op meanwhile and that
    print is dropped. Needs `wonderwords` and `nltk`."""
    require_packages(_NIAH)
    name = f"{RULER_PACKAGE}.prepare_niah"
    if name in sys.modules:
        return sys.modules[name]
    import nltk

    with _swapped(nltk, "download", _no_download), contextlib.redirect_stdout(io.StringIO()):
        return _ruler_module("prepare_niah")


def _no_download(*args, **kwargs) -> bool:
    logger.debug("oscar-hf: not downloading nltk data %s (offline RULER splits sentences with a regex)", args)
    return False


def build_dataset(task_name: str, metadata: dict):
    """lm-eval's RULER dataset (`{"test": datasets.Dataset}`) for `task_name`, built offline from `metadata` (the
    task's lm-eval metadata: `max_seq_lengths`, `pretrained`/`tokenizer`, optionally `haystack_file`)."""
    from ..assets import resolve_pretrained

    task = OFFLINE_TASKS[task_name]
    metadata = dict(metadata)
    haystack_file = metadata.pop(HAYSTACK_KEY, None)
    for key in ("tokenizer", "pretrained"):  # RULER loads its tokenizer by name: `offline:NAME` -> local folder
        if isinstance(metadata.get(key), str):
            metadata[key] = resolve_pretrained(metadata[key])
    require_packages(task.packages)
    with contextlib.ExitStack() as patches:
        if task.module == "niah_utils":
            prepare_niah = import_prepare_niah()  # before niah_utils, which imports it
            _internal(prepare_niah, "cached_sent_tokenize")
            patches.enter_context(_swapped(prepare_niah, "cached_sent_tokenize", _split_sentences_cached))
            niah_utils = _ruler_module("niah_utils")
            lm_eval_get_haystack = _internal(niah_utils, "get_haystack")
            patches.enter_context(_swapped(niah_utils, "get_haystack",
                                           functools.partial(_haystack, haystack_file, lm_eval_get_haystack)))
        dataset_function = _internal(_ruler_module(task.module), task.function)
        return dataset_function(**metadata)


# The functions the written task files name as `custom_dataset` (one per task, named after it).
def niah_single_1(**metadata):
    return build_dataset("niah_single_1", metadata)


def niah_single_2(**metadata):
    return build_dataset("niah_single_2", metadata)


def niah_single_3(**metadata):
    return build_dataset("niah_single_3", metadata)


def niah_multikey_1(**metadata):
    return build_dataset("niah_multikey_1", metadata)


def niah_multikey_2(**metadata):
    return build_dataset("niah_multikey_2", metadata)


def niah_multikey_3(**metadata):
    return build_dataset("niah_multikey_3", metadata)


def niah_multivalue(**metadata):
    return build_dataset("niah_multivalue", metadata)


def niah_multiquery(**metadata):
    return build_dataset("niah_multiquery", metadata)


def ruler_vt(**metadata):
    return build_dataset("ruler_vt", metadata)


def ruler_cwe(**metadata):
    return build_dataset("ruler_cwe", metadata)


def ruler_fwe(**metadata):
    return build_dataset("ruler_fwe", metadata)


# ------------------------------------------------------------------------------------------------ task files
class _Function(str):
    """The text of a YAML `!function` tag (a dotted function name), kept as a tag when written back."""


class _Loader(yaml.SafeLoader):
    pass


class _Dumper(yaml.SafeDumper):
    pass


_Loader.add_constructor("!function", lambda loader, node: _Function(loader.construct_scalar(node)))
_Dumper.add_representer(_Function, lambda dumper, value: dumper.represent_scalar("!function", str(value)))


def _absolute_functions(value):
    """`value` (a parsed task file) with every `!function module.name` made `!function lm_eval.tasks.ruler.module.name`:
    lm-eval resolves a bare module name next to the YAML, and the written files live elsewhere."""
    if isinstance(value, _Function):
        return _Function(f"{RULER_PACKAGE}.{value}")
    if isinstance(value, dict):
        return {k: _absolute_functions(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_absolute_functions(v) for v in value]
    return value


def lm_eval_ruler_dir() -> Path | None:
    """lm-eval's `tasks/ruler/` folder, or None when this lm-eval has none."""
    import lm_eval.tasks

    folder = Path(lm_eval.tasks.__file__).resolve().parent / "ruler"
    return folder if folder.is_dir() else None


class _DropTakeOverWarnings(logging.Filter):
    """Drops lm-eval's index warning "Task NAME from FILE overrides existing task from FILE" for the offline RULER
    tasks (written by `write_task_files`): expected, and else 11 lines on every run whatever the tasks."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (str(record.msg).startswith("Task '%s' from %s overrides existing task") and len(args) == 3
                    and args[0] in OFFLINE_TASKS and Path(str(args[1])).parent.name == "ruler")


@contextlib.contextmanager
def quiet_task_takeover():
    """Inside the block, lm-eval's task index does not warn that the offline RULER tasks take over its own names."""
    index_logger = logging.getLogger("lm_eval.tasks._index")
    dropping = _DropTakeOverWarnings()
    index_logger.addFilter(dropping)
    try:
        yield
    finally:
        index_logger.removeFilter(dropping)


def write_task_files(folder: Path) -> list[str]:
    """Writes the offline RULER task files into `folder/ruler/`; returns the task names written (none when lm-eval
    has no RULER). Each is lm-eval's YAML with `custom_dataset` set to this module's function of the same name,
    every other `!function` made absolute, and `tag` dropped (lm-eval's `longcxt` tag keeps listing these names,
    which then resolve to these files)."""
    source = lm_eval_ruler_dir()
    if source is None:
        return []
    target = Path(folder) / "ruler"
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for name, task in OFFLINE_TASKS.items():
        path = source / task.yaml_file
        if not path.is_file():
            logger.warning("oscar-hf: lm-eval has no %s; offline task %s not registered", path, name)
            continue
        config = _absolute_functions(yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader))
        config.pop("tag", None)
        config["custom_dataset"] = _Function(f"{__name__}.{name}")
        (target / task.yaml_file).write_text(yaml.dump(config, Dumper=_Dumper, sort_keys=False), encoding="utf-8")
        written.append(name)
    return written
