"""Regenerates eval/RESULTS.md and eval/plots/*.png from the raw JSON results in eval/results/<model>/*.json.

    python eval/make_results.py            # no model is run; every number comes from the JSON files

The JSON files are written by `oscar-hf eval ...` (see eval/run_all.sh); each carries its own provenance (model
source, data, token counts, seeds, windows, method configs, versions, command line).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

EVAL = Path(__file__).resolve().parent
RESULTS = EVAL / "results"
PLOTS = EVAL / "plots"
MODEL_ORDER = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
MAIN = ["bf16", "oscar", "oscar-token", "oscar-ref", "naive-int2", "hadamard-int2", "kivi2", "kivi2-g64", "kivi2-g128",
        "oscar-s32w64", "hf-hqq-int2", "naive-int4"]
DOMAINS = {"": "essays (in-domain)", "_python": "Python code", "_shakespeare": "Shakespeare plays"}
# the default (format 6) against format 5's default (2 bits in every key channel), the paper layout and KIVI-2
HEADLINE = ["bf16", "oscar", "oscar-uniform-channels", "oscar-token", "kivi2-g64", "kivi2"]
LEVERS = ["oscar-token", "oscar-token-centered", "oscar-ch-uhp", "oscar-ch-h", "oscar-ch-id", "oscar-ch-auto",
          "oscar-ch-id-b64", "oscar-ch-uhp-b64", "oscar-uniform-b64", "oscar-no-wide", "oscar-uniform-channels",
          "oscar-h-keys", "oscar-hpref2", "oscar", "oscar-value-clip-ref", "oscar-value-clip-none", "kivi2-g64", "kivi2"]


def load(model: str, stage: str, root: Path | None = None):
    path = (root or RESULTS) / model / f"{stage}.json"
    return normalize(json.loads(path.read_text())) if path.is_file() else None


def normalize(data: dict) -> dict:
    """Files written before the storage format became channel-wise called the paper's layout `oscar`: read that row
    as `oscar-token` (its layout), and leave out `oscar-s32w64` / `oscar_centered`, measured in the old layout under
    names that now mean another one."""
    methods = data["meta"].get("methods", {})
    if "oscar" not in methods or "key_granularity" in methods["oscar"].get("oscar_config", {}):
        return data
    rename = {"oscar": "oscar-token"}
    drop = {"oscar-s32w64", "oscar_centered"}
    data["meta"]["methods"] = {rename.get(n, n): m for n, m in methods.items() if n not in drop}
    res = data["results"]
    if isinstance(res, dict):
        data["results"] = {rename.get(n, n): r for n, r in res.items() if n not in drop}
    else:
        data["results"] = [dict(r, method=rename.get(r["method"], r["method"])) for r in res if r["method"] not in drop]
    return data


def fmt(x, digits=2):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}f}"


def models() -> list[str]:
    stages = ("ppl", "niah", "ablations", "diagnostics", "lm_eval", "centering_ppl")
    found = [p.name for p in RESULTS.iterdir() if p.is_dir() and any((p / f"{s}.json").is_file() for s in stages)] \
        if RESULTS.is_dir() else []  # model folders only (not e.g. results/gpu)
    return [m for m in MODEL_ORDER if m in found] + sorted(m for m in found if m not in MODEL_ORDER)


NIAH_STAGES = (("niah", "1 needle"), ("niah_python", "1 needle, code haystack"),
               ("niah_shakespeare", "1 needle, Shakespeare haystack"), ("niah4", "4 needles"),
               ("niah4_python", "4 needles, code haystack"))


def niah_files(root: Path, model: str) -> list[tuple[str, dict]]:
    """`(variant label, data)` of each NIAH result file of `model` under `root`."""
    return [(label, data) for stage, label in NIAH_STAGES for data in [load(model, stage, root)] if data]


def hits_on_trials(records: list[dict], method: str, length: int, trials: set[tuple] | None = None) -> tuple[int, int]:
    """(hits, trials) of `method` at `length`, on the (depth, seed) `trials` only when given."""
    rs = [r for r in records if r["method"] == method and r["length"] == length
          and (trials is None or (r["depth"], r["seed"]) in trials)]
    return sum(r["hit"] for r in rs), len(rs)


def trials_of(records: list[dict], method: str, length: int) -> set[tuple]:
    return {(r["depth"], r["seed"]) for r in records if r["method"] == method and r["length"] == length}


def within_one_hit(records: list[dict], length: int) -> str:
    """Issue 8's retrieval target for one cell: `oscar` at most one hit per ten trials behind `bf16`, counted on the
    trials both measured ("yes", or "**no** (-k of n)"); "–" where either is missing."""
    common = trials_of(records, "oscar", length) & trials_of(records, "bf16", length)
    if not common:
        return "–"
    (oscar, n), (bf16, _) = (hits_on_trials(records, m, length, common) for m in ("oscar", "bf16"))
    return "yes" if (bf16 - oscar) * 10 <= n else f"**no** ({oscar - bf16} of {n})"


def niah_lines(rows: list[tuple[str, str, dict]], methods: list[str], target: bool = False) -> list[str]:
    """A hits/trials table, one row per (model, variant, length); with `target`, whether `oscar` is within one hit
    per ten trials of `bf16` on the same trials (issue 8's retrieval target)."""
    out = ["| model | variant | length | " + " | ".join(f"`{m}`" for m in methods) + " |"
           + (" `oscar` within one hit of `bf16` per ten trials |" if target else ""),
           "|---|---|---|" + "---|" * (len(methods) + target)]
    for model, label, data in rows:
        table = niah_table(data["results"])
        for L in sorted({r["length"] for r in data["results"]}):
            cells = [f"{table[m]['by_length'][L][0]}/{table[m]['by_length'][L][1]}"
                     if m in table and L in table[m]["by_length"] else "–" for m in methods]
            if target:
                cells.append(within_one_hit(data["results"], L))
            out.append(f"| {model} | {label} | {L} | " + " | ".join(cells) + " |")
    return out


def lever_order(method: str) -> tuple:
    """LEVERS' order first, then the other methods by name (a stable page from run to run)."""
    return (LEVERS.index(method), "") if method in LEVERS else (len(LEVERS), method)


def variant_lines(rows: list[tuple[str, str, dict]], headline: list[str]) -> list[str]:
    """The methods of `rows` outside `headline`, each beside `bf16` and `oscar` on the same trials."""
    out = []
    for model, label, data in rows:
        records = data["results"]
        for m in sorted({r["method"] for r in records} - set(headline), key=lever_order):
            for L in sorted({r["length"] for r in records if r["method"] == m}):
                trials = trials_of(records, m, L)
                same = [hits_on_trials(records, b, L, trials) for b in ("bf16", "oscar")]
                h = hits_on_trials(records, m, L)
                out.append(f"| {model} | {label} | {L} | `{m}` | {h[0]}/{h[1]} | "
                           + " | ".join(f"{x[0]}/{x[1]}" if x[1] else "–" for x in same) + " |")
    if out:
        out = ["| model | variant | length | method | hits | `bf16` on its trials | `oscar` on its trials |",
               "|---|---|---|---|---|---|---|"] + out
    return out


def gpu_niah_section() -> list[str]:
    """The NIAH cells re-run on an H200 (`eval/gpu_eval.sh`; results/h200/<model>/niah*.json): every method of a
    cell measured there on the same trials, so BF16 and OSCAR share the GPU's numerics."""
    root = RESULTS / "h200"
    found = [p.name for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
    ordered = [m for m in MODEL_ORDER if m in found] + sorted(m for m in found if m not in MODEL_ORDER)
    rows = [(model, label, data) for model in ordered for label, data in niah_files(root, model)]
    if not rows:
        return []
    methods = [m for m in HEADLINE if any(m in niah_table(d["results"]) for _, _, d in rows)]
    commands = sorted({d["meta"]["command"] for _, _, d in rows}
                      | {c["command"] for _, _, d in rows
                         for c in (d["meta"].get("carried_over") or {}).get("cells", {}).values() if c.get("command")})
    notes = sorted({f"{d['meta']['model']['name']}: {d['meta']['tokenizer_note']}" for _, _, d in rows
                    if d["meta"].get("tokenizer_note")})
    gpus = sorted({d["meta"]["machine"].get("gpu") or "?" for _, _, d in rows})
    versions = sorted({f"torch {d['meta']['versions']['torch']}, transformers {d['meta']['versions']['transformers']}"
                       for _, _, d in rows})
    out = ["### Needle retrieval on the GPU, the default with wide heads (same trials, every method re-run there)", "",
           "The same trials as the table above (same haystacks, needles, depths and seeds), run on "
           f"{', '.join(gpus)} with the model in bfloat16 and calibration run there with the default options "
           "(`bash eval/gpu_eval.sh \"niah --model M --lengths ... --depths 0.1,0.3,0.5,0.7,0.9 --seeds 0,1 "
           "--methods ...\" ...`, the offline models' wheels carried by `eval/ship.py`). A cell's BF16 and OSCAR "
           "share the GPU's numerics; against the CPU table they show how much a 10-trial cell moves with the "
           "machine alone. Some cells have more seeds than the CPU's (20 or 40 trials: `--seeds 0,1,2,3` or "
           "`0,...,7`), to tell a real gap from a cell's noise; the target column counts one hit per ten trials.", ""]
    out += niah_lines(rows, methods, target=True)
    variants = variant_lines(rows, methods)
    if variants:
        out += ["", "Other variants on the H200 (the levers, on some of the same trials):", ""] + variants
    out += ["", f"Versions: {'; '.join(versions)}. Commands (as recorded): " + "; ".join(f"`{c}`" for c in commands)]
    out += [""] + [f"Note, {n}." for n in notes] + ([""] if notes else [])
    return out


# ------------------------------------------------------------------------------------------------ NIAH
def niah_table(records: list[dict]) -> dict[str, dict]:
    """{method: {"overall": acc, (length): acc, "trials": n}} from NIAH records."""
    out: dict[str, dict] = {}
    for r in records:
        m = out.setdefault(r["method"], {"hits": 0, "n": 0, "by_length": {}, "bits": []})
        m["hits"] += r["hit"]
        m["n"] += 1
        bl = m["by_length"].setdefault(r["length"], [0, 0])
        bl[0] += r["hit"]
        bl[1] += 1
        m["bits"].append((r["length"], r["bits_per_element"]))
    return out


def plot_niah(model: str, records: list[dict]) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    methods = [m for m in MAIN if any(r["method"] == m for r in records)]
    lengths = sorted({r["length"] for r in records})
    depths = sorted({r["depth"] for r in records})
    if not methods:
        return None
    cols = min(4, len(methods))
    rows = math.ceil(len(methods) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False)
    for ax, method in zip(axes.flat, methods):
        grid = np.full((len(depths), len(lengths)), np.nan)
        for i, d in enumerate(depths):
            for j, L in enumerate(lengths):
                hits = [r["hit"] for r in records if r["method"] == method and r["depth"] == d and r["length"] == L]
                if hits:
                    grid[i, j] = sum(hits) / len(hits)
        ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(L) for L in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [str(d) for d in depths], fontsize=7)
        ax.set_title(method, fontsize=9)
        ax.set_xlabel("prompt tokens", fontsize=7)
        ax.set_ylabel("needle depth", fontsize=7)
    for ax in list(axes.flat)[len(methods):]:
        ax.axis("off")
    fig.suptitle(f"{model}: needle retrieval (green = exact match)")
    fig.tight_layout()
    PLOTS.mkdir(parents=True, exist_ok=True)
    path = PLOTS / f"niah_{model}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"plots/{path.name}"


# ------------------------------------------------------------------------------------------------ plots
def plot_ppl(all_ppl: dict[str, dict]) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not all_ppl:
        return None
    fig, axes = plt.subplots(1, len(all_ppl), figsize=(4.2 * len(all_ppl), 3.8), squeeze=False)
    for ax, (model, data) in zip(axes.flat, all_ppl.items()):
        res = data["results"]
        names = [m for m in MAIN if m in res]
        bf16 = res["bf16"]["perplexity"]
        vals = [res[m]["perplexity"] / bf16 for m in names]
        colors = ["tab:green" if m.startswith("oscar") else "tab:gray" if m == "bf16" else "tab:red" for m in names]
        ax.barh(range(len(names)), vals, color=colors)
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.set_xscale("log")
        ax.axvline(1.0, color="k", lw=0.5)
        ax.invert_yaxis()
        ax.set_title(f"{model}\nPPL / BF16 PPL ({fmt(bf16)})", fontsize=9)
        for i, v in enumerate(vals):
            ax.text(v, i, f" {v:.2f}", va="center", fontsize=6)
    fig.tight_layout()
    PLOTS.mkdir(parents=True, exist_ok=True)
    path = PLOTS / "ppl_vs_method.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"plots/{path.name}"


def plot_diagnostics(model: str, data: dict) -> str:
    from oscar_hf.evaluation.diagnostics import plot

    PLOTS.mkdir(parents=True, exist_ok=True)
    path = PLOTS / f"layer_error_{model}.png"
    plot(data["results"], path, title=f"{model}: per-layer error vs BF16 ({data['meta']['data']['context']} context "
                                      f"+ {data['meta']['data']['chunk']} scored tokens)")
    return f"plots/{path.name}"


# ------------------------------------------------------------------------------------------------ sections
def provenance(meta: dict) -> str:
    v = meta["versions"]
    versions = ", ".join(f"{k} {val}" for k, val in v.items())
    src = meta["model"]["source"]
    pkg = ", ".join(src.get("requirements", [])[:1]) + (" …" if len(src.get("requirements", [])) > 1 else "")
    return (f"model `{meta['model']['name']}` ({pkg}, GGUF sha256 {src.get('gguf_sha256', '?')[:12]}…, run in "
            f"{meta['dtype']}); {versions}; {meta['machine']['platform']}, {meta['machine']['threads']} threads; "
            f"{meta['date']}; command: `{meta['command']}`")


def ppl_section(model: str, ppl: dict, niah: dict | None) -> list[str]:
    res, meta = ppl["results"], ppl["meta"]
    d = meta["data"]
    bf16 = res["bf16"]["perplexity"]
    niah_acc = niah_table(niah["results"]) if niah else {}
    lengths = sorted({r["length"] for r in niah["results"]}) if niah else []
    head = "| method | PPL | vs BF16 | bits/elem @ " + str(d["sequence_length"]) + " tok | history bits | "
    head += " | ".join(f"NIAH {L}" for L in lengths) + (f" | NIAH all | bits/elem @ {lengths[-1]} tok |" if lengths else "")
    lines = [head, "|" + "---|" * (5 + len(lengths) + (2 if lengths else 0))]
    for name in MAIN:
        if name not in res:
            continue
        r = res[name]
        cells = [f"`{name}`", fmt(r["perplexity"]), f"{100 * (r['perplexity'] / bf16 - 1):+.1f}%",
                 fmt(r["bits"]["bits_per_element"], 3), fmt(meta["methods"][name]["history_bits"], 3)]
        if lengths:
            n = niah_acc.get(name)
            for L in lengths:
                cells.append(f"{n['by_length'][L][0]}/{n['by_length'][L][1]}"
                             if n and L in n["by_length"] else "–")
            cells.append(f"**{n['hits']}/{n['n']}**" if n else "–")
            long_bits = [b for L, b in n["bits"] if L == lengths[-1]] if n else []
            cells.append(fmt(sum(long_bits) / len(long_bits), 3) if long_bits else "–")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"Perplexity: {d['sequences']} × {d['sequence_length']} tokens of {d['source']}; the first "
                 f"{d['context']} tokens of each sequence go into the cache, the rest is scored in chunks of {d['chunk']} "
                 f"({d['scored_tokens']} scored tokens in all). Windows: {meta['windows']}. bits/elem: bytes the "
                 "cache holds for its full-attention layers at the end of a sequence (metadata, sink/window or residual "
                 "included) per K/V element; history bits: the quantized part alone (the long-context asymptote).")
    if niah:
        nd = niah["meta"]["data"]
        lines.append(f"NIAH: lengths {nd['lengths']}, depths {nd['depths']}, seeds {nd['seeds']}, {nd['max_new_tokens']} "
                     f"greedy tokens, {nd['scoring']}; {niah['meta']['protocol']}.")
    cal = meta.get("calibration", {}).get("oscar")
    if cal:
        lines.append(f"Calibration (`oscar`): {cal['tokens']} tokens + {cal['heldout_tokens']} held out, {cal['data']} "
                     f"({cal['documents'] if isinstance(cal['documents'], int) else len(cal['documents'] or [])} essays), "
                     f"{cal['seconds']} s; mean fitted clip keys {fmt(cal['mean_key_clip'])}, values "
                     f"{fmt(cal['mean_value_clip'])}.")
    lines.append(f"Provenance: {provenance(meta)}")
    return lines


