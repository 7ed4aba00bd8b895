import json

import pytest

from conftest import char_tokenizer, tiny_model
from oscar_hf import OscarConfig, OscarRotations
from oscar_hf.cli import main
from test_calibrate import SMALL, TEXT


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "tiny"
    tiny_model("llama", attn="sdpa").save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def test_calibrate_then_generate(model_dir, tmp_path, capsys):
    data = tmp_path / "calib.txt"
    data.write_text(TEXT)
    config = tmp_path / "oscar.yaml"
    OscarConfig(**SMALL).save(config)
    out = tmp_path / "rot"
    assert main(["calibrate", "--model", str(model_dir), "--output", str(out), "--data", str(data),
                 "--config", str(config), "--dtype", "float32", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "calibrated on 256 tokens" in printed and "oscar_rotations.safetensors" in printed
    rot = OscarRotations.from_pretrained(out)
    assert json.loads((out / "oscar_rotations.json").read_text())["oscar_config"]["sink_tokens"] == 4
    assert rot.layers == [0, 1, 2]
    assert main(["generate", "--model", str(model_dir), "--rotations", str(out), "--prompt", TEXT[:120],
                 "--max-new-tokens", "8", "--config", str(config), "--dtype", "float32", "--compare"]) == 0
    printed = capsys.readouterr().out
    assert "bits per element" in printed and "greedy tokens identical to BF16" in printed


def _calibrate_small(model_dir, tmp_path, config_name, *flags):
    """`oscar-hf calibrate` of the tiny model with the SMALL config saved as `config_name`, plus `flags`."""
    data = tmp_path / "calib.txt"
    data.write_text(TEXT)
    config = tmp_path / config_name
    OscarConfig(**SMALL).save(config)
    main(["calibrate", "--model", str(model_dir), "--output", str(tmp_path / "r"), "--data", str(data),
          "--config", str(config), *flags, "--dtype", "float32", "--quiet"])


def test_tokens_flag_overrides_the_config(model_dir, tmp_path, capsys):
    _calibrate_small(model_dir, tmp_path, "oscar.json", "--tokens", "384")
    assert OscarRotations.from_pretrained(tmp_path / "r").metadata["calibration"]["tokens"] == 384


def test_center_keys_flag_and_yaml_field(model_dir, tmp_path, capsys):
    _calibrate_small(model_dir, tmp_path, "oscar.yaml", "--center-keys")
    data, config = tmp_path / "calib.txt", tmp_path / "oscar.yaml"
    rot = OscarRotations.from_pretrained(tmp_path / "r")
    assert rot.center_keys and rot.metadata["oscar_config"]["center_keys"] is True
    OscarConfig(center_keys=True, **SMALL).save(config)  # the YAML field does the same
    main(["calibrate", "--model", str(model_dir), "--output", str(tmp_path / "y"), "--data", str(data),
          "--config", str(config), "--dtype", "float32", "--quiet"])
    assert OscarRotations.from_pretrained(tmp_path / "y").center_keys
    assert main(["generate", "--model", str(model_dir), "--rotations", str(tmp_path / "y"), "--prompt", TEXT[:60],
                 "--max-new-tokens", "4", "--config", str(config), "--dtype", "float32"]) == 0


def test_missing_prompt_is_an_error(model_dir, tmp_path, capsys):
    rot = OscarRotations.data_free(tiny_model("llama"), "hadamard")
    rot.save_pretrained(tmp_path / "r")
    assert main(["generate", "--model", str(model_dir), "--rotations", str(tmp_path / "r"), "--dtype", "float32"]) == 2
