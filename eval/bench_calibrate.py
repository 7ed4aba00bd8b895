"""Wall time and peak GPU memory of `calibrate()` at real scale: a random-weight Qwen3-8B (or Qwen3-4B), the default
`OscarConfig()` and `CalibrationConfig()`, one GPU (the target: at most 10 minutes, within 80 GB).

    python eval/bench_calibrate.py --out DIR [--arch qwen3-8b|qwen3-4b] [--deadline SECONDS]
    python eval/bench_calibrate.py --out DIR --tiny        # CPU smoke run, a few minutes
    BENCH=bench_calibrate.py OUT=DIR bash eval/gpu_check.sh --arch qwen3-8b    # on the GPU machine (carry .whl)

Protocol: the model is built from the published geometry (`bench_gpu.QWEN3`, max_position_embeddings 40960,
rope_theta 1e6) with random weights, in bfloat16 with sdpa attention as `oscar-hf calibrate` loads a model. Speed
and memory do not depend on the weights or the text, so the calibration text is random tokens: the tokenizer is a
`PreTrainedTokenizerFast` whose vocabulary maps one word "t<id>" to each id (no hub, no asset package), and the text
is the words of uniformly random ids, as many as the default token counts take (8192 calibration tokens in sequences
of 2048, then 1024 held out). The retrieval probe of the wide heads draws its own random ids from that vocabulary.
`--tiny` keeps every step of the 8B run (key block allocation, a wide head, wide key channels) at 2 layers of 16 KV
heads (32 query heads, head_dim 128), small enough for the CPU.

The CUDA peak statistics are reset after the model is built. While calibrate() runs, the outermost calls of its main
steps (`TIMED`) are timed, the GPU synchronised at their ends, and each prints a line with its time and the peak
memory so far, so a cut run shows where it was (these lines replace calibrate()'s progress bars). `--deadline` stops
the run before the next step once that many seconds have passed since the start. One JSON object is printed and
written to DIR/bench_calibrate.json, also when calibrate() fails (its error, the steps so far).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import resource
import shlex
import sys
import time
import traceback
from pathlib import Path

import torch

from bench_gpu import QWEN3

GIB = 1024**3
ISSUE_LIMITS = {"seconds": 600, "bytes": 80e9}  # "≤ 10 minutes and fits in 80 GB"
TINY = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=32,
            num_key_value_heads=16, head_dim=128, vocab_size=4096, tie_word_embeddings=False)
# oscar_hf.calibrate functions timed as steps; a call inside another timed one counts in its caller's time
TIMED = ("_run", "rotations_from_statistics", "key_basis_errors", "key_block_errors", "allocate_key_blocks",
         "clip_errors", "allocate_wide_channels", "weight_fingerprint")
START = time.time()


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} {time.time() - START:7.1f} s] {message}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory(device: torch.device) -> dict:
    """Peak memory so far: the CUDA allocator's on a GPU, the process's resident set on the host."""
    out = {"host_peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, 2)}
    if device.type == "cuda":
        out |= {"max_allocated_gib": round(torch.cuda.max_memory_allocated(device) / GIB, 2),
                "max_reserved_gib": round(torch.cuda.max_memory_reserved(device) / GIB, 2)}
    return out


def word_tokenizer(vocab_size: int):
    """A fast tokenizer over the words "t0" ... "t<vocab_size - 2>" (id = the number) and "<|endoftext|>" (the last
    id, its one special token): text of those words separated by spaces tokenizes to their ids, with no prefix."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    eos = "<|endoftext|>"
    vocab = {f"t{i}": i for i in range(vocab_size - 1)} | {eos: vocab_size - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=eos))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, unk_token=eos)


def random_text(vocab_size: int, words: int, seed: int = 0) -> str:
    ids = torch.randint(vocab_size - 1, (words,), generator=torch.Generator().manual_seed(seed))
    return " ".join(f"t{i}" for i in ids.tolist())


def build_model(geometry: dict, device: torch.device):
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(**geometry, max_position_embeddings=40960, rope_theta=1e6)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


class DeadlineExceeded(RuntimeError):
    pass


