import json
from pathlib import Path

import pytest
import torch

from conftest import rewrite_rotation_file, tiny_config, tiny_model
from oscar_hf import OscarRotations, RotationFileError
from oscar_hf.rotations_io import CONFIG_NAME, WEIGHTS_NAME, weight_fingerprint


def _rotations(family="llama", kind="hadamard"):
    rot = OscarRotations.data_free(tiny_config(family), kind)
    rot.key_clips = {l: 0.9 for l in rot.layers}
    rot.value_clips = {l: 0.95 for l in rot.layers}
    rot.metadata["calibration"] = {"tokens": 123, "data": {"source": "unit-test"}}
    return rot


def test_save_and_load_round_trip(tmp_path):
    rot = _rotations()
    rot.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([CONFIG_NAME, WEIGHTS_NAME])
    loaded = OscarRotations.from_pretrained(tmp_path)
    assert loaded.layers == rot.layers == [0, 1, 2]
    for l in rot.layers:
        assert torch.equal(loaded.key_rotations[l], rot.key_rotations[l])
        assert torch.equal(loaded.value_rotations[l], rot.value_rotations[l])
    assert loaded.key_clips == rot.key_clips and loaded.value_clips == rot.value_clips
    assert loaded.metadata["calibration"]["tokens"] == 123
    loaded.validate_for(tiny_config("llama"))


def test_gemma3_rotations_cover_only_full_attention_layers(tmp_path):
    rot = OscarRotations.data_free(tiny_config("gemma3"), "identity")
    assert rot.layers == [1, 3]
    rot.save_pretrained(tmp_path)
    assert OscarRotations.from_pretrained(tmp_path).layers == [1, 3]


def _fake_hub_cache(cache: Path, repo: str, folder: Path, commit: str, branch: str = "main") -> None:
    base = cache / ("models--" + repo.replace("/", "--"))
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in folder.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (base / "refs").mkdir(exist_ok=True)
    (base / "refs" / branch).write_text(commit)


def test_from_pretrained_resolves_repo_ids_through_the_offline_hub_cache(tmp_path, monkeypatch):
    src = tmp_path / "src"
    _rotations().save_pretrained(src)
    cache = tmp_path / "hub"
    _fake_hub_cache(cache, "org/tiny-oscar", src, "a" * 40)
    other = tmp_path / "src2"
    changed = _rotations()
    changed.key_clips = {l: 0.8 for l in changed.layers}
    changed.save_pretrained(other)
    _fake_hub_cache(cache, "org/tiny-oscar", other, "b" * 40, branch="v2")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = OscarRotations.from_pretrained("org/tiny-oscar", cache_dir=str(cache))
    assert loaded.key_clip(0) == 0.9
    assert OscarRotations.from_pretrained("org/tiny-oscar", revision="v2", cache_dir=str(cache)).key_clip(0) == 0.8
    assert OscarRotations.from_pretrained("org/tiny-oscar", revision="b" * 40, cache_dir=str(cache)).key_clip(0) == 0.8


def test_push_to_hub_uploads_both_files(monkeypatch):
    calls = {}

    class FakeApi:
        def __init__(self, token=None):
            calls["token"] = token

        def create_repo(self, repo_id, private=None, exist_ok=False):
            calls["create"] = (repo_id, exist_ok)

        def upload_folder(self, repo_id, folder_path, path_in_repo, revision, commit_message):
            calls["files"] = sorted(p.name for p in Path(folder_path).iterdir())
            calls["upload"] = (repo_id, path_in_repo, revision)
            return "commit-url"

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    assert _rotations().push_to_hub("org/model", subfolder="oscar", token="t") == "commit-url"
    assert calls["files"] == sorted([CONFIG_NAME, WEIGHTS_NAME])
    assert calls["upload"] == ("org/model", "oscar", None) and calls["create"] == ("org/model", True)


@pytest.mark.parametrize(
    "field,value",
    [("num_hidden_layers", 5), ("num_key_value_heads", 4), ("num_attention_heads", 8), ("model_type", "qwen3")],
)
def test_mismatch_with_the_model_names_field_and_both_values(field, value):
    rot = _rotations()
    cfg = tiny_config("llama")
    if field == "model_type":
        cfg = tiny_config("qwen3")
    else:
        setattr(cfg, field, value)
    mine = rot.geometry[field]
    with pytest.raises((RotationFileError, ValueError), match=rf"{field} is {mine!r} in the rotation file but {value!r}"):
        rot.validate_for(cfg)


