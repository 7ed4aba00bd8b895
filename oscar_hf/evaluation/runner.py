"""`oscar-hf eval ...`: runs the metrics for a list of methods on one model and writes raw JSON results.

Every result file is `{"meta": {...provenance...}, "results": ...}` where meta records the model (and its package
source), the data, token counts, seeds, windows, methods (with their full configs), calibration, library versions,
the machine and the command line. `eval/make_results.py` turns these files into `eval/RESULTS.md` and plots.

Stages (each writes `<output>/<model>/<stage>.json`):
- ppl:         perplexity through the cache (`oscar_hf.metrics.perplexity`), main methods; bits at the last token.
- ablations:   the same protocol for the paper's ablations (calibration statistics reused).
- niah:        needle-in-a-haystack (`niah.py`), lengths × depths × seeds, main methods.
- diagnostics: per-layer attention KL / output errors vs BF16 (`diagnostics.py`).
- lm-eval:     offline lm-eval tasks through `OscarLM` (`lm_eval_model.py`).
- format:      perplexity of the default with one of its refinements taken away (`format_ppl.json`; not part of
               `all`).
- ruler:       RULER's offline tasks (`ruler_runs.py`): lm-eval's prompts and scoring, every method's cache filled
               from one prefill per prompt (`ruler.json`; not part of `all`).
"""

from __future__ import annotations

import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import torch

from .. import assets
from ..data import token_sequences
from ..metrics import perplexity
from ..rotations_io import OscarRotations
from .domains import evaluation_texts
from .methods import (Method, RotationStore, Windows, ablation_methods, all_methods, cache_bits, format_methods,
                      head_dim_of, main_methods, nominal_history_bits)

STAGES = ("ppl", "ablations", "diagnostics", "niah", "lm-eval")
EXPERIMENTS = ("format", "ruler")  # stages outside `all`
# the default's refinements, one taken away at a time, against the paper layout and KIVI-2 at equal and more bits
FORMAT_METHODS = ("bf16,oscar-token,oscar-token-centered,oscar-uniform-b64,oscar-no-wide,oscar-uniform-channels,oscar,"
                  "kivi2-g64,kivi2")


def versions() -> dict:
    import transformers

    from .. import __version__

    out = {"oscar_hf": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version()}
    for name in ("lm_eval", "hqq", "optimum.quanto"):
        try:
            module = __import__(name, fromlist=["__version__"])
            out[name] = getattr(module, "__version__", "unknown")
        except ImportError:
            pass
    return out


def machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.machine(), "threads": torch.get_num_threads(),
            "cuda": torch.cuda.is_available(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def load(model_spec: str, dtype: str = "bfloat16", device: str | None = None):
    """`(model, tokenizer, info)`: an offline model name (see `assets.OFFLINE_MODELS`) or a local folder, on `device`
    (default: the CPU)."""
    import oscar_hf  # noqa: F401  (registers the "oscar" attention)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..config import DTYPES as dtypes
    if device and torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this torch build sees no CUDA device (torch {torch.__version__})")
    name = model_spec.split(":", 1)[1] if model_spec.startswith("offline:") else model_spec
    if name in assets.OFFLINE_MODELS:
        path = assets.model_path(name)
        source = json.loads((path / "oscar_hf_source.json").read_text())
    elif model_spec.startswith("offline:"):
        raise FileNotFoundError(f"unknown offline model {name!r}; available: {', '.join(assets.OFFLINE_MODELS)}")
    elif not (Path(model_spec) / "config.json").is_file():
        raise FileNotFoundError(f"model folder {model_spec} not found (or it has no config.json); offline models: "
                                f"{', '.join(assets.OFFLINE_MODELS)}")
    else:
        path, source = Path(model_spec), {"path": str(Path(model_spec).resolve())}
        name = path.resolve().name
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtypes[dtype], attn_implementation="oscar",
                                                 device_map=device).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    cfg = model.config.get_text_config(decoder=True)
    info = {"name": name, "source": source, "dtype": dtype, "device": str(model.device), "model_type": cfg.model_type,
            "layers": cfg.num_hidden_layers, "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
            "head_dim": head_dim_of(model), "layer_types": list(getattr(cfg, "layer_types", None) or []),
            "max_position_embeddings": getattr(cfg, "max_position_embeddings", None)}
    return model, tokenizer, info


