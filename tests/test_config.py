import pytest

from oscar_hf import OscarConfig


def test_defaults_and_their_bits():
    c = OscarConfig()
    assert (c.bits, c.sink_tokens, c.window_tokens, c.demotion_block, c.key_granularity) == (2, 64, 256, 128, "channel")
    assert (c.key_block, c.key_block_allocation, c.key_block_choices) == (64, "fitted", (64, 128, 32))
    # keys: 2 + 32/64 per channel per block of 64 tokens on average; values: 2 + 32/head_dim per token
    no_wide = c.replace(wide_heads="none")
    assert no_wide.history_bits_per_element(128) == (2.5 + 2.25) / 2
    assert no_wide.history_bits_per_element(64) == 2.5
    # wide heads (4 bits) fill the history up to the size budget: 2.75 at head_dim 64, 2.4375 at 128 (the whole cache
    # <= 2.6 bits at 32K tokens), 2.5 at 256
    assert (c.wide_heads, c.wide_layout) == ("retrieval", True)
    assert [c.history_bits_per_element(d) for d in (64, 128, 256)] == [2.75, 2.4375, 2.5]
    assert c.replace(wide_history_bits=3.0).history_bits_per_element(128) == 3.0
    assert not c.replace(key_granularity="token", demotion_block=8).wide_layout and not c.replace(group_size=32).wide_layout
    paper = OscarConfig(key_granularity="token", demotion_block=8)
    assert paper.history_bits_per_element(128) == 2.25 and paper.history_bits_per_element(64) == 2.5
    assert paper.replace(scale_dtype="float32").history_bits_per_element(128) == 2.5
    assert OscarConfig(bits=16).history_bits_per_element(128) == 16


def test_allocation_budget_spends_what_cheap_values_leave_at_head_dim_256():
    c = OscarConfig()
    # head_dim 256: values cost 2 + 32/256 = 2.125 bits, so the fitted keys may use 2.875 (history 2.5, KIVI-2 g64's)
    assert c.value_bits(256) == 2.125 and c.allocation_key_bits(256) == 2.875 and c.history_bits_per_element(256) == 2.5
    # head_dim <= 128: the bits of key_block everywhere (2.5)
    assert c.allocation_key_bits(128) == c.allocation_key_bits(64) == 2.5
    assert c.replace(key_block_allocation="uniform").allocation_key_bits(256) == 2.5  # no allocation, no extra bits
    assert c.replace(allocation_history_bits=2.5).allocation_key_bits(128) == 2.75
    assert c.replace(key_granularity="token", demotion_block=8).allocation_key_bits(256) == 2.125


@pytest.mark.parametrize(
    "field,value",
    [
        ("bits", 5), ("bits", True), ("group_size", 0), ("sink_tokens", -1), ("window_tokens", 1.5),
        ("demotion_block", 0), ("key_block", 0), ("key_block", 48), ("key_block_allocation", "greedy"),
        ("allocation_history_bits", 2), ("allocation_history_bits", 17.0), ("allocation_history_bits", True),
        ("allocation_history_bits", "2.5"),
        ("key_clip", 1.2), ("key_clip", "auto"), ("value_clip", 0.0), ("value_clip", True),
        ("scale_dtype", "int8"), ("key_granularity", "row"), ("choose_key_basis", "yes"), ("key_target", "kv"), ("value_target", "sst"), ("per_head", 1), ("center_keys", 1), ("center_keys", "yes"),
        ("key_basis_hadamard_preference", 0.5), ("key_basis_hadamard_preference", True),
        ("clip_grid", ()), ("clip_grid", (0.5, 1.5)), ("calibration_tokens", 0), ("heldout_tokens", -3),
    ],
)
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"OscarConfig\.{field}"):
        OscarConfig(**{field: value})


def test_json_and_yaml_round_trip(tmp_path):
    c = OscarConfig(bits=4, group_size=32, key_clip=0.96, value_clip="none", per_head=False, clip_grid=(0.9, 1.0),
                    center_keys=True)
    assert OscarConfig().center_keys is False
    assert OscarConfig.from_json(c.to_json()) == c
    assert OscarConfig.from_yaml(c.to_yaml()) == c
    for name in ("c.json", "c.yaml"):
        c.save(tmp_path / name)
        assert OscarConfig.load(tmp_path / name) == c


def test_unknown_fields_are_rejected():
    with pytest.raises(ValueError, match="unknown field"):
        OscarConfig.from_dict({"bitz": 2})
    with pytest.raises(ValueError, match="mapping"):
        OscarConfig.from_yaml("- 1\n- 2\n")


def test_head_dim_dependent_checks():
    OscarConfig(group_size=32).check_head_dim(128)
    with pytest.raises(ValueError, match="group_size"):
        OscarConfig(group_size=48).check_head_dim(128)
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


def test_key_blocks_follow_the_allocation_or_the_uniform_block():
    c = OscarConfig()
    assert c.key_blocks(3, None) == (64, 64, 64)  # rotations without an allocation
    assert c.key_blocks(3, [32, 128, 64]) == (32, 128, 64)
    assert c.replace(key_block_allocation="uniform").key_blocks(2, [32, 128]) == (64, 64)
    assert c.replace(key_block_allocation="uniform").key_block_choices == (64,)
    assert OscarConfig(demotion_block=64).key_block_choices == (64, 32)  # 128 does not divide the demotion block
    assert OscarConfig(demotion_block=8, key_block=8).key_block_choices == (8,)  # blocks of 4 cannot be packed
    with pytest.raises(ValueError, match="key blocks \\[32, 256\\] do not fit 2 KV heads"):
        c.key_blocks(2, [32, 256])
    with pytest.raises(ValueError, match="do not fit 3 KV heads"):
        c.key_blocks(3, [64, 64])
