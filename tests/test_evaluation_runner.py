"""CI smoke of the harness: `oscar-hf eval` stages on a tiny model, then eval/make_results.py on their JSON."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import char_tokenizer, tiny_model
from oscar_hf.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]


def test_eval_stages_and_results_page(tmp_path, monkeypatch, capsys):
    def main(args):  # as from the command line: the result files record the command
        monkeypatch.setattr(sys, "argv", ["oscar-hf", *args])
        return cli_main(args)

    model_dir = tmp_path / "tiny"
    tiny_model("llama", attn="sdpa").save_pretrained(model_dir)
    char_tokenizer().save_pretrained(model_dir)
    out = tmp_path / "results"
    common = ["--model", str(model_dir), "--output", str(out), "--dtype", "float32", "--sink", "16", "--window", "32",
              "--residual", "32", "--calibration-tokens", "512", "--calibration-length", "256"]
    methods = "bf16,oscar,naive-int2,kivi2,naive-int4"
    assert main(["eval", "ppl", *common, "--methods", methods, "--sequences", "1", "--length", "448",
                 "--context", "256", "--chunk", "64"]) == 0
    assert main(["eval", "niah", *common, "--methods", methods, "--lengths", "500", "--depths", "0.5",
                 "--max-new-tokens", "3", "--device", "cpu"]) == 0
    assert main(["eval", "diagnostics", *common, "--diagnostic-methods", "naive-int2", "--diagnostic-sequences", "1"]) == 0
    ppl = json.loads((out / "tiny" / "ppl.json").read_text())
    assert set(ppl["results"]) == set(methods.split(","))
    assert ppl["meta"]["data"]["scored_tokens"] == 448 - 256 - 1
    assert ppl["meta"]["methods"]["oscar"]["oscar_config"]["sink_tokens"] == 16
    assert ppl["results"]["naive-int2"]["bits"]["bits_per_element"] < ppl["results"]["bf16"]["bits"]["bits_per_element"]
    niah = json.loads((out / "tiny" / "niah.json").read_text())
    assert {r["method"] for r in niah["results"]} == set(methods.split(","))
    assert {r["date"] for r in niah["results"]} == {niah["meta"]["date"]}  # each trial names its run
    assert niah["meta"]["model"]["device"] == "cpu" and niah["meta"]["machine"]["gpu"] is None
    (out / "h200" / "tiny").mkdir(parents=True)  # as if re-run on a GPU: the page gets the GPU's rows beside the CPU's
    (out / "h200" / "tiny" / "niah.json").write_text((out / "tiny" / "niah.json").read_text())
    # a run on other text or another number of sequences does not add its rows to the file: refused, file untouched
    before = (out / "tiny" / "ppl.json").read_text()
    capsys.readouterr()
    assert main(["eval", "ppl", *common, "--methods", "bf16", "--sequences", "2", "--length", "448",
                 "--context", "256", "--chunk", "64"]) == 2
    assert "sequences=1" in capsys.readouterr().err and (out / "tiny" / "ppl.json").read_text() == before
    if not torch.cuda.is_available():  # asking for a GPU that is not there: one line, before any model is loaded
        assert main(["eval", "niah", *common, "--methods", "bf16", "--device", "cuda"]) == 2
        assert "sees no CUDA device" in capsys.readouterr().err
    # a run at another length adds its cells and keeps the earlier ones, with their provenance
    assert main(["eval", "niah", *common, "--methods", "bf16,oscar", "--lengths", "400", "--depths", "0.5",
                 "--max-new-tokens", "3"]) == 0
    merged = json.loads((out / "tiny" / "niah.json").read_text())
    cells = {(r["method"], r["length"]) for r in merged["results"]}
    assert cells == {(m, 500) for m in methods.split(",")} | {("bf16", 400), ("oscar", 400)}
    assert merged["meta"]["data"]["lengths"] == [400, 500] and "bf16@500" in merged["meta"]["carried_over"]["cells"]
    # another depth adds a trial to a cell; the same trial measured again replaces the old record
    for _ in range(2):
        assert main(["eval", "niah", *common, "--methods", "bf16", "--lengths", "400", "--depths", "0.3",
                     "--max-new-tokens", "3"]) == 0
    merged = json.loads((out / "tiny" / "niah.json").read_text())
    trials = sorted((r["method"], r["depth"]) for r in merged["results"] if r["length"] == 400)
    assert trials == [("bf16", 0.3), ("bf16", 0.5), ("oscar", 0.5)]
    # each carried cell names the run that measured it, however many files ago (not the file it was last read from)
    provenance = merged["meta"]["carried_over"]["cells"]
    assert "--lengths 500" in provenance["naive-int2@500"]["command"]
    assert "--lengths 400" in provenance["oscar@400"]["command"] and "bf16,oscar" in provenance["oscar@400"]["command"]
    page = tmp_path / "page"
    subprocess.run([sys.executable, str(REPO / "eval" / "make_results.py"), "--results", str(out), "--output", str(page)],
                   check=True, cwd=REPO)
    text = (page / "RESULTS.md").read_text()
    assert "## tiny" in text and "`naive-int2`" in text and (page / "plots" / "ppl_vs_method.png").is_file()
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("| haystack |"))
    gpu_row = next(line for line in lines if line.startswith("| essays, H200 | 500 |"))  # the GPU's trials, apart
    cells = dict(zip([c.strip() for c in header.strip("|").split("|")],
                     [c.strip() for c in gpu_row.strip("|").split("|")]))
    hits = {r["method"]: int(r["hit"]) for r in niah["results"]}
    assert cells["`bf16`"].startswith(f"{hits['bf16']}/1") and cells["`oscar`"].startswith(f"{hits['oscar']}/1")
    within = "yes" if (hits["bf16"] - hits["oscar"]) * 10 <= 1 else "**no**"  # one hit per ten trials
    assert list(cells.values())[-1] == within
    assert "--methods bf16,oscar --lengths 400 --depths 0.5" in text  # each table lists the commands that measured it


def _niah_file(path: Path, model: str, trials: list[tuple], command: str) -> Path:
    results = [{"method": m, "length": n, "depth": d, "seed": s, "hit": h, "bits_per_element": 2.5}
               for m, n, d, s, h in trials]
    meta = {"stage": "niah", "model": {"name": model}, "command": command, "date": "d", "versions": {},
            "methods": {"bf16": {}, "oscar": {"oscar_config": {"key_granularity": "channel"}}},
            "data": {"domain": "essays", "needles": 1, "lengths": sorted({t[1] for t in trials})}}
    path.write_text(json.dumps({"meta": meta, "results": results}))
    return path


def test_a_gpu_run_adds_its_trials_to_the_committed_cells(tmp_path):
    from oscar_hf.evaluation.runner import merge_record_files

    old = _niah_file(tmp_path / "old.json", "m", [("oscar", 8192, 0.1, 0, True), ("oscar", 4096, 0.1, 0, False)], "old run")
    new = _niah_file(tmp_path / "new.json", "m", [("oscar", 4096, 0.1, 0, True), ("bf16", 4096, 0.1, 0, True)], "new run")
    merged = merge_record_files(old, new)
    trials = {(r["method"], r["length"]): r["hit"] for r in merged["results"]}
    assert trials == {("oscar", 8192): True, ("oscar", 4096): True, ("bf16", 4096): True}  # re-measured trial replaced
    assert merged["meta"]["carried_over"]["cells"]["oscar@8192"]["command"] == "old run"
    assert merged["meta"]["data"]["lengths"] == [4096, 8192]
    other = _niah_file(tmp_path / "other.json", "another-model", [("oscar", 4096, 0.1, 0, True)], "x")
    with pytest.raises(ValueError, match="not the same cells"):
        merge_record_files(old, other)


def _make_results():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_results", REPO / "eval" / "make_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_retrieval_target_counts_one_hit_per_ten_trials_on_shared_trials():
    mr = _make_results()
    trials = [(d / 10, s) for d in (1, 3, 5, 7, 9) for s in range(4)]  # 20 trials
    rec = lambda m, hits: [{"method": m, "length": 4096, "depth": d, "seed": s, "hit": i < hits}
                           for i, (d, s) in enumerate(trials)]
    assert mr.within_one_hit(rec("bf16", 19) + rec("oscar", 17), 4096) == "yes"  # 2 behind in 20
    assert mr.within_one_hit(rec("bf16", 20) + rec("oscar", 17), 4096) == "**no** (-3 of 20)"
    # counted on the trials both measured: bf16's misses on seeds oscar did not run do not count for oscar
    first_seeds = [dict(r, hit=r["seed"] < 2) for r in rec("bf16", 0)]  # bf16: seeds 0-1 hit, 2-3 miss
    oscar = [dict(r, method="oscar", hit=r["depth"] != 0.1) for r in first_seeds if r["seed"] < 2]  # 8 of 10
    assert mr.within_one_hit(first_seeds + oscar, 4096) == "**no** (-2 of 10)"
    assert mr.within_one_hit(rec("bf16", 20), 4096) == "–"
    # the page's column: the verdict, with the counts where the trials both measured are not all of either's
    assert mr.same_trials(rec("bf16", 19) + rec("oscar", 17), 4096) == "yes"
    assert mr.same_trials(first_seeds + oscar, 4096) == "**no** (8 vs 10 of 10)"


def test_the_results_page_shows_commands_as_typed():
    mr = _make_results()
    recorded = ("/x/oscar_hf/cli.py eval niah --output eval/results --threads 2 --quiet --depths 0.1,0.3,0.5,0.7,0.9 "
                "--seeds 0,1 --methods oscar --model m --lengths 4096 --domain python")
    typed = "oscar-hf eval niah --model m --methods oscar --domain python --lengths 4096 --seeds 0,1"
    assert mr.command(recorded) == typed  # options in one order, those that change no figure left out
    other_depths = "oscar-hf eval niah --model m --depths 0.25,0.5"
    assert mr.command(other_depths + " --quiet") == other_depths
    commands = mr.Commands("oscar-hf eval niah --model m")
    assert commands.mark({"oscar-hf eval niah --model m --lengths 8", "oscar-hf eval all --model m"}) == " ¹˒²"
    assert commands.lines() == ["Commands, each after `oscar-hf eval niah --model m`:", "",
                                "1. the whole command `oscar-hf eval all --model m`", "2. `--lengths 8`"]


def test_trials_of_one_name_measured_with_two_configurations_are_refused(tmp_path):
    from oscar_hf.evaluation.runner import merge_record_files

    old = _niah_file(tmp_path / "old.json", "m", [("oscar", 8192, 0.1, 0, True), ("oscar", 4096, 0.1, 0, False)], "old")
    new = _niah_file(tmp_path / "new.json", "m", [("oscar", 4096, 0.1, 0, True)], "new")
    data = json.loads(new.read_text())
    data["meta"]["methods"]["oscar"]["oscar_config"]["key_channel_bits"] = "fitted"  # the default changed since
    new.write_text(json.dumps(data))
    # the 8K trial would stay under `oscar` beside a 4K trial of another cache: refused, naming the field
    with pytest.raises(ValueError, match=r"'oscar' measured with another configuration \(calibration_config.key_channel_bits"):
        merge_record_files(old, new)
    # measuring every trial again replaces them all: nothing of the old configuration stays
    data["results"].append(dict(data["results"][0], length=8192))
    new.write_text(json.dumps(data))
    assert {r["length"] for r in merge_record_files(old, new)["results"]} == {4096, 8192}


def test_a_field_added_since_counts_only_where_the_new_configuration_uses_it():
    """Trials stored before a field existed describe the same cache where that field is inert (channel-wise key
    blocks under token-wise keys), and another cache where it is not. Records of oscar-hf 0.1 kept calibration fields
    in `oscar_config`: they are compared at their place now."""
    from oscar_hf.config import CalibrationConfig, OscarConfig
    from oscar_hf.evaluation.runner import _inert_fields, _measured_config, check_same_methods

    def described(config, **calibration):
        return {"family": "oscar", "rotations": "calibrated", "oscar_config": config.to_dict(),
                "calibration_config": CalibrationConfig(**calibration).to_dict()}

    token = _measured_config(described(OscarConfig(key_granularity="token", demotion_block=8)))
    assert {"oscar_config.key_block", "calibration_config.wide_heads", "calibration_config.key_channel_bits"} <= \
        _inert_fields(token)
    assert not {"oscar_config.key_block", "calibration_config.key_channel_bits"} & _inert_fields(
        _measured_config(described(OscarConfig())))
    for granularity, refused in (("token", False), ("channel", True)):
        new = described(OscarConfig(key_granularity=granularity, demotion_block=64))
        old = {**new, "oscar_config": {k: v for k, v in new["oscar_config"].items() if k != "key_block"}}
        if refused:
            with pytest.raises(ValueError, match=r"oscar_config.key_block: '\(absent\)' there, 64 now"):
                check_same_methods({"m": old}, {"m": new}, {"m"})
        else:
            check_same_methods({"m": old}, {"m": new}, {"m"})
        changed = {**new, "oscar_config": dict(new["oscar_config"], key_block=32)}
        with pytest.raises(ValueError, match="key_block: 32 there, 64 now"):  # a stored value always counts
            check_same_methods({"m": changed}, {"m": new}, {"m"})
    # a 0.1 record: one flat oscar_config with the calibration fields in it, under their old names
    legacy = {"family": "oscar", "rotations": "calibrated",
              "oscar_config": {**OscarConfig().to_dict(), **{k: v for k, v in CalibrationConfig().to_dict().items()
                                                            if k not in ("tokens", "sequence_length", "clip_grid")},
                               "calibration_tokens": 8192, "key_basis_hadamard_preference": 1.0}}
    check_same_methods({"m": legacy}, {"m": described(OscarConfig())}, {"m"})
    with pytest.raises(ValueError, match="calibration_config.wide_heads: 'none' there, 'retrieval' now"):
        check_same_methods({"m": {**legacy, "oscar_config": dict(legacy["oscar_config"], wide_heads="none")}},
                           {"m": described(OscarConfig())}, {"m"})

def test_the_ruler_table_scores_tasks_averages_them_and_names_each_command(tmp_path):
    """RESULTS.md's RULER table: per task the mean score in percent over its requests (a method with fewer requests
    than the task shows its count), the average over tasks, bits per element, CPU seconds (one prefill per request
    plus every answer), and the command of each record's run (kept records name their own)."""
    mr = _make_results()
    rec = lambda task, doc, method, score, date: {  # noqa: E731
        "task": task, "length": 4096, "doc_id": doc, "method": method, "score": score, "bits_per_element": 2.5,
        "seconds": 1.0, "prefill_seconds": 10.0, "date": date}
    records = ([rec("niah_single_1", d, m, s, "new") for d in range(2) for m, s in (("bf16", 1.0), ("oscar", d % 2))]
               + [rec("ruler_vt", 0, "bf16", 0.5, "old"), rec("ruler_vt", 0, "oscar", 0.25, "old"),
                  rec("ruler_vt", 1, "bf16", 1.0, "old")])
    meta = {"command": "cli.py eval ruler --model m --methods bf16,oscar --output x", "date": "new", "dtype": "float32",
            "carried_over": {"command": "cli.py eval ruler --model m --tasks ruler_vt", "date": "old"}}
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "ruler.json").write_text(json.dumps({"meta": meta, "results": {"requests": records}}))
    mr.RESULTS = tmp_path
    lines = mr.ruler_section("m")
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")] for line in lines
            if line.startswith("| ")}
    assert rows["niah_single_1"][1:] == ["2", "100 ¹", "50 ¹", "24"]  # 2 prefills of 10 s + 4 answers of 1 s
    assert rows["ruler_vt"][1:] == ["2", "75 ²", "25 (1) ²", "23"]
    assert rows["**average**"][2:4] == ["**87.5**", "**37.5**"]
    assert rows["bits per element"][2:4] == ["2.50", "2.50"]
    assert "1. `--methods bf16,oscar`" in lines and "2. `--tasks ruler_vt`" in lines
