import pytest

from oscar_hf import CalibrationConfig, OscarConfig
from oscar_hf.config import split_legacy


def test_defaults_and_their_bits():
    c, cal = OscarConfig(), CalibrationConfig()
    assert (c.bits, c.sink_tokens, c.window_tokens, c.demotion_block, c.key_granularity) == (2, 64, 256, 128, "channel")
    assert (c.key_block, cal.key_block_allocation, cal.key_block_choices(c)) == (64, "fitted", (64, 128, 32))
    # keys: 2 + 32/64 per channel per block of 64 tokens on average; values: 2 + 32/head_dim per token
    no_wide = cal.replace(wide_heads="none")
    assert no_wide.history_bits_per_element(c, 128) == (2.5 + 2.25) / 2
    assert no_wide.history_bits_per_element(c, 64) == 2.5
    # wide heads (4 bits) fill the history up to the size budget: 2.75 at head_dim 64, 2.4375 at 128 (the whole cache
    # <= 2.6 bits at 32K tokens), 2.5 at 256
    assert (cal.wide_heads, c.wide_layout) == ("retrieval", True)
    assert [cal.history_bits_per_element(c, d) for d in (64, 128, 256)] == [2.75, 2.4375, 2.5]
    assert cal.replace(wide_history_bits=3.0).history_bits_per_element(c, 128) == 3.0
    assert not c.replace(key_granularity="token", demotion_block=8).wide_layout and not c.replace(group_size=32).wide_layout
    paper = OscarConfig(key_granularity="token", demotion_block=8)
    assert cal.history_bits_per_element(paper, 128) == 2.25 and cal.history_bits_per_element(paper, 64) == 2.5
    assert cal.history_bits_per_element(paper.replace(scale_dtype="float32"), 128) == 2.5
    assert cal.history_bits_per_element(OscarConfig(bits=16), 128) == 16


def test_allocation_budget_spends_what_cheap_values_leave_at_head_dim_256():
    c, cal = OscarConfig(), CalibrationConfig()
    # head_dim 256: values cost 2 + 32/256 = 2.125 bits, so the fitted keys may use 2.875 (history 2.5, KIVI-2 g64's)
    assert c.value_bits(256) == 2.125 and cal.allocation_key_bits(c, 256) == 2.875
    assert cal.history_bits_per_element(c, 256) == 2.5
    # head_dim <= 128: the bits of key_block everywhere (2.5)
    assert cal.allocation_key_bits(c, 128) == cal.allocation_key_bits(c, 64) == 2.5
    assert cal.replace(key_block_allocation="uniform").allocation_key_bits(c, 256) == 2.5  # no allocation, no extra
    assert cal.replace(allocation_history_bits=2.5).allocation_key_bits(c, 128) == 2.75
    assert cal.allocation_key_bits(c.replace(key_granularity="token", demotion_block=8), 256) == 2.125


@pytest.mark.parametrize(
    "field,value",
    [
        ("bits", 5), ("bits", True), ("bits", 2.0), ("group_size", 0), ("group_size", 3), ("sink_tokens", -1), ("window_tokens", 1.5),
        ("demotion_block", 0), ("key_block", 0), ("key_block", 48), ("key_block", 2),
        ("key_clip", 1.2), ("key_clip", "auto"), ("value_clip", 0.0), ("value_clip", True),
        ("scale_dtype", "int8"), ("key_granularity", "row"),
    ],
)
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"OscarConfig\.{field}"):
        OscarConfig(**{field: value})


@pytest.mark.parametrize(
    "field,value",
    [
        ("key_block_allocation", "greedy"), ("allocation_history_bits", 0), ("allocation_history_bits", 17.0),
        ("allocation_history_bits", True), ("allocation_history_bits", "2.5"), ("wide_heads", "all"),
        ("wide_history_bits", -1), ("key_channel_bits", "mixed"), ("choose_key_basis", "yes"), ("center_keys", 1),
        ("center_keys", "yes"), ("clip_grid", ()), ("clip_grid", (0.5, 1.5)), ("tokens", 0), ("sequence_length", 8),
        ("heldout_tokens", -3), ("clip_grid", "0.9"), ("clip_grid", ("a",)), ("clip_grid", 0.9),
    ],
)
def test_invalid_calibration_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"CalibrationConfig\.{field}"):
        CalibrationConfig(**{field: value})


