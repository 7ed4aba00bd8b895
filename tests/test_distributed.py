"""OscarCache under transformers' tensor parallelism (`tp_plan="auto"`), on two CPU processes (torchrun, gloo):
each rank's cache holds its own KV heads with those heads' rotations and key means, and generates the tokens of a
single process. Per-head rotations and means differ here, so a wrong slice would change the tokens."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_model
from oscar_hf import OscarRotations
from oscar_hf.models import UnsupportedModelError, kv_head_shards

HERE = Path(__file__).resolve().parent


def _random_rotations(model, seed=0):
    rot = OscarRotations.data_free(model, "hadamard")
    g = torch.Generator().manual_seed(seed)
    h, d = model.config.num_key_value_heads, model.config.head_dim
    for layer in rot.layers:
        rot.key_rotations[layer] = torch.linalg.qr(torch.randn(h, d, d, generator=g))[0]
        rot.value_rotations[layer] = torch.linalg.qr(torch.randn(h, d, d, generator=g))[0]
    rot.key_means = {layer: torch.randn(h, d, generator=g) for layer in rot.layers}
    return rot


def _run(tmp_path, nproc):
    out = tmp_path / f"tokens_{nproc}.json"
    cmd = [sys.executable, str(HERE / "tp_worker.py"), str(tmp_path / "model"), str(tmp_path / "rotations"), str(out)]
    if nproc > 1:
        torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
        cmd = [torchrun, "--nproc-per-node", str(nproc), "--master-port", "29533"] + cmd[1:]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without torch.distributed")
def test_tensor_parallel_generate_equals_one_process(tmp_path):
    model = tiny_model("qwen3", attn="sdpa", num_key_value_heads=2, num_attention_heads=4)
    model.save_pretrained(tmp_path / "model")
    _random_rotations(model).save_pretrained(tmp_path / "rotations")
    one, two = _run(tmp_path, 1), _run(tmp_path, 2)
    assert one["dynamic_local_heads"] == 2 and two["dynamic_local_heads"] == 1 and two["static_local_heads"] == 1
    assert two["dynamic"] == one["dynamic"] and two["static"] == one["static"]


def test_shards_that_split_a_head_are_refused():
    """A k_proj sharded into a number of rows that is not whole KV heads (here: a plain weight with 24 of 32 rows,
    as a rank's local shard) is refused by name."""
    model = tiny_model("qwen3", num_key_value_heads=2, num_attention_heads=4)
    assert kv_head_shards(model, 16, 2) == {}
    k = model.model.layers[0].self_attn.k_proj
    k.weight = torch.nn.Parameter(k.weight[:24])
    with pytest.raises(UnsupportedModelError, match="whole KV heads"):
        kv_head_shards(model, 16, 2)