def layout_bits(method: str, head_dim: int, tokens: int) -> float | None:
    """Bits per K/V element of a method's layout holding `tokens` tokens (16-bit metadata), from its accounting:
    OSCAR default: BF16 sink 64 + window 256..383 (whole chunks of 128 demoted), keys 2 + 32/64 (per-head blocks of
    32/64/128 allocated at the metadata of 64 everywhere: at most that), values 2 + 32/d, and wide heads at 4 bits up
    to the history budget (`OscarConfig.wide_budget`: at most that; `oscar-no-wide`: none);
    paper layout: sink 64 + window 256..263, 2 + 32/d for both; KIVI-2 (residual 128): keys in blocks of G tokens
    once 128 full-precision keys have gathered, values per token in groups of min(G, d) beyond the last 128."""
    sink, window = 64, 256
    if method in ("oscar", "oscar-uniform-channels", "oscar-no-wide", "oscar-token"):
        from oscar_hf import OscarConfig

        config = {"oscar": OscarConfig(), "oscar-uniform-channels": OscarConfig(key_channel_bits="uniform"),
                  "oscar-no-wide": OscarConfig(wide_heads="none"),
                  "oscar-token": OscarConfig(key_granularity="token", demotion_block=8)}[method]
        hist = max(tokens - sink - window, 0) // config.demotion_block * config.demotion_block
        return ((tokens - hist) * 16 + hist * config.history_bits_per_element(head_dim)) / tokens
    if method.startswith("kivi2"):
        g = {"kivi2": 32, "kivi2-g64": 64}.get(method, 128)
        k_hist = tokens // 128 * 128
        v_hist = max(tokens - 128, 0)
        k = (tokens - k_hist) * 16 + k_hist * (2 + 32 / g)
        v = (tokens - v_hist) * 16 + v_hist * (2 + 32 / min(g, head_dim))
        return (k + v) / 2 / tokens
    return 16.0 if method == "bf16" else None


