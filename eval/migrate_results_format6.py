"""Renames the result files' methods after the default became format 6 (water-filled key channels, 2026-12-05):

    python eval/migrate_results_format6.py [eval/results]     # run once; a second run changes nothing

Before format 6 every OSCAR cache had 2 bits in every key channel, so each stored OSCAR configuration without
`key_channel_bits` gets `"uniform"` written in. The `oscar` rows measured then are format 5's default (wide heads),
which `oscar-uniform-channels` names now, or, for cells measured before wide heads (2026-12-03 19:00, as
`eval/make_results.py` dated them), format 4's, which `oscar-no-wide` names; the rows measured as
`oscar-wide-channels` (the format-6 default's configuration, run before it became the default) become `oscar`.
Provenance (`carried_over`, per-trial dates), calibration records and labels follow the names; a renamed cell that
the file already holds under its new name (the same cache measured twice) keeps the file's own. Files from before
channel-wise keys (no `key_granularity` in `oscar`'s configuration) keep their names: `make_results.normalize` and
the runner read their `oscar` as `oscar-token`. After renaming, each renamed method's stored configuration is
compared with the one its name means now (`runner.check_same_methods`' rule) and any difference is printed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from oscar_hf.evaluation.methods import all_methods
from oscar_hf.evaluation.runner import _cell_provenance, _measured_config, _provenance

WIDE_HEADS_SINCE = "2026-12-03 19:00"  # the first runs with wide heads (rotation format 5)


# Fields added to OscarConfig without changing what the caches did before (absent from older files: filled in).
NEUTRAL_FIELDS = {"key_channel_bits": "uniform", "key_basis_hadamard_preference": 1.0, "wide_history_bits": None,
                  "allocation_history_bits": None}
FORMAT6 = "oscar-wide-channels"  # the default's configuration, measured under this name before it became the default


def previous_name(meta: dict, cell_date: str | None, current: dict) -> tuple[str, dict]:
    """What a pre-format-6 `oscar` result is called now, and its method record: the current method with exactly its
    configuration (format 5's default, or format 4's before wide heads), else `oscar-default-<date>` (an older
    default, under the date of the run that measured it)."""
    entry = json.loads(json.dumps(meta["methods"]["oscar"]))
    config = entry["oscar_config"]
    if "wide_heads" not in config or (cell_date is not None and cell_date < WIDE_HEADS_SINCE):
        config["wide_heads"] = "none"
    for name in ("oscar-uniform-channels", "oscar-no-wide"):
        if _measured_config(entry) == _measured_config(current[name].describe()):
            return name, dict(entry, name=name, label=current[name].label)
    date = (cell_date or meta.get("date") or "undated")[:10]
    name = f"oscar-default-{date}"
    return name, dict(entry, name=name, label=f"oscar-hf's default as measured on {date} (an earlier format)")


def migrate(data: dict, current: dict) -> tuple[dict, list[str]]:
    meta, notes = data["meta"], []
    methods = meta.get("methods", {})
    for entry in methods.values():
        for field, value in NEUTRAL_FIELDS.items():
            if "oscar_config" in entry:
                entry["oscar_config"].setdefault(field, value)
    oscar = methods.get("oscar", {}).get("oscar_config", {})
    before = "oscar" in methods and "key_granularity" in oscar and "wide_channels_migrated" not in meta \
        and methods["oscar"].get("label") != current["oscar"].label
    if not before and FORMAT6 not in methods:
        return data, notes
    old_meta = json.loads(json.dumps(meta))
    new_entries: dict[str, dict] = {}

    def new_name(method: str, cell_date: str | None) -> str:
        if method == FORMAT6:
            new_entries["oscar"] = dict(old_meta["methods"][FORMAT6], name="oscar", label=current["oscar"].label)
            return "oscar"
        if method == "oscar" and before:
            name, entry = previous_name(old_meta, cell_date, current)
            new_entries.setdefault(name, entry)
            return name
        return method

    renamed = set()
    if isinstance(data["results"], dict):  # per method
        carried = meta.get("carried_over") or {}
        results, out, out_carried = data["results"], {}, {}
        for name, result in results.items():
            new = new_name(name, (carried.get(name) or {}).get("date") or old_meta.get("date"))
            if new != name and new != "oscar" and new in results:
                notes.append(f"dropped {name} (also measured as {new})")
                continue
            out[new] = result
            renamed |= {(name, new)} if new != name else set()
            if name in carried:
                out_carried[new] = carried[name]
        data["results"] = out
        if carried:
            meta["carried_over"] = out_carried
    else:  # per trial
        records = data["results"]
        own = {(r["method"], r["length"], r["depth"], r["seed"]) for r in records
               if r["method"] != FORMAT6 and not (r["method"] == "oscar" and before)}
        out, cells = [], {}
        for r in records:
            prov = _cell_provenance(old_meta, f"{r['method']}@{r['length']}")
            new = new_name(r["method"], r.get("date") or prov.get("date"))
            if new != r["method"] and (new, r["length"], r["depth"], r["seed"]) in own:
                notes.append(f"dropped {r['method']}@{r['length']} depth {r['depth']} seed {r['seed']} "
                             f"(also measured as {new})")
                continue
            renamed |= {(r["method"], new)} if new != r["method"] else set()
            out.append(dict(r, method=new))
            if prov != _provenance(old_meta):
                cells[f"{new}@{r['length']}"] = prov
        data["results"] = out
        if old_meta.get("carried_over"):
            meta["carried_over"] = {"cells": dict(sorted(cells.items()))}
    gone = {"oscar", FORMAT6} if before else {FORMAT6}
    calibration = meta.get("calibration") or {}
    meta["methods"] = {n: m for n, m in methods.items() if n not in gone}
    for name, entry in new_entries.items():
        if name == "oscar" or name not in meta["methods"]:
            meta["methods"][name] = entry
    if calibration:
        meta["calibration"] = {n: c for n, c in calibration.items() if n not in gone}
        for old, new in renamed:
            if old in calibration:
                meta["calibration"].setdefault(new, calibration[old])
    notes += [f"{old} -> {new}" for old, new in sorted(renamed)]
    return data, notes


def main(root: Path) -> None:
    current = all_methods()
    for path in sorted(root.rglob("*.json")):
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or "meta" not in data or "results" not in data:
            continue
        if isinstance(data["results"], list) and data["results"] and "method" not in data["results"][0]:
            continue  # an experiment's own record format, not a method table
        before = json.dumps(data, indent=1)
        data, notes = migrate(data, current)
        after = json.dumps(data, indent=1)
        if after != before:
            path.write_text(after)
            print(f"{path}: " + ("; ".join(notes) if notes else "key_channel_bits written in"))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "results")
