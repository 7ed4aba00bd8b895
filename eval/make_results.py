"""Regenerates eval/RESULTS.md and eval/plots/ppl_vs_method.png from the result files in eval/results/.

    python eval/make_results.py            # no model is run; every number comes from the JSON files

`oscar-hf eval ppl|niah ...` writes `eval/results/<model>/<stage>.json` (`bash eval/run_all.sh` reruns them on the
CPU); `bash eval/gpu_eval.sh` runs the same on a GPU machine, and `python eval/merge_gpu_results.py` adds those
trials under `eval/results/h200/<model>/`. Each file records the command, data, versions and machine of every cell.
The page shows the default (`oscar`) against its peers only; other variants' rows stay in the files.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

EVAL = Path(__file__).resolve().parent
RESULTS = EVAL / "results"
PLOTS = EVAL / "plots"
MODEL_ORDER = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
# the default against its peers, in the page's order
PEERS = ["bf16", "oscar", "oscar-token", "oscar-ref", "naive-int2", "hadamard-int2", "kivi2", "kivi2-g64",
         "kivi2-g128", "hf-hqq-int2", "naive-int4"]
LEGEND = {
    "bf16": "no quantization",
    "oscar": "the default: keys per channel over per-head blocks at 0/2/4 bits per channel; values rotated, clipped, "
             "per token; retrieval heads at 4 bits; BF16 sink 64 + window 256",
    "oscar-token": "OSCAR in the paper's layout (keys per token), fitted clips",
    "oscar-ref": "the paper's reference recipe (one rotation per layer, clips 0.96 / 0.92)",
    "naive-int2": "INT2, no rotation or clip (same sink and window)",
    "hadamard-int2": "INT2 after a Hadamard rotation only",
    "kivi2": "KIVI-2: keys per channel, values per token, groups of 32, residual 128",
    "kivi2-g64": "KIVI-2, groups of 64",
    "kivi2-g128": "KIVI-2, groups of 128",
    "hf-hqq-int2": "transformers' `QuantizedCache` (HQQ, 2 bits, groups of 64, residual 128)",
    "naive-int4": "INT4, no rotation or clip",
}
DOMAINS = (("", "essays"), ("_python", "code"), ("_shakespeare", "Shakespeare"))
# needle files: (file stem, haystack label)
NIAH_FILES = (("niah", "essays"), ("niah_python", "code"), ("niah_shakespeare", "Shakespeare"),
              ("niah_python_seeds23", "code, seeds 2–3"), ("niah4", "essays, 4 needles"),
              ("niah4_python", "code, 4 needles"))
MACHINES = (("", "CPU"), ("h200", "H200"))  # (folder under the results root, label)


def load(model: str, stage: str, root: Path | None = None) -> dict | None:
    path = (root or RESULTS) / model / f"{stage}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def fmt(x, digits=2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}f}"


def models() -> list[str]:
    """Model folders under the results root (not the GPU machine's folder, nor results/gpu)."""
    machines = {folder for folder, _ in MACHINES if folder}
    found = [p.name for p in RESULTS.iterdir() if p.is_dir() and p.name not in machines
             and (any(p.glob("ppl*.json")) or any(p.glob("niah*.json")))] if RESULTS.is_dir() else []
    return [m for m in MODEL_ORDER if m in found] + sorted(m for m in found if m not in MODEL_ORDER)


# ------------------------------------------------------------------------------------------------ commands
OPTION_ORDER = ("--model", "--methods", "--domain", "--needles", "--lengths", "--depths", "--seeds", "--sequences",
                "--device")
LEFT_OUT = {"--output": True, "--threads": True, "--quiet": False}  # option: takes a value


def command(text: str) -> str:
    """A recorded command as one would type it: `oscar-hf` for the entry point, its options in one order, without
    those that change where or how fast it runs (--output, --threads, --quiet) and without `--depths` where it is
    the default (0.1,0.3,0.5,0.7,0.9)."""
    words = re.sub(r"^\S*cli\.py\b", "oscar-hf", text.strip()).split()
    head, options, i = [], [], 0
    while i < len(words) and not words[i].startswith("--"):
        head.append(words[i])
        i += 1
    while i < len(words):
        name, value = words[i], None
        if i + 1 < len(words) and not words[i + 1].startswith("--"):
            value, i = words[i + 1], i + 1
        i += 1
        if name in LEFT_OUT or (name == "--depths" and value == "0.1,0.3,0.5,0.7,0.9"):
            continue
        options.append((name, value))
    rank = {n: k for k, n in enumerate(OPTION_ORDER)}
    options.sort(key=lambda o: rank.get(o[0], len(OPTION_ORDER)))
    return " ".join(head + [w for name, value in options for w in (name, value) if w is not None])


SUPERSCRIPT = str.maketrans("0123456789,", "⁰¹²³⁴⁵⁶⁷⁸⁹˒")


class Commands:
    """The distinct commands behind one table, numbered in order of first use; `mark` tags a cell with them."""

    def __init__(self, prefix: str):
        self.prefix = prefix  # what every command of the table starts with, said once
        self.numbers: dict[str, int] = {}

    def mark(self, commands: set[str]) -> str:
        for c in sorted(commands):
            self.numbers.setdefault(c, len(self.numbers) + 1)
        return " " + ",".join(str(n) for n in sorted(self.numbers[c] for c in commands)).translate(SUPERSCRIPT) \
            if commands else ""

    def lines(self, caption: str = "") -> list[str]:
        out = [f"{caption}Commands, each after `{self.prefix}`:", ""]
        for c, n in sorted(self.numbers.items(), key=lambda x: x[1]):
            rest = c[len(self.prefix):].strip() if c.startswith(self.prefix + " ") else None
            out.append(f"{n}. `{rest}`" if rest else f"{n}. the whole command `{c}`")
        return out


def method_command(data: dict, method: str) -> set[str]:
    """The command that measured `method`'s row of a per-method file (ppl): its own run's, or the run it carried the
    row over from."""
    carried = (data["meta"].get("carried_over") or {}).get(method) or data["meta"]
    return {command(carried["command"])}


def cell_commands(data: dict, records: list[dict]) -> set[str]:
    """Commands that measured these trials of a per-trial file (niah): by each trial's date where it has one, else
    by its cell's provenance ("method@length" in `carried_over`, else the file's own run)."""
    meta = data["meta"]
    cells = (meta.get("carried_over") or {}).get("cells") or {}
    by_date = {meta.get("date"): meta["command"]}
    for p in cells.values():
        if isinstance(p, dict) and p.get("date"):
            by_date.setdefault(p["date"], p["command"])
    out = set()
    for r in records:
        cell = cells.get(f"{r['method']}@{r['length']}") or meta
        out.add(command(by_date.get(r.get("date")) or cell["command"]))
    return out


# ------------------------------------------------------------------------------------------------ perplexity
def ppl_section(model: str) -> list[str]:
    files = [(label, load(model, "ppl" + suffix)) for suffix, label in DOMAINS]
    files = [(label, data) for label, data in files if data and "bf16" in data["results"]]
    if not files:
        return []
    shown = [m for m in PEERS if any(m in data["results"] for _, data in files)]
    essays = dict(files).get("essays")
    tokens = essays["meta"]["data"]["sequence_length"] if essays else None
    head = "| method | " + " | ".join(label for label, _ in files)
    head += f" | bits per element at {tokens:,} tokens |" if essays else " |"
    out = [head + " history bits |", "|---|" + "---|" * (len(files) + bool(essays) + 1)]
    commands = Commands(f"oscar-hf eval ppl --model {model}")
    for m in shown:
        cells = []
        for _, data in files:
            r, bf16 = data["results"].get(m), data["results"]["bf16"]["perplexity"]
            value = "–" if r is None else fmt(r["perplexity"]) if m == "bf16" \
                else f"{fmt(r['perplexity'])} ({100 * (r['perplexity'] / bf16 - 1):+.1f}%)"
            cells.append(value + (commands.mark(method_command(data, m)) if r else ""))
        if essays:
            r = essays["results"].get(m)
            cells.append(fmt(r["bits"]["bits_per_element"]) if r else "–")
        described = next((d["meta"]["methods"][m] for _, d in files if m in d["meta"]["methods"]), {})
        cells.append(fmt(described.get("history_bits"), 3) if m != "bf16" else "16")
        name = f"**`{m}`**" if m == "oscar" else f"`{m}`"
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    d = files[0][1]["meta"]["data"]
    return out + [""] + commands.lines(f"{d['sequences']} × {d['sequence_length']} tokens per text. ")


# ------------------------------------------------------------------------------------------------ needles
def hits_on_trials(records: list[dict], method: str, length: int, trials: set[tuple] | None = None) -> tuple[int, int]:
    """(hits, trials) of `method` at `length`, on the (depth, seed) `trials` only when given."""
    rs = [r for r in records if r["method"] == method and r["length"] == length
          and (trials is None or (r["depth"], r["seed"]) in trials)]
    return sum(r["hit"] for r in rs), len(rs)


def trials_of(records: list[dict], method: str, length: int) -> set[tuple]:
    return {(r["depth"], r["seed"]) for r in records if r["method"] == method and r["length"] == length}


def within_one_hit(records: list[dict], length: int) -> str:
    """The retrieval target for one cell: `oscar` at most one hit per ten trials behind `bf16`, counted on the
    trials both measured ("yes", or "**no** (-k of n)"); "–" where either is missing."""
    common = trials_of(records, "oscar", length) & trials_of(records, "bf16", length)
    if not common:
        return "–"
    (oscar, n), (bf16, _) = (hits_on_trials(records, m, length, common) for m in ("oscar", "bf16"))
    return "yes" if (bf16 - oscar) * 10 <= n else f"**no** ({oscar - bf16} of {n})"


def same_trials(records: list[dict], length: int) -> str:
    """Whether `oscar` meets the target against `bf16` on the trials both measured, with the counts where those
    trials are not all of either method's."""
    common = trials_of(records, "oscar", length) & trials_of(records, "bf16", length)
    if not common:
        return "–"
    verdict = "yes" if within_one_hit(records, length) == "yes" else "**no**"
    if common == trials_of(records, "oscar", length) == trials_of(records, "bf16", length):
        return verdict
    (oscar, n), (bf16, _) = (hits_on_trials(records, m, length, common) for m in ("oscar", "bf16"))
    return f"{verdict} ({oscar} vs {bf16} of {n})"


def niah_rows(model: str) -> list[tuple[str, str, dict]]:
    """(haystack label, machine label, data) of every needle file of `model`, CPU first."""
    return [(label, machine, data) for folder, machine in MACHINES for stem, label in NIAH_FILES
            for data in [load(model, stem, RESULTS / folder if folder else RESULTS)] if data]


def niah_section(model: str) -> list[str]:
    rows = []
    for label, machine, data in niah_rows(model):
        records = [r for r in data["results"] if r["method"] in PEERS]
        for length in sorted({r["length"] for r in records}):
            cell = [r for r in records if r["length"] == length]
            if {r["method"] for r in cell} - {"bf16"}:  # a row says something only beside another method
                rows.append((label, machine, length, cell, data))
    if not rows:
        return []
    shown = [m for m in PEERS if any(r["method"] == m for *_, cell, _ in rows for r in cell)]
    out = ["| haystack | tokens | " + " | ".join(f"`{m}`" for m in shown)
           + " | `oscar` within one hit per ten trials of `bf16`? |",
           "|---|---|" + "---|" * (len(shown) + 1)]
    commands = Commands(f"oscar-hf eval niah --model {model}")
    for label, machine, length, cell, data in rows:
        cells = []
        for m in shown:
            trials = [r for r in cell if r["method"] == m]
            h, n = hits_on_trials(cell, m, length)
            cells.append(f"{h}/{n}" + commands.mark(cell_commands(data, trials)) if n else "–")
        where = label if machine == MACHINES[0][1] else f"{label}, {machine}"
        out.append(f"| {where} | {length:,} | " + " | ".join(cells) + f" | {same_trials(cell, length)} |")
    out += [""] + commands.lines()
    notes = sorted({data["meta"]["tokenizer_note"] for *_, data in rows if data["meta"].get("tokenizer_note")})
    return out + [f"- Note: {n}" for n in notes]


# ------------------------------------------------------------------------------------------------ RULER
def ruler_commands(data: dict, records: list[dict]) -> set[str]:
    """Commands that measured these RULER requests: by each record's date (the file's run, or the earlier run whose
    records it kept)."""
    meta = data["meta"]
    by_date = {meta["date"]: meta["command"]}
    carried = meta.get("carried_over") or {}
    if carried.get("date"):
        by_date.setdefault(carried["date"], carried["command"])
    return {command(by_date.get(r.get("date"), meta["command"])) for r in records}


def ruler_section(model: str) -> list[str]:
    """Per length: each task's score (percent, RULER's own scoring) per method, over the requests measured, the
    average over the tasks, each method's bits per element and the CPU seconds each task took (one prefill per
    request, then every method's answer)."""
    data = load(model, "ruler")
    if not data:
        return []
    records = [r for r in data["results"]["requests"] if r["method"] in PEERS]
    out = []
    commands = Commands(f"oscar-hf eval ruler --model {model}")
    for length in sorted({r["length"] for r in records}):
        at = [r for r in records if r["length"] == length]
        methods = [m for m in PEERS if any(r["method"] == m for r in at)]
        tasks = sorted({r["task"] for r in at})
        out += [f"{length:,} tokens:", "",
                "| task | requests | " + " | ".join(f"`{m}`" for m in methods) + " | CPU seconds |",
                "|---|---|" + "---|" * (len(methods) + 1)]
        means = {m: [] for m in methods}
        for task in tasks:
            rows = [r for r in at if r["task"] == task]
            cells = []
            for m in methods:
                mine = [r for r in rows if r["method"] == m]
                if mine:
                    score = 100 * sum(r["score"] for r in mine) / len(mine)
                    means[m].append(score)
                    cells.append(f"{score:.0f}" + (f" ({len(mine)})" if len(mine) != len({r['doc_id'] for r in rows})
                                                   else "") + commands.mark(ruler_commands(data, mine)))
                else:
                    cells.append("–")
            docs = {r["doc_id"]: r["prefill_seconds"] for r in rows}
            seconds = sum(docs.values()) + sum(r["seconds"] for r in rows)
            out.append(f"| {task} | {len(docs)} | " + " | ".join(cells) + f" | {seconds:,.0f} |")
        out.append("| **average** | | " + " | ".join(f"**{sum(v) / len(v):.1f}**" if v else "–"
                                                    for v in means.values()) + " | |")
        bits = {m: [r["bits_per_element"] for r in at if r["method"] == m] for m in methods}
        out.append("| bits per element | | " + " | ".join(f"{sum(b) / len(b):.2f}" for b in bits.values()) + " | |")
        out.append("")
    meta = data["meta"]
    return out + commands.lines() + ["", f"- Model dtype: {meta.get('dtype', 'as recorded in the file')}; "
                                         f"{meta.get('protocol', '')}."]


# ------------------------------------------------------------------------------------------------ bits
def layout_bits(method: str, head_dim: int, tokens: int) -> float | None:
    """Bits per K/V element of a method's layout holding `tokens` tokens (16-bit metadata), from its accounting:
    `oscar`: BF16 sink 64 + window 256..383 (whole chunks of 128 demoted), keys 2 + 32/64 on average, values
    2 + 32/d, wide heads at 4 bits up to the history budget (`CalibrationConfig.wide_budget`: at most that); paper layout:
    sink 64 + window 256..263, 2 + 32/d for both; KIVI-2 (residual 128): keys in blocks of G tokens once 128
    full-precision keys have gathered, values per token in groups of min(G, d) beyond the last 128."""
    sink, window = 64, 256
    if method in ("oscar", "oscar-token"):
        from oscar_hf import CalibrationConfig, OscarConfig

        config = OscarConfig() if method == "oscar" else OscarConfig(key_granularity="token", demotion_block=8)
        hist = max(tokens - sink - window, 0) // config.demotion_block * config.demotion_block
        return ((tokens - hist) * 16 + hist * CalibrationConfig().history_bits_per_element(config, head_dim)) / tokens
    if method.startswith("kivi2"):
        g = {"kivi2": 32, "kivi2-g64": 64}.get(method, 128)
        k_hist = tokens // 128 * 128
        v_hist = max(tokens - 128, 0)
        k = (tokens - k_hist) * 16 + k_hist * (2 + 32 / g)
        v = (tokens - v_hist) * 16 + v_hist * (2 + 32 / min(g, head_dim))
        return (k + v) / 2 / tokens
    return 16.0 if method == "bf16" else None


def bits_section() -> list[str]:
    out = ["| layout | history, head_dim 64 / 128 | all, 8K tokens, head_dim 64 / 128 | 32K, head_dim 128 | "
           "128K, head_dim 128 |", "|---|---|---|---|---|"]
    for m in ("oscar", "oscar-token", "kivi2-g64", "kivi2", "kivi2-g128"):
        out.append(f"| `{m}` | {fmt(layout_bits(m, 64, 10**9), 3)} / {fmt(layout_bits(m, 128, 10**9), 3)} | "
                   f"{fmt(layout_bits(m, 64, 8192), 2)} / {fmt(layout_bits(m, 128, 8192), 2)} | "
                   f"{fmt(layout_bits(m, 128, 32768), 2)} | {fmt(layout_bits(m, 128, 131072), 2)} |")
    return out + ["", "What each layout stores per K/V element, 16-bit metadata and BF16 tokens included "
                  "(`layout_bits` in `eval/make_results.py`; for `oscar` the most its wide heads may add). The tables "
                  "below give what each cache held, measured; history bits: the quantized part alone, which long "
                  "contexts approach."]


# ------------------------------------------------------------------------------------------------ plot
def plot_ppl(all_ppl: dict[str, dict]) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not all_ppl:
        return None
    fig, axes = plt.subplots(1, len(all_ppl), figsize=(4.2 * len(all_ppl), 3.8), squeeze=False)
    for ax, (model, data) in zip(axes.flat, all_ppl.items()):
        res = data["results"]
        names = [m for m in PEERS if m in res]
        bf16 = res["bf16"]["perplexity"]
        vals = [res[m]["perplexity"] / bf16 for m in names]
        colors = ["tab:green" if m.startswith("oscar") else "tab:gray" if m == "bf16" else "tab:red" for m in names]
        ax.barh(range(len(names)), vals, color=colors)
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.set_xscale("log")
        ax.axvline(1.0, color="k", lw=0.5)
        ax.invert_yaxis()
        ax.set_title(f"{model}\nPPL / BF16 PPL ({fmt(bf16)}), essays", fontsize=9)
        for i, v in enumerate(vals):
            ax.text(v, i, f" {v:.2f}", va="center", fontsize=6)
    fig.tight_layout()
    PLOTS.mkdir(parents=True, exist_ok=True)
    path = PLOTS / "ppl_vs_method.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"plots/{path.name}"


# ------------------------------------------------------------------------------------------------ page
def model_heading(model: str) -> list[str]:
    data = next((d for stem in ("ppl", "niah") for d in [load(model, stem)] if d), None)
    meta = data["meta"] if data else {}
    source = meta.get("model", {}).get("source")
    what = source.get("description") if isinstance(source, dict) else None
    line = f"{what.split('), ')[0]})." if what else ""
    return [f"## {model}", ""] + ([line, ""] if line else [])


def main(argv=None) -> None:
    import argparse

    global RESULTS, PLOTS, EVAL
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(RESULTS), help="folder of <model>/<stage>.json files")
    parser.add_argument("--output", default=str(EVAL), help="folder for RESULTS.md and plots/")
    args = parser.parse_args(argv)
    RESULTS, EVAL = Path(args.results), Path(args.output)
    PLOTS = EVAL / "plots"
    ppl_essays = {m: d for m in models() for d in [load(m, "ppl")] if d and "bf16" in d["results"]}
    plot = plot_ppl(ppl_essays)
    text = ["# Accuracy: oscar-hf's default against its peers", "",
            "Generated by `python eval/make_results.py` from `eval/results/`; no number is typed by hand. A cell's "
            "superscripts point to the commands under its table (without `--output`, `--threads`, `--quiet` and the "
            "default `--depths 0.1,0.3,0.5,0.7,0.9`); each JSON's `meta` has the exact command, data, versions and "
            "machine. Commands keep the method names of their day: `oscar-wide-channels` is today's `oscar`; an "
            "`oscar` run before 2026-12-05 was an earlier default (not shown). The CPU `oscar` perplexities of "
            "SmolLM2 and both Qwen2.5-Coder models, and their 4K essay needles on the CPU, were "
            "measured on 2026-12-07 with today's calibration and storage (each head fitted at the bits it stores, "
            "wide heads unclipped); the change moved those perplexities by at most 0.2% on SmolLM2 and the 1.5B and "
            "up to 1.6% on the 0.5B, toward BF16 (research log, \"Clips\"), and leaves Gemma-3, which has no wide "
            "head, as it was. The other `oscar` cells were calibrated before 2026-12-06, when calibration began to "
            "weigh a 2-bit head's key blocks in the channels it stores: its perplexities are within 0.3% of these on "
            "every model and domain (research log, \"Which key basis\"). H200 rows ran "
            "through `bash eval/gpu_eval.sh`. Other variants and the history: "
            "[`docs/research-log.md`](../docs/research-log.md).",
            ""]
    text += ["| method | what it stores |", "|---|---|"] + [f"| `{m}` | {LEGEND[m]} |" for m in PEERS] + [""]
    text += ["Perplexity: 512 tokens of each 2048-token sequence go into the cache, the rest is scored in chunks of "
             "128 through it; in brackets, the change against BF16 on the same text. Rotations are calibrated on "
             "essays only. Needles: the BF16 prefill of the haystack fills each method's cache, the question runs "
             "through it, and the answer must be the 5-digit needle; hits / trials, on the CPU unless marked H200, "
             "the last column counted on the trials both measured. A 10-trial cell moves by one or two hits "
             "between machines for BF16 alone. Models run in bfloat16.", ""]
    if plot:
        text += [f"![perplexity against BF16]({plot})", ""]
    text += ["## Bits per element", ""] + bits_section() + [""]
    for model in models():
        ppl, niah, ruler = ppl_section(model), niah_section(model), ruler_section(model)
        if not ppl and not niah and not ruler:
            continue
        text += model_heading(model)
        if ppl:
            text += ["### Perplexity", ""] + ppl + [""]
        if niah:
            text += ["### Needle retrieval", ""] + niah + [""]
        if ruler:
            text += ["### RULER (offline tasks)", ""] + ruler + [""]
    (EVAL / "RESULTS.md").write_text("\n".join(text).rstrip() + "\n")
    print(f"wrote {EVAL / 'RESULTS.md'}")


if __name__ == "__main__":
    main()