def test_channel_wise_key_blocks_hold_whole_bytes_of_codes():
    """Channel-wise key codes are packed along the block: a block of fewer codes than a byte holds failed only once
    the history was first written, deep in the packing."""
    OscarConfig(bits=4, demotion_block=4, key_block=2)
    OscarConfig(bits=3, key_granularity="token", demotion_block=4, key_block=4)  # token-wise keys: no key blocks
    with pytest.raises(ValueError, match=r"OscarConfig\.key_block: must be a multiple of 8 at bits=3"):
        OscarConfig(bits=3, demotion_block=8, key_block=4)


def test_calibration_budgets_must_exceed_the_layout_bits():
    with pytest.raises(ValueError, match=r"CalibrationConfig\.allocation_history_bits: must be above"):
        CalibrationConfig(allocation_history_bits=2).check_for(OscarConfig())
    CalibrationConfig(wide_history_bits=2.5).check_for(OscarConfig())


def test_json_and_yaml_round_trip(tmp_path):
    c = OscarConfig(bits=4, group_size=32, key_clip=0.96, value_clip="none")
    cal = CalibrationConfig(tokens=1000, clip_grid=(0.9, 1.0), center_keys=True)
    for config, cls in ((c, OscarConfig), (cal, CalibrationConfig)):
        assert cls.from_json(config.to_json()) == config
        assert cls.from_yaml(config.to_yaml()) == config
        for name in ("c.json", "c.yaml"):
            config.save(tmp_path / name)
            assert cls.load(tmp_path / name) == config


def test_unknown_fields_are_rejected_and_misplaced_ones_named():
    with pytest.raises(ValueError, match="unknown field"):
        OscarConfig.from_dict({"bitz": 2})
    with pytest.raises(ValueError, match=r"center_keys belong to CalibrationConfig"):
        OscarConfig.from_dict({"center_keys": True})
    with pytest.raises(ValueError, match=r"sink_tokens belong to OscarConfig"):
        CalibrationConfig.from_dict({"sink_tokens": 4})
    with pytest.raises(ValueError, match="mapping"):
        OscarConfig.from_yaml("- 1\n- 2\n")
    with pytest.raises(ValueError, match="OscarConfig: a config must be a mapping of field names to values, got list"):
        OscarConfig.from_json("[1, 2]")


def test_a_config_file_that_does_not_parse_is_named(tmp_path):
    for name, text, message in (("c.json", "{broken", "Expecting property name"), ("c.yaml", "a: [b", "not valid YAML"),
                                ("d.json", '{"bits": 5}', r"OscarConfig\.bits")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=rf"^{tmp_path / name}: .*{message}"):
            OscarConfig.load(tmp_path / name)


def test_a_legacy_config_splits_into_its_parts():
    """Rotation files and result files of oscar-hf 0.1 recorded storage, calibration and rotation-target fields in one
    dict."""
    config, calibration, targets = split_legacy({"bits": 2, "sink_tokens": 32, "calibration_tokens": 4096,
                                                 "wide_heads": "none", "per_head": False,
                                                 "key_basis_hadamard_preference": 1.0})
    assert config == OscarConfig(sink_tokens=32)
    assert calibration == CalibrationConfig(tokens=4096, wide_heads="none")
    assert targets == {"per_head": False}
    with pytest.raises(ValueError, match="unknown OscarConfig field 'bitz'"):
        split_legacy({"bitz": 2})


def test_configs_are_frozen():
    with pytest.raises(AttributeError):
        OscarConfig().bits = 4


def test_head_dim_dependent_checks():
    OscarConfig(group_size=32).check_head_dim(128)
    with pytest.raises(ValueError, match="group_size"):
        OscarConfig(group_size=256).check_head_dim(128)
    with pytest.raises(ValueError, match="bits"):
        OscarConfig(bits=3).check_head_dim(12)


def test_clip_ratio_resolution():
    assert OscarConfig().clip_ratio("key", None) == 1.0  # channel-wise keys are never clipped
    c = OscarConfig(key_granularity="token")
    assert c.clip_ratio("key", 0.9) == 0.9
    with pytest.raises(ValueError, match="key_clip"):
        c.clip_ratio("key", None)
    assert OscarConfig(key_clip="none").clip_ratio("key", 0.9) == 1.0
    assert OscarConfig(value_clip=0.92).clip_ratio("value", 0.5) == 0.92


def test_key_block_choices():
    cal = CalibrationConfig()
    assert cal.replace(key_block_allocation="uniform").key_block_choices(OscarConfig()) == (64,)
    assert cal.key_block_choices(OscarConfig(demotion_block=64)) == (64, 32)  # 128 does not divide the demotion block
    assert cal.key_block_choices(OscarConfig(demotion_block=8, key_block=8)) == (8,)  # blocks of 4 cannot be packed
