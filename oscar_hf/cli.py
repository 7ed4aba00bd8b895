"""`oscar-hf` command line: calibrate | generate | demo | export | eval | report | lm-eval.

Models are given as a local folder, a Hub repo id, or the name of a model that installs from PyPI (`smollm2-135m`,
also written `offline:smollm2-135m`; `oscar-hf demo` uses it). A mistake in what was asked for (a missing path, a bad
file, a bad value, an unsupported model) prints one line `oscar-hf: error: ...` and exits with status 2; `--debug` (or
`OSCAR_HF_DEBUG=1`) shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch

from .config import DTYPES
from .loading import (MODEL_HELP, UsageError, check_rotation_path, first_line, load_config, load_model,  # noqa: F401
                      load_rotations, model_config, resolve_model)

def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# ------------------------------------------------------------------------------------------------ commands
def cmd_calibrate(args) -> int:
    from .calibrate import calibrate
    from .models import text_config
    from .rotations_io import weight_fingerprint

    if args.data not in (None, "default") and not args.data.startswith("hf:") and not Path(args.data).is_file():
        raise UsageError(f"calibration data file {args.data} not found")
    config, calibration, targets = load_config(args.config, calibration=True)
    changes = dict(tokens=args.tokens, center_keys=True if args.center_keys else None,
                   wide_heads="none" if args.no_wide_heads else None, key_channel_bits=args.key_channel_bits)
    calibration = calibration.replace(**{k: v for k, v in changes.items() if v is not None})
    path, model_cfg = model_config(args.model)
    output = args.output
    if output is None:
        if not Path(path).is_dir():
            raise UsageError(f"give --output FOLDER: {args.model!r} is not a local folder to write the rotations beside")
        output = str(Path(path) / "oscar")
    calibration = _fit_to_positions(calibration, getattr(text_config(model_cfg), "max_position_embeddings", None))
    calibration = _whole_sequences(calibration, "--tokens" if args.tokens is not None else "CalibrationConfig.tokens")
    model, tokenizer, path = load_model(args.model, args.dtype, args.device_map, attn="sdpa", tokenizer=args.tokenizer)
    rotations = calibrate(model, tokenizer, data=args.data, config=config, calibration=calibration,
                          progress=not args.quiet, targets=targets)
    rotations.metadata["weight_fingerprint"] = weight_fingerprint(model)
    out = rotations.save_pretrained(output)
    print(rotations.report.summary())
    print(f"saved {out / 'oscar_rotations.safetensors'} and {out / 'oscar_rotations.json'}")
    return 0


def _fit_to_positions(config, max_positions: int | None):
    """Calibration sequences no longer than the model's positions (GPT-2: 1024; the default length is 2048)."""
    if not max_positions:
        return config
    changes = {name: max_positions for name in ("sequence_length", "heldout_tokens")
               if getattr(config, name) > max_positions}
    if changes:
        names = {"sequence_length": "calibration sequence length", "heldout_tokens": "held-out tokens"}
        print(f"oscar-hf: note: {' and '.join(names[n] for n in changes)} lowered to the model's {max_positions} "
              "positions", file=sys.stderr)
    return config.replace(**changes) if changes else config


def _whole_sequences(calibration, what: str):
    """Calibration runs whole sequences of `sequence_length` tokens: a token count below one sequence is refused (it
    would silently become a whole sequence), one between two whole counts is rounded up, with a note."""
    import math

    tokens, length = calibration.tokens, calibration.sequence_length
    if tokens < length:
        raise UsageError(f"{what} {tokens} is less than one calibration sequence ({length} tokens, "
                         f"CalibrationConfig.sequence_length): give {length} or more, or a shorter sequence_length "
                         "in --config")
    whole = math.ceil(tokens / length) * length
    if whole != tokens:
        print(f"oscar-hf: note: {what} {tokens} rounded up to {whole} ({whole // length} whole sequences of "
              f"{length} tokens)", file=sys.stderr)
        calibration = calibration.replace(tokens=whole)
    return calibration


def _prompt_ids(tokenizer, prompt: str, chat: bool) -> torch.Tensor:
    """The prompt's token ids, inside the tokenizer's chat template when it has one and `chat` is on."""
    if chat and getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=True)
        return encoded["input_ids"]
    return tokenizer(prompt, return_tensors="pt").input_ids


def _generate(model, tokenizer, prompt_ids, cache, max_new_tokens):
    from .metrics import cache_kwarg

    start = time.perf_counter()
    extra = {cache_kwarg(model): cache} if cache is not None else {}
    out = model.generate(
        prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=max_new_tokens, do_sample=False,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id, **extra,
    )
    return out[0, prompt_ids.shape[1]:], time.perf_counter() - start