class StepTimer:
    """Times the outermost calls of the `TIMED` functions of `oscar_hf.calibrate` while in use (the module's globals,
    which calibrate() looks up at each call, are swapped for timed wrappers and restored on exit)."""

    def __init__(self, device: torch.device, deadline: float):
        import oscar_hf.calibrate as module

        self.module, self.device, self.deadline = module, device, deadline
        self.steps: dict[str, dict] = {}
        self.depth = 0

    def __enter__(self):
        self.originals = {name: getattr(self.module, name) for name in TIMED}
        for name, fn in self.originals.items():
            setattr(self.module, name, self._timed(name, fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self.originals.items():
            setattr(self.module, name, fn)

    def _timed(self, name, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if self.depth:
                return fn(*args, **kwargs)
            label = f"forward: {args[3] if len(args) > 3 else kwargs['description']}" if name == "_run" else name
            if time.time() > self.deadline:
                raise DeadlineExceeded(f"--deadline passed before {label}")
            sync(self.device)
            start = time.perf_counter()
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                sync(self.device)
                seconds = time.perf_counter() - start
                step = self.steps.setdefault(label, {"seconds": 0.0, "calls": 0})
                step["seconds"] += seconds
                step["calls"] += 1
                peak = ", ".join(f"{k} {v}" for k, v in memory(self.device).items())
                log(f"{label} #{step['calls']}: {seconds:.2f} s ({peak})")

        return timed


def outcome(rotations, config) -> dict:
    """calibrate()'s own clock, the tokens it read, and what it fitted, in counts of KV heads (and key channels)."""
    report, meta = rotations.report, rotations.metadata["calibration"]
    blocks = [b for per_layer in (report.key_blocks or {}).values() for b in per_layer]
    return {
        "calibrate_seconds": round(report.seconds, 2),
        "tokens": {k: meta[k] for k in ("tokens", "sequences", "sequence_length", "heldout_tokens")},
        "fitted": {"key_blocks": {b: blocks.count(b) for b in sorted(set(blocks))},
                   "wide_heads": sum(b != config.bits for bits in (report.head_bits or {}).values() for b in bits),
                   "wide_key_channels": sum(sum(n) for n in (report.key_wide_channels or {}).values())},
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--arch", choices=sorted(QWEN3), default="qwen3-8b")
    parser.add_argument("--tiny", action="store_true", help="2 layers of the same attention shape (a CPU smoke run)")
    parser.add_argument("--deadline", type=float, default=None, help="seconds after which no further step starts")
    args = parser.parse_args(argv)

    import transformers

    import oscar_hf
    from oscar_hf import CalibrationConfig, OscarConfig
    from oscar_hf.calibrate import calibrate

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    geometry = TINY if args.tiny else QWEN3[args.arch]
    config, calibration = OscarConfig(), CalibrationConfig()
    result = {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "arch": "tiny" if args.tiny else args.arch,
        "geometry": geometry,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "cpu_threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "oscar_hf": oscar_hf.__version__, "python": platform.python_version()},
        "oscar_config": config.to_dict(),
        "calibration_config": calibration.to_dict(),
    }
    log(f"{result['arch']} on {result['device']}: building the model")
    start = time.perf_counter()
    model = build_model(geometry, device)
    sync(device)
    weight_bytes = sum(t.nbytes for t in (*model.parameters(), *model.buffers()))
    result["model"] = {"parameters": sum(p.numel() for p in model.parameters()),
                       "weight_gib": round(weight_bytes / GIB, 2), "dtype": "bfloat16", "attn_implementation": "sdpa",
                       "build_seconds": round(time.perf_counter() - start, 1)}
    tokenizer = word_tokenizer(geometry["vocab_size"])
    words = math.ceil(calibration.tokens / calibration.sequence_length) * calibration.sequence_length
    text = random_text(geometry["vocab_size"], words + calibration.heldout_tokens)
    log(f"model: {result['model']}; calibrating on {words} + {calibration.heldout_tokens} random tokens")

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result["memory"] = {"device_total_gib": round(torch.cuda.get_device_properties(device).total_memory / GIB, 2),
                            "allocated_before_gib": round(before / GIB, 2)}
    deadline = START + args.deadline if args.deadline else float("inf")
    timer = StepTimer(device, deadline)
    start = time.perf_counter()
    try:
        with timer:
            rotations = calibrate(model, tokenizer, [text], config, calibration, progress=False)
        sync(device)
        result["status"] = "ok"
    except Exception as error:  # out of memory or past the deadline: report how far it came
        traceback.print_exc()
        result["status"] = f"{type(error).__name__}: {error}"
        rotations = None
    seconds = time.perf_counter() - start
    result["seconds"] = round(seconds, 2)
    steps = timer.steps
    result["steps"] = {label: {"seconds": round(s["seconds"], 2), "calls": s["calls"]} for label, s in steps.items()}
    result["steps"]["rest"] = {"seconds": round(seconds - sum(s["seconds"] for s in steps.values()), 2)}
    result["memory"] = result.get("memory", {}) | memory(device)
    if device.type == "cuda":  # what calibrate() adds at its peak to what was allocated before (the weights)
        result["memory"]["peak_over_weights_gib"] = round((torch.cuda.max_memory_allocated(device) - before) / GIB, 2)
    if rotations is not None:
        result |= outcome(rotations, config)
    if device.type == "cuda" and not args.tiny:
        peak = torch.cuda.max_memory_reserved(device)
        result["issue_limits"] = ISSUE_LIMITS | {"met": result["status"] == "ok" and seconds <= ISSUE_LIMITS["seconds"]
                                                 and peak <= ISSUE_LIMITS["bytes"]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_calibrate.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    log(f"wrote {out / 'bench_calibrate.json'}")
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