class Session:
    """One model, its rotations, and where results go. Calibrates at most once (statistics reused)."""

    def __init__(self, model_spec: str, output: str | Path = "eval/results", dtype: str = "bfloat16",
                 calibration_tokens: int = 8192, windows: Windows = Windows(), threads: int | None = None,
                 calibration_length: int = 2048, domain: str = "essays", progress: bool = False,
                 device: str | None = None):
        if threads:
            torch.set_num_threads(threads)
        torch.set_grad_enabled(False)
        self.model, self.tokenizer, self.info = load(model_spec, dtype, device)
        self.windows = windows
        self.output = Path(output) / self.info["name"]
        self.output.mkdir(parents=True, exist_ok=True)
        self.store = RotationStore(self.model, self.tokenizer, calibration_tokens=calibration_tokens, progress=progress,
                                   calibration_sequence_length=calibration_length)
        self.rotation_dir = self.output / "rotations"
        # Evaluation text (disjoint from the calibration essays); results of other domains get a suffix.
        self.domain = domain
        self.eval_docs, self.eval_data = evaluation_texts(domain)
        self.suffix = "" if domain == "essays" else f"_{domain}"

    # ------------------------------------------------------------------ rotations
    def rotations(self, methods: dict[str, Method]) -> dict[str, OscarRotations]:
        """Calibrated rotations for the methods that need them; saved under `<output>/rotations/` and reused."""
        out = {}
        for name, method in methods.items():
            if not method.needs_calibration:
                continue
            folder = self.rotation_dir / _slug(self.store.key(method))
            if (folder / "oscar_rotations.json").is_file() and self.store.statistics is None:
                rotations = OscarRotations.from_pretrained(folder)
                self.store.put(method, rotations)
            rotations = self.store.rotations_for(method)
            if not (folder / "oscar_rotations.json").is_file():
                rotations.save_pretrained(folder)
            out[name] = rotations
        return out

    def calibration_meta(self, rotations: dict[str, OscarRotations]) -> dict:
        out = {}
        for name, rot in rotations.items():
            cal = rot.metadata.get("calibration", {})
            kc, vc = rot.key_clips or {}, rot.value_clips or {}
            out[name] = {"data": cal.get("data", {}).get("source"), "documents": cal.get("data", {}).get("documents"),
                         "tokens": cal.get("tokens"), "heldout_tokens": cal.get("heldout_tokens"),
                         "seconds": cal.get("seconds"), "method": rot.metadata.get("method"),
                         "mean_key_clip": sum(kc.values()) / len(kc) if kc else None,
                         "mean_value_clip": sum(vc.values()) / len(vc) if vc else None,
                         # the file's wide heads (a method that does not take them, `oscar-no-wide`, still lists them)
                         "wide_heads": [list(pair) for pair in rot.wide_heads],
                         "kv_heads": sum(len(rot.key_rotations[layer]) for layer in rot.layers)}
        return out

    # ------------------------------------------------------------------ output
    def meta(self, stage: str, methods: dict[str, Method], extra: dict) -> dict:
        return {
            "stage": stage, "model": self.info, "windows": self.windows.__dict__, "dtype": self.info["dtype"],
            "methods": {name: m.describe() | {"history_bits": nominal_history_bits(m, self.info["head_dim"])}
                        for name, m in methods.items()},
            "versions": versions(), "machine": machine(),
            "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), **extra,
        }

    def result_path(self, stage: str) -> Path:
        """`<output>/<model>/<stage>[_domain].json`."""
        return self.output / f"{stage}{self.suffix}.json"

    def write(self, stage: str, meta: dict, results, merge: bool = False) -> Path:
        """Writes `<output>/<model>/<stage>[_domain].json`. With `merge` (per-method results), methods of an earlier
        file that this run did not measure are kept, each with the provenance of the run that measured it."""
        path = self.result_path(stage)
        if merge and path.is_file():
            old = json.loads(path.read_text())
            kept = _carried_over(old, set(results))
            if kept:
                results = {**kept["results"], **results}
                meta["methods"] = {**kept["methods"], **meta["methods"]}
                meta["carried_over"] = kept["provenance"]
        path.write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=_jsonable))
        print(f"wrote {path}", flush=True)
        return path

    # ------------------------------------------------------------------ stages
    def perplexity(self, methods: dict[str, Method], stage: str = "ppl", sequences: int = 3, length: int = 2048,
                   context: int = 512, chunk: int = 128) -> Path:
        protocol = {**self.eval_data, "sequences": sequences, "sequence_length": length, "context": context,
                    "chunk": chunk}
        check_same_protocol(self.result_path(stage), protocol, PPL_PROTOCOL)
        seqs = token_sequences(self.tokenizer, self.eval_docs, length, sequences)
        rotations = self.rotations(methods)
        results = {}
        for name, method in methods.items():
            start = time.perf_counter()
            caches = []

            def make(method=method, name=name):
                caches.append(method.make_cache(self.model, rotations.get(name)))
                return caches[-1]

            ppl = perplexity(self.model, seqs, make, context=context, chunk=chunk)
            results[name] = {**ppl, "bits": cache_bits(caches[-1]), "seconds": round(time.perf_counter() - start, 1)}
            print(f"[{self.info['name']}] {stage} {name:20s} ppl {ppl['perplexity']:8.3f}  bits "
                  f"{results[name]['bits']['bits_per_element']:.3f}  ({results[name]['seconds']} s)", flush=True)
        data = {**protocol, "scored_tokens": results[next(iter(results))]["tokens"]}
        meta = self.meta(stage, methods, {"data": data, "calibration": self.calibration_meta(rotations),
                                          "protocol": "oscar_hf.metrics.perplexity: context prefilled into the cache, "
                                                      "the rest scored in chunks against the stored history"})
        return self.write(stage, meta, results, merge=True)

    def niah(self, methods: dict[str, Method], lengths, depths, seeds, max_new_tokens: int = 8, needles: int = 1) -> Path:
        from .niah import haystack_stream, make_trial, run_trial

        stage = "niah" if needles == 1 else f"niah{needles}"
        protocol = {**self.eval_data, "haystack": True, "max_new_tokens": max_new_tokens, "needles": needles,
                    "scoring": "first number of the greedy answer == key"}
        check_same_protocol(self.result_path(stage), protocol, NIAH_PROTOCOL)
        if self.result_path(stage).is_file():  # before anything is measured, as merge_records would after
            old = json.loads(self.result_path(stage).read_text())
            planned = {(n, L, d, s) for n in methods for L in lengths for d in depths for s in seeds}
            kept, stored = _carried_over_records(old, planned)
            check_same_methods(stored, {n: m.describe() for n, m in methods.items()}, {r["method"] for r in kept})
        rotations = self.rotations(methods)
        records = []
        path = None
        run_date = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        stream = haystack_stream(self.tokenizer, self.eval_docs)
        for length in lengths:
            for depth in depths:
                for seed in seeds:
                    trial = make_trial(self.tokenizer, self.eval_docs, length, depth, seed, needles, stream)
                    rows = run_trial(self.model, self.tokenizer, trial, methods, rotations, max_new_tokens)
                    records.extend({**row, "date": run_date} for row in rows)  # a cell may gather several runs' trials
                    hits = " ".join(f"{r['method']}={'Y' if r['hit'] else 'n'}" for r in rows)
                    print(f"[{self.info['name']}] niah{needles if needles > 1 else ''} L={length} depth={depth} seed={seed} prefill "
                          f"{rows[0]['prefill_seconds']} s: {hits}", flush=True)
                # written after every (length, depth): a long run leaves partial results behind
                meta = self.meta(stage, methods, {
                    "date": run_date,  # the run's start, as its trials record it
                    "data": {**protocol, "lengths": list(lengths), "depths": list(depths), "seeds": list(seeds)},
                    "calibration": self.calibration_meta(rotations),
                    "protocol": "haystack prefilled once in BF16; each method's cache built from those keys/values "
                                "with cache.update; question fed through the cache; greedy answer"})
                path = self.write_records(stage, meta, records, {_trial_key(r) for r in records})
        return path

    def ruler(self, methods: dict[str, Method], tasks: list[str], lengths, limit: int | None) -> Path:
        """RULER's offline tasks at each length (`ruler_runs`): lm-eval's first `limit` requests of each task, every
        method on each request from one prefill. Per-request records and their summary go to
        `<output>/<model>/ruler.json`, written after every (length, task); records of an earlier file for requests
        this run does not measure (task, length, document, method) are kept, with that file's command."""
        from .lm_eval_model import OscarLM, task_manager
        from .ruler import OFFLINE_TASKS
        from .ruler_runs import ruler_requests, run_request, summarize

        unknown = sorted(set(tasks) - set(OFFLINE_TASKS))
        if unknown:
            raise ValueError(f"not an offline RULER task: {', '.join(unknown)} (offline: {', '.join(OFFLINE_TASKS)})")
        path = self.result_path("ruler")
        old = json.loads(path.read_text()) if path.is_file() else None
        rotations = self.rotations(methods)
        lm = OscarLM(pretrained=self.model, tokenizer=self.tokenizer, method="bf16", batch_size=1)  # lm-eval's I/O
        run_date = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        records = []
        for length in lengths:
            manager = task_manager(metadata={"max_seq_lengths": [length], "tokenizer": self.tokenizer.name_or_path})
            for task_name in tasks:
                start = time.perf_counter()
                task, requests = ruler_requests(task_name, manager, limit)
                for request in requests:
                    rows = run_request(lm, task, request, methods, rotations)
                    records.extend({**row, "date": run_date} for row in rows)
                    scores = " ".join(f"{r['method']}={r['score']:.2f}" for r in rows)
                    print(f"[{self.info['name']}] ruler {task_name} L={length} doc {request.doc_id} prefill "
                          f"{rows[0]['prefill_seconds']} s: {scores}", flush=True)
                seconds = round(time.perf_counter() - start, 1)
                print(f"[{self.info['name']}] ruler {task_name} L={length}: {len(requests)} requests in {seconds} s",
                      flush=True)
                meta = self.meta("ruler", methods, {
                    "date": run_date, "tasks": list(tasks), "lengths": list(lengths), "limit": limit,
                    "calibration": self.calibration_meta(rotations),
                    "protocol": "lm-eval's RULER requests (oscar_hf.evaluation.ruler, offline) and scoring; the "
                                "context but its last token prefilled once in the model's dtype, each method's cache "
                                "filled from it; the last token and the greedy answer through that cache"})
                path = self._write_ruler(path, old, meta, records)
        print(json.dumps(summarize(records), indent=1), flush=True)
        return path

    @staticmethod
    def _write_ruler(path: Path, old: dict | None, meta: dict, records: list[dict]) -> Path:
        from .ruler_runs import summarize

        key = lambda r: (r["task"], r["length"], r["doc_id"], r["method"])  # noqa: E731
        measured = {key(r) for r in records}
        kept = [r for r in old["results"]["requests"] if key(r) not in measured] if old else []
        if kept:
            check_same_methods(old["meta"]["methods"], meta["methods"], {r["method"] for r in kept})
            meta = {**meta, "methods": {**old["meta"]["methods"], **meta["methods"]},
                    "carried_over": {"command": old["meta"].get("carried_over", {}).get("command") or
                                     old["meta"]["command"], "date": old["meta"]["date"]}}
        everything = kept + records
        path.write_text(json.dumps({"meta": meta, "results": {"summary": summarize(everything),
                                                              "requests": everything}}, indent=1, default=_jsonable))
        print(f"wrote {path}", flush=True)
        return path

    def write_records(self, stage: str, meta: dict, records: list[dict], measured: set[tuple]) -> Path:
        """Writes per-trial records; records of an earlier file for trials (method, length, depth, seed) this run
        does not measure are kept, with the provenance of the run that measured them (a 16K run adds to the 4K/8K
        cells; a run of more depths adds trials to a cell; a trial measured again is replaced)."""
        path = self.result_path(stage)
        old = json.loads(path.read_text()) if path.is_file() else None
        path.write_text(json.dumps(merge_records(old, meta, records, measured), indent=1, default=_jsonable))
        print(f"wrote {path}", flush=True)
        return path

    def diagnostics(self, methods: dict[str, Method], sequences: int = 2, context: int = 1536, chunk: int = 128) -> Path:
        from .diagnostics import layer_errors

        rotations = self.rotations(methods)
        seqs = token_sequences(self.tokenizer, self.eval_docs, context + chunk, sequences, offset=50000)
        results = layer_errors(self.model, seqs, {k: v for k, v in methods.items() if k != "bf16"}, rotations,
                               context=context, chunk=chunk)
        meta = self.meta("diagnostics", methods, {"data": {"source": "evaluation essays", "sequences": sequences,
                                                           "context": context, "chunk": chunk, "offset_tokens": 50000}})
        return self.write("diagnostics", meta, results)