def _memory_lines(cache) -> list[str]:
    """The cache's memory, told truthfully at any length: bytes holding tokens ("used") apart from bytes reserved
    ahead, and plainly when every token still sits in the BF16 sink/window."""
    report = cache.memory_report()
    tokens, cfg = report["tokens"], cache.oscar_config
    quantized = cache.plan.counts(tokens)[1]
    used = report["oscar_used_bytes"] + report["sliding_bytes"]
    bf16 = report["bf16_equivalent_bytes"]
    lines = [
        f"  tokens in cache          {tokens} ({max(quantized, 0)} in the INT{cfg.bits} history)",
        f"  OSCAR layers             {report['oscar_layers']} (sliding-window layers: {report['sliding_layers']})",
    ]
    if quantized <= 0:
        lines.append(
            f"  all {tokens} tokens are still in the BF16 sink/window: nothing is quantized yet (the history starts "
            f"after {cfg.sink_tokens + cfg.window_tokens + cfg.demotion_block} tokens)"
        )
        lines.append(f"  KV bytes used            {_human(used)} (BF16 DynamicCache: {_human(bf16)})")
    else:
        lines.append(f"  KV bytes used            {_human(used)} vs BF16 DynamicCache {_human(bf16)}  "
                     f"({bf16 / used:.2f}x smaller)")
    lines += [
        f"  KV bytes reserved        {_human(report['total_allocated_bytes'])} (allocated: spare capacity included)",
        f"  bits per element         {report['bits_per_element_used']:.3f} used, {report['bits_per_element']:.3f} "
        "reserved (sink + window + history, metadata included)",
    ]
    return lines


def cmd_generate(args) -> int:
    from .cache import OscarCache

    if args.prompt_file:
        if not Path(args.prompt_file).is_file():
            raise UsageError(f"prompt file {args.prompt_file} not found")
        prompt = Path(args.prompt_file).read_text()
    else:
        prompt = args.prompt
    if prompt is None:
        raise UsageError("give --prompt TEXT or --prompt-file FILE")
    if not prompt.strip():
        raise UsageError("the prompt is empty")
    config = load_config(args.config)
    check_rotation_path(args.rotations)  # before the model loads: a typo should not cost a minute
    model, tokenizer, _ = load_model(args.model, args.dtype, args.device_map, tokenizer=args.tokenizer)
    rotations = load_rotations(args.rotations, model, args.allow_other_weights)
    ids = _prompt_ids(tokenizer, prompt, chat=not args.no_chat).to(model.get_input_embeddings().weight.device)
    cache = OscarCache(model, rotations, config)
    tokens, seconds = _generate(model, tokenizer, ids, cache, args.max_new_tokens)
    print(tokenizer.decode(tokens, skip_special_tokens=True))
    print(f"\n[{len(tokens)} tokens in {seconds:.1f} s]")
    print("\n".join(_memory_lines(cache)))
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


def cmd_export(args) -> int:
    from .export import export_sglang_oscar
    from .rotations_io import OscarRotations

    check_rotation_path(args.rotations)
    rotations = OscarRotations.from_pretrained(args.rotations)
    config = load_config(args.config) if args.config else None
    paths = export_sglang_oscar(rotations, args.output, config=config, key_clip=args.key_clip,
                                value_clip=args.value_clip)
    for role, path in paths.items():
        print(f"wrote {role}: {path}")
    print(f"serve with: set -a; . {paths['env']}; set +a  (then launch the OSCAR SGLang fork)")
    return 0


