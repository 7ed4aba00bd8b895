"""Decode tokens/s of the CPU path (the torch twins) through `model.generate`, on the bundled SmolLM2-135M: BF16
`DynamicCache`, `OscarCache` and `StaticOscarCache` (eager), with data-free rotations (speed does not depend on
them). What the CPU path is for is accuracy, not speed; this guards it against regressions between commits.

    python eval/bench_cpu_decode.py [--prompt-tokens 1500] [--new-tokens 32] [--rounds 3] [--threads 2]

Protocol: the prompt is the first tokens of the evaluation essays; decode tokens/s = N / (t(generate N + 1) −
t(generate 1)), best of `--rounds` after one warm-up, methods interleaved. Prints one JSON object.
"""

import argparse
import json
import time

import torch


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import DynamicCache

    from oscar_hf import OscarCache, OscarConfig, OscarRotations, StaticOscarCache, assets
    from oscar_hf.data import token_sequences

    model, tokenizer = assets.load_model("smollm2-135m", dtype=torch.bfloat16, attn_implementation="oscar")
    ids = token_sequences(tokenizer, list(assets.essay_split("eval").values()), args.prompt_tokens, 1)[0][None]
    rotations = OscarRotations.data_free(model, "hadamard")
    config = OscarConfig(key_clip="none", value_clip="none")  # (data-free rotations carry no fitted clips)
    total = args.prompt_tokens + args.new_tokens + 8
    makers = {
        "bf16-dynamic": lambda: DynamicCache(config=model.config),
        "oscar-dynamic": lambda: OscarCache(model, rotations, config),
        "oscar-static-eager": lambda: StaticOscarCache(model, rotations, config, max_cache_len=total),
    }

    def timed(make, n):
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, cache=make(), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           disable_compile=True, pad_token_id=tokenizer.eos_token_id)
        return time.perf_counter() - start

    best = {name: float("inf") for name in makers}
    for r in range(args.rounds + 1):
        for name, make in makers.items():
            decode = timed(make, args.new_tokens + 1) - timed(make, 1)
            if r:  # round 0 warms up
                best[name] = min(best[name], decode)
    print(json.dumps({"prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "threads": args.threads,
                      "tokens_per_s": {n: round(args.new_tokens / t, 2) for n, t in best.items()}}))


if __name__ == "__main__":
    main()