def layout_section() -> list[str]:
    """The storage-format study: the default against the paper's layout and KIVI-2 on three text domains, NIAH,
    the levers one at a time, and the bits each layout costs."""
    out = ["## The default layout across text domains (issue: a 2-bit cache you can trust)", "",
           "`oscar` is the library's default: keys quantized **per channel** over blocks of 32, 64 or 128 tokens "
           "(allocated per KV head at calibration, at the bits of 64 everywhere) of the chunks of 128 demoted "
           "from the BF16 window, in a per-(layer, KV head) basis chosen at calibration among the calibrated U·H·P, "
           "the data-free H·P and none, by held-out attention error; values token-wise after OSCAR's U·H·P rotation "
           "and fitted clip; and the KV heads that retrieve by content (a data-free induction score at calibration) "
           "at 4 bits, as many as fit in 2.75 history bits at head_dim 64 and 2.4375 at 128 (`oscar-no-wide`: none, "
           "format 4's default); and in each 2-bit head (format 6) the raw post-RoPE key channels at 0, 2 or 4 bits, "
           "water-filled at calibration by held-out query energy × key error at 2 bits on average, in the same bytes "
           "(`oscar-uniform-channels`: 2 bits in every channel of the chosen basis, format 5's default; its rows are "
           "the `oscar` rows measured before 2026-12-05, renamed by `eval/migrate_results_format6.py`). "
           "`oscar-token` is OSCAR in the paper's layout (token-wise keys). "
           "Calibration is always the default essays; `python` and `shakespeare` are text the calibration never saw "
           "in kind (`oscar_hf/evaluation/domains.py`). KIVI-2 is data-free, so its domain gap is the reference.", ""]
    rows = []
    for model in models():
        for suffix, domain in DOMAINS.items():
            ppl = load(model, "ppl" + suffix)
            if ppl and "oscar" in ppl["results"] and "bf16" in ppl["results"]:
                rows.append((model, domain, ppl))
    if rows:
        out += ["| model | text | " + " | ".join(f"`{m}`" for m in HEADLINE) + " |", "|---|---|" + "---|" * len(HEADLINE)]
        for model, domain, ppl in rows:
            res = ppl["results"]
            bf16 = res["bf16"]["perplexity"]
            cells = []
            for m in HEADLINE:
                r = res.get(m)
                cells.append("–" if r is None else fmt(r["perplexity"]) if m == "bf16" else
                             f"{fmt(r['perplexity'])} "
                             f"({100 * (r['perplexity'] / bf16 - 1):+.1f}%)")
            out.append(f"| {model} | {domain} | " + " | ".join(cells) + " |")
        out += ["", "(Perplexity through the cache, the protocol of the main tables; in brackets the change against "
                "BF16 on the same text.) Commands and provenance are in each model's section below and in the JSON "
                "files `ppl.json`, `ppl_python.json`, `ppl_shakespeare.json`.", ""]
        wide = []
        for model in models():  # the newest calibration record of this model's default rotations that names them
            cals = [data["meta"].get("calibration", {}).get("oscar", {})
                    for stage in ("ppl", "ppl_python", "ppl_shakespeare", "niah", "niah_python", "niah4")
                    for data in [load(model, stage)] if data]
            cal = next((c for c in cals if "wide_heads" in c), None)
            if cal:
                wide.append((model, cal["wide_heads"], cal["kv_heads"]))
        if wide:
            out += ["Wide heads the default calibration picked: " + "; ".join(
                f"{model} {len(heads)} of {n} KV heads" for model, heads, n in wide) + ".", ""]
    bits = ["| layout | history bits, head_dim 64 / 128 | all bits at 8K, d=64 / d=128 | at 32K, d=128 | at 128K, d=128 |",
            "|---|---|---|---|---|"]
    for m in ("oscar", "oscar-uniform-channels", "oscar-no-wide", "oscar-token", "kivi2-g64", "kivi2"):
        hist = {64: layout_bits(m, 64, 10**9), 128: layout_bits(m, 128, 10**9)}
        bits.append(f"| `{m}` | {fmt(hist[64], 3)} / {fmt(hist[128], 3)} | {fmt(layout_bits(m, 64, 8192), 3)} / "
                    f"{fmt(layout_bits(m, 128, 8192), 3)} | {fmt(layout_bits(m, 128, 32768), 3)} | "
                    f"{fmt(layout_bits(m, 128, 131072), 3)} |")
    out += ["Bits per element each layout stores (16-bit metadata; from the layouts' accounting, "
            "`eval/make_results.py:layout_bits`, which the caches' measured bits in the tables below follow):", ""]
    out += bits + [""]
    niah_rows = [(model, label, data) for model in models() for label, data in niah_files(RESULTS, model)]
    if niah_rows:
        out += ["### Needle retrieval (exact 5-digit answer; hits / trials per length)", ""]
        out += niah_lines(niah_rows, HEADLINE)
        variants = variant_lines(niah_rows, HEADLINE)
        if variants:
            out += ["", "Other variants on the same trials (the levers of the format study):", ""] + variants
        out += ["", "Trials: seeded depths × seeds per length (`oscar-hf eval niah --lengths ... --depths ... --seeds "
                "...`; `--needles 4`: four needles of the same pattern with different names and numbers, one asked "
                "for); the haystack is prefilled once in BF16 and each method's cache is built from it; the question "
                "runs through the cache. Commands in each JSON's meta.", ""]
    out += gpu_niah_section()
    from oscar_hf.evaluation.methods import all_methods

    labels = {n: m.label for n, m in all_methods().items()}
    for model in models():
        data = load(model, "format_ppl")
        if not data:
            continue
        res, meta = data["results"], data["meta"]
        bf16 = res.get("bf16", {}).get("perplexity")
        columns = lever_needles(model)
        title = "perplexity through the cache" + (", and needle hits" if columns else "")
        header = "| variant | what changes | PPL | vs BF16 | history bits |" + "".join(f" {c} |" for c in columns)
        out += [f"### The levers one at a time on `{model}` ({title})", "", header,
                "|---|---|---|---|---|" + "---|" * len(columns)]
        for name in ["bf16"] * bool(columns) + LEVERS:
            if name in res:
                r = res[name]
                change = "–" if name == "bf16" or not bf16 else f"{100 * (r['perplexity'] / bf16 - 1):+.1f}%"
                # the registry's label where it has the method (older files' labels say "the default" for what
                # is now format 5's default, on which the levers were measured); the file's otherwise
                label = "no quantization" if name == "bf16" else labels.get(name, meta["methods"][name]["label"])
                bits = fmt(meta["methods"][name]["history_bits"], 3) if name != "bf16" else "16"
                out.append(f"| `{name}` | {label} | {fmt(r['perplexity'])} | {change} | "
                           f"{bits} |" + "".join(f" {hits.get(name, '–')} |" for hits in columns.values()))
        out += ["", f"Provenance: {provenance(meta)}"]
        if columns:
            out += ["", "Needles (hits / trials, each column on its own trials; commands in each file's meta): "
                    + "; ".join(f"{c}: `{path}`" for c, path in lever_needle_sources(model)) + "."]
        out += [""]
    return out