def test_head_dim_mismatch_is_reported():
    rot = _rotations()
    cfg = tiny_config("llama", head_dim=32)
    with pytest.raises(RotationFileError, match="head_dim is 16 in the rotation file but 32"):
        rot.validate_for(cfg)


def _rewrite(tmp_path, edit_json=None, edit_tensors=None):
    rewrite_rotation_file(tmp_path, _rotations(), edit_json, edit_tensors)


def test_non_orthogonal_rotation_is_rejected(tmp_path):
    def scale(t):
        t["layers.1.key_rotation"] = t["layers.1.key_rotation"] * 1.01

    _rewrite(tmp_path, edit_tensors=scale)
    with pytest.raises(RotationFileError, match="layers.1.key_rotation is not orthogonal"):
        OscarRotations.from_pretrained(tmp_path)


def test_nan_rotation_is_rejected(tmp_path):
    def poison(t):
        t["layers.0.value_rotation"][0, 0, 0] = float("nan")

    _rewrite(tmp_path, edit_tensors=poison)
    with pytest.raises(RotationFileError, match="NaN"):
        OscarRotations.from_pretrained(tmp_path)


def test_wrong_shape_is_rejected(tmp_path):
    def shrink(t):
        t["layers.2.value_rotation"] = torch.eye(16).expand(1, 16, 16).contiguous()

    _rewrite(tmp_path, edit_tensors=shrink)
    with pytest.raises(RotationFileError, match=r"layers.2.value_rotation has shape \(1, 16, 16\)"):
        OscarRotations.from_pretrained(tmp_path)


def test_unexpected_tensor_is_rejected(tmp_path):
    _rewrite(tmp_path, edit_tensors=lambda t: t.update({"evil": torch.zeros(1)}))
    with pytest.raises(RotationFileError, match="unexpected tensor 'evil'"):
        OscarRotations.from_pretrained(tmp_path)


def test_format_version_and_kind_are_checked(tmp_path):
    _rewrite(tmp_path, edit_json=lambda m: m.update({"format_version": 99}))
    with pytest.raises(RotationFileError, match="format_version 99"):
        OscarRotations.from_pretrained(tmp_path)
    _rewrite(tmp_path, edit_json=lambda m: m.update({"format": "something-else"}))
    with pytest.raises(RotationFileError, match="not an OSCAR rotation file"):
        OscarRotations.from_pretrained(tmp_path)


def test_clip_values_are_checked(tmp_path):
    _rewrite(tmp_path, edit_json=lambda m: m["clip"]["key"].update({"0": 1.5}))
    with pytest.raises(RotationFileError, match="clip ratios"):
        OscarRotations.from_pretrained(tmp_path)


def test_missing_or_corrupt_files(tmp_path):
    with pytest.raises(RotationFileError, match="is missing"):
        OscarRotations.from_pretrained(tmp_path)
    _rotations().save_pretrained(tmp_path)
    (tmp_path / WEIGHTS_NAME).write_bytes(b"not a safetensors file")
    with pytest.raises(RotationFileError, match="not a readable safetensors"):
        OscarRotations.from_pretrained(tmp_path)
    (tmp_path / CONFIG_NAME).write_text("{broken")
    with pytest.raises(RotationFileError, match="not valid JSON"):
        OscarRotations.from_pretrained(tmp_path)


def test_weight_fingerprint_tells_weights_apart_but_not_dtypes(tmp_path):
    model = tiny_model("llama")
    rotations = OscarRotations.data_free(model, "hadamard")
    rotations.metadata = {"weight_fingerprint": weight_fingerprint(model)}
    rotations.save_pretrained(tmp_path)
    loaded = OscarRotations.from_pretrained(tmp_path)
    loaded.check_fingerprint(model)
    loaded.check_fingerprint(tiny_model("llama", dtype=torch.bfloat16))  # same weights in another dtype
    other = tiny_model("llama", seed=1)  # the same config, other random weights
    with pytest.raises(RotationFileError, match=r"calibrated on other weights .*: layers\.0\.k_proj\.weight differs: "
                                                 r".*; so do 8 more of the 9 attention tensors; recalibrate"):
        loaded.check_fingerprint(other)
    with pytest.warns(UserWarning, match="calibrated on other weights"):
        loaded.check_fingerprint(other, strict=False)