# What makes two runs' numbers comparable: a run adds to a result file only when these match the file's.
PPL_PROTOCOL = ("domain", "source", "sequences", "sequence_length", "context", "chunk")
NIAH_PROTOCOL = ("domain", "source", "max_new_tokens", "needles", "scoring")


def merge_records(old: dict | None, meta: dict, records: list[dict], measured: set[tuple]) -> dict:
    """A per-trial result file: `records` (this run's, with its `meta`) after the records of the `old` file whose
    trials this run did not measure, each cell keeping the provenance of the run that measured it."""
    meta = dict(meta)
    if old is not None:
        kept, old_methods = _carried_over_records(old, measured)
        check_same_methods(old_methods, meta["methods"], {r["method"] for r in kept})
        if kept:
            records = kept + records
            meta["methods"] = {**{r["method"]: old_methods[r["method"]] for r in kept if r["method"] in old_methods},
                               **meta["methods"]}
            meta["carried_over"] = {"cells": {cell: _cell_provenance(old["meta"], cell)
                                              for cell in sorted({_cell(r) for r in kept})}}
            if "lengths" in meta.get("data", {}):
                meta["data"] = {**meta["data"], "lengths": sorted({r["length"] for r in records})}
    return {"meta": meta, "results": records}


def merge_record_files(older: Path, newer: Path) -> dict:
    """`newer`'s trials added to `older`'s (e.g. a GPU run's file to the committed one); the same protocol only."""
    old, new = json.loads(older.read_text()), json.loads(newer.read_text())
    check_same_protocol(older, new["meta"].get("data", {}), NIAH_PROTOCOL)
    cells = [(m["meta"].get("model", {}).get("name"), m["meta"].get("stage")) for m in (old, new)]
    if cells[0] != cells[1]:
        raise ValueError(f"{newer} holds {'/'.join(map(str, cells[1]))}, {older} {'/'.join(map(str, cells[0]))}: "
                         "not the same cells")
    return merge_records(old, new["meta"], new["results"], {_trial_key(r) for r in new["results"]})


