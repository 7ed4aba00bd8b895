import json

import pytest
import torch

from conftest import VOCAB, char_tokenizer, tiny_model
from transformers import DynamicCache
from oscar_hf import CalibrationConfig, OscarCache, OscarConfig, OscarRotations, UnsupportedModelError
from oscar_hf.calibrate import (RotationTargets, StatisticsCollector, attention_column_energy, calibrate,
                               calibration_sequences, capturing)
from oscar_hf.models import model_geometry
from oscar_hf.quant import fake_quantize
from oscar_hf.rotation import hadamard, orthogonality_error

TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
        "foolishness, it was the epoch of belief, it was the epoch of incredulity. ") * 40
SMALL = dict(sink_tokens=4, window_tokens=8, demotion_block=4, key_block=4)
LAYOUT = OscarConfig(**SMALL)
CAL = CalibrationConfig(tokens=256, sequence_length=128, heldout_tokens=64, clip_grid=(0.7, 0.85, 1.0))


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "calib.txt"
    path.write_text(TEXT)
    return path


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_calibrate_end_to_end(family, text_file):
    model = tiny_model(family, attn="sdpa")
    rot = calibrate(model, char_tokenizer(), data=str(text_file), config=LAYOUT, calibration=CAL, progress=False)
    assert rot.layers == list(model_geometry(model.config).oscar_layers)
    for table in (rot.key_rotations, rot.value_rotations):
        for r in table.values():
            assert r.shape == (2, 16, 16) and orthogonality_error(r) < 1e-5
    assert set(rot.key_clips.values()) <= {0.7, 0.85, 1.0} and set(rot.value_clips) == set(rot.layers)
    cal = rot.metadata["calibration"]
    assert cal["tokens"] == 256 and cal["sequences"] == 2 and cal["heldout_tokens"] == 64
    assert cal["data"]["source"].endswith("calib.txt") and len(cal["data"]["sha256"]) == 64
    assert rot.metadata["method"] == {"key_target": "query", "value_target": "attention", "per_head": True, "composition": "U·H·P"}
    assert "calibrated on 256 tokens" in rot.report.summary()
    assert model.config._attn_implementation == "sdpa"  # restored
    # and the rotations drive a cache
    model.set_attn_implementation("oscar")
    ids = torch.randint(4, 100, (1, 40))
    model.generate(ids, max_new_tokens=5, cache=OscarCache(model, rot, LAYOUT), pad_token_id=0)


def test_column_energy_matches_the_dense_computation():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 6, 37, 8, generator=g), torch.randn(2, 3, 37, 8, generator=g)
    energy = attention_column_energy(q, k, 0.4, block=8)
    s = torch.einsum("bhgid,bhjd->bhgij", q.reshape(2, 3, 2, 37, 8).double(), k.double()) * 0.4
    s = s.masked_fill(~torch.ones(37, 37, dtype=torch.bool).tril(), float("-inf"))
    dense = torch.softmax(s, -1).square().sum(dim=(2, 3))
    assert torch.allclose(energy, dense, atol=1e-5)


def test_streaming_statistics_equal_a_direct_computation(text_file):
    model = tiny_model("llama", attn="sdpa")
    tok = char_tokenizer()
    seqs = [torch.tensor(tok(TEXT[i * 300 : i * 300 + 90])["input_ids"]) for i in range(3)]
    geometry = model_geometry(model.config)
    streaming, recorder = StatisticsCollector(geometry), StatisticsCollector(geometry)
    recorder.record = {}
    per_seq = []
    with capturing(model, streaming):
        for s in seqs:
            model(input_ids=s[None], use_cache=False)
    with capturing(model, recorder):
        for s in seqs:
            model(input_ids=s[None], use_cache=False)
            per_seq.append(dict(recorder.record))
    for layer in geometry.oscar_layers:
        qs = torch.cat([r[layer][0].double().reshape(2, -1, 16) for r in per_seq], 1)  # [H, g*N, d]
        vs = torch.cat([r[layer][2].double() for r in per_seq], 1)
        direct_q = torch.einsum("hnd,hne->hde", qs, qs) / qs.shape[1]
        assert torch.allclose(streaming.layers[layer].target("query"), direct_q, atol=1e-8)
        weights = torch.cat([attention_column_energy(r[layer][0][None], r[layer][1][None], r[layer][3])[0] for r in per_seq], 1)
        direct_v = torch.einsum("hn,hnd,hne->hde", weights, vs, vs) / vs.shape[1]
        assert torch.allclose(streaming.layers[layer].target("attention"), direct_v, atol=1e-8)
        assert streaming.layers[layer].tokens == 270