def test_rotations_are_found_beside_the_model(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path)
    rotations = OscarRotations.data_free(model, "hadamard")
    rotations.metadata["weight_fingerprint"] = weight_fingerprint(model)
    rotations.save_pretrained(tmp_path / "oscar")
    reloaded = type(model).from_pretrained(tmp_path)  # config._name_or_path is the folder
    assert OscarRotations.from_pretrained(reloaded).layers == rotations.layers
    assert OscarRotations.from_pretrained(tmp_path).layers == rotations.layers
    other = tiny_model("llama", seed=1)
    other.config._name_or_path = str(tmp_path)
    with pytest.raises(RotationFileError, match="other weights"):
        OscarRotations.from_pretrained(other)
    with pytest.warns(UserWarning, match="other weights"):  # a warning only
        OscarRotations.from_pretrained(other, allow_other_weights=True)


def test_a_file_without_fingerprint_loads_with_a_warning(tmp_path, monkeypatch):
    from oscar_hf import rotations_io

    monkeypatch.setattr(rotations_io, "_warned", set())
    model = tiny_model("llama")
    rotations = OscarRotations.data_free(model, "hadamard")
    rotations.metadata = {}  # as calibrate() output saved without a fingerprint
    with pytest.warns(UserWarning, match="records no weight fingerprint"):
        rotations.check_fingerprint(model)


def test_a_rotation_json_of_the_wrong_shape_is_named(tmp_path):
    rewrite_rotation_file(tmp_path, _rotations(), lambda meta: meta.update(method="hadamard"))
    with pytest.raises(RotationFileError, match="rotation metadata field 'method' must be an object, got 'hadamard'"):
        OscarRotations.from_pretrained(tmp_path)  # (was an AttributeError when a cache checked the fingerprint)
    (tmp_path / CONFIG_NAME).write_text("[1, 2]")
    with pytest.raises(RotationFileError, match="is not an OSCAR rotation file: it holds a JSON list, not an object"):
        OscarRotations.from_pretrained(tmp_path)


def test_key_blocks_round_trip_and_are_checked(tmp_path):
    rot = _rotations()
    rot.key_blocks = {l: (32, 128) for l in rot.layers}
    rot.save_pretrained(tmp_path)
    meta = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert meta["format_version"] == 6 and meta["key_blocks"]["0"] == [32, 128]
    assert meta["layout"] == {"key_granularity": "channel", "demotion_block": 128, "key_block": 64,
                              "key_block_allocation": "fitted"}
    loaded = OscarRotations.from_pretrained(tmp_path)
    assert loaded.key_block(1) == (32, 128)
    rewrite_rotation_file(tmp_path, rot, lambda m: m["key_blocks"].update({"0": [32, 48]}))
    with pytest.raises(RotationFileError, match="layer 0: key blocks \\[32, 48\\]"):
        OscarRotations.from_pretrained(tmp_path)
    rewrite_rotation_file(tmp_path, rot, lambda m: m["key_blocks"].update({"0": [64]}))
    with pytest.raises(RotationFileError, match="expected 2 blocks"):
        OscarRotations.from_pretrained(tmp_path)


def test_head_bits_round_trip_are_checked_and_format_4_files_have_none(tmp_path):
    rot = _rotations()
    rot.head_bits = {l: (4, 2) for l in rot.layers}
    rot.save_pretrained(tmp_path)
    meta = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert meta["format_version"] == 6 and meta["head_bits"]["0"] == [4, 2]
    loaded = OscarRotations.from_pretrained(tmp_path)
    assert loaded.head_bit(1) == (4, 2) and loaded.wide_heads == [(l, 0) for l in rot.layers]
    rewrite_rotation_file(tmp_path, rot, lambda m: m["head_bits"].update({"0": [3, 2]}))
    with pytest.raises(RotationFileError, match="layer 0: head bits \\[3, 2\\]"):
        OscarRotations.from_pretrained(tmp_path)
    rewrite_rotation_file(tmp_path, rot, lambda m: m["layout"].update({"key_granularity": "token", "demotion_block": 8,
                                                                        "key_block": 8}))
    with pytest.raises(RotationFileError, match="head_bits need a layout with channel-wise 2-bit keys"):
        OscarRotations.from_pretrained(tmp_path)
    rewrite_rotation_file(tmp_path, rot, lambda m: m.update({"format_version": 4}) or m.pop("head_bits"))
    assert OscarRotations.from_pretrained(tmp_path).head_bits is None  # version 4: every head at 2 bits


def test_format_3_files_load_with_one_key_block_everywhere(tmp_path):
    _rotations().save_pretrained(tmp_path)

    def as_version_3(m):
        m.update({"format_version": 3, "layout": {"key_granularity": "channel", "demotion_block": 64}})
        del m["key_blocks"]

    _rewrite(tmp_path, edit_json=as_version_3)
    loaded = OscarRotations.from_pretrained(tmp_path)
    assert loaded.layout == {"key_granularity": "channel", "demotion_block": 64, "key_block": 64,
                             "key_block_allocation": "uniform"}
    assert loaded.key_blocks is None


