"""`oscar-hf export --format sglang-oscar`: the written files follow the reference engine's layout exactly, and
rotations it cannot serve unchanged are refused with the reason."""

import pytest
import torch

from conftest import char_tokenizer, tiny_model
from oscar_hf import OscarConfig, OscarRotations
from oscar_hf.calibrate import RotationTargets, calibrate
from oscar_hf.cli import main
from oscar_hf.export import ENV_FILE, KEY_FILE, VALUE_FILE, ExportError, export_sglang_oscar
from oscar_hf.rotation import rotate
from test_calibrate import CAL, SMALL, TEXT

# The reference's recipe: token-wise keys, one rotation per layer, fixed clips; windows in whole 8-token pages.
REFERENCE = dict(SMALL, sink_tokens=8, window_tokens=16, key_granularity="token", demotion_block=8, key_clip=0.75,
                 value_clip=0.875)


@pytest.fixture(scope="module")
def reference_rotations(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    rotations = calibrate(tiny_model("llama", attn="sdpa"), char_tokenizer(), data=[TEXT], config=OscarConfig(**REFERENCE),
                          calibration=CAL.replace(choose_key_basis=False, key_channel_bits="uniform"),
                          targets=RotationTargets(per_head=False), progress=False)
    rotations.save_pretrained(tmp / "rot")
    return tmp / "rot"


def _env(path):
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if line and not line.startswith("#"))


def test_cli_writes_the_reference_schema(reference_rotations, tmp_path, capsys):
    out = tmp_path / "sglang"
    assert main(["export", "--rotations", str(reference_rotations), "--output", str(out)]) == 0
    assert "wrote keys" in capsys.readouterr().out
    rotations = OscarRotations.from_pretrained(reference_rotations)
    d = rotations.geometry["head_dim"]
    for name, table in ((KEY_FILE, rotations.key_rotations), (VALUE_FILE, rotations.value_rotations)):
        state = torch.load(out / name, weights_only=True)  # plain tensors, ints and strings: no pickled objects
        assert state["format_version"] == 1 and state["source_grouping"] == "layer"
        assert sorted(state["layers"]) == rotations.layers  # int layer ids, as the engine looks them up
        for layer, entry in state["layers"].items():
            r = entry["rotation"]
            assert entry["layer_id"] == layer and r.dtype == torch.float32 and r.shape == (d, d)
            assert torch.equal(r, table[layer][0])
            assert entry["eigenvalues"].shape == (d,)
    # The engine computes rows @ R: the same rotated keys as OscarCache.
    keys = torch.randn(1, 2, 5, d)
    exported = torch.load(out / KEY_FILE, weights_only=True)["layers"][1]["rotation"]
    torch.testing.assert_close(keys @ exported, rotate(keys, rotations.key_rotations[1]))
    env = _env(out / ENV_FILE)
    assert env["SGLANG_OSCAR_K_CLIP_RATIO"] == "0.75" and env["SGLANG_OSCAR_V_CLIP_RATIO"] == "0.875"
    assert env["SGLANG_MIXED_KV_PREFIX_TOKENS"] == "8" and env["SGLANG_MIXED_KV_RECENT_TOKENS"] == "16"
    assert env["SGLANG_MIXED_KV_SCALE_DTYPE"] == "float16"
    assert env["SGLANG_OSCAR_K_ROTATION_PATH"].endswith(KEY_FILE)
    assert "--kv-cache-quant-group-size 16" in (out / ENV_FILE).read_text()


def test_no_clip_is_written_as_the_engines_off(reference_rotations, tmp_path):
    rotations = OscarRotations.from_pretrained(reference_rotations)
    config = OscarConfig(**dict(REFERENCE, key_clip="none", value_clip=1.0))
    env = _env(export_sglang_oscar(rotations, tmp_path, config=config)["env"])
    assert env["SGLANG_OSCAR_K_CLIP_RATIO"] == "0.0" and env["SGLANG_OSCAR_V_CLIP_RATIO"] == "0.0"


def _edited(rotations: OscarRotations, **changes) -> OscarRotations:
    fields = dict(geometry=rotations.geometry, key_rotations=rotations.key_rotations,
                  value_rotations=rotations.value_rotations, key_clips=rotations.key_clips,
                  value_clips=rotations.value_clips, metadata=rotations.metadata, layout=rotations.layout)
    return OscarRotations(**(fields | changes))


@pytest.mark.parametrize("case, message", [
    ("channel", "for channel-wise keys"),
    ("per_head", "differ between KV heads"),
    ("centered", "key mean"),
    ("fitted_per_layer", "pass --key-clip"),
    ("page", "multiple of 8"),
])
def test_what_the_engine_cannot_serve_is_refused(reference_rotations, tmp_path, case, message):
    rotations = OscarRotations.from_pretrained(reference_rotations)
    config = OscarConfig(**REFERENCE)
    if case == "channel":
        rotations = _edited(rotations, layout={"key_granularity": "channel", "demotion_block": 8})
    elif case == "per_head":
        keys = {layer: r.clone() for layer, r in rotations.key_rotations.items()}
        keys[2][1] = keys[2][1][:, torch.randperm(keys[2].shape[-1])]  # still orthogonal, another head's basis
        rotations = _edited(rotations, key_rotations=keys)
    elif case == "centered":
        means = {layer: torch.zeros(r.shape[:2]) for layer, r in rotations.key_rotations.items()}
        rotations = _edited(rotations, key_means=means)
    elif case == "fitted_per_layer":
        config = config.replace(key_clip="fitted")
        rotations = _edited(rotations, key_clips={layer: 0.7 + 0.1 * i for i, layer in enumerate(rotations.layers)})
    elif case == "page":
        config = config.replace(sink_tokens=4)
    with pytest.raises(ExportError, match=message):
        export_sglang_oscar(rotations, tmp_path, config=config)
    assert not (tmp_path / KEY_FILE).exists()  # nothing half-written


def test_arguments_of_the_wrong_type_are_named(reference_rotations, tmp_path):
    with pytest.raises(TypeError, match="export_sglang_oscar needs OscarRotations .*got str"):
        export_sglang_oscar(str(reference_rotations), tmp_path)  # (was an AttributeError)
    with pytest.raises(TypeError, match="config must be an OscarConfig .*got dict"):
        export_sglang_oscar(OscarRotations.from_pretrained(reference_rotations), tmp_path, config={"bits": 2})


def test_an_explicit_clip_resolves_per_layer_fits(reference_rotations, tmp_path, capsys):
    rotations = OscarRotations.from_pretrained(reference_rotations)
    rotations = _edited(rotations, key_clips={layer: 0.7 + 0.1 * i for i, layer in enumerate(rotations.layers)})
    config = OscarConfig(**dict(REFERENCE, key_clip="fitted"))
    env = _env(export_sglang_oscar(rotations, tmp_path, config=config, key_clip=0.9375)["env"])
    assert env["SGLANG_OSCAR_K_CLIP_RATIO"] == "0.9375"


def test_cli_refusal_is_one_line(tmp_path, capsys):
    rotations = OscarRotations.data_free(tiny_model("llama").config, "hadamard")  # the default layout: channel-wise keys
    rotations.save_pretrained(tmp_path / "rot")
    assert main(["export", "--rotations", str(tmp_path / "rot"), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("oscar-hf: error:") and "token-wise" in err and "\n" not in err
