"""OscarCache under transformers' tensor parallelism (`tp_plan="auto"`), on two CPU processes (torchrun, gloo):
each rank's cache holds its own KV heads with those heads' rotations, key means and per-head refinements (key blocks,
wide heads, wide key channels), and generates the tokens of a single process. Per-head rotations, means and
refinements differ here, so a wrong slice would change the logits (checked: the same file in reverse head order does).

One single-process run and one torchrun launch (`tp_worker.py`) serve both cases: data-free-style random rotations
with key means on 2 KV heads, and a calibrated-style file on 4 KV heads (two per rank)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_model
from oscar_hf import OscarConfig, OscarRotations
from oscar_hf.models import UnsupportedModelError, kv_head_shards

HERE = Path(__file__).resolve().parent
needs_distributed = pytest.mark.skipif(not torch.distributed.is_available(),
                                       reason="torch built without torch.distributed")


def _random_rotations(model, seed=0):
    rot = OscarRotations.data_free(model, "hadamard")
    g = torch.Generator().manual_seed(seed)
    h, d = model.config.num_key_value_heads, model.config.head_dim
    for layer in rot.layers:
        rot.key_rotations[layer] = torch.linalg.qr(torch.randn(h, d, d, generator=g))[0]
        rot.value_rotations[layer] = torch.linalg.qr(torch.randn(h, d, d, generator=g))[0]
    rot.key_means = {layer: torch.randn(h, d, generator=g) for layer in rot.layers}
    return rot


# A calibrated file's per-head refinements on 4 KV heads (rank 0 holds heads 0, 1; rank 1 heads 2, 3), different in
# every layer and every head: key blocks in chunks of 8, wide (4-bit) heads, wide key channels (0 for wide heads).
REFINED_LAYOUT = {"key_granularity": "channel", "demotion_block": 8, "key_block": 8, "key_block_allocation": "fitted"}
KEY_BLOCKS = {0: (8, 4, 4, 8), 1: (4, 8, 8, 4), 2: (8, 8, 4, 4)}
HEAD_BITS = {0: (2, 2, 4, 2), 1: (2, 4, 2, 2), 2: (4, 2, 2, 4)}
WIDE_CHANNELS = {0: (3, 1, 0, 5), 1: (2, 0, 6, 4), 2: (0, 7, 3, 0)}
VALUE_CLIPS = {0: 0.8, 1: 0.9, 2: 0.95}


def _refined_rotations(model, seed=1):
    rot = _random_rotations(model, seed)
    return OscarRotations(rot.geometry, rot.key_rotations, rot.value_rotations, value_clips=VALUE_CLIPS,
                          metadata=rot.metadata, key_means=rot.key_means, layout=REFINED_LAYOUT, key_blocks=KEY_BLOCKS,
                          head_bits=HEAD_BITS, key_wide_channels=WIDE_CHANNELS)


def _run(tmp_path, cases, nproc):
    """Runs tp_worker.py on `cases` in `nproc` processes; returns each rank's record."""
    out = tmp_path / f"record_{nproc}"
    cmd = [sys.executable, str(HERE / "tp_worker.py"), str(cases), str(out)]
    if nproc > 1:
        torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
        cmd = [torchrun, "--nproc-per-node", str(nproc), "--master-port", "29533"] + cmd[1:]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    """(the single process's record, both ranks' records) for both cases, from one run each."""
    tmp = tmp_path_factory.mktemp("tp")
    model = tiny_model("qwen3", attn="sdpa", num_key_value_heads=2, num_attention_heads=4)
    model.save_pretrained(tmp / "model")
    _random_rotations(model).save_pretrained(tmp / "rotations")
    OscarConfig(sink_tokens=4, window_tokens=8, demotion_block=4, key_block=4, value_clip=0.95).save(
        tmp / "config.json")
    refined = tiny_model("qwen3", attn="sdpa", num_key_value_heads=4, num_attention_heads=8, seed=1)
    refined.save_pretrained(tmp / "refined_model")
    _refined_rotations(refined).save_pretrained(tmp / "refined_rotations")
    OscarConfig(sink_tokens=4, window_tokens=8, demotion_block=8, key_block=8, value_clip="fitted").save(
        tmp / "refined_config.json")
    cases = [{"name": "random", "model": str(tmp / "model"), "rotations": str(tmp / "rotations"),
              "config": str(tmp / "config.json")},
             {"name": "refined", "model": str(tmp / "refined_model"), "rotations": str(tmp / "refined_rotations"),
              "config": str(tmp / "refined_config.json"), "sensitivity": True}]
    (tmp / "cases.json").write_text(json.dumps(cases))
    return _run(tmp, tmp / "cases.json", 1)[0], _run(tmp, tmp / "cases.json", 2)


@needs_distributed
def test_tensor_parallel_generate_equals_one_process(tp_runs):
    one, two = tp_runs[0]["random"], tp_runs[1][0]["random"]
    assert one["dynamic_local_heads"] == 2 and two["dynamic_local_heads"] == 1 and two["static_local_heads"] == 1
    assert two["dynamic"] == one["dynamic"] and two["static"] == one["static"]
    want = torch.tensor(one["dynamic_logits"])
    for kind in ("dynamic", "static"):  # and the logits, to float32 rounding (the sharded o_proj sums in another order)
        assert (torch.tensor(two[f"{kind}_logits"]) - want).abs().max() <= 1e-4 * want.abs().max()