def test_key_wide_channels_round_trip_are_checked_and_format_5_files_have_none(tmp_path):
    rot = _rotations()  # head_dim 16, 2 KV heads
    rot.head_bits = {l: (4, 2) for l in rot.layers}
    rot.key_wide_channels = {l: (0, 3) for l in rot.layers}
    rot.save_pretrained(tmp_path)
    meta = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert meta["format_version"] == 6 and meta["key_wide_channels"]["0"] == [0, 3]
    assert OscarRotations.from_pretrained(tmp_path).key_wide_channel(1) == (0, 3)
    for bad, match in (([0, 9], "in \\[0, 8\\]"), ([2, 3], "0 for the wide heads"), ([3], "expected 2 counts")):
        rewrite_rotation_file(tmp_path, rot, lambda m: m["key_wide_channels"].update({"0": bad}))
        with pytest.raises(RotationFileError, match=f"layer 0: wide key channels .*{match}"):
            OscarRotations.from_pretrained(tmp_path)
    rewrite_rotation_file(tmp_path, rot, lambda m: m.update({"format_version": 5}) or m.pop("key_wide_channels"))
    assert OscarRotations.from_pretrained(tmp_path).key_wide_channels is None  # version 5: 2 bits in every channel


def _deterministic(model):
    """Weights from a formula (no random init), so that a fingerprint of them is the same with any torch version."""
    with torch.no_grad():
        for i, (_, p) in enumerate(model.named_parameters()):
            p.copy_(torch.sin(torch.arange(p.numel(), dtype=torch.float64) * 0.37 + i).reshape(p.shape))
    return model


def test_fingerprint_catches_a_slightly_changed_middle_layer_but_not_a_dtype(tmp_path):
    """Guards (16d): the fingerprint covers every decoder layer's attention weights in value, not only the signs of
    the first and last layers: a k_proj of a middle layer scaled by 1.01 is refused by name, while the same
    checkpoint loaded as bfloat16 or float16 passes."""
    from transformers import AutoModelForCausalLM

    model = tiny_model("llama")
    model.save_pretrained(tmp_path)
    rotations = OscarRotations.data_free(model, "hadamard")
    rotations.metadata = {"weight_fingerprint": weight_fingerprint(model)}
    for dtype in (torch.bfloat16, torch.float16):
        rotations.check_fingerprint(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype))
    changed = tiny_model("llama")
    with torch.no_grad():
        changed.model.layers[1].self_attn.k_proj.weight.mul_(1.01)
    with pytest.raises(RotationFileError, match=r"other weights .*: layers\.1\.k_proj\.weight differs: RMS [0-9.]+ in "
                                                 r"the rotation file, [0-9.]+ in the model \(1\.0e-02 apart"):
        rotations.check_fingerprint(changed)
    fingerprint = rotations.metadata["weight_fingerprint"]
    assert set(fingerprint["sketch"]["tensors"]) == {f"layers.{i}.{p}_proj.weight" for i in range(3) for p in "qkv"}


def test_files_with_the_sign_bit_fingerprint_still_verify(tmp_path, capsys):
    """Guards: rotation files written before the sketch (their fingerprint: sha256 of the sign bits of the first and
    last layers' q/k weights) still verify with that method, the same weights pass and others are refused, and new
    files keep that field, so that those older versions still verify them. The hash below was computed by the
    fingerprint code of 7f7ff3d for these (formula) weights."""
    model = _deterministic(tiny_model("llama"))
    old = {"sha256": "d22da63f1617de9c7769f8342363e54730a173ed32688eea5d1568304d66260f",
           "method": "sign bits of q_proj/k_proj (or c_attn) weights, first and last layer", "layers": [0, 2]}
    rotations = OscarRotations.data_free(model, "hadamard")
    rotations.metadata = {"weight_fingerprint": old}
    rotations.save_pretrained(tmp_path)
    loaded = OscarRotations.from_pretrained(tmp_path)
    loaded.check_fingerprint(model)
    with pytest.raises(RotationFileError, match="signs of the first and last layers"):
        loaded.check_fingerprint(tiny_model("llama", seed=1))
    new = weight_fingerprint(model)
    assert {k: new[k] for k in old} == old