def test_ablation_options(text_file):
    model = tiny_model("llama", attn="sdpa")
    tok = char_tokenizer()
    base = calibrate(model, tok, data=str(text_file), config=LAYOUT, calibration=CAL, progress=False)
    shared = calibrate(model, tok, data=str(text_file), config=LAYOUT, calibration=CAL, progress=False,
                       statistics=base.statistics, targets=RotationTargets(per_head=False))
    for r in shared.key_rotations.values():
        assert torch.equal(r[0], r[1])
    ident = calibrate(model, tok, data=str(text_file), config=LAYOUT, calibration=CAL, progress=False,
                      statistics=base.statistics, targets=RotationTargets("identity", "hadamard"))
    assert torch.allclose(ident.key_rotations[0][0], torch.eye(16))
    assert torch.allclose(ident.value_rotations[0][0].abs(), hadamard(16).abs().float())
    # reusing statistics gives the same rotations as recomputing them
    again = calibrate(model, tok, data=str(text_file), config=LAYOUT, calibration=CAL, progress=False,
                      statistics=base.statistics)
    assert torch.equal(again.key_rotations[1], base.key_rotations[1])


def test_unsupported_architecture_is_refused_before_running(text_file):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=112, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=2, num_experts_per_tok=1, first_k_dense_replace=1,
        kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8))
    with pytest.raises(UnsupportedModelError, match="latent attention"):
        calibrate(model, char_tokenizer(), data=str(text_file), config=LAYOUT, calibration=CAL, progress=False)


def test_bad_inputs_are_reported(text_file, tmp_path):
    model = tiny_model("llama", attn="sdpa")
    tok = char_tokenizer()
    with pytest.raises(ValueError, match="text has .* tokens but"):
        calibrate(model, tok, data=str(text_file), config=LAYOUT, calibration=CAL.replace(tokens=100_000),
                  progress=False)
    with pytest.raises(ValueError, match="heldout_tokens"):
        calibrate(model, tok, data=str(text_file), config=LAYOUT, calibration=CAL.replace(heldout_tokens=10),
                  progress=False)
    with pytest.raises(FileNotFoundError, match="neither a file"):
        calibrate(model, tok, data=str(tmp_path / "missing.txt"), config=LAYOUT, calibration=CAL, progress=False)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"content": "x"}]))
    with pytest.raises(ValueError, match="'text' field"):
        calibrate(model, tok, data=str(bad), config=LAYOUT, calibration=CAL, progress=False)
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="layer 1 produced non-finite"):
        calibrate(model, tok, data=str(text_file), config=LAYOUT, calibration=CAL, progress=False)


def test_bad_data_files_wrong_configs_and_a_foreign_tokenizer_are_named(text_file, tmp_path):
    model, tok = tiny_model("llama", attn="sdpa", vocab_size=50), char_tokenizer()
    for name, text, message in (("bad.jsonl", '"fine"\n{oops}\n', "bad.jsonl: not valid JSON at line 2"),
                                ("bad.json", "[1,", "bad.json: not valid JSON at line 1 column 4")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=message):
            calibrate(model, tok, data=str(tmp_path / name), config=LAYOUT, calibration=CAL, progress=False)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match="latin1.txt: not UTF-8 text"):
        calibrate(model, tok, data=str(tmp_path / "latin1.txt"), config=LAYOUT, calibration=CAL, progress=False)
    with pytest.raises(TypeError, match="calibrate: config must be an OscarConfig .*got CalibrationConfig"):
        calibrate(model, tok, str(text_file), CAL, LAYOUT, progress=False)  # the two configs swapped
    # the char tokenizer's ids exceed 50, which this model embeds (it was an IndexError inside the embedding)
    with pytest.raises(ValueError, match=r"token id \d+, but the model's input embeddings have 50 rows"):
        calibrate(model, tok, data=str(text_file), config=LAYOUT, calibration=CAL, progress=False)


def test_jsonl_data_and_recorded_description(tmp_path):
    path = tmp_path / "calib.jsonl"
    path.write_text("\n".join(json.dumps({"text": TEXT[i : i + 2000]}) for i in range(0, 8000, 2000)))
    rot = calibrate(tiny_model("qwen2", attn="sdpa"), char_tokenizer(), data=str(path), config=LAYOUT, calibration=CAL, progress=False)
    assert rot.metadata["calibration"]["data"]["documents"] == 4


def test_device_map_models_calibrate(tmp_path, text_file):
    """Layers dispatched by accelerate (here: some offloaded to disk, executed on the CPU) still calibrate."""
    from transformers import AutoModelForCausalLM

    tiny_model("llama", attn="sdpa").save_pretrained(tmp_path / "m")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "disk",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", device_map=device_map, offload_folder=str(tmp_path / "off"))
    rot = calibrate(model, char_tokenizer(), data=str(text_file), config=LAYOUT, calibration=CAL, progress=False)
    assert rot.layers == [0, 1, 2]