def check_same_methods(stored: dict[str, dict], methods: dict[str, dict], kept: set[str]) -> None:
    """Refuses to add trials of a method to a file that keeps (`kept`) trials of that name measured with another
    configuration (`stored`, as `Method.describe` wrote it): one cell would count two caches' hits under one name,
    as after the default changes. A field a stored configuration lacks is a difference (the code that wrote it had
    no such field, so what it did then is not known here), unless it is inert in the new configuration
    (`_inert_fields`, e.g. channel-wise key blocks under token-wise keys): then neither code used it."""
    for name in sorted(kept & set(methods) & set(stored)):
        old, new = _measured_config(stored[name]), _measured_config(methods[name])
        inert = _inert_fields(new)
        differ = sorted(k for k in set(old) | set(new) if old.get(k, "(absent)") != new.get(k, "(absent)")
                        and not (k not in old and k in inert))
        if differ:
            raise ValueError(
                f"the result file holds trials of {name!r} measured with another configuration ("
                + ", ".join(f"{k}: {old.get(k, '(absent)')!r} there, {new.get(k, '(absent)')!r} now" for k in differ[:3])
                + (f", and {len(differ) - 3} more" if len(differ) > 3 else "")
                + "): measure the same trials again to replace them, or write elsewhere with --output")


