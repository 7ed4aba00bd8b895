"""`oscar-hf` command line: calibrate | generate | demo | eval | report | lm-eval.

Models are given as a local folder, a Hub repo id, or `offline:NAME` for a model that installs from PyPI
(`oscar-hf demo` uses `offline:smollm2-135m`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(spec: str, dtype: str = "bfloat16", device_map: str | None = None, attn: str = "oscar"):
    """`(model, tokenizer, path)` from a folder, a Hub id, or `offline:NAME`."""
    import oscar_hf  # noqa: F401  (registers the "oscar" attention)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = spec
    if spec.startswith("offline:"):
        from .assets import model_path

        path = str(model_path(spec.split(":", 1)[1]))
    kwargs = {"dtype": DTYPES[dtype], "attn_implementation": attn}
    if device_map:
        kwargs["device_map"] = device_map
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer, path


def _config(path: str | None, **overrides):
    from .config import OscarConfig

    config = OscarConfig.load(path) if path else OscarConfig()
    changes = {k: v for k, v in overrides.items() if v is not None}
    return config.replace(**changes) if changes else config


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def cmd_calibrate(args) -> int:
    from .calibrate import calibrate

    model, tokenizer, _ = load_model(args.model, args.dtype, args.device_map, attn="sdpa")
    config = _config(args.config, calibration_tokens=args.tokens, center_keys=True if args.center_keys else None)
    rotations = calibrate(model, tokenizer, data=args.data, config=config, progress=not args.quiet)
    out = rotations.save_pretrained(args.output)
    print(rotations.report.summary())
    print(f"saved {out / 'oscar_rotations.safetensors'} and {out / 'oscar_rotations.json'}")
    return 0


def _generate(model, tokenizer, prompt_ids, cache, max_new_tokens):
    from .metrics import cache_kwarg

    start = time.perf_counter()
    extra = {cache_kwarg(model): cache} if cache is not None else {}
    out = model.generate(
        prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=max_new_tokens, do_sample=False,
        pad_token_id=tokenizer.eos_token_id, **extra,
    )
    return out[0, prompt_ids.shape[1]:], time.perf_counter() - start


def _memory_lines(report: dict) -> list[str]:
    return [
        f"  tokens in cache          {report['tokens']}",
        f"  OSCAR layers             {report['oscar_layers']} (sliding-window layers: {report['sliding_layers']})",
        f"  KV bytes allocated       {_human(report['total_allocated_bytes'])} vs BF16 DynamicCache "
        f"{_human(report['bf16_equivalent_bytes'])}  ({report['compression']:.2f}x smaller)",
        f"  bits per element         {report['bits_per_element']:.3f} allocated, {report['bits_per_element_used']:.3f} "
        "used (sink + window + history, metadata included)",
    ]


def cmd_generate(args) -> int:
    from .cache import OscarCache
    from .rotations_io import OscarRotations

    model, tokenizer, _ = load_model(args.model, args.dtype, args.device_map)
    rotations = OscarRotations.from_pretrained(args.rotations)
    config = _config(args.config)
    prompt = Path(args.prompt_file).read_text() if args.prompt_file else args.prompt
    if prompt is None:
        print("give --prompt or --prompt-file", file=sys.stderr)
        return 2
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.get_input_embeddings().weight.device)
    cache = OscarCache(model, rotations, config)
    tokens, seconds = _generate(model, tokenizer, ids, cache, args.max_new_tokens)
    print(tokenizer.decode(tokens, skip_special_tokens=True))
    print(f"\n[{len(tokens)} tokens in {seconds:.1f} s]")
    print("\n".join(_memory_lines(cache.memory_report())))
    if args.compare:
        ref, ref_seconds = _generate(model, tokenizer, ids, None, args.max_new_tokens)
        same = _common_prefix(tokens.tolist(), ref.tolist())
        print(f"\nBF16 DynamicCache [{ref_seconds:.1f} s]: {tokenizer.decode(ref, skip_special_tokens=True)}")
        print(f"first {same} of {len(ref)} greedy tokens identical to BF16")
    return 0


def _common_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def cmd_demo(args) -> int:
    """The main job: calibrate the bundled model, save/load rotations, generate, compare with BF16."""
    from . import assets
    from .cache import OscarCache
    from .calibrate import calibrate
    from .config import OscarConfig
    from .data import token_sequences
    from .metrics import cache_kwarg, perplexity
    from .rotations_io import OscarRotations

    torch.manual_seed(0)
    print(f"== 1. model: {args.model}")
    model, tokenizer, path = load_model(args.model, args.dtype)
    out_dir = Path(args.output)
    print(f"== 2. calibrating OSCAR rotations ({args.tokens} tokens, calibration split of the essays)")
    rotations = calibrate(model, tokenizer, config=OscarConfig(calibration_tokens=args.tokens), progress=True)
    print(rotations.report.summary())
    rotations.save_pretrained(out_dir)
    print(f"== 3. saved to {out_dir}; reloading with OscarRotations.from_pretrained")
    rotations = OscarRotations.from_pretrained(out_dir)

    eval_docs = list(assets.essay_split("eval").values())
    prompt_ids = token_sequences(tokenizer, eval_docs, args.prompt_tokens, 1)[0].unsqueeze(0)
    print(f"== 4. greedy generation, {args.prompt_tokens}-token prompt from the evaluation essays, {args.new_tokens} new tokens")
    cache = OscarCache(model, rotations)
    oscar_tokens, oscar_s = _generate(model, tokenizer, prompt_ids, cache, args.new_tokens)
    bf16_tokens, bf16_s = _generate(model, tokenizer, prompt_ids, None, args.new_tokens)
    same = _common_prefix(oscar_tokens.tolist(), bf16_tokens.tolist())
    print(f"  OSCAR [{oscar_s:.1f} s]: {tokenizer.decode(oscar_tokens, skip_special_tokens=True)[:300]!r}")
    print(f"  BF16  [{bf16_s:.1f} s]: {tokenizer.decode(bf16_tokens, skip_special_tokens=True)[:300]!r}")
    print(f"  first {same} of {len(bf16_tokens)} greedy tokens identical")
    print("\n".join(_memory_lines(cache.memory_report())))

    print(f"== 5. KV memory after a {args.long_tokens}-token prefill (measured)")
    long_ids = token_sequences(tokenizer, eval_docs, args.long_tokens, 1)[0].unsqueeze(0)
    long_cache = OscarCache(model, rotations)
    with torch.no_grad():
        model(input_ids=long_ids, use_cache=True, **{cache_kwarg(model): long_cache})
    report = long_cache.memory_report()
    print("\n".join(_memory_lines(report)))

    print("== 6. perplexity through the cache (2048-token evaluation sequences, context 512, chunks of 128)")
    seqs = token_sequences(tokenizer, eval_docs, 2048, args.ppl_sequences)
    naive = OscarRotations.data_free(model, "identity")
    results = {}
    for name, factory in (
        ("BF16 DynamicCache", None),
        ("OSCAR INT2", lambda: OscarCache(model, rotations)),
        ("naive INT2 (no rotation, no clip)", lambda: OscarCache(model, naive, OscarConfig(key_clip="none", value_clip="none"))),
    ):
        results[name] = perplexity(model, seqs, factory)["perplexity"]
        print(f"  {name:36s} {results[name]:8.2f}")
    summary = {
        "model": args.model,
        "dtype": args.dtype,
        "calibration_seconds": rotations.metadata["calibration"]["seconds"],
        "greedy_tokens_identical": same,
        "new_tokens": len(bf16_tokens),
        "memory_at_long_prefill": report,
        "perplexity": results,
    }
    (out_dir / "demo_summary.json").write_text(json.dumps(summary, indent=2))
    print(f"== done; summary in {out_dir / 'demo_summary.json'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oscar-hf", description="OSCAR 2-bit KV cache for Hugging Face Transformers")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("calibrate", help="calibrate rotations and clips for a model")
    p.add_argument("--model", required=True, help="folder, Hub repo id, or offline:NAME")
    p.add_argument("--output", required=True, help="folder for oscar_rotations.{safetensors,json}")
    p.add_argument("--data", default=None, help="text/json/jsonl file, 'hf:NAME[:CONFIG][:SPLIT][:COLUMN]', or default")
    p.add_argument("--tokens", type=int, default=None, help="calibration tokens (default 8192)")
    p.add_argument("--config", default=None, help="OscarConfig as YAML or JSON")
    p.add_argument("--center-keys", action="store_true",
                   help="subtract the calibrated per-(layer, KV head) key mean before storing keys (OscarConfig."
                        "center_keys; helps models whose keys carry a large mean, e.g. Qwen2.5, Gemma 3)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--device-map", default=None, help="e.g. auto (accelerate) to spread a large model over devices")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("generate", help="generate with OscarCache")
    p.add_argument("--model", required=True)
    p.add_argument("--rotations", required=True, help="folder or Hub repo id with oscar_rotations.*")
    p.add_argument("--prompt", default=None)
    p.add_argument("--prompt-file", default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--config", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--device-map", default=None)
    p.add_argument("--compare", action="store_true", help="also generate with a BF16 DynamicCache")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("demo", help="calibrate the bundled SmolLM2-135M, generate, compare with BF16")
    p.add_argument("--model", default="offline:smollm2-135m")
    p.add_argument("--output", default="oscar-demo")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--long-tokens", type=int, default=8000)
    p.add_argument("--ppl-sequences", type=int, default=3)
    p.set_defaults(func=cmd_demo)

    # The evaluation harness lives in oscar_hf.evaluation; only the argument wiring is here.
    from .evaluation import report, runner

    p = sub.add_parser("eval", help="accuracy evaluation: ppl | ablations | diagnostics | niah | lm-eval | all")
    runner.add_eval_arguments(p)
    p.set_defaults(func=runner.run)

    p = sub.add_parser("report", help="per-layer quantization error on your data (attention KL, output error)")
    report.add_arguments(p)
    p.set_defaults(func=report.run)

    p = sub.add_parser("lm-eval", add_help=False, help="lm-eval's command line with the 'oscar' model type registered")
    p.set_defaults(func=None)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["lm-eval"]:  # everything after it goes to lm-eval's own parser
        from .evaluation.lm_eval_model import cli_main

        return cli_main(argv[1:])
    args = build_parser().parse_args(argv)
    torch.set_grad_enabled(False)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