def test_geometry_is_checked_before_the_fingerprint(tmp_path):
    """Guards (10): rotations of another model (here a 2-layer Llama's) are named as such (the field and both values),
    not as "same shapes, different values" with advice to allow other weights; also when found beside the model."""
    small = tiny_model("llama", num_hidden_layers=2)
    rotations = OscarRotations.data_free(small, "hadamard")
    rotations.metadata = {"weight_fingerprint": weight_fingerprint(small)}
    model = tiny_model("llama")
    with pytest.raises(RotationFileError, match="num_hidden_layers is 2 in the rotation file but 3 in the model config"):
        rotations.check_fingerprint(model, strict=False)
    model.save_pretrained(tmp_path)
    rotations.save_pretrained(tmp_path / "oscar")
    model.config._name_or_path = str(tmp_path)
    with pytest.raises(RotationFileError, match="num_hidden_layers is 2 in the rotation file"):
        OscarRotations.from_pretrained(model, allow_other_weights=True)


def test_fingerprint_is_computed_once_per_model_and_weight_state(monkeypatch):
    """Guards (8): building caches for one model reads its weights for the fingerprint once, not per cache; a weight
    changed in place (or replaced) is seen at the next cache, and refused."""
    from oscar_hf import OscarCache, OscarConfig, rotations_io

    calls = []
    compute = rotations_io._compute_sketch
    monkeypatch.setattr(rotations_io, "_compute_sketch", lambda tensors: calls.append(1) or compute(tensors))
    model = tiny_model("llama")
    rotations = OscarRotations.data_free(model, "hadamard")
    rotations.metadata = {"weight_fingerprint": weight_fingerprint(model)}
    config = OscarConfig(key_clip="none", value_clip="none")
    for _ in range(3):
        OscarCache(model, rotations, config)
    assert len(calls) == 1
    with torch.no_grad():
        model.model.layers[2].self_attn.v_proj.weight.mul_(1.5)
    with pytest.raises(RotationFileError, match=r"layers\.2\.v_proj\.weight differs"):
        OscarCache(model, rotations, config)
    assert len(calls) == 2
    with torch.no_grad():
        model.model.layers[2].self_attn.v_proj.weight.div_(1.5)
    q_proj = model.model.layers[0].self_attn.q_proj
    q_proj.weight = torch.nn.Parameter(torch.zeros_like(q_proj.weight))  # replaced, not written in place
    with pytest.raises(RotationFileError, match=r"layers\.0\.q_proj\.weight differs"):
        OscarCache(model, rotations, config)


def _write(how, weight, value):
    if how == "data.copy_":
        weight.data.copy_(value)
    elif how == "no_grad copy_":
        with torch.no_grad():
            weight.copy_(value)
    else:
        weight.data = value.clone()


@pytest.mark.parametrize("how", ["data.copy_", "no_grad copy_", "data ="])
def test_weights_written_in_place_are_seen_by_the_memo(how, monkeypatch):
    """Guards (issue 50, item 4): the fingerprint memo compares what the sketch reads, not only the version counter
    and storage: other weights written through `.data` (which bumps no counter of the parameter), under no_grad, or
    swapped in as `.data` are refused at the next check, as through load_state_dict; with the weights written back
    the check passes again, and an unchanged model is not read again. The sign-bit check of older files sees them
    too."""
    from oscar_hf import rotations_io

    calls = []
    compute = rotations_io._compute_sketch
    monkeypatch.setattr(rotations_io, "_compute_sketch", lambda tensors: calls.append(1) or compute(tensors))
    model, other = tiny_model("llama"), tiny_model("llama", seed=1)
    rotations = OscarRotations.data_free(model, "hadamard")
    fingerprint = weight_fingerprint(model)
    rotations.metadata = {"weight_fingerprint": fingerprint}
    weight = model.model.layers[1].self_attn.k_proj.weight
    mine = weight.detach().clone()
    rotations.check_fingerprint(model)
    _write(how, weight, other.model.layers[1].self_attn.k_proj.weight.detach())
    with pytest.raises(RotationFileError, match=r"layers\.1\.k_proj\.weight differs"):
        rotations.check_fingerprint(model)
    _write(how, weight, mine)
    rotations.check_fingerprint(model)
    calls.clear()
    for _ in range(3):
        rotations.check_fingerprint(model)
    assert not calls
    legacy = OscarRotations.data_free(model, "hadamard")
    legacy.metadata = {"weight_fingerprint": {k: v for k, v in fingerprint.items() if k != "sketch"}}
    legacy.check_fingerprint(model)
    _write(how, model.model.layers[0].self_attn.q_proj.weight, other.model.layers[0].self_attn.q_proj.weight.detach())
    with pytest.raises(RotationFileError, match="signs of the first and last layers"):
        legacy.check_fingerprint(model)