# Needle columns of the lever tables: (column, folder under the results root, stage, length). A column is shown
# where three levers besides the defaults have trials there (otherwise it would say little about the levers), or
# where the default has trials beside BF16's (its own needle figure in the table).
LEVER_NEEDLE_CELLS = {
    "smollm2-135m": [("essays 4K", "", "niah", 4096),
                     ("essays 4K, H200", "h200", "niah", 4096),
                     ("code 4K, H200", "h200", "niah_python", 4096),
                     ("Shakespeare 4K, H200", "h200", "niah_shakespeare", 4096)],
    "qwen2.5-coder-1.5b": [("essays 4K", "", "niah", 4096),
                           ("essays 4K, H200", "h200", "niah", 4096),
                           ("4 needles, essays 4K", "", "niah4", 4096),
                           ("4 needles, essays 4K, H200", "h200", "niah4", 4096),
                           ("4 needles, code 4K", "", "niah4_python", 4096),
                           ("4 needles, code 4K, H200", "h200", "niah4_python", 4096)],
}


def lever_needle_sources(model: str) -> list[tuple[str, str]]:
    shown = lever_needles(model)
    return [(c, "/".join(p for p in ("results", folder, model, f"{stage}.json") if p))
            for c, folder, stage, _ in LEVER_NEEDLE_CELLS.get(model, []) if c in shown]


