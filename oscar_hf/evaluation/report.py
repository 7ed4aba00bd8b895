"""`oscar-hf report`: how well KV quantization holds on your own data, layer by layer.

    oscar-hf report --model PATH_OR_ID --rotations ROTATIONS [--data FILE] [--methods oscar,naive-int2]
                    [--context 1536 --chunk 128 --sequences 2] [--output report.json] [--plot report.png]

For each method, a fresh cache is filled with `context` tokens of your text, then `chunk` more tokens are run
through it; per layer, the attention probabilities and the attention-block output are compared with a BF16
`DynamicCache` (`diagnostics.py`). Low attention KL and output error on every layer mean the rotations fit your
data; a layer that stands out is where quantization hurts (e.g. text far from the calibration data).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .methods import Windows, main_methods


def add_arguments(parser) -> None:
    from ..loading import MODEL_HELP

    parser.add_argument("--model", required=True, help=MODEL_HELP)
    parser.add_argument("--rotations", default=None, help="OSCAR rotations (folder or Hub id); needed for oscar methods")
    parser.add_argument("--data", default=None, help="text/json/jsonl file or hf:... (default: the evaluation essays)")
    parser.add_argument("--allow-other-weights", action="store_true",
                        help="use rotations calibrated on other weights of the same shapes (a warning instead of an error)")
    parser.add_argument("--methods", default="oscar,naive-int2,hadamard-int2,kivi2",
                        help="comma-separated methods (see oscar_hf.evaluation.methods)")
    parser.add_argument("--config", default=None, help="OscarConfig (YAML/JSON) for the 'oscar' method")
    parser.add_argument("--context", type=int, default=1536, help="tokens put into the cache before scoring")
    parser.add_argument("--chunk", type=int, default=128, help="tokens run through the filled cache and compared")
    parser.add_argument("--sequences", type=int, default=2, help="sequences of your text")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"),
                        help="dtype the model is loaded in (default bfloat16)")
    parser.add_argument("--output", default=None, help="write the per-layer results as JSON")
    parser.add_argument("--plot", default=None, help="write a PNG of the per-layer errors")


def run(args) -> int:
    from ..loading import UsageError, load_config, load_model, load_rotations
    from ..data import load_texts, token_sequences
    from .diagnostics import format_table, layer_errors, plot

    torch.set_grad_enabled(False)
    model, tokenizer, _ = load_model(args.model, args.dtype)
    methods = main_methods(Windows())
    names = [n.strip() for n in args.methods.split(",") if n.strip()]
    unknown = [n for n in names if n not in methods]
    if unknown:
        raise UsageError(f"unknown method(s) {unknown}; available: {', '.join(methods)}")
    methods = {n: methods[n] for n in names if n != "bf16"}
    if args.config and "oscar" in methods:
        from dataclasses import replace

        methods["oscar"] = replace(methods["oscar"], oscar=load_config(args.config))
    rotations = {}
    needing = [n for n, m in methods.items() if m.needs_calibration]
    if needing:
        if not args.rotations:
            raise UsageError(f"method(s) {needing} need calibrated rotations: pass --rotations (see `oscar-hf calibrate`)")
        loaded = load_rotations(args.rotations, model, allow_other_weights=getattr(args, "allow_other_weights", False))
        rotations = {n: loaded for n in needing}
    if args.data is None:
        from ..assets import essay_split

        docs, source = list(essay_split("eval").values()), "evaluation essays"
    else:
        docs, info = load_texts(args.data)
        source = info.get("source")
    seqs = token_sequences(tokenizer, docs, args.context + args.chunk, args.sequences)
    if not getattr(args, "quiet", False):  # each sequence runs BF16 and every method: minutes on a CPU
        from tqdm.auto import tqdm

        seqs = tqdm(seqs, desc="per-layer report", unit="seq")
    results = layer_errors(model, seqs, methods, rotations, context=args.context, chunk=args.chunk)
    print(f"per-layer error vs BF16 on {args.sequences} x ({args.context} context + {args.chunk} scored) tokens of {source}")
    print("(attention KL in nats / relative attention-output error; 's' = sliding-window layer, BF16 in every method)")
    print(format_table(results))
    if args.output:
        Path(args.output).write_text(json.dumps({"data": source, "context": args.context, "chunk": args.chunk,
                                                 "sequences": args.sequences, "results": results}, indent=1))
        print(f"wrote {args.output}")
    if args.plot:
        plot(results, args.plot, title=f"{args.model}: per-layer error vs BF16")
        print(f"wrote {args.plot}")
    return 0