def _local_wide_rows(bits):
    """The codes row of each local head's low plane: local H + j for the j-th wide head here, -1 otherwise."""
    rows, extra = [], len(bits)
    for b in bits:
        rows.append(extra if b == 4 else -1)
        extra += b == 4
    return rows if extra > len(bits) else []


@needs_distributed
def test_tensor_parallel_ranks_hold_their_heads_slices_of_a_calibrated_file(tp_runs):
    """Per-head key blocks, wide heads and wide key channels that differ per head: each rank's layers hold its own
    heads' slices (format = `format.resolve` on the shard; rotations and key means = the rank's rows), and the sharded
    model generates the single process's tokens, token for token, with quantization on (history blocks written)."""
    one, ranks = tp_runs[0]["refined"], [r["refined"] for r in tp_runs[1]]
    for kind in ("dynamic", "static"):
        assert one[f"{kind}_history_rows"] >= 24  # 52 tokens, sink 4, window 8: the 2-bit history is in use
        for layer, held in one[f"{kind}_layers"].items():  # one process holds everything
            layer = int(layer)
            assert (held["first_head"], held["heads"]) == (0, 4)
            assert held["key_blocks"] == list(KEY_BLOCKS[layer]) and held["wide_channels"] == list(WIDE_CHANNELS[layer])
            assert held["wide_rows"] == held["value_wide_rows"] == _local_wide_rows(HEAD_BITS[layer])
        for rank, record in enumerate(ranks):
            assert record[f"{kind}_local_heads"] == 2
            assert record[kind] == one[kind], (kind, rank)  # the tokens of one process
            for layer, held in record[f"{kind}_layers"].items():
                layer, mine = int(layer), slice(2 * rank, 2 * rank + 2)
                assert (held["first_head"], held["heads"]) == (2 * rank, 2), (kind, rank, layer)
                assert held["key_blocks"] == list(KEY_BLOCKS[layer][mine]), (kind, rank, layer)
                assert held["wide_channels"] == list(WIDE_CHANNELS[layer][mine]), (kind, rank, layer)
                assert held["wide_rows"] == held["value_wide_rows"] == _local_wide_rows(HEAD_BITS[layer][mine])
                assert held["value_clip"] == VALUE_CLIPS[layer]
                assert held["format_is_resolve_on_shard"], (kind, rank, layer)
                assert held["key_rotation_rows"] and held["value_rotation_rows"] and held["key_mean_rows"]
    # The logits agree to float32 rounding (the sharded o_proj sums in another order), far closer than those of the
    # same file with its heads in reverse order: what a rank holding another rank's slice would compute (this tiny
    # model's greedy tokens, repetitive, do not always show it).
    want = torch.tensor(one["dynamic_logits"])
    scale = want.abs().max()
    for record in ranks:
        for kind in ("dynamic", "static"):
            assert (torch.tensor(record[f"{kind}_logits"]) - want).abs().max() <= 1e-4 * scale
    assert (torch.tensor(one["reversed_heads_logits"]) - want).abs().max() > 1e-2 * scale


def test_shards_that_split_a_head_are_refused():
    """A k_proj sharded into a number of rows that is not whole KV heads (here: a plain weight with 24 of 32 rows,
    as a rank's local shard) is refused by name."""
    model = tiny_model("qwen3", num_key_value_heads=2, num_attention_heads=4)
    assert kv_head_shards(model, 16, 2) == {}
    k = model.model.layers[0].self_attn.k_proj
    k.weight = torch.nn.Parameter(k.weight[:24])
    with pytest.raises(UnsupportedModelError, match="whole KV heads"):
        kv_head_shards(model, 16, 2)


@needs_distributed
@pytest.mark.parametrize("dims,tp_rank", [(("tp", "dp"), 0), (("dp", "tp"), 1)])
def test_shards_follow_the_tp_coordinate_wherever_tp_sits_in_the_mesh(dims, tp_rank):
    """Suspected, confirmed for plain (local-tensor) shards: global rank 1 of a 2x2 mesh is TP rank 0 when TP is the
    outer dimension, where `global_rank % tp_size` (7f7ff3d) said 1 and gave this rank the other rank's KV heads; the
    rank is now read on the mesh's "tp" dimension. DTensor weights (transformers 5.2x) were right all along: their
    offset comes from the mesh coordinate. One process plays rank 1 of 4 (torch's fake process group)."""
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg",
                                  reason="torch's fake process group (a testing module) is not in this build")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.distributed.init_process_group("fake", rank=1, world_size=4, store=fake_pg.FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=dims)
        expected = {layer: (tp_rank, 1) for layer in range(3)}
        plain = tiny_model("qwen3", num_key_value_heads=2, num_attention_heads=4)
        for layer in plain.model.layers:
            k = layer.self_attn.k_proj
            k.weight = torch.nn.Parameter(k.weight[16 * tp_rank : 16 * (tp_rank + 1)])  # this rank's local rows
        plain._tp_size, plain._device_mesh = 2, mesh
        assert kv_head_shards(plain, 16, 2) == expected
        dtensors = tiny_model("qwen3", num_key_value_heads=2, num_attention_heads=4)
        for layer in dtensors.model.layers:
            k = layer.self_attn.k_proj
            k.weight = torch.nn.Parameter(distribute_tensor(k.weight.detach(), mesh["tp"], [Shard(0)], src_data_rank=None))
        assert kv_head_shards(dtensors, 16, 2) == expected
    finally:
        torch.distributed.destroy_process_group()