def lever_needles(model: str) -> dict[str, dict[str, str]]:
    """{column: {method: "hits/trials"}} for `model`'s lever table."""
    out = {}
    for column, folder, stage, length in LEVER_NEEDLE_CELLS.get(model, []):
        data = load(model, stage, RESULTS / folder)
        if not data:
            continue
        table = niah_table(data["results"])
        hits = {m: f"{t['by_length'][length][0]}/{t['by_length'][length][1]}"
                for m, t in table.items() if length in t["by_length"]}
        if (len(set(hits) & (set(LEVERS) - {"oscar", "oscar-uniform-channels", "kivi2-g64", "kivi2"})) >= 3
                or {"oscar", "bf16"} <= set(hits)):
            out[column] = hits
    return out


def ablation_section(model: str, data: dict) -> list[str]:
    res, meta = data["results"], data["meta"]
    from oscar_hf.evaluation.methods import ablation_methods

    labels = {n: m.label for n, m in ablation_methods().items()}
    base = res.get("oscar-token", {}).get("perplexity")  # the paper layout the ablations vary
    lines = [f"### Ablations on `{model}` (perplexity through the cache, same protocol)", "",
             "| variant | what changes | PPL | vs OSCAR | bits/elem | history bits |", "|---|---|---|---|---|---|"]
    for name, r in res.items():
        change = "–" if base is None else f"{100 * (r['perplexity'] / base - 1):+.1f}%"
        lines.append(f"| `{name}` | {labels.get(name, '')} | {fmt(r['perplexity'])} | {change} | "
                     f"{fmt(r['bits']['bits_per_element'], 3)} | {fmt(meta['methods'][name]['history_bits'], 3)} |")
    lines.append("")
    lines.append(f"Provenance: {provenance(meta)}")
    return lines


