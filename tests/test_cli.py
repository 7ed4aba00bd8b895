import argparse
import json
import re

import pytest

from conftest import char_tokenizer, rewrite_rotation_file, tiny_model
from oscar_hf import OscarConfig, OscarRotations
from oscar_hf.cli import UsageError, _prompt_ids, build_parser, load_model, main, resolve_model
from test_calibrate import CAL, LAYOUT, TEXT


def _write_config(path, layout=LAYOUT, calibration=CAL, **extra):
    """A `--config` file: the storage layout's fields, and for `calibrate` the calibration's, in one mapping."""
    import yaml

    data = {**layout.to_dict(), **({} if calibration is None else calibration.to_dict()), **extra}
    path.write_text(yaml.safe_dump(data) if path.suffix == ".yaml" else json.dumps(data))
    return path


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "tiny"
    tiny_model("llama", attn="sdpa").save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def test_calibrate_then_generate(model_dir, tmp_path, capsys):
    data = tmp_path / "calib.txt"
    data.write_text(TEXT)
    config = _write_config(tmp_path / "calibrate.yaml")
    out = tmp_path / "rot"
    assert main(["calibrate", "--model", str(model_dir), "--output", str(out), "--data", str(data),
                 "--config", str(config), "--dtype", "float32", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "calibrated on 256 tokens" in printed and "oscar_rotations.safetensors" in printed
    rot = OscarRotations.from_pretrained(out)
    assert json.loads((out / "oscar_rotations.json").read_text())["oscar_config"]["sink_tokens"] == 4
    assert rot.layers == [0, 1, 2]
    LAYOUT.save(tmp_path / "oscar.yaml")
    assert main(["generate", "--model", str(model_dir), "--rotations", str(out), "--prompt", TEXT[:120],
                 "--max-new-tokens", "8", "--config", str(tmp_path / "oscar.yaml"), "--dtype", "float32", "--compare"]) == 0
    printed = capsys.readouterr().out
    assert "bits per element" in printed and "greedy tokens identical to BF16" in printed
    assert "calibration settings belong to" in _error(capsys, ["generate", "--model", str(model_dir), "--rotations",
                                                                str(out), "--prompt", "hi", "--config", str(config)])


def _calibrate_small(model_dir, tmp_path, config_name, *flags):
    """`oscar-hf calibrate` of the tiny model with the small config saved as `config_name`, plus `flags`; the storage
    layout alone is saved as oscar.yaml (what `generate --config` takes)."""
    data = tmp_path / "calib.txt"
    data.write_text(TEXT)
    config = _write_config(tmp_path / config_name)
    LAYOUT.save(tmp_path / "oscar.yaml")
    main(["calibrate", "--model", str(model_dir), "--output", str(tmp_path / "r"), "--data", str(data),
          "--config", str(config), *flags, "--dtype", "float32", "--quiet"])


def test_tokens_flag_overrides_the_config(model_dir, tmp_path, capsys):
    _calibrate_small(model_dir, tmp_path, "calibrate.json", "--tokens", "384")
    assert OscarRotations.from_pretrained(tmp_path / "r").metadata["calibration"]["tokens"] == 384


def test_center_keys_flag_and_yaml_field(model_dir, tmp_path, capsys):
    _calibrate_small(model_dir, tmp_path, "calibrate.yaml", "--center-keys")
    data, config = tmp_path / "calib.txt", tmp_path / "calibrate.yaml"
    rot = OscarRotations.from_pretrained(tmp_path / "r")
    assert rot.center_keys and rot.metadata["calibration_config"]["center_keys"] is True
    _write_config(config, calibration=CAL.replace(center_keys=True))  # the YAML field does the same
    main(["calibrate", "--model", str(model_dir), "--output", str(tmp_path / "y"), "--data", str(data),
          "--config", str(config), "--dtype", "float32", "--quiet"])
    assert OscarRotations.from_pretrained(tmp_path / "y").center_keys
    assert main(["generate", "--model", str(model_dir), "--rotations", str(tmp_path / "y"), "--prompt", TEXT[:60],
                 "--max-new-tokens", "4", "--config", str(tmp_path / "oscar.yaml"), "--dtype", "float32"]) == 0


def test_no_wide_heads_flag(model_dir, tmp_path, capsys):
    # a budget that pays for wide heads in the tiny model (head_dim 16: a history of 4 bits at key blocks of 16)
    data, config = tmp_path / "calib.txt", tmp_path / "oscar.json"
    data.write_text(TEXT)
    _write_config(config, LAYOUT.replace(demotion_block=16, key_block=16), CAL.replace(wide_history_bits=4.75))
    for name, flags in (("wide", ()), ("none", ("--no-wide-heads",))):
        main(["calibrate", "--model", str(model_dir), "--output", str(tmp_path / name), "--data", str(data),
              "--config", str(config), *flags, "--dtype", "float32", "--quiet"])
    assert "wide heads at 4 bits" in capsys.readouterr().out
    assert len(OscarRotations.from_pretrained(tmp_path / "wide").wide_heads) == 2
    none = OscarRotations.from_pretrained(tmp_path / "none")
    assert none.head_bits is None and none.metadata["calibration_config"]["wide_heads"] == "none"


def test_missing_prompt_is_an_error(model_dir, tmp_path, capsys):
    rot = OscarRotations.data_free(tiny_model("llama"), "hadamard")
    rot.save_pretrained(tmp_path / "r")
    assert main(["generate", "--model", str(model_dir), "--rotations", str(tmp_path / "r"), "--dtype", "float32"]) == 2


# ------------------------------------------------------------------------------------------------ errors: one line, status 2
def _error(capsys, argv) -> str:
    """Runs `oscar-hf argv`, checks it failed with status 2 and one error line (after progress bars, if any, and no
    traceback); returns that line."""
    capsys.readouterr()  # drop what came before
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and lines[-1].startswith("oscar-hf: error: "), lines
    assert sum("error" in line for line in lines) == 1, lines
    return lines[-1]


def test_missing_local_paths_say_not_found(model_dir, tmp_path, capsys):
    gen = ["generate", "--prompt", "hi", "--dtype", "float32"]
    assert "model folder /no/such/model not found" in _error(capsys, [*gen, "--model", "/no/such/model"])
    assert "model folder ./no-such-model not found" in _error(capsys, [*gen, "--model", "./no-such-model"])
    missing = str(tmp_path / "no-rotations")
    assert f"rotation folder {missing} not found" in _error(capsys, [*gen, "--model", str(model_dir), "--rotations", missing])
    assert "config file" in _error(capsys, [*gen, "--model", str(model_dir), "--config", str(tmp_path / "c.yaml")])
    data = str(tmp_path / "calib.txt")
    assert f"calibration data file {data} not found" in _error(
        capsys, ["calibrate", "--model", str(model_dir), "--output", str(tmp_path / "r"), "--data", data])
    assert "is not a model folder: config.json" in _error(capsys, [*gen, "--model", str(tmp_path)])


def test_bad_values_and_files_are_one_line(model_dir, tmp_path, capsys):
    gen = ["generate", "--model", str(model_dir), "--dtype", "float32"]
    assert "the prompt is empty" in _error(capsys, [*gen, "--prompt", " "])
    bad = tmp_path / "bad.json"
    bad.write_text("{broken")
    assert f"config file {bad}:" in _error(capsys, [*gen, "--prompt", "hi", "--config", str(bad)])
    bad.write_text('{"bits": 5}')
    assert "OscarConfig.bits" in _error(capsys, [*gen, "--prompt", "hi", "--config", str(bad)])
    assert "unknown offline model 'nope'" in _error(capsys, ["calibrate", "--model", "offline:nope", "--output", "x"])
    rot = tmp_path / "r"
    rewrite_rotation_file(rot, OscarRotations.data_free(tiny_model("llama"), "hadamard"),
                          edit_json=lambda meta: meta.pop("model"))
    assert "oscar_rotations.json is malformed: it lacks the field 'model'" in _error(
        capsys, [*gen, "--prompt", "hi", "--rotations", str(rot)])


def test_counts_below_one_are_refused_when_the_command_line_is_read(capsys):
    """Before, generate --max-new-tokens 0 failed after the model loaded, demo --new-tokens 0 after minutes of
    calibration."""
    for argv, option in ((["generate", "--model", "m", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens"),
                         (["demo", "--new-tokens", "-1"], "--new-tokens"), (["demo", "--ppl-sequences", "0"],
                                                                              "--ppl-sequences")):
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args(argv)
        assert exit_info.value.code == 2
        assert f"argument {option}: must be a positive integer" in capsys.readouterr().err


def test_no_rotations_beside_the_model_says_what_to_do(model_dir, capsys):
    line = _error(capsys, ["generate", "--model", str(model_dir), "--prompt", "hi", "--dtype", "float32"])
    assert "none beside the model" in line and "oscar-hf calibrate" in line


def test_debug_shows_the_traceback(model_dir, monkeypatch):
    with pytest.raises(UsageError, match="the prompt is empty"):
        main(["generate", "--model", str(model_dir), "--prompt", "", "--debug"])
    monkeypatch.setenv("OSCAR_HF_DEBUG", "1")
    with pytest.raises(UsageError):
        main(["generate", "--model", str(model_dir), "--prompt", ""])


def test_every_option_has_help_and_model_help_lists_offline_names():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("calibrate", "generate", "demo", "eval", "report"):
        for action in subparsers.choices[name]._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"
            if "--model" in action.option_strings:
                assert "smollm2-135m" in action.help, name


def test_missing_tokenizer_points_to_the_flag(tmp_path, capsys):
    bare = tmp_path / "bare"
    tiny_model("llama", attn="sdpa").save_pretrained(bare)
    line = _error(capsys, ["generate", "--model", str(bare), "--prompt", "hi", "--dtype", "float32"])
    assert "cannot load a tokenizer" in line and "--tokenizer" in line
    tokenizer = tmp_path / "tok"
    char_tokenizer().save_pretrained(tokenizer)
    model, tok, _ = load_model(str(bare), "float32", tokenizer=str(tokenizer))
    assert tok("ab").input_ids[-2:] == char_tokenizer()("ab").input_ids[-2:]


# ------------------------------------------------------------------------------------------------ rotations beside the model
def test_calibrate_into_the_model_folder_then_generate_finds_them(model_dir, tmp_path, capsys):
    data = tmp_path / "calib.txt"
    data.write_text(TEXT)
    config = _write_config(tmp_path / "calibrate.yaml")
    assert main(["calibrate", "--model", str(model_dir), "--data", str(data), "--config", str(config),
                 "--dtype", "float32", "--quiet"]) == 0
    assert (model_dir / "oscar" / "oscar_rotations.json").is_file()
    LAYOUT.save(tmp_path / "oscar.yaml")
    assert main(["generate", "--model", str(model_dir), "--prompt", TEXT[:60], "--max-new-tokens", "4",
                 "--config", str(tmp_path / "oscar.yaml"), "--dtype", "float32"]) == 0


def test_rotations_of_other_weights_are_refused_unless_allowed(model_dir, tmp_path, capsys):
    _calibrate_small(model_dir, tmp_path, "calibrate.yaml")
    other = tmp_path / "other"  # the same config, other (random) weights
    tiny_model("llama", attn="sdpa", seed=1).save_pretrained(other)
    char_tokenizer().save_pretrained(other)
    gen = ["generate", "--model", str(other), "--rotations", str(tmp_path / "r"), "--prompt", TEXT[:60],
           "--max-new-tokens", "4", "--config", str(tmp_path / "oscar.yaml"), "--dtype", "float32"]
    line = _error(capsys, gen)
    assert "calibrated on other weights" in line and "--allow-other-weights" in line
    assert main([*gen, "--allow-other-weights"]) == 0
    assert "oscar-hf: warning: rotations were calibrated on other weights" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ memory report, chat
def test_memory_report_on_a_short_prompt_says_nothing_is_quantized(model_dir, tmp_path, capsys):
    _calibrate_small(model_dir, tmp_path, "calibrate.yaml")
    assert main(["generate", "--model", str(model_dir), "--rotations", str(tmp_path / "r"), "--prompt", TEXT[:40],
                 "--max-new-tokens", "4", "--dtype", "float32", "--compare"]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"all 4\d tokens are still in the BF16 sink/window: nothing is quantized yet", printed)
    assert "smaller" not in printed and "KV bytes reserved" in printed
    assert main(["generate", "--model", str(model_dir), "--rotations", str(tmp_path / "r"), "--prompt", TEXT[:40],
                 "--max-new-tokens", "4", "--dtype", "float32", "--config", str(tmp_path / "oscar.yaml")]) == 0
    printed = capsys.readouterr().out  # sink 4 + window 8: most tokens are in the INT2 history
    assert "nothing is quantized" not in printed and "x smaller" in printed and "in the INT2 history" in printed


def test_chat_template_is_applied_by_default():
    tokenizer = char_tokenizer()
    plain = _prompt_ids(tokenizer, "hi", chat=True)  # no template: plain text
    assert plain.tolist() == tokenizer("hi", return_tensors="pt").input_ids.tolist()
    tokenizer.chat_template = "{% for m in messages %}Q:{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    assert tokenizer.decode(_prompt_ids(tokenizer, "hi", chat=True)[0]).replace(" ", "").endswith("Q:hi\nA:".replace(" ", ""))
    assert _prompt_ids(tokenizer, "hi", chat=False).tolist() == plain.tolist()


def test_offline_names_resolve_alike_in_every_form(monkeypatch, tmp_path):
    from oscar_hf import assets

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(assets, "model_path", lambda name: tmp_path / "models" / name)
    assert resolve_model("smollm2-135m") == resolve_model("offline:smollm2-135m") == str(tmp_path / "models" / "smollm2-135m")
    assert resolve_model("org/some-model") == "org/some-model"  # a Hub id stays one


def test_an_unsupported_model_is_one_line(tmp_path, capsys):
    folder = tmp_path / "odd"
    tiny_model("llama", attn="sdpa", head_dim=12).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    line = _error(capsys, ["generate", "--model", str(folder), "--prompt", "hi", "--dtype", "float32"])
    assert "head_dim 12 is not a power of two" in line


# ------------------------------------------------------------------------------------------------ reliability fixes
def test_rotations_of_another_model_are_named_by_geometry_first(model_dir, tmp_path, capsys):
    """Guards (10): rotations of another model (a 2-layer Llama's, fingerprint included) are refused for their
    geometry, naming the field and both values, not as "same shapes, different values" with advice to pass
    --allow-other-weights (which then ran into the geometry error), with or without that flag, given or beside."""
    from oscar_hf.rotations_io import weight_fingerprint

    small = tiny_model("llama", attn="sdpa", num_hidden_layers=2)
    rotations = OscarRotations.data_free(small, "hadamard")
    rotations.metadata = {"weight_fingerprint": weight_fingerprint(small)}
    rotations.save_pretrained(tmp_path / "r")
    gen = ["generate", "--model", str(model_dir), "--prompt", TEXT[:60], "--max-new-tokens", "2", "--dtype", "float32"]
    for extra in ([], ["--allow-other-weights"]):
        line = _error(capsys, [*gen, "--rotations", str(tmp_path / "r"), *extra])
        assert "num_hidden_layers is 2 in the rotation file but 3 in the model config" in line, line
        assert "other weights" not in line and "--allow-other-weights" not in line
    rotations.save_pretrained(model_dir / "oscar")  # found beside the model: the same answer
    line = _error(capsys, gen)
    assert "num_hidden_layers is 2 in the rotation file but 3" in line and "none beside the model" not in line


def test_a_truncated_weight_file_is_bad_input_named_by_path(model_dir, capsys):
    """Guards (14): a truncated model.safetensors is the user's file, not an internal bug: status 2 and one line
    naming the file (it was status 1, "unexpected; ... report it", no file name)."""
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    line = _error(capsys, ["generate", "--model", str(model_dir), "--prompt", "hi", "--dtype", "float32"])
    assert f"{weights} is damaged" in line and "unexpected" not in line


def test_gemma2_is_refused_for_soft_capping_by_every_command(tmp_path, capsys):
    """Guards (15): Gemma-2 is refused for its attention-logit soft-capping before any weight loads, by calibrate
    (which loads with sdpa) as by generate, not with transformers' advice to load with attn_implementation="eager"."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    folder = tmp_path / "gemma2"
    AutoModelForCausalLM.from_config(Gemma2Config(
        vocab_size=112, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16)).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    for argv in (["calibrate", "--model", str(folder)], ["generate", "--model", str(folder), "--prompt", "hi"]):
        line = _error(capsys, argv)
        assert "gemma2' is not supported: attention-logit soft-capping" in line and "eager" not in line, line


def test_config_help_names_only_real_config_fields():
    """Guards (15): the `--config` help of every command lists config fields the parser accepts (it named
    `sink` and `window`, which a config file refuses)."""
    import dataclasses

    from oscar_hf import CalibrationConfig

    fields = {f.name for f in dataclasses.fields(OscarConfig)} | {f.name for f in dataclasses.fields(CalibrationConfig)}
    parser = build_parser()
    checked = 0
    for sub in next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices.values():
        for action in sub._actions:
            if action.dest == "config" and action.help:
                for listing in re.findall(r"(?:\w+, )+\w+", action.help):
                    named = set(listing.split(", "))
                    assert named <= fields, (sub.prog, named - fields)
                    checked += 1
    assert checked >= 2


def test_too_few_calibration_tokens_are_refused_and_others_rounded_aloud(model_dir, tmp_path, capsys):
    """Guards (16b): `--tokens` below one calibration sequence is refused with one line (10 silently became 2,048);
    a count between whole sequences is rounded up with a note, and the rotation file records what was used."""
    data = tmp_path / "calib.txt"
    data.write_text(TEXT)
    config = _write_config(tmp_path / "calibrate.yaml")  # sequences of 128 tokens
    cal = ["calibrate", "--model", str(model_dir), "--output", str(tmp_path / "r"), "--data", str(data),
           "--config", str(config), "--dtype", "float32", "--quiet"]
    line = _error(capsys, [*cal, "--tokens", "10"])
    assert "--tokens 10 is less than one calibration sequence (128 tokens" in line
    assert "--tokens 10" in _error(capsys, ["demo", "--tokens", "10", "--output", str(tmp_path / "demo")])
    assert main([*cal, "--tokens", "300"]) == 0
    assert "--tokens 300 rounded up to 384 (3 whole sequences of 128 tokens)" in capsys.readouterr().err
    assert OscarRotations.from_pretrained(tmp_path / "r").metadata["calibration"]["tokens"] == 384