def test_without_heldout_tokens_channelwise_keys_stay_unrotated(text_file):
    model, tok = tiny_model("llama"), char_tokenizer()
    calibration = CalibrationConfig(tokens=512, sequence_length=256, heldout_tokens=0)
    rotations = calibrate(model, tok, data=str(text_file), calibration=calibration, progress=False)
    for rotation in rotations.key_rotations.values():
        assert torch.equal(rotation, torch.eye(rotation.shape[-1]).expand_as(rotation))
    assert set(rotations.metadata["key_basis"]["chosen"]["0"]) == {"identity"}


def test_the_key_basis_choice_keeps_the_basis_with_the_lower_heldout_error():
    from oscar_hf.calibrate import choose_key_basis, key_basis_candidates, key_basis_errors

    g = torch.Generator().manual_seed(0)
    t, d = 400, 16
    key = torch.randn(2, t, d, generator=g) * 0.1
    key[0, :, 0] += 100 * (torch.arange(t) % 2 * 2 - 1)  # head 0: one huge channel, flipping sign every token...
    query = torch.randn(2, t, d, generator=g)
    query[0, :, 0] = 0  # ...that its queries never look at: unrotated, its error stays where nobody looks
    value = torch.randn(2, t, d, generator=g)
    calibrated = torch.linalg.qr(torch.randn(2, d, d, generator=g, dtype=torch.float64))[0]
    candidates = key_basis_candidates(calibrated)
    config = OscarConfig(sink_tokens=4, window_tokens=8, demotion_block=16, key_block=16)
    errors = key_basis_errors(query, key, value, candidates, d ** -0.5, config)
    assert errors["identity"][0] < 0.1 * errors["hadamard"][0]  # a rotation spreads the flipping channel everywhere
    rotation, names = choose_key_basis(candidates, errors)
    assert names[0] == "identity" and torch.equal(rotation[0], candidates["identity"][0])
    shared, shared_names = choose_key_basis(candidates, errors, per_head=False)
    assert shared_names[0] == shared_names[1] and torch.equal(shared[0], shared[1])


