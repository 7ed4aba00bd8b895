"""The `oscar` model type for lm-eval (EleutherAI lm-evaluation-harness 0.4.x), where scoring goes through the cache.

    oscar-hf lm-eval --model oscar \\
        --model_args pretrained=offline:smollm2-135m,method=oscar,rotations=ROT_DIR,dtype=bfloat16 \\
        --tasks oscar_bb_siqa --num_fewshot 5 --device cpu --batch_size 1
    # same as: python -m oscar_hf.evaluation.lm_eval_model --model oscar ...

lm-eval 0.4.13 discovers model types only through its registry, so `lm_eval --model oscar` works once this module is
imported; the two commands above import it, add this package's offline tasks (`--include_path`), and hand the
arguments to lm-eval's own command line. In Python: `OscarLM(pretrained=model, tokenizer=tok, method="oscar",
rotations=rot)` with `lm_eval.simple_evaluate(model=lm, tasks=[...], task_manager=task_manager())`.

Why a model type and not `generation_kwargs`: a plain HFLM scores a loglikelihood request with ONE forward pass over
context + continuation, in which every token attends to the others in full precision; a quantized cache, even if
passed in, would never be read (lm-eval issues #1105, #3298). `OscarLM` scores through the cache instead:
- loglikelihood (multiple choice, perplexity): the context, minus its last token, is prefilled into a fresh cache of
  the chosen method; then the last context token and the continuation are fed in chunks of `score_chunk` tokens,
  so every continuation token is predicted by a query that attends to the stored (sink / quantized / window) context.
  Requests that share a context reuse one prefill (the cache is copied).
- generate_until: `generate()` with a fresh cache of the method (the prompt prefill is exact, as in real use; every
  generated token attends to the stored prompt).
Short contexts stay entirely inside the full-precision sink + window (64 + 256 tokens by default), where nothing is
quantized: use `sink=`, `window=` and `residual=` (KIVI / HF cache) to shrink the windows, and/or few-shot prompts.

model_args (besides HFLM's): method (see `oscar_hf.evaluation.methods`, default "oscar"), rotations (folder or Hub
id, for calibrated methods), sink, window, residual, score_chunk (default 128).
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
from pathlib import Path

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm

from ..metrics import cache_kwarg
from ..rotations_io import OscarRotations
from .methods import Windows, get_method

TASKS_DIR = Path(__file__).resolve().parent / "tasks"


@register_model("oscar")
class OscarLM(HFLM):
    """HFLM whose loglikelihood and generation go through an OscarCache / KIVI / BF16 / HF quantized cache."""

    def __init__(self, pretrained="offline:smollm2-135m", method: str = "oscar", rotations=None, sink: int = 64,
                 window: int = 256, residual: int = 128, score_chunk: int = 128, **kwargs):
        if isinstance(pretrained, str):
            if pretrained.startswith("offline:"):
                from ..assets import model_path

                pretrained = str(model_path(pretrained.split(":", 1)[1]))
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
        return results

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        generation_kwargs[cache_kwarg(self.model)] = self.make_cache()
        return super()._model_generate(context, max_length, stop, **generation_kwargs)


# ------------------------------------------------------------------------------------------------ offline tasks
def task_dir() -> Path:
    """A folder with this package's offline lm-eval tasks, their data paths made absolute (lm-eval resolves
    `data_files` against the working directory, not the YAML): `oscar_bb_siqa` (BIG-bench social_iqa, multiple
    choice, few-shot pool of 50) and `oscar_pg_ppl` (rolling loglikelihood of 10 evaluation essays)."""
    folder = Path(tempfile.mkdtemp(prefix="oscar_lm_eval_tasks_"))
    test, fewshot = TASKS_DIR / "bb_siqa_test.jsonl", TASKS_DIR / "bb_siqa_fewshot.jsonl"
    (folder / "oscar_bb_siqa.yaml").write_text(
        (TASKS_DIR / "oscar_bb_siqa.yaml").read_text().replace("@TEST@", str(test)).replace("@FEWSHOT@", str(fewshot))
    )
    from ..assets import essay_split

    essays = list(essay_split("eval").values())[:10]
    data = folder / "pg_ppl.jsonl"
    data.write_text("".join(json.dumps({"text": e[:3000]}) + "\n" for e in essays))
    (folder / "oscar_pg_ppl.yaml").write_text((TASKS_DIR / "oscar_pg_ppl.yaml").read_text().replace("@DATA@", str(data)))
    return folder


def task_manager():
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(task_dir()))


def cli_main(argv: list[str] | None = None) -> int:
    """lm-eval's command line with the `oscar` model type registered and this package's tasks included."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--include_path" not in argv:
        argv += ["--include_path", str(task_dir())]
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    sys.argv = ["lm_eval"] + argv
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    return 0


# ------------------------------------------------------------------------------------------------ harness stage
def run_tasks(args) -> int:
    """`oscar-hf eval lm-eval`: the offline tasks for each method on one model; writes `<output>/<model>/lm_eval.json`."""
    import time

    import lm_eval

    from .methods import main_methods
    from .runner import Session, select

    windows = Windows(args.sink, args.window, args.residual)
    session = Session(args.model, args.output, args.dtype, args.calibration_tokens, windows, args.threads,
                      args.calibration_length)
    methods = select(main_methods(windows), args.methods)
    rotations = session.rotations(methods)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    manager = task_manager()
    results = {}
    for name, method in methods.items():
        start = time.perf_counter()
        lm = OscarLM(pretrained=session.model, tokenizer=session.tokenizer, method=name, rotations=rotations.get(name),
                     sink=windows.sink, window=windows.window, residual=windows.residual, batch_size=1)
        out = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, num_fewshot=args.num_fewshot,
                                      limit=args.limit, log_samples=False, bootstrap_iters=1000, random_seed=0,
                                      numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
        results[name] = {"results": out["results"], "n_samples": out.get("n-samples"),
                         "seconds": round(time.perf_counter() - start, 1)}
        summary = {t: {k: v for k, v in r.items() if isinstance(v, float)} for t, r in out["results"].items()}
        print(f"[{session.info['name']}] lm-eval {name}: {summary} ({results[name]['seconds']} s)", flush=True)
        meta = session.meta("lm-eval", methods, {
            "data": {"tasks": tasks, "num_fewshot": args.num_fewshot, "limit": args.limit,
                     "task_source": "BIG-bench social_iqa (bigbench 1.0.0 sdist, seed-0 shuffle, eval/build_tasks.py); "
                                    "pg essays (evaluation split)"},
            "calibration": session.calibration_meta(rotations),
            "protocol": "OscarLM: context prefilled into the method's cache, continuation scored in chunks through it"})
        session.write("lm_eval", meta, results)
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