def diagnostics_section(model: str, data: dict) -> list[str]:
    plot = plot_diagnostics(model, data)
    lines = [f"### Per-layer error on `{model}`", "", f"![per-layer error]({plot})", "",
             "| method | mean attention KL | mean attention-output rel. error | mean key rel. error | mean value rel. error | final hidden rel. error | logits KL |",
             "|---|---|---|---|---|---|---|"]

    def mean_over_full(r, key):
        rows = [row[key] for row in r["layers"] if not row.get("sliding")]
        return sum(rows) / len(rows) if rows else None

    for name, r in data["results"].items():
        lines.append(f"| `{name}` | {fmt(r['mean_attention_kl'], 4)} | {fmt(r['mean_attention_output_error'], 4)} | "
                     f"{fmt(mean_over_full(r, 'key_error'), 4)} | {fmt(mean_over_full(r, 'value_error'), 4)} | "
                     f"{fmt(r['final_hidden_error'], 4)} | {fmt(r['logits_kl'], 4)} |")
    first = next(iter(data["results"].values()))
    if "key_mean_share" in first["layers"][0]:
        lines.append("")
        lines.append(f"Share of the BF16 keys' / values' energy in their per-channel mean (full-attention layers, mean "
                     f"over layers): keys {fmt(mean_over_full(first, 'key_mean_share'), 3)}, values "
                     f"{fmt(mean_over_full(first, 'value_mean_share'), 3)} (near 1: every token carries the same offset "
                     "vector, which token-wise quantization must spend its levels on and per-channel KIVI keys absorb).")
        sens = {n: r["mean_attention_kl"] / mean_over_full(r, "key_error") for n, r in data["results"].items()
                if mean_over_full(r, "key_error")}
        lines.append("Attention KL per unit of relative key error (how sensitive this model's attention is to key "
                     "storage error): " + ", ".join(f"{n} {fmt(v, 2)}" for n, v in sens.items()) + ".")
    d = data["meta"]["data"]
    lines.append("")
    lines.append(f"{d['sequences']} sequences of the evaluation essays (offset {d['offset_tokens']} tokens): {d['context']} "
                 f"tokens prefilled into each method's cache, the next {d['chunk']} run through it and compared with "
                 "BF16 layer by layer (`oscar-hf report` runs the same on your own data). Errors propagate through "
                 "the layers, as in use.")
    return lines


def lm_eval_section(model: str, data: dict) -> list[str]:
    meta = data["meta"]
    lines = [f"### lm-eval through the cache on `{model}`", "",
             "| method | task | acc | acc_norm | bits/byte | word PPL |", "|---|---|---|---|---|---|"]
    for name, r in data["results"].items():
        for task, m in r["results"].items():
            lines.append(f"| `{name}` | {task} | {fmt(m.get('acc,none'), 3)} ± {fmt(m.get('acc_stderr,none'), 3)} | "
                         f"{fmt(m.get('acc_norm,none'), 3)} | {fmt(m.get('bits_per_byte,none'), 4)} | "
                         f"{fmt(m.get('word_perplexity,none'), 2)} |")
    d = meta["data"]
    lines.append("")
    lines.append(f"Tasks {d['tasks']}, {d['num_fewshot']}-shot, limit {d['limit']}; windows {meta['windows']} "
                 f"(shrunk so that these short prompts reach the quantized history); {meta['protocol']}. "
                 f"Provenance: {provenance(meta)}")
    return lines


def closing_note(all_ppl: dict, all_niah: dict, ablations: dict | None) -> list[str]:
    lines = ["## Where OSCAR stands (generated from the tables above)", ""]
    for model, data in all_ppl.items():
        res = data["results"]
        bf16 = res["bf16"]["perplexity"]
        n_tok = data["meta"]["data"]["sequence_length"]

        def rel(name):
            return f"{100 * (res[name]['perplexity'] / bf16 - 1):+.1f}%"

        def bits(name):
            return fmt(res[name]["bits"]["bits_per_element"], 2)

        head = (f"OSCAR {rel('oscar')} at {bits('oscar')} bits" if "oscar" in res
                else "the default layout not measured yet on this model")
        parts = [f"**{model}** (perplexity vs BF16 {fmt(bf16)}, bits/element at {n_tok} tokens): {head}"]
        for other in ("oscar-token", "oscar-ref", "kivi2", "kivi2-g64", "oscar-s32w64", "hadamard-int2", "naive-int2", "hf-hqq-int2", "naive-int4"):
            if other in res:
                parts.append(f"{other} {rel(other)} at {bits(other)}")
        line = "; ".join(parts) + "."
        if {"kivi2", "kivi2-g64", "oscar-s32w64"} <= set(res):
            best_kivi = min(("kivi2", "kivi2-g64"), key=lambda k: res[k]["perplexity"])
            o = res["oscar-s32w64"]
            k = res[best_kivi]
            fewer = o["bits"]["bits_per_element"] <= k["bits"]["bits_per_element"]
            better = o["perplexity"] < k["perplexity"]
            line += (f" Against KIVI-2 at matched (or fewer) bits: OSCAR s32/w64 ({bits('oscar-s32w64')} bits) is "
                     f"{'better' if better else 'worse'} than the best KIVI-2 row `{best_kivi}` ({bits(best_kivi)} bits)"
                     f"{'' if fewer else ' although it stores more bits'}.")
        if "oscar-ref" in res and "oscar" in res:
            line += (f" Against the reference recipe at equal bits: OSCAR is "
                     f"{'better' if res['oscar']['perplexity'] < res['oscar-ref']['perplexity'] else 'worse'}.")
        niah = all_niah.get(model)
        if niah:
            acc = niah_table(niah["results"])
            line += " NIAH exact match: " + ", ".join(f"{m} {acc[m]['hits']}/{acc[m]['n']}" for m in MAIN if m in acc) + "."
        lines.append(line)
        lines.append("")
    return lines


