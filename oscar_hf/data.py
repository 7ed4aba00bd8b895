"""Calibration and evaluation text: where it comes from, and how it becomes fixed-length token sequences.

A data spec is one of:
- `None` / `"default"`: the calibration split of the offline Paul Graham essays (`assets.essay_split`);
- a path to a `.txt` file (one document), or a `.json` / `.jsonl` file of strings or of objects with a `"text"` field;
- a list of strings (documents given in memory, from Python);
- `"hf:NAME[:CONFIG][:SPLIT][:COLUMN]"`: a dataset loaded with the `datasets` library (Hub names work where a hub is
  reachable, local dataset folders and the offline datasets cache work everywhere).
Every loader returns the documents and a description that is recorded in the rotation file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch


def load_texts(spec: str | Path | list[str] | None = None) -> tuple[list[str], dict]:
    """`(documents, description)` for a data spec (see module docstring)."""
    if spec is None or str(spec) == "default":
        from .assets import ESSAYS_PACKAGE, essay_split

        essays = essay_split("calibration")
        return list(essays.values()), {
            "source": f"pip:{ESSAYS_PACKAGE} Paul Graham essays, calibration split",
            "documents": list(essays),
        }
    if isinstance(spec, (list, tuple)):  # documents given in memory (Python callers)
        if not spec or not all(isinstance(d, str) for d in spec) or not any(d.strip() for d in spec):
            raise ValueError("calibration data given as a list must be a non-empty list of non-empty strings")
        docs = [d for d in spec if d.strip()]
        digest = hashlib.sha256("\0".join(docs).encode()).hexdigest()
        return docs, {"source": "in-memory documents", "sha256": digest, "documents": len(docs)}
    if not isinstance(spec, (str, Path)):
        raise TypeError(f"calibration data must be a path, 'default', 'hf:...' or a list of strings, not {type(spec).__name__}")
    spec = str(spec)
    if spec.startswith("hf:"):
        return _load_hf(spec)
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"calibration data {spec!r} is neither a file, 'default', nor 'hf:NAME[:CONFIG][:SPLIT][:COLUMN]'")
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if path.suffix == ".jsonl":
        docs = [_doc_text(_parse_json(line, path, number), path)
                for number, line in enumerate(raw.splitlines(), 1) if line.strip()]
    elif path.suffix == ".json":
        data = _parse_json(raw, path)
        if not isinstance(data, list):
            raise ValueError(f"{path}: a .json calibration file must hold a list of strings or of {{'text': ...}} objects")
        docs = [_doc_text(item, path) for item in data]
    else:
        docs = [raw]
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise ValueError(f"{path}: no text found")
    return docs, {"source": str(path.resolve()), "sha256": hashlib.sha256(raw.encode()).hexdigest(), "documents": len(docs)}


def _parse_json(text: str, path: Path, line: int | None = None):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        where = f"line {line}" if line is not None else f"line {e.lineno} column {e.colno}"
        raise ValueError(f"{path}: not valid JSON at {where}: {e.msg}") from None


def _doc_text(item, path: Path) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, dict) and isinstance(item.get("text"), str):
        return item["text"]
    raise ValueError(f"{path}: each entry must be a string or an object with a string 'text' field, got {item!r:.80}")


def _load_hf(spec: str) -> tuple[list[str], dict]:
    try:
        import datasets
    except ImportError:
        raise ImportError("loading 'hf:' calibration data needs the `datasets` package: pip install datasets") from None
    parts = spec[3:].split(":")
    name = parts[0]
    config = parts[1] or None if len(parts) > 1 else None
    split = parts[2] if len(parts) > 2 and parts[2] else "train"
    column = parts[3] if len(parts) > 3 and parts[3] else "text"
    ds = datasets.load_dataset(name, config, split=split)
    if column not in ds.column_names:
        raise ValueError(f"dataset {name!r} split {split!r} has no column {column!r}; columns: {ds.column_names}")
    docs = [t for t in ds[column] if isinstance(t, str) and t.strip()]
    return docs, {"source": f"datasets:{name}", "config": config, "split": split, "column": column, "documents": len(docs)}


def token_sequences(tokenizer, documents: list[str], sequence_length: int, count: int, offset: int = 0) -> list[torch.Tensor]:
    """`count` sequences of `sequence_length` token ids from the concatenated documents, skipping `offset` tokens.

    Documents are joined with a blank line; each sequence starts with the tokenizer's own prefix (e.g. a BOS token,
    for models that expect one) followed by a contiguous slice of the stream.
    """
    prefix = sequence_prefix(tokenizer)
    stream = tokenizer("\n\n".join(documents), add_special_tokens=False)["input_ids"]
    body = sequence_length - len(prefix)
    needed = offset + count * body
    if len(stream) < needed:
        raise ValueError(
            f"the text has {len(stream)} tokens but {count} sequence(s) of {sequence_length} tokens "
            f"(after skipping {offset}) need {needed}; give more data or fewer tokens"
        )
    return [
        torch.tensor(prefix + stream[offset + i * body : offset + (i + 1) * body], dtype=torch.long)
        for i in range(count)
    ]


def sequence_prefix(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts before a text (e.g. BOS), without a trailing EOS."""
    prefix = tokenizer("", add_special_tokens=True)["input_ids"]
    if tokenizer.eos_token_id is not None and prefix and prefix[-1] == tokenizer.eos_token_id:
        prefix = prefix[:-1]
    return prefix


def stream_length(tokenizer, documents: list[str]) -> int:
    return len(tokenizer("\n\n".join(documents), add_special_tokens=False)["input_ids"])