def test_key_block_allocation_is_the_exact_optimum_within_the_budget():
    import itertools

    from oscar_hf.calibrate import allocate_key_blocks

    config = OscarConfig()  # chunks of 128, blocks 32 / 64 / 128 at the metadata of 64 everywhere
    choices = CalibrationConfig().key_block_choices(config)
    g = torch.Generator().manual_seed(3)
    for trial in range(20):
        errors = {layer: {b: torch.rand(2, generator=g) * (1 + b / 64) for b in (32, 64, 128)} for layer in (0, 3)}
        chosen = allocate_key_blocks(errors, config, choices)
        rows = lambda blocks: sum(128 // b for b in blocks)  # noqa: E731
        total = lambda blocks: sum(float(errors[l][b][h]) for (l, h), b in zip([(0, 0), (0, 1), (3, 0), (3, 1)], blocks))  # noqa: E731
        feasible = [c for c in itertools.product((32, 64, 128), repeat=4) if rows(c) <= 4 * 2]
        flat = chosen[0] + chosen[3]
        assert rows(flat) <= 8 and total(flat) == pytest.approx(min(total(c) for c in feasible), abs=1e-12)
    # three heads whose error falls evenly with the metadata rows: one head at 32 and two at 128 (error 1 + 2 + 2)
    # lose to 64 everywhere (1.5 x 3)
    even = {0: {32: torch.full((3,), 1.0), 64: torch.full((3,), 1.5), 128: torch.full((3,), 2.0)}}
    assert allocate_key_blocks(even, config, choices) == {0: (64, 64, 64)}


def test_key_block_allocation_spends_a_larger_key_budget_exactly():
    import itertools

    from oscar_hf.calibrate import allocate_key_blocks

    config, calibration = OscarConfig(), CalibrationConfig()
    choices = calibration.key_block_choices(config)
    # Gemma 3's case: three layers of one KV head at head_dim 256 may spend 2.875 key bits: int(3 * 0.875 * 128 / 32)
    # = 10 metadata rows per chunk, i.e. two heads at 32 (4 rows each) and one at 64 (2 rows)
    errors = {layer: {32: torch.tensor([1.0 + e]), 64: torch.tensor([2.0 + e]), 128: torch.tensor([4.0 + e])}
              for layer, e in ((5, 0.3), (11, 0.1), (17, 0.2))}
    blocks = allocate_key_blocks(errors, config, choices, calibration.allocation_key_bits(config, 256))
    assert sorted(b for bl in blocks.values() for b in bl) == [32, 32, 64]
    g = torch.Generator().manual_seed(5)
    for trial in range(10):
        errors = {layer: {b: torch.rand(1, generator=g) * b for b in (32, 64, 128)} for layer in (0, 1, 2)}
        flat = [b for bl in allocate_key_blocks(errors, config, choices, 2.875).values() for b in bl]
        total = lambda c: sum(float(errors[l][b][0]) for l, b in zip((0, 1, 2), c))  # noqa: E731
        feasible = [c for c in itertools.product((32, 64, 128), repeat=3) if sum(128 // b for b in c) <= 10]
        assert sum(128 // b for b in flat) <= 10 and total(flat) == pytest.approx(min(map(total, feasible)), abs=1e-12)
    with pytest.raises(ValueError, match="below the coarsest key block"):
        allocate_key_blocks(errors, config, choices, 2.1)


def test_calibration_allocates_key_blocks_per_head_and_the_cache_uses_them(text_file, tmp_path, monkeypatch):
    import oscar_hf.calibrate as calibration

    model = tiny_model("llama", attn="sdpa")
    config = LAYOUT.replace(demotion_block=32, key_block=16)  # choices 16, 32, 8
    # the tiny model has 3 layers x 2 KV heads: too few to allocate between by default
    assert calibrate(model, char_tokenizer(), data=str(text_file), config=config, calibration=CAL,
                     progress=False).key_blocks is None
    # ... unless the budget exceeds key_block everywhere: then no head gives up bits, and it allocates within it
    d = model_geometry(model.config).head_dim
    richer = CAL.replace(allocation_history_bits=CAL.history_bits_per_element(config, d) + 0.25)
    rich = calibrate(model, char_tokenizer(), data=str(text_file), config=config, calibration=richer, progress=False)
    assert rich.key_blocks is not None
    info = rich.metadata["key_block_allocation"]
    assert info["budget_key_bits"] == pytest.approx(richer.allocation_key_bits(config, d), abs=1e-4)
    assert CAL.allocation_key_bits(config, d) < info["average_key_bits"] <= info["budget_key_bits"] + 1e-9
    monkeypatch.setattr(calibration, "MIN_ALLOCATION_HEADS", 6)
    rot = calibrate(model, char_tokenizer(), data=str(text_file), config=config, calibration=CAL, progress=False)
    assert set(rot.key_blocks) == set(rot.layers)
    blocks = [b for layer in rot.layers for b in rot.key_blocks[layer]]
    assert set(blocks) <= {8, 16, 32} and sum(32 // b for b in blocks) <= 2 * len(blocks)  # within the budget
    assert "key blocks per KV head (tokens): " in rot.report.summary()
    info = rot.metadata["key_block_allocation"]
    assert info["average_key_bits"] <= 2 + 32 / 16 + 1e-9 and set(info["errors"]["0"]) == {"8", "16", "32"}
    rot.save_pretrained(tmp_path)
    loaded = OscarRotations.from_pretrained(tmp_path)
    assert loaded.key_blocks == rot.key_blocks and loaded.layout["demotion_block"] == 32
    model.set_attn_implementation("oscar")
    cache = OscarCache(model, loaded)
    assert [cache.layers[l].fmt.keys.blocks for l in rot.layers] == [rot.key_blocks[l] for l in rot.layers]
    # another key budget than the file's allocation was made for: that budget everywhere, and a warning says so
    with pytest.warns(RuntimeWarning, match="key_block=32 vs 16"):
        coarser = OscarCache(model, loaded, config.replace(key_block=32))
    assert all(coarser.layers[l].fmt.keys.blocks == (32, 32) for l in rot.layers)


def test_retrieval_probe_scores_the_head_that_attends_to_the_token_after_the_earlier_occurrence():
    """`RetrievalProbe`: over [prefix | A | A], KV head 1's (only) query head looks up, from each token of the second
    A, the token after its first occurrence; KV head 0 attends uniformly. Head 1 scores ~1, head 0 ~1/n."""
    from oscar_hf.calibrate import RetrievalProbe
    from oscar_hf.models import model_geometry

    geometry = model_geometry(tiny_model("llama").config)
    span, prefix, d = 16, 1, 16
    n = prefix + 2 * span
    keys = torch.zeros(1, 2, n, d)
    queries = torch.zeros(1, 4, n, d)  # GQA 2: query heads 2, 3 belong to KV head 1
    for i in range(prefix + span, n - 1):
        target = i - span + 1
        keys[0, 1, target, target % d] = 1.0
        queries[0, 2, i, target % d] = 50.0  # a sharp lookup from query head 2
    probe = RetrievalProbe(geometry, prefix, span)
    probe.observe(0, queries, keys, keys, None, 1.0)
    probe.observe(2, queries, keys, keys, None, 1.0)
    scores = probe.scores
    assert set(scores) == {0, 2} and scores[0].shape == (2,)
    assert scores[0][1] > 0.95 and scores[0][0] < 0.1
    assert torch.allclose(scores[0], scores[2])


def test_wide_heads_fill_the_history_bit_budget_in_order_of_retrieval_score():
    from oscar_hf.calibrate import allocate_wide_heads

    config, budget = OscarConfig(), CalibrationConfig().wide_budget
    scores = {0: torch.tensor([0.1, 0.9, 0.2]), 1: torch.tensor([0.5, 0.0, 0.8]), 2: torch.tensor([0.3, 0.4, 0.05])}
    # head_dim 64: history 2.5 (keys 2.5, values 2.5), budget 2.75: int(0.25 * 9 / 2) = 1 wide head
    assert allocate_wide_heads(scores, config, 64, budget(64)) == {0: (2, 4, 2), 1: (2, 2, 2), 2: (2, 2, 2)}
    # a budget of 3.2: int(0.7 * 9 / 2) = 3
    assert allocate_wide_heads(scores, config, 64, 3.2) == {0: (2, 4, 2), 1: (4, 2, 4), 2: (2, 2, 2)}
    # finer key blocks already spend bits: (2.5 + 3 + 2.25 ... ) averaged, less left for wide heads
    blocks = {layer: (32, 32, 32) for layer in scores}  # keys 3 bits: history 2.75, nothing left at 2.75
    assert allocate_wide_heads(scores, config, 64, budget(64), blocks) is None
    assert allocate_wide_heads(scores, config, 128, budget(128)) is None  # 2.375 -> 2.4375: int(0.0625 * 9 / 2) = 0


def test_calibration_keeps_the_retrieval_heads_wide_and_the_cache_stores_them_at_4_bits(text_file, tmp_path):
    model = tiny_model("llama", attn="sdpa")
    # head_dim 16, key blocks of 16: keys 2 + 32/16 and values 2 + 32/16 bits, a history of 4
    config = LAYOUT.replace(demotion_block=16, key_block=16)
    calibration = CAL.replace(key_block_allocation="uniform")
    assert calibrate(model, char_tokenizer(), data=str(text_file), config=config, calibration=calibration,
                     progress=False).head_bits is None
    rot = calibrate(model, char_tokenizer(), data=str(text_file), config=config,
                    calibration=calibration.replace(wide_history_bits=4.75),
                    progress=False)  # int((4.75 - 4) * 6 / 2) = 2 of the 6 (layer, KV head)s
    assert sum(b == 4 for bits in rot.head_bits.values() for b in bits) == 2 and len(rot.wide_heads) == 2
    info = rot.metadata["wide_heads"]
    ranked = sorted(((s, (int(l), h)) for l, sc in info["scores"].items() for h, s in enumerate(sc)), reverse=True)
    assert sorted(rot.wide_heads) == sorted(u for _, u in ranked[:2])  # the two highest retrieval scores
    assert "wide heads at 4 bits (layer.head): " in rot.report.summary()
    rot.save_pretrained(tmp_path)
    loaded = OscarRotations.from_pretrained(tmp_path)
    assert loaded.head_bits == rot.head_bits
    model.set_attn_implementation("oscar")
    ids = torch.randint(3, VOCAB, (1, 80), generator=torch.Generator().manual_seed(2))
    errors = {}
    for name, cfg in (("wide", None), ("none", config.replace(group_size=8))):  # a layout that holds no wide head
        if cfg is None:
            cache = OscarCache(model, loaded, cfg)
        else:
            with pytest.warns(RuntimeWarning, match="4-bit wide heads are not stored by this layout"):
                cache = OscarCache(model, loaded, cfg)
        model(input_ids=ids, cache=cache)
        layer, head = loaded.wide_heads[0]
        exact = model(input_ids=ids, cache=DynamicCache(config=model.config)).past_key_values.layers[layer]
        keys, _ = cache.layers[layer].stored_states()
        stored = keys[:, head, 4:-24].float() @ cache.layers[layer].key_rotation[head].float().T
        errors[name] = (stored - exact.keys[:, head, 4:-24].float()).abs().mean().item()
        if name == "wide":
            assert cache.layers[layer].storage.keys.codes.shape[1] == 2 + len(
                [h for h in range(2) if loaded.head_bits[layer][h] == 4])
    assert errors["wide"] < errors["none"] / 3  # the wide head's history is 4-bit


def test_water_filling_gives_the_bits_to_channels_whose_queries_look_and_whose_keys_vary():
    """Greedy reverse water-filling at 2 bits per channel: a channel with query energy and key spread gets 4 bits, a
    channel no query reads (or whose keys are constant) gets 0; the budget is spent exactly and the order is
    [4-bit | 2-bit | 0-bit] with as many 0-bit channels as 4-bit ones."""
    from oscar_hf.calibrate import CHANNEL_WIDTHS, channel_width_errors, water_fill
    from oscar_hf.format import wide_channel_permutation as wide_channel_order

    g = torch.Generator().manual_seed(3)
    keys = torch.randn(1, 256, 8, generator=g) * torch.tensor([4.0, 1, 1, 1, 1, 1, 1, 1])
    keys[..., 5] = 0.5  # a constant channel: its block mean is exact
    errors = channel_width_errors(keys, (64,))[0]  # [d, widths]
    assert errors.shape == (8, len(CHANNEL_WIDTHS)) and errors[5, 0] < 1e-6 and (errors[:, 2] <= errors[:, 1]).all()
    weights = torch.tensor([1.0, 1, 1, 1, 1, 1, 1, 1e-6])  # nothing reads channel 7
    bits = water_fill(weights, errors, 16)
    assert bits.sum() == 16 and bits[0] == 4 and bits[5] == 0 and bits[7] == 0
    n, perm = wide_channel_order(bits)
    assert n == int((bits == 4).sum()) == int((bits == 0).sum())
    order = perm.argmax(0).tolist()  # stored slot i holds raw channel order[i]
    assert [int(bits[c]) for c in order] == sorted(bits.tolist(), reverse=True)
    assert torch.equal(perm @ perm.T, torch.eye(8, dtype=torch.float64))
    # an unspent budget leaves unpaired 0-bit channels, stored at 2 bits
    n, perm = wide_channel_order(torch.tensor([4, 0, 0, 0, 2, 2, 2, 2]))
    assert n == 1 and perm.argmax(0).tolist()[0] == 0 and perm.argmax(0).tolist()[-1] == 3
    # other widths (the experiments' 0..4): a 1-bit step worse than 0 bits is skipped, not taken
    errors = torch.tensor([[1.0, 2.0, 0.25, 0.1, 0.05], [1.0, 2.0, 0.5, 0.2, 0.1]])
    assert water_fill(torch.ones(2), errors, 4, widths=(0, 1, 2, 3, 4)).tolist() == [2, 2]
    with pytest.raises(ValueError, match="must start at 0"):
        water_fill(torch.ones(2), errors[:, 1:], 4, widths=(1, 2, 3, 4))


def test_calibration_water_fills_key_channels_and_the_cache_stores_them(text_file, tmp_path):
    """`key_channel_bits="fitted"`: each non-wide head's key rotation is the permutation that sorts its channels,
    the file keeps the counts (format 6), a cache built from the file alone uses them, and what it stores is each
    channel at its width (4-bit channels finer, 0-bit channels their block means)."""
    model = tiny_model("llama", attn="sdpa")
    config = LAYOUT.replace(demotion_block=16, key_block=16)
    rot = calibrate(model, char_tokenizer(), data=str(text_file), config=config,
                    calibration=CAL.replace(key_block_allocation="uniform"), progress=False)
    assert set(rot.key_wide_channels) == set(rot.layers) and any(n for c in rot.key_wide_channels.values() for n in c)
    for layer in rot.layers:
        r = rot.key_rotations[layer]
        assert torch.equal(r.sort(-1).values[..., -1], torch.ones(r.shape[:2]))  # one 1 per row: permutations
    assert "wide key channels:" in rot.report.summary()
    assert rot.metadata["key_channel_bits"]["widths"] == [0, 2, 4]
    rot.save_pretrained(tmp_path)
    loaded = OscarRotations.from_pretrained(tmp_path)
    assert loaded.key_wide_channels == rot.key_wide_channels
    model.set_attn_implementation("oscar")
    cache = OscarCache(model, loaded, config)
    ids = torch.randint(3, VOCAB, (1, 80), generator=torch.Generator().manual_seed(2))
    model(input_ids=ids, cache=cache)
    exact = model(input_ids=ids, cache=DynamicCache(config=model.config)).past_key_values
    layer = max(rot.layers, key=lambda l: max(rot.key_wide_channels[l]))
    head = max(range(2), key=lambda h: rot.key_wide_channels[layer][h])
    n = rot.key_wide_channels[layer][head]
    lay = cache.layers[layer]
    assert lay.fmt.keys.wide_channels[head] == n
    assert OscarCache(model, loaded).layers[layer].fmt.keys.wide_channels == rot.key_wide_channels[layer]  # the file's
    keys, _ = lay.stored_states()
    stored = keys[0, head, 4:68].float()  # the history: 4 chunks of 16 after the sink
    want = exact.layers[layer].keys[0, head, 4:68].float() @ lay.key_rotation[head].float()
    blocks = want.reshape(4, 16, -1)
    assert torch.allclose(stored[:, -n:], blocks[..., -n:].mean(1, keepdim=True).expand(-1, 16, -1).reshape(64, n),
                          atol=2e-2)  # 0-bit channels: block means (fp16 metadata, bf16-free float32 model)
    err = (stored - want).abs().mean(0)
    assert err[:n].mean() < err[n:-n].mean() / 2  # 4-bit channels against 2-bit ones
    with pytest.warns(RuntimeWarning, match="wide key channels are not stored by this layout"):
        OscarCache(model, loaded, config.replace(bits=4))


def test_errors_weigh_each_head_at_the_bits_it_stores():
    """`key_basis_errors`, `key_block_errors` and `clip_errors` score a wide head's keys and values at 4 bits and the
    other heads at the layout's 2: on a layer of two identical KV heads, head bits (2, 4) give head 0 the errors of a
    2-bit layout and head 1 those of a 4-bit one (and `clip_errors`, which sums the layer, their mean, the 4-bit
    head's values unclipped at every ratio)."""
    from oscar_hf.calibrate import clip_errors, key_basis_errors, key_block_errors

    g = torch.Generator().manual_seed(4)
    t, d = 96, 16
    query = torch.randn(2, t, d, generator=g).repeat(2, 1, 1)  # GQA 2: both KV heads see the same two query heads
    key = (torch.randn(1, t, d, generator=g) * torch.rand(d, generator=g) * 3).repeat(2, 1, 1)
    value = torch.randn(1, t, d, generator=g).repeat(2, 1, 1)
    eye, scale = torch.eye(d).expand(2, d, d), d ** -0.5
    two = OscarConfig(sink_tokens=4, window_tokens=8, demotion_block=16, key_block=8)
    four = two.replace(bits=4)
    mixed = key_basis_errors(query, key, value, {"stored": eye}, scale, two, (2, 4))["stored"]
    low = key_basis_errors(query, key, value, {"stored": eye}, scale, two)["stored"]
    high = key_basis_errors(query, key, value, {"stored": eye}, scale, four)["stored"]
    assert mixed[0] == low[0] and mixed[1] == pytest.approx(high[1].item(), rel=1e-5) and mixed[1] < low[1] / 4
    mixed = key_block_errors(query, key, value, eye, scale, two, (8, 16), (2, 4))
    high = key_block_errors(query, key, value, eye, scale, four, (8, 16))
    assert all(mixed[b][1] == pytest.approx(high[b][1].item(), rel=1e-5) for b in (8, 16))
    ratios = (0.8, 1.0)
    mixed = clip_errors(query, key, value, eye, eye, scale, two, ratios, (2, 4))
    low, high = clip_errors(query, key, value, eye, eye, scale, two, ratios), clip_errors(
        query, key, value, eye, eye, scale, four, ratios)
    assert [mixed["key"][r] for r in ratios] == pytest.approx(  # channel-wise keys: no clip
        [(low["key"][r] + high["key"][r]) / 2 for r in ratios], rel=1e-5)
    assert [mixed["value"][r] for r in ratios] == pytest.approx(  # the wide head's values are stored unclipped
        [(low["value"][r] + high["value"][1.0]) / 2 for r in ratios], rel=1e-5)
    assert high["value"][0.8] > high["value"][1.0]


@pytest.fixture(scope="module")
def fitted_per_head(tmp_path_factory):
    """A tiny model's calibration that allocates key blocks, keeps two retrieval heads wide and water-fills the other
    heads' key channels: `(rotations, config, {layer: (query, key, value, scale)} of the held-out tokens)`."""
    path = tmp_path_factory.mktemp("calibration") / "calib.txt"
    path.write_text(TEXT)
    model, tok = tiny_model("llama", attn="sdpa"), char_tokenizer()
    config = LAYOUT.replace(demotion_block=32, key_block=16)  # key block choices 8, 16 and 32
    # a key budget above key_block everywhere (so that the six KV heads allocate), and two wide heads on top of it
    budget = CAL.history_bits_per_element(config, 16) + 0.25
    calibration = CAL.replace(allocation_history_bits=budget, wide_history_bits=budget + 0.75)
    rotations = calibrate(model, tok, data=str(path), config=config, calibration=calibration, progress=False)
    _, heldout, _ = calibration_sequences(tok, calibration, str(path))
    recorder = StatisticsCollector(model_geometry(model.config))
    recorder.record = {}
    with capturing(model, recorder), torch.no_grad():
        model(input_ids=heldout[0][None], use_cache=False)
    return rotations, config, recorder.record


def _value_errors(query, key, value, scale, config, head_bits, ratios) -> dict[float, float]:
    """Relative attention-output error of a layer's values `[H, T, d]` (rotated) stored token-wise, head h quantized
    at head_bits[h] (clipped at each ratio if 2-bit, unclipped if 4-bit): the held-out queries that see history,
    keys exact."""
    h, t, d = value.shape
    i, j = torch.arange(t)[:, None], torch.arange(t)[None]
    causal = j <= i
    history = causal & (j >= config.sink_tokens) & (i - j > config.window_tokens)
    rows = history.any(1)
    scores = torch.einsum("hgid,hjd->hgij", query.reshape(h, -1, t, d)[:, :, rows], key) * scale
    probs = torch.softmax(scores.masked_fill(~causal[rows], float("-inf")), -1)
    norm = torch.einsum("hgij,hjd->hgid", probs, value).square().sum()
    errors = {}
    for ratio in ratios:
        delta = torch.stack([fake_quantize(value[x], head_bits[x], d, ratio if head_bits[x] == 2 else 1.0) - value[x]
                             for x in range(h)])
        errors[ratio] = (torch.einsum("hgij,hjd->hgid", probs * history[rows], delta).square().sum() / norm).item()
    return errors


def test_value_clips_are_fitted_on_what_each_head_stores(fitted_per_head):
    """A layer's one value clip is the grid ratio with the least held-out error of the values as every head stores
    them: the wide heads at 4 bits and unclipped, the others clipped at 2. Recomputed head by head with
    `fake_quantize`; fitting every head at 2 bits would choose another clip in some layer."""
    from oscar_hf.calibrate import best_ratio

    rot, config, record = fitted_per_head
    assert sum(b == 4 for bits in rot.head_bits.values() for b in bits) == 2
    grid, moved = CAL.clip_grid, False
    for layer in rot.layers:
        q, k, v, scale = record[layer]
        v = v @ rot.value_rotations[layer]
        errors = _value_errors(q, k, v, scale, config, rot.head_bits[layer], grid)
        recorded = rot.metadata["clip_fit"]["errors"][str(layer)]["value"]
        assert [recorded[str(r)] for r in grid] == pytest.approx([errors[r] for r in grid], rel=1e-4)
        assert rot.value_clips[layer] == best_ratio(errors)
        moved |= best_ratio(_value_errors(q, k, v, scale, config, (2, 2), grid)) != rot.value_clips[layer]
    assert moved


def test_key_blocks_are_allocated_on_the_bits_each_head_stores(fitted_per_head):
    """The key block errors the allocation weighs are those of each head's keys as stored: a wide head's at 4 bits in
    its chosen basis, a 2-bit head's at 2 bits in its raw channels (their order by width comes after)."""
    from oscar_hf.calibrate import key_block_errors

    rot, config, record = fitted_per_head
    info = rot.metadata["key_block_allocation"]
    choices = info["choices"]
    for layer in rot.layers:
        q, k, v, scale = record[layer]
        bits = rot.head_bits[layer]
        basis = torch.stack([r if b == 4 else torch.eye(16) for r, b in zip(rot.key_rotations[layer], bits)])
        want = {b: key_block_errors(q, k, v, basis, scale, config.replace(bits=b), choices) for b in (2, 4)}
        for head, b in enumerate(bits):
            assert [info["errors"][str(layer)][str(c)][head] for c in choices] == pytest.approx(
                [want[b][c][head].item() for c in choices], rel=1e-5)


def test_key_channel_widths_are_fitted_over_each_heads_allocated_key_blocks(fitted_per_head):
    """A 2-bit head's key channel widths weigh its keys' errors over the key blocks it was allocated, not key_block
    (recomputed from the held-out tokens; key_block everywhere would give other widths)."""
    from oscar_hf.calibrate import allocate_wide_channels

    rot, config, record = fitted_per_head
    assert any(b != config.key_block for blocks in rot.key_blocks.values() for b in blocks)
    recorded = rot.metadata["key_channel_bits"]["channel_widths"]
    moved = False
    for layer in rot.layers:
        q, k, _, _ = record[layer]
        counts, _, widths = allocate_wide_channels(q, k, rot.key_blocks[layer], config, rot.head_bits[layer])
        assert torch.equal(torch.tensor(recorded[str(layer)]), widths) and rot.key_wide_channels[layer] == counts
        uniform = allocate_wide_channels(q, k, (config.key_block,) * 2, config, rot.head_bits[layer])[2]
        moved |= not torch.equal(uniform, widths)
    assert moved


def test_calibration_data_can_be_a_list_of_strings_and_bad_data_is_named():
    """From Python, documents in memory calibrate like a file of them; anything else gets a one-line error (a list
    used to be taken for a path: 'File name too long')."""
    from oscar_hf.data import load_texts

    docs, info = load_texts([TEXT, "  ", TEXT[:100]])
    assert docs == [TEXT, TEXT[:100]] and info["documents"] == 2 and len(info["sha256"]) == 64
    for bad in ([], ["", " "], [TEXT, 3]):
        with pytest.raises(ValueError, match="non-empty list of non-empty strings"):
            load_texts(bad)
    with pytest.raises(TypeError, match="not int"):
        load_texts(3)
    model = tiny_model("llama", attn="sdpa")
    rot = calibrate(model, char_tokenizer(), data=[TEXT], config=LAYOUT, calibration=CAL, progress=False)
    assert rot.metadata["calibration"]["data"]["source"] == "in-memory documents"