def _inert_fields(config: dict) -> set[str]:
    """Fields of a flat measured configuration (`_measured_config`) that change nothing it stores or calibrates: the
    channel-wise key layout's under token-wise keys, the wide heads' where the layout cannot hold them, a fitted
    allocation's budget under uniform blocks."""
    get = config.get
    channel = get("oscar_config.key_granularity", "channel") == "channel"
    two_bit = get("oscar_config.bits", 2) == 2
    inert = set()
    if not channel:
        inert |= {"oscar_config.key_block", "calibration_config.key_block_allocation",
                  "calibration_config.allocation_history_bits"}
    elif get("calibration_config.key_block_allocation") == "uniform":
        inert.add("calibration_config.allocation_history_bits")
    if not (two_bit and channel and get("oscar_config.group_size") is None):
        inert |= {"calibration_config.wide_heads", "calibration_config.wide_history_bits"}
    if not (two_bit and channel):
        inert.add("calibration_config.key_channel_bits")
    return inert


def _measured_config(described: dict) -> dict:
    """What decides a method's cache in its `Method.describe()` record, as one flat dict. Records of oscar-hf 0.1 kept
    calibration and rotation-target fields in `oscar_config`: each is filed under its place now."""
    from ..config import LEGACY_CALIBRATION_NAMES, LEGACY_RECIPE_FIELDS, CalibrationConfig

    out = {k: described[k] for k in ("family", "rotations") if k in described}
    calibration_fields = {f for f in CalibrationConfig.__dataclass_fields__}
    for part in ("oscar_config", "calibration_config", "rotation_targets", "kivi_config", "hf_quantized_cache"):
        for k, v in (described.get(part) or {}).items():
            k = LEGACY_CALIBRATION_NAMES.get(k, k)
            if part in ("oscar_config", "calibration_config") and k in ("tokens", "sequence_length", "clip_grid",
                                                                         "key_basis_hadamard_preference"):
                continue  # recorded elsewhere (calibration meta), or no longer a setting
            if part == "oscar_config" and k in calibration_fields:
                out[f"calibration_config.{k}"] = v
            elif part == "oscar_config" and k in LEGACY_RECIPE_FIELDS:
                out[f"rotation_targets.{k}"] = v
            else:
                out[f"{part}.{k}"] = v
    if out.get("family") == "oscar" and out.get("rotations") == "calibrated":
        # rotation targets recorded by describe() (0.2) or as the 0.1 fields; the composition is derived from them
        targets = {k: v for k, v in out.items() if k.startswith("rotation_targets.")}
        if "rotation_targets.composition" in targets:
            composition = out.pop("rotation_targets.composition")
            out["rotation_targets.use_hadamard"] = "H" in composition
            out["rotation_targets.use_permutation"] = "P" in composition
    return out