def paper_comparison(ablations: dict | None, all_ppl: dict) -> list[str]:
    """Where these results agree or disagree with the paper (oscar-method.md §3), each claim computed from the JSON."""
    lines = ["## Against the paper's claims (generated; explanations in prose, numbers from the JSON)", ""]
    if ablations:
        a = ablations["results"]
        model = ablations["meta"]["model"]["name"]
        p = {k: v["perplexity"] for k, v in a.items()}
        base = p.get("oscar-token")  # the paper's ablations vary OSCAR in the paper's layout

        def pct(name):
            return f"{100 * (p[name] / base - 1):+.1f}%"

        def claim(text):
            lines.append(f"- {text}")

        if {"no-P", "g32", "g32-no-P"} <= set(p):
            same = abs(p["no-P"] - base) < 1e-9
            claim(f"**P (bit-reversal permutation)**: the paper's Table 4 loses accuracy without P. Here, with one "
                  f"quantization group per head_dim row, removing P gives PPL {fmt(p['no-P'])} vs {fmt(base)} "
                  f"({'identical' if same else pct('no-P')}): per-row min/max and clip thresholds are permutation-"
                  f"invariant, so P can only matter when groups are smaller than head_dim. With groups of 32, OSCAR "
                  f"{fmt(p['g32'])} vs without P {fmt(p['g32-no-P'])} ({100 * (p['g32-no-P'] / p['g32'] - 1):+.1f}%).")
        if "no-H" in p:
            claim(f"**H (Hadamard)**: without H (U·P only) PPL {fmt(p['no-H'])} ({pct('no-H')}); the paper ranks H as "
                  "the second most important factor (Table 4).")
        if "no-U" in p:
            claim(f"**U (calibrated eigenbasis)**: H·P alone with fitted clips gives {fmt(p['no-U'])} ({pct('no-U')}); "
                  "the paper calls the attention-aware basis the key factor.")
        if "ktk-vtv" in p:
            claim(f"**KᵀK / VᵀV targets** instead of the query / attention targets: {fmt(p['ktk-vtv'])} ({pct('ktk-vtv')}).")
        if {"logit-v", "shared-per-layer", "clip-ref"} <= set(p):
            claim(f"**The reference recipe's three departures, one at a time**: logit-weighted V target "
                  f"{fmt(p['logit-v'])} ({pct('logit-v')}), one rotation per layer {fmt(p['shared-per-layer'])} "
                  f"({pct('shared-per-layer')}), fixed clips 0.96/0.92 {fmt(p['clip-ref'])} ({pct('clip-ref')}); "
                  f"no clip at all {fmt(p.get('clip-none'))}.")
        sweep = [k for k in ("sw-0-0", "sw-32-128", "oscar", "sw-128-512") if k in p]
        if len(sweep) > 2:
            bits = {k: a[k]["bits"]["bits_per_element"] for k in sweep}
            claim("**Sink/window sweep** (Table 5: knee at 64/256): " + ", ".join(
                f"{'64/256' if k == 'oscar' else k[3:].replace('-', '/')}: {fmt(p[k])} at {fmt(bits[k], 2)} bits" for k in sweep) + ".")
        if "naive-int2-sw-0-0" in p and "sw-0-0" in p:
            claim(f"**Without any full-precision window** naive INT2 reaches PPL {fmt(p['naive-int2-sw-0-0'])} and OSCAR "
                  f"{fmt(p['sw-0-0'])}, at {fmt(a['sw-0-0']['bits']['bits_per_element'], 2)} bits (the paper reports a "
                  "mean accuracy of 0 for OSCAR with (S0, W) = (0, 0), Table 5 as summarised in oscar-method.md).")
        lines.append(f"(Ablations on `{model}`, same perplexity protocol as the main table.)")
        lines.append("")
    return lines


# ------------------------------------------------------------------------------------------------ key centering
CENTERING = ["bf16", "oscar", "oscar_centered", "kivi2"]


