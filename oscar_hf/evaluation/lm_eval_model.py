"""The `oscar` model type for lm-eval (EleutherAI lm-evaluation-harness 0.4.x), where scoring goes through the cache.

    oscar-hf lm-eval --model oscar \\
        --model_args pretrained=smollm2-135m,method=oscar,rotations=ROT_DIR,dtype=bfloat16 \\
        --tasks oscar_bb_siqa_long --device cpu --batch_size 1
    # same as: python -m oscar_hf.evaluation.lm_eval_model --model oscar ...

`pretrained` may name a model that installs from PyPI (`smollm2-135m`, also `offline:smollm2-135m`), as everywhere in
oscar-hf: it is resolved to its local folder, never looked up on the Hub (`oscar-hf lm-eval` does so for any
`--model`, `hf` included).

lm-eval 0.4.13 discovers model types only through its registry, so `lm_eval --model oscar` works once this module is
imported; the two commands above import it, add this package's offline tasks (`--include_path`), and hand the
arguments to lm-eval's own command line. In Python: `OscarLM(pretrained=model, tokenizer=tok, method="oscar",
rotations=rot)` with `lm_eval.simple_evaluate(model=lm, tasks=[...], task_manager=task_manager())`. RULER's offline
tasks (`niah_*`, `ruler_vt/cwe/fwe`) come with them: see `oscar_hf.evaluation.ruler` (`--metadata
'{"max_seq_lengths":[4096]}'`, in Python `task_manager(metadata={...})`).

Why a model type and not `generation_kwargs`: a plain HFLM scores a loglikelihood request with ONE forward pass over
context + continuation, in which every token attends to the others in full precision; a quantized cache, even if
passed in, would never be read (lm-eval issues #1105, #3298). `OscarLM` scores through the cache instead:
- loglikelihood (multiple choice, perplexity): the context, minus its last token, is prefilled into a fresh cache of
  the chosen method; then the last context token and the continuation are fed in chunks of `score_chunk` tokens,
  so every continuation token is predicted by a query that attends to the stored (sink / quantized / window) context.
  Requests that share a context reuse one prefill (the cache is copied).
- generate_until: `generate()` with a fresh cache of the method (the prompt prefill is exact, as in real use; every
  generated token attends to the stored prompt).

Short contexts measure BF16, not the quantization: a context that fits the full-precision sink + window (64 + 256
tokens by default, plus one demotion block) is never quantized, so a 0-shot multiple-choice score (`oscar_bb_siqa`,
about 40 tokens a question) is the BF16 score. After every run the model logs how many scored tokens attended to
quantized history (`history_tokens` of `scored_tokens`; a warning when none did). To reach the history, use the
bundled `oscar_bb_siqa_long` (25-shot: about 900 tokens a question), `oscar_pg_ppl` (rolling perplexity of 3,000
characters), `--num_fewshot`, or smaller windows (`sink=`, `window=`, and `residual=` for KIVI / the HF cache).

model_args (besides HFLM's): method (see `oscar_hf.evaluation.methods`, default "oscar"), rotations (folder or Hub
id, for calibrated methods), sink, window, residual, score_chunk (default 128).
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import re
import sys
import tempfile
from pathlib import Path

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm

from .. import assets
from ..metrics import cache_kwarg
from ..rotations_io import OscarRotations
from .methods import Windows, get_method

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
logger = logging.getLogger("lm_eval.oscar")  # lm-eval's command line shows its "lm_eval" loggers


def quantized_tokens(cache) -> int:
    """Tokens (per sequence) that `cache` holds in quantized form in its full-attention layers: an OSCAR history below
    16 bits, KIVI's quantized blocks, the quantized part of transformers' QuantizedCache; 0 for a BF16 cache."""
    from ..cache import OscarLayer
    from .kivi import KiviLayer

    count = 0
    for layer in getattr(cache, "layers", ()):
        if isinstance(layer, OscarLayer):
            held = layer.plan.counts(layer.plan.current_length())[1] if layer.is_initialized and layer.fmt.bits < 16 else 0
        elif isinstance(layer, KiviLayer):
            held = max(layer.quantized_keys, layer.quantized_values)
        elif hasattr(layer, "_quantized_keys") and getattr(layer, "is_initialized", False):  # transformers' QuantizedLayer
            residual = layer.keys.shape[-2] if getattr(layer, "keys", None) is not None else 0
            held = getattr(layer, "cumulative_length", 0) - residual
        else:
            held = 0
        count = max(count, int(held))
    return count


@register_model("oscar")
class OscarLM(HFLM):
    """HFLM whose loglikelihood and generation go through an OscarCache / KIVI / BF16 / HF quantized cache."""

    def __init__(self, pretrained="offline:smollm2-135m", method: str = "oscar", rotations=None, sink: int = 64,
                 window: int = 256, residual: int = 128, score_chunk: int = 128, **kwargs):
        pretrained = assets.resolve_pretrained(pretrained)
        if isinstance(pretrained, str):
            import oscar_hf  # noqa: F401  (registers the "oscar" attention)

            kwargs.setdefault("attn_implementation", "oscar")
            kwargs.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
        super().__init__(pretrained=pretrained, **kwargs)
        self.method = get_method(method, Windows(int(sink), int(window), int(residual)))
        if isinstance(rotations, (str, Path)):
            rotations = OscarRotations.from_pretrained(str(rotations))
        if self.method.needs_calibration and rotations is None:
            raise ValueError(f"method {method!r} needs calibrated rotations: pass rotations=FOLDER (oscar-hf calibrate)")
        self.rotations = rotations
        self.score_chunk = int(score_chunk)
        if self.score_chunk < 1:
            raise ValueError("score_chunk must be >= 1")
        # What reached the quantized history: scored (loglikelihood) tokens whose query attended to at least one
        # quantized token, and generation requests whose prompt was partly quantized. See `history_report`.
        self.scored_tokens = self.history_tokens = 0
        self.generations = self.history_generations = 0

    def history_report(self) -> str:
        """One line: how much of the scoring went through quantized history (the rest measured full precision)."""
        parts = []
        if self.scored_tokens:
            parts.append(f"{self.history_tokens} of {self.scored_tokens} scored tokens "
                         f"({100 * self.history_tokens / self.scored_tokens:.0f}%) attended to quantized history")
        if self.generations:
            parts.append(f"{self.history_generations} of {self.generations} generation prompts reached it")
        windows = self.method.describe().get("oscar_config", {})
        held = (f"sink {windows['sink_tokens']} + window {windows['window_tokens']} tokens"
                if "sink_tokens" in windows else "its full-precision residual")
        return (f"OscarLM {self.method.name}: {'; '.join(parts) or 'nothing scored'}; the others saw only BF16 "
                f"({held}), so they measure BF16, not the quantization")

    def _log_history(self) -> None:
        if self.method.family == "bf16":
            return
        reached = self.history_tokens + self.history_generations
        (logger.warning if reached == 0 else logger.info)(self.history_report()
                                                            + ("" if reached else ": use longer contexts (e.g. "
                                                               "oscar_bb_siqa_long, --num_fewshot) or smaller windows"))

    def make_cache(self):
        return self.method.make_cache(self.model, self.rotations)

    def _copy_cache(self, cache):
        # Shared, read-only objects (rotations, model config) are not copied.
        memo = {id(self.rotations): self.rotations, id(self.model.config): self.model.config}
        text = self.model.config.get_text_config(decoder=True)
        memo[id(text)] = text
        return copy.deepcopy(cache, memo)

    @torch.no_grad()
    def _forward(self, ids: list[int], cache) -> torch.Tensor:
        """Feeds `ids` through `cache` in chunks of `score_chunk`; returns their logits `[len(ids), vocab]` (float32)."""
        kwarg = cache_kwarg(self.model)
        out = []
        for start in range(0, len(ids), self.score_chunk):
            chunk = torch.tensor([ids[start : start + self.score_chunk]], device=self.device)
            out.append(self.model(input_ids=chunk, use_cache=True, **{kwarg: cache}).logits[0].float())
            # the chunk's queries attended to whatever was quantized once its own tokens were stored
            self.scored_tokens += chunk.shape[1]
            self.history_tokens += chunk.shape[1] if quantized_tokens(cache) else 0
        return torch.cat(out)

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        """`requests`: `[((context, continuation) strings or None, context_ids, continuation_ids)]` ->
        `[(sum of continuation log-probabilities, continuation is the greedy output)]`."""
        kwarg = cache_kwarg(self.model)
        split = []
        for _, context, continuation in requests:
            if not context or not continuation:
                raise ValueError("loglikelihood requests need a non-empty context and continuation")
            full = (context + continuation)[-(self.max_length + 1):]
            inputs = full[:-1]
            n = min(len(continuation), len(inputs))
            split.append((tuple(inputs[:-n]), inputs[-n:], full[-n:]))
        order = sorted(range(len(requests)), key=lambda i: split[i][0])
        results: list = [None] * len(requests)
        prefix_key, prefix_cache = None, None
        for i in tqdm(order, disable=disable_tqdm or self.rank != 0, desc=f"loglikelihood through {self.method.name}"):
            prefix, scored_inputs, targets = split[i]
            if prefix != prefix_key:
                prefix_key, prefix_cache = prefix, self.make_cache()
                if prefix:
                    self.model(input_ids=torch.tensor([prefix], device=self.device), use_cache=True, logits_to_keep=1,
                               **{kwarg: prefix_cache})
            cache = self._copy_cache(prefix_cache)
            logprobs = torch.log_softmax(self._forward(scored_inputs, cache), dim=-1)
            target = torch.tensor(targets, device=logprobs.device)
            answer = (float(logprobs.gather(-1, target.unsqueeze(-1)).sum()), bool((logprobs.argmax(-1) == target).all()))
            results[i] = answer
            if requests[i][0] is not None:
                self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
        self._log_history()
        return results

    def generate_until(self, requests, disable_tqdm: bool = False):
        out = super().generate_until(requests, disable_tqdm=disable_tqdm)
        self._log_history()
        return out

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        cache = generation_kwargs[cache_kwarg(self.model)] = self.make_cache()
        out = super()._model_generate(context, max_length, stop, **generation_kwargs)
        self.generations += context.shape[0]
        self.history_generations += context.shape[0] if quantized_tokens(cache) else 0
        return out


# ------------------------------------------------------------------------------------------------ offline tasks
def task_dir() -> Path:
    """A folder with this package's offline lm-eval tasks, their data paths made absolute (lm-eval resolves
    `data_files` against the working directory, not the YAML): `oscar_bb_siqa` (BIG-bench social_iqa, multiple
    choice, few-shot pool of 50; 0-shot by default, which stays in the BF16 windows), `oscar_bb_siqa_long` (the same,
    25-shot by default: most of each context is in the quantized history), `oscar_pg_ppl` (rolling
    loglikelihood of 10 evaluation essays), and RULER's 11 offline tasks under lm-eval's names (`niah_*`,
    `ruler_vt`, `ruler_cwe`, `ruler_fwe`), made to run without network by `oscar_hf.evaluation.ruler`."""
    folder = Path(tempfile.mkdtemp(prefix="oscar_lm_eval_tasks_"))
    test, fewshot = TASKS_DIR / "bb_siqa_test.jsonl", TASKS_DIR / "bb_siqa_fewshot.jsonl"
    (folder / "oscar_bb_siqa.yaml").write_text(
        (TASKS_DIR / "oscar_bb_siqa.yaml").read_text().replace("@TEST@", str(test)).replace("@FEWSHOT@", str(fewshot))
    )
    (folder / "oscar_bb_siqa_long.yaml").write_text((TASKS_DIR / "oscar_bb_siqa_long.yaml").read_text())
    from ..assets import essay_split
    from .ruler import write_task_files

    essays = list(essay_split("eval").values())[:10]
    data = folder / "pg_ppl.jsonl"
    data.write_text("".join(json.dumps({"text": e[:3000]}) + "\n" for e in essays))
    (folder / "oscar_pg_ppl.yaml").write_text((TASKS_DIR / "oscar_pg_ppl.yaml").read_text().replace("@DATA@", str(data)))
    write_task_files(folder)
    return folder


def task_manager(metadata: dict | None = None):
    """lm-eval's `TaskManager` with this package's offline tasks, `metadata` given to every task as lm-eval's
    `--metadata` is (RULER reads `max_seq_lengths`, `pretrained` or `tokenizer` to size its prompts, and
    `haystack_file`). Pass metadata here: `simple_evaluate` ignores its own `metadata=` once given a task manager.
    One manager per distinct (JSON-able) `metadata` is built per process (indexing lm-eval's own tasks takes
    10-20 s on a small CPU), then reused."""
    return _task_manager(json.dumps(metadata or {}, sort_keys=True))


@functools.lru_cache(maxsize=None)
def _task_manager(metadata_json: str):
    from lm_eval.tasks import TaskManager

    from .ruler import quiet_task_takeover

    with quiet_task_takeover():
        return TaskManager(include_path=str(task_dir()), metadata=json.loads(metadata_json) or None)


def cli_main(argv: list[str] | None = None) -> int:
    """lm-eval's command line with the `oscar` model type registered and this package's tasks included."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    argv = resolve_model_args(list(sys.argv[1:] if argv is None else argv))
    if "--include_path" not in argv:
        argv += ["--include_path", str(task_dir())]
    from lm_eval.__main__ import cli_evaluate

    from .ruler import quiet_task_takeover

    saved = sys.argv
    sys.argv = ["lm_eval"] + argv
    try:
        with quiet_task_takeover():
            cli_evaluate()
    finally:
        sys.argv = saved
    return 0


def resolve_model_args(argv: list[str]) -> list[str]:
    """`argv` with `pretrained=NAME` of `--model_args` (any `--model`, `hf` included) resolved by
    `assets.resolve_pretrained`: a model installed from PyPI becomes its local folder, so lm-eval never asks the Hub."""

    def resolve(match):
        return f"{match.group(1)}{assets.resolve_pretrained(match.group(2))}"

    out, in_args = [], False
    for arg in argv:
        if arg.startswith("-"):
            in_args = arg in ("--model_args", "-a") or arg.startswith("--model_args=")
        if in_args:
            arg = re.sub(r"((?:^|[,=\s])pretrained=)([^,\s]+)", resolve, arg)
            arg = re.sub(r'("pretrained"\s*:\s*")([^"]+)', resolve, arg)  # the JSON form
        out.append(arg)
    return out


if __name__ == "__main__":
    sys.exit(cli_main())