def check_same_protocol(path: Path, data: dict, keys: tuple[str, ...]) -> None:
    """Refuses (before anything is measured) to add results to a file measured under another protocol: its table
    would compare numbers from different texts as if they were one experiment."""
    if not path.is_file():
        return
    old = json.loads(path.read_text()).get("meta", {}).get("data", {})
    differ = [k for k in keys if k in old and k in data and old[k] != data[k]]
    if differ:
        raise ValueError(f"{path} holds results measured with "
                         + ", ".join(f"{k}={old[k]!r}" for k in differ) + "; this run has "
                         + ", ".join(f"{k}={data[k]!r}" for k in differ)
                         + ": run with the file's settings, or write elsewhere with --output")


def _carried_over(old: dict, measured: set[str]) -> dict:
    """The methods of an earlier per-method result file that a new run did not measure. Files written before the
    storage format became channel-wise called the paper's layout `oscar`: that row is renamed `oscar-token`."""
    results, methods = dict(old["results"]), dict(old["meta"].get("methods", {}))
    legacy = "key_granularity" not in methods.get("oscar", {}).get("oscar_config", {"key_granularity": None})
    if legacy and "oscar" in results:
        results["oscar-token"], methods["oscar-token"] = results.pop("oscar"), methods.pop("oscar")
    if legacy:  # measured in the old default layout, which its name no longer means
        for name in ("oscar-s32w64", "oscar_centered"):
            results.pop(name, None)
    keep = [name for name in results if name not in measured]
    if not keep:
        return {}
    meta = old["meta"]
    earlier = meta.get("carried_over") or {}  # methods the old file had itself carried over keep their own run
    return {"results": {n: results[n] for n in keep}, "methods": {n: methods[n] for n in keep if n in methods},
            "provenance": {n: earlier.get(n) or _provenance(meta) for n in keep}}


def _provenance(meta: dict) -> dict:
    """The run that wrote a result file with this meta."""
    return {"date": meta.get("date"), "command": meta.get("command"), "versions": meta.get("versions")}


def _cell(record: dict) -> str:
    return f"{record['method']}@{record['length']}"


def _cell_provenance(meta: dict, cell: str) -> dict:
    """The run that measured `cell` ("method@length") of a per-trial file with this meta: the run that wrote the
    file, unless the file carried the cell over from an earlier one. `carried_over` is per cell
    ({"cells": {cell: provenance}}); files written before that nest it ({"cells": [...], <the earlier file's
    run>, "earlier": <that file's carried_over>}), resolved here by following the cell down the chain."""
    level = meta.get("carried_over")
    if not level:
        return _provenance(meta)
    if isinstance(level.get("cells"), dict):
        return level["cells"].get(cell) or _provenance(meta)
    if cell not in level.get("cells", []):
        return _provenance(meta)
    while True:
        earlier = level.get("earlier") or {}
        if isinstance(earlier.get("cells"), dict) and cell in earlier["cells"]:
            return earlier["cells"][cell]
        if cell not in (earlier.get("cells") or []):
            return _provenance(level)
        level = earlier