def centering_section() -> list[str]:
    """The key-centering experiment (`oscar-hf eval centering`): PPL table and key-mean diagnostic, all models."""
    runs = {m: (load(m, "centering_ppl"), load(m, "centering_keys")) for m in models()}
    runs = {m: r for m, r in runs.items() if r[0]}
    if not runs:
        return []
    out = ["## Experiment: key centering (`oscar_centered`)", "",
           "`oscar_centered` subtracts μ, the per-(layer, KV head) mean of the post-RoPE keys over the calibration "
           "tokens, from every key before the cache stores it (sink, INT2 history, recent window, current chunk), "
           "before the rotation: q·(k − μ) = q·k − q·μ shifts each query's scores by one constant, which softmax "
           "ignores, so only the quantization changes. Rotations are OSCAR's (the key rotation comes from the queries); "
           "the clips are refitted on the same held-out tokens with centered keys. μ (d values per layer and KV head) "
           "is a model constant like the rotations and is not counted in bits/elem. Code: "
           "`oscar_hf/evaluation/centering.py`.", "",
           "| method | " + " | ".join(runs) + " |", "|---|" + "---|" * len(runs)]
    for name in CENTERING:
        cells = []
        for ppl, _ in runs.values():
            r = ppl["results"].get(name)
            cells.append(f"{fmt(r['perplexity'])} ({fmt(r['bits']['bits_per_element'], 2)} b)" if r else "–")
        out.append(f"| `{name}` | " + " | ".join(cells) + " |")
    out += ["", "(PPL through the cache, same protocol as the main table; in brackets the bits per element stored at "
            "the end of the 2048-token sequences.)", "",
            "Key-mean diagnostic over the calibration tokens, per full-attention layer and KV head (median / max over "
            "them): share of the keys' energy in their mean, ‖μ‖² / E‖k‖², and the token-wise INT2 key error after "
            "OSCAR's rotation, Σ‖Q(x·R) − x·R‖² / Σ‖k‖², with x = k (plain) or x = k − μ (centered), without clip "
            "and with the fitted clips (OSCAR's for plain, refitted for centered).", "",
            "| model | ‖μ‖²/E‖k‖² | INT2 err, no clip: plain | centered | INT2 err, fitted clip: plain | centered "
            "| mean key clip: plain → centered |", "|---|---|---|---|---|---|---|"]
    for model, (ppl, keys) in runs.items():
        if not keys or "oscar_centered" not in keys["results"]:
            continue
        d = keys["results"]["oscar_centered"]
        s, layers = d["summary"], d["layers"].values()

        def mm(name):
            return f"{fmt(s[name]['median'], 3)} / {fmt(s[name]['max'], 3)}" if name in s else "–"

        clips = [(r["key_clip"], r["key_clip_centered"]) for r in layers if "key_clip" in r]
        clip = (f"{fmt(sum(c[0] for c in clips) / len(clips))} → {fmt(sum(c[1] for c in clips) / len(clips))}"
                if clips else "–")
        out.append(f"| {model} | {mm('mean_energy_ratio')} | {mm('int2_error_noclip')} | "
                   f"{mm('int2_error_noclip_centered')} | {mm('int2_error_fitted')} | "
                   f"{mm('int2_error_fitted_centered')} | {clip} |")
    out.append("")
    for model, (ppl, _) in runs.items():
        meta = ppl["meta"]
        d = meta["data"]
        main = (load(model, "ppl") or {}).get("results", {}).get("oscar")
        rerun = (f" `oscar` is rerun here (calibrated afresh); the main table's run gave {fmt(main['perplexity'])}."
                 if main else "")
        out.append(f"- {model}: {d['sequences']} × {d['sequence_length']} tokens, context {d['context']}, chunks of "
                   f"{d['chunk']} ({d['scored_tokens']} scored tokens).{rerun} Provenance: {provenance(meta)}")
    return out + [""]


def main(argv=None) -> None:
    import argparse

    global RESULTS, PLOTS, EVAL
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(RESULTS), help="folder of <model>/<stage>.json files")
    parser.add_argument("--output", default=str(EVAL), help="folder for RESULTS.md and plots/")
    args = parser.parse_args(argv)
    notes_path = EVAL / "NOTES.md"
    RESULTS, EVAL = Path(args.results), Path(args.output)
    PLOTS = EVAL / "plots"
    all_ppl, all_niah = {}, {}
    body: list[str] = []
    ablations = None
    for model in models():
        ppl, niah = load(model, "ppl"), load(model, "niah")
        if ppl:
            all_ppl[model] = ppl
        if niah:
            all_niah[model] = niah
        body += [f"## {model}", ""]
        if ppl:
            body += ppl_section(model, ppl, niah)
        if niah:
            plot = plot_niah(model, niah["results"])
            body += ["", f"![NIAH {model}]({plot})"]
        body.append("")
        abl = load(model, "ablations")
        if abl:
            ablations = ablations or abl  # the paper comparison uses the first model's (full) ablation set
            body += ablation_section(model, abl) + [""]
        diag = load(model, "diagnostics")
        if diag:
            body += diagnostics_section(model, diag) + [""]
        lm = load(model, "lm_eval")
        if lm:
            body += lm_eval_section(model, lm) + [""]
    ppl_plot = plot_ppl(all_ppl)
    head = ["# OSCAR against its peers: accuracy results", "",
            "Generated by `python eval/make_results.py` from the JSON files in `eval/results/` (produced by "
            "`bash eval/run_all.sh`, i.e. `oscar-hf eval ...`); no number below is typed by hand. Each section ends "
            "with the provenance recorded in its JSON (model package and checksum, data, versions, command).", ""]
    if ppl_plot:
        head += [f"![PPL vs method]({ppl_plot})", ""]
    summary = ["## Perplexity through the cache, all models", "",
               "| method | " + " | ".join(all_ppl) + " |", "|---|" + "---|" * len(all_ppl)]
    for name in MAIN:
        if any(name in d["results"] for d in all_ppl.values()):
            cells = [fmt(d["results"][name]["perplexity"])
                     + f" ({fmt(d['results'][name]['bits']['bits_per_element'], 2)} b)"
                     if name in d["results"] else "–" for d in all_ppl.values()]
            summary.append(f"| `{name}` | " + " | ".join(cells) + " |")
    summary += ["", "(PPL, and in brackets the bits per element really stored at the end of the 2048-token sequences.)", ""]
    notes = notes_path.read_text().splitlines() if notes_path.is_file() else []
    text = head + layout_section() + summary + body + centering_section() + closing_note(all_ppl, all_niah, ablations) + paper_comparison(ablations, all_ppl) + notes
    (EVAL / "RESULTS.md").write_text("\n".join(text) + "\n")
    print(f"wrote {EVAL / 'RESULTS.md'}")


if __name__ == "__main__":
    main()