def cmd_demo(args) -> int:
    """The main job: calibrate the bundled model, save/load rotations, generate, compare with BF16."""
    from . import assets
    from .cache import OscarCache
    from .calibrate import calibrate
    from .config import CalibrationConfig, OscarConfig
    from .data import token_sequences
    from .metrics import cache_kwarg, perplexity
    from .rotations_io import OscarRotations, weight_fingerprint

    torch.manual_seed(0)
    calibration = _whole_sequences(CalibrationConfig(tokens=args.tokens), "--tokens")
    print(f"== 1. model: {args.model}")
    model, tokenizer, path = load_model(args.model, args.dtype)
    out_dir = Path(args.output)
    print(f"== 2. calibrating OSCAR rotations ({calibration.tokens} tokens, calibration split of the essays)")
    rotations = calibrate(model, tokenizer, calibration=calibration, progress=not args.quiet)
    print(rotations.report.summary())
    rotations.metadata["weight_fingerprint"] = weight_fingerprint(model)
    rotations.save_pretrained(out_dir)
    print(f"== 3. saved to {out_dir}; reloading with OscarRotations.from_pretrained")
    rotations = OscarRotations.from_pretrained(out_dir)
    rotations.check_fingerprint(model)

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
    print("\n".join(_memory_lines(cache)))

    print(f"== 5. KV memory after a {args.long_tokens}-token prefill (measured)")
    long_ids = token_sequences(tokenizer, eval_docs, args.long_tokens, 1)[0].unsqueeze(0)
    long_cache = OscarCache(model, rotations)
    with torch.no_grad():
        model(input_ids=long_ids, use_cache=True, **{cache_kwarg(model): long_cache})
    report = long_cache.memory_report()
    print("\n".join(_memory_lines(long_cache)))

    print("== 6. perplexity through the cache (2048-token evaluation sequences, context 512, chunks of 128)")
    seqs = token_sequences(tokenizer, eval_docs, 2048, args.ppl_sequences)
    naive = OscarRotations.data_free(model, "identity")
    results = {}
    for name, factory in (
        ("BF16 DynamicCache", None),
        ("OSCAR INT2", lambda: OscarCache(model, rotations)),
        ("naive INT2 (token-wise, no rotation)", lambda: OscarCache(model, naive, OscarConfig(
            key_clip="none", value_clip="none", key_granularity="token", demotion_block=8))),
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


# ------------------------------------------------------------------------------------------------ parser
def _positive_int(text: str) -> int:
    """An argparse type: a count that must be at least 1 (checked when the command line is read, not after a model
    has loaded or calibrated)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _common_options() -> argparse.ArgumentParser:
    """--quiet and --debug, accepted by every subcommand."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--quiet", action="store_true", help="no progress bars")
    common.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error (also: environment variable OSCAR_HF_DEBUG=1)")
    return common


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oscar-hf", description="OSCAR 2-bit KV cache for Hugging Face Transformers")
    sub = parser.add_subparsers(dest="command", required=True)
    common = [_common_options()]
    dtype_help = "dtype the model is loaded in (default bfloat16)"

    p = sub.add_parser("calibrate", parents=common, help="calibrate rotations and clips for a model",
                       description="Calibrate OSCAR rotations and clip ratios for a model and save them.")
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--output", default=None,
                   help="folder for oscar_rotations.{safetensors,json} (default: MODEL/oscar when MODEL is a local "
                        "folder, where `generate` finds them without --rotations)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder or Hub id, when the model folder has none")
    p.add_argument("--data", default=None, help="text/json/jsonl file, 'hf:NAME[:CONFIG][:SPLIT][:COLUMN]', or default")
    p.add_argument("--tokens", type=int, default=None,
                   help="calibration tokens (default 8192), in whole sequences of CalibrationConfig.sequence_length "
                        "(2048): fewer than one sequence is refused, others are rounded up")
    p.add_argument("--config", default=None,
                   help="a YAML or JSON mapping of OscarConfig fields (the storage layout to calibrate for) and "
                        "CalibrationConfig fields")
    p.add_argument("--center-keys", action="store_true",
                   help="subtract the calibrated per-(layer, KV head) key mean before storing keys (CalibrationConfig"
                        ".center_keys; helps models whose keys carry a large mean, e.g. Qwen2.5, Gemma 3)")
    p.add_argument("--no-wide-heads", action="store_true",
                   help="every KV head at 2 bits (CalibrationConfig.wide_heads='none'; by default the heads that retrieve "
                        "by content keep a 4-bit history, within the size budget)")
    p.add_argument("--key-channel-bits", default=None, choices=("fitted", "uniform"),
                   help="fitted: each 2-bit head's key channels at 0, 2 or 4 bits by held-out query energy x key error "
                        "(same bytes; CalibrationConfig.key_channel_bits); uniform: 2 bits in every channel")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help=dtype_help)
    p.add_argument("--device-map", default=None, help="e.g. auto (accelerate) to spread a large model over devices")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("generate", parents=common, help="generate with OscarCache",
                       description="Generate greedily with a 2-bit OscarCache (and optionally compare with BF16).")
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--rotations", default=None,
                   help="folder or Hub repo id with oscar_rotations.* (default: beside the model, or in its oscar/)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder or Hub id, when the model folder has none")
    p.add_argument("--prompt", default=None, help="the prompt text")
    p.add_argument("--prompt-file", default=None, help="read the prompt from this file instead")
    p.add_argument("--no-chat", action="store_true",
                   help="use the prompt as plain text (by default it goes into the tokenizer's chat template, if any)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=128, help="tokens to generate (default 128)")
    p.add_argument("--config", default=None,
                   help="OscarConfig as a YAML or JSON file (fields such as sink_tokens, window_tokens, bits, key_clip, "
                        "value_clip)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help=dtype_help)
    p.add_argument("--device-map", default=None, help="e.g. auto (accelerate) to spread a large model over devices")
    p.add_argument("--allow-other-weights", action="store_true",
                   help="use rotations calibrated on other weights of the same shapes (a warning instead of an error)")
    p.add_argument("--compare", action="store_true", help="also generate with a BF16 DynamicCache")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("demo", parents=common, help="calibrate the bundled SmolLM2-135M, generate, compare with BF16",
                       description="Calibrate, save, reload, generate, measure memory and perplexity, on one model.")
    p.add_argument("--model", default="offline:smollm2-135m", help=MODEL_HELP + " (default offline:smollm2-135m)")
    p.add_argument("--output", default="oscar-demo", help="folder for the rotations and demo_summary.json")
    p.add_argument("--tokens", type=int, default=8192,
                   help="calibration tokens, in whole sequences of 2048 (fewer than one sequence is refused)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help=dtype_help)
    p.add_argument("--prompt-tokens", type=_positive_int, default=1024, help="length of the essay prompt for generation")
    p.add_argument("--new-tokens", type=_positive_int, default=64, help="tokens generated greedily")
    p.add_argument("--long-tokens", type=_positive_int, default=8000, help="prefill length of the memory measurement")
    p.add_argument("--ppl-sequences", type=_positive_int, default=3, help="2048-token sequences in the perplexity check")
    p.set_defaults(func=cmd_demo)

    from .export import FORMATS

    p = sub.add_parser("export", parents=common, help="write rotation files for a serving engine (the OSCAR SGLang fork)",
                       description="Write calibrated rotations in a serving engine's format; refuses what the engine "
                                   "cannot serve unchanged (see oscar_hf/export.py).")
    p.add_argument("--rotations", required=True, help="folder or Hub repo id with oscar_rotations.*")
    p.add_argument("--format", default=FORMATS[0], choices=FORMATS, help="target engine format")
    p.add_argument("--output", required=True, help="folder for the engine's files")
    p.add_argument("--config", default=None,
                   help="OscarConfig (YAML/JSON) to reproduce: sink_tokens, window_tokens, group_size, key_clip, "
                        "value_clip (default: the calibration's)")
    p.add_argument("--key-clip", type=float, default=None, help="one key clip ratio for all layers (0, 1]")
    p.add_argument("--value-clip", type=float, default=None, help="one value clip ratio for all layers (0, 1]")
    p.set_defaults(func=cmd_export)

    # The evaluation harness lives in oscar_hf.evaluation; only the argument wiring is here.
    from .evaluation import report, runner

    p = sub.add_parser("eval", parents=common, help="accuracy evaluation: ppl | ablations | diagnostics | niah | lm-eval | all")
    runner.add_eval_arguments(p)
    p.set_defaults(func=runner.run)

    p = sub.add_parser("report", parents=common, help="per-layer quantization error on your data (attention KL, output error)")
    report.add_arguments(p)
    p.set_defaults(func=report.run)

    p = sub.add_parser("lm-eval", add_help=False,
                       help="lm-eval's command line with the 'oscar' model type and the offline tasks registered "
                            "(pretrained=smollm2-135m works offline). Short 0-shot prompts stay in the BF16 sink/window "
                            "(64 + 256 tokens), so their score measures BF16: use oscar_bb_siqa_long, --num_fewshot or "
                            "sink=/window=; the log after the run says how many scored tokens reached the INT2 history")
    p.set_defaults(func=None)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "what was asked for is wrong" (a message for the user, not a bug report)."""
    from .models import UnsupportedModelError
    from .rotations_io import RotationFileError

    return (UsageError, RotationFileError, UnsupportedModelError, FileNotFoundError, NotADirectoryError,
            IsADirectoryError, PermissionError, ValueError, ImportError)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["lm-eval"]:  # everything after it goes to lm-eval's own parser
        from .evaluation.lm_eval_model import cli_main

        return _report_errors(lambda: cli_main(argv[1:]), os.environ.get("OSCAR_HF_DEBUG", "") not in ("", "0"))
    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get("OSCAR_HF_DEBUG", "") not in ("", "0")
    if args.quiet:
        from transformers.utils import logging as transformers_logging

        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        transformers_logging.disable_progress_bar()
    torch.set_grad_enabled(False)
    show = warnings.showwarning
    if not debug:  # a warning is one line too
        warnings.showwarning = lambda message, category, *_, **__: print(
            f"oscar-hf: warning: {message}", file=sys.stderr)
    try:
        return _report_errors(lambda: args.func(args), debug)
    finally:
        warnings.showwarning = show


def _report_errors(run, debug: bool) -> int:
    """`run()`'s status; an error is one line: status 2 for a user error, 1 (asking for a report) for anything else."""
    try:
        return run()
    except KeyboardInterrupt:
        print("oscar-hf: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if debug:
            raise
        if isinstance(e, _user_errors()):
            print(f"oscar-hf: error: {first_line(e)}", file=sys.stderr)
            return 2
        print(f"oscar-hf: error: {type(e).__name__}: {first_line(e)} (unexpected; rerun with --debug or "
              "OSCAR_HF_DEBUG=1 for the traceback and report it)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