def _trial_key(record: dict) -> tuple:
    return record["method"], record["length"], record["depth"], record["seed"]


def _carried_over_records(old: dict, measured: set[tuple]) -> tuple[list[dict], dict]:
    """The per-trial records of an earlier file whose trial (`_trial_key`) a new run does not measure; files from
    before the channel-wise layout name the paper's layout `oscar` (renamed `oscar-token`, as in `_carried_over`)."""
    methods = dict(old["meta"].get("methods", {}))
    legacy = "key_granularity" not in methods.get("oscar", {}).get("oscar_config", {"key_granularity": None})
    kept = []
    for record in old["results"]:
        record = dict(record)
        if legacy and record["method"] in ("oscar-s32w64", "oscar_centered"):
            continue  # measured in the old default layout, which these names no longer mean
        if legacy and record["method"] == "oscar":
            record["method"] = "oscar-token"
        if _trial_key(record) not in measured:
            kept.append(record)
    if legacy and "oscar" in methods:
        methods["oscar-token"] = methods.pop("oscar")
    return kept, methods


def _slug(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _jsonable(obj):
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def select(methods: dict[str, Method], names: str | None) -> dict[str, Method]:
    if not names:
        return methods
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in methods]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; available: {', '.join(methods)}")
    return {n: methods[n] for n in wanted}


def run(args) -> int:
    """Entry point of `oscar-hf eval STAGE` (argparse namespace from `add_eval_arguments`)."""
    stages = STAGES[:-1] if args.stage == "all" else (args.stage,)
    windows = Windows(args.sink, args.window, args.residual)
    if args.stage == "lm-eval":
        return run_tasks(args)
    session = Session(args.model, args.output, args.dtype, args.calibration_tokens, windows, args.threads,
                      args.calibration_length, args.domain, progress=not getattr(args, "quiet", True),
                      device=getattr(args, "device", None))
    for stage in stages:
        if stage == "ppl":
            session.perplexity(select(all_methods(windows), args.methods or ",".join(main_methods(windows))),
                               sequences=args.sequences,
                               length=args.length, context=args.context, chunk=args.chunk)
        elif stage == "ablations":
            session.perplexity(select(ablation_methods(windows), args.ablations), stage="ablations",
                               sequences=args.sequences, length=args.length, context=args.context, chunk=args.chunk)
        elif stage == "diagnostics":
            session.diagnostics(select(main_methods(windows), args.diagnostic_methods), sequences=args.diagnostic_sequences)
        elif stage == "niah":
            lengths = [int(x) for x in (args.lengths or "2048,4096,8000").split(",")]
            depths = [float(x) for x in args.depths.split(",")]
            seeds = [int(x) for x in args.seeds.split(",")]
            session.niah(select(all_methods(windows), args.methods or ",".join(main_methods(windows))), lengths, depths,
                         seeds, args.max_new_tokens, args.needles)
        elif stage == "ruler":
            from .ruler import OFFLINE_TASKS

            tasks = [t.strip() for t in (args.tasks or ",".join(OFFLINE_TASKS)).split(",") if t.strip()]
            session.ruler(select(all_methods(windows), args.methods or ",".join(main_methods(windows))), tasks,
                          [int(x) for x in (args.lengths or "4096").split(",")], args.limit)
        elif stage == "format":
            session.perplexity(select({**main_methods(windows), **format_methods(windows)}, args.methods or FORMAT_METHODS),
                               stage="format_ppl", sequences=args.sequences, length=args.length, context=args.context,
                               chunk=args.chunk)
    return 0


def run_tasks(args) -> int:
    """`oscar-hf eval lm-eval`: the offline tasks for each method on one model; writes `<output>/<model>/lm_eval.json`."""
    import lm_eval

    from .lm_eval_model import OscarLM, task_manager

    windows = Windows(args.sink, args.window, args.residual)
    session = Session(args.model, args.output, args.dtype, args.calibration_tokens, windows, args.threads,
                      args.calibration_length)
    methods = select(main_methods(windows), args.methods)
    rotations = session.rotations(methods)
    tasks = [t.strip() for t in (args.tasks or "oscar_bb_siqa").split(",") if t.strip()]
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
                         "seconds": round(time.perf_counter() - start, 1),
                         # how much of the scoring went through quantized history (the rest measured BF16)
                         "scored_tokens": lm.scored_tokens, "scored_tokens_on_history": lm.history_tokens,
                         "generations": lm.generations, "generations_on_history": lm.history_generations}
        summary = {t: {k: v for k, v in r.items() if isinstance(v, float)} for t, r in out["results"].items()}
        print(f"[{session.info['name']}] lm-eval {name}: {summary} ({results[name]['seconds']} s)", flush=True)
        print(f"[{session.info['name']}] {lm.history_report()}", flush=True)
        meta = session.meta("lm-eval", methods, {
            "data": {"tasks": tasks, "num_fewshot": args.num_fewshot, "limit": args.limit,
                     "task_source": "BIG-bench social_iqa (bigbench 1.0.0 sdist, seed-0 shuffle, eval/build_tasks.py); "
                                    "pg essays (evaluation split)"},
            "calibration": session.calibration_meta(rotations),
            "protocol": "OscarLM: context prefilled into the method's cache, continuation scored in chunks through it"})
        session.write("lm_eval", meta, results)
    return 0


def add_eval_arguments(parser) -> None:
    """The `oscar-hf eval` arguments (also used by the scripts under eval/)."""
    parser.add_argument("stage", choices=STAGES + EXPERIMENTS + ("all",),
                        help="metric to run ('all' = every stage but lm-eval and the experiments)")
    parser.add_argument("--model", default="smollm2-135m",
                        help=f"a model installed from PyPI without a hub: {', '.join(assets.OFFLINE_MODELS)} (also "
                             "written offline:NAME), or a local model folder (default smollm2-135m)")
    parser.add_argument("--output", default="eval/results", help="results folder (one sub-folder per model)")
    parser.add_argument("--domain", default="essays", choices=("essays", "python", "shakespeare"),
                        help="evaluation text (calibration always uses the default essays): results get a _DOMAIN suffix")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"),
                        help="dtype the model is loaded in (default bfloat16)")
    parser.add_argument("--device", default=None,
                        help="where the model runs, e.g. cuda (default: the CPU); recorded in each result's meta")
    parser.add_argument("--methods", default=None, help="comma-separated subset of the main methods (default: all)")
    parser.add_argument("--ablations", default=None, help="comma-separated subset of the ablations (default: all)")
    parser.add_argument("--diagnostic-methods", default="oscar,oscar-ref,naive-int2,hadamard-int2,kivi2,naive-int4",
                        help="diagnostics: comma-separated methods")
    parser.add_argument("--diagnostic-sequences", type=int, default=2, help="diagnostics: sequences")
    parser.add_argument("--sink", type=int, default=64, help="full-precision sink tokens of the cache methods")
    parser.add_argument("--window", type=int, default=256, help="full-precision recent-window tokens of the cache methods")
    parser.add_argument("--residual", type=int, default=128, help="KIVI / HF QuantizedCache full-precision residual")
    parser.add_argument("--calibration-tokens", type=int, default=8192, help="tokens the rotations are calibrated on")
    parser.add_argument("--calibration-length", type=int, default=2048, help="tokens per calibration sequence")
    parser.add_argument("--sequences", type=int, default=3, help="perplexity: evaluation sequences")
    parser.add_argument("--length", type=int, default=2048, help="perplexity: tokens per sequence")
    parser.add_argument("--context", type=int, default=512, help="perplexity: tokens prefilled before scoring")
    parser.add_argument("--chunk", type=int, default=128, help="perplexity: tokens per scored chunk")
    parser.add_argument("--lengths", default=None,
                        help="NIAH: prompt lengths in tokens (default 2048,4096,8000); ruler: RULER lengths (default 4096)")
    parser.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9", help="NIAH: needle depths")
    parser.add_argument("--seeds", default="0", help="NIAH: seeds")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="NIAH: tokens generated for the answer")
    parser.add_argument("--needles", type=int, default=1,
                        help="NIAH: needles of the same pattern in the haystack (one is asked for); results niahN.json")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--tasks", default=None,
                        help="lm-eval: task names (default oscar_bb_siqa); ruler: offline RULER tasks (default: all 11)")
    parser.add_argument("--num-fewshot", type=int, default=None, help="lm-eval: few-shot examples")
    parser.add_argument("--limit", type=int, default=None, help="lm-eval, ruler: documents per task (and length)")
