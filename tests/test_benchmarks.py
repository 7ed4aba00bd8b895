"""The generate benchmark as a CPU smoke run on a tiny Qwen3 (the numbers mean nothing here; the run checks that every
method goes through `model.generate` and that each speed row records what docs/benchmarks.md reads from it)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_generate_kernel_table(tmp_path):
    """The `kernels` section (per decode step: which kernels a compiled step launches, how long): on the CPU the
    table lists CPU ops, so only its shape is checked here. The `runtime` section (host side of an eager step): its
    table of runtime calls, on a dynamic cache too (a new one per call: a dynamic cache only grows)."""
    out = tmp_path / "gpu"
    methods = ["oscar-static-eager", "oscar-eager"]
    subprocess.run([sys.executable, str(REPO / "eval" / "bench_generate.py"), "--out", str(out), "--sections",
                    "kernels,runtime", "--archs", "tiny", "--points", "300x1", "--new-tokens", "4", "--methods",
                    ",".join(methods)],
                   check=True, cwd=tmp_path, timeout=600, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    result = json.loads((out / "bench_generate.json").read_text())
    for section in ("kernels", "runtime"):
        rows = result[section]
        assert [r["method"] for r in rows] == methods and all(r["launches_per_step"] > 0 for r in rows)
        for m in methods:
            assert (out / f"{section}_{m}.txt").read_text().startswith(f"{m} tiny L=300 B=1")
    assert all(set(r["wall_ms"]) == {"gc on", "gc off"} for r in result["runtime"])


def test_bench_generate_smoke(tmp_path):
    out = tmp_path / "gpu"
    methods = "bf16-eager,bf16-static,oscar-eager,oscar-static-eager,oscar-static,oscar-static-format5"
    subprocess.run([sys.executable, str(REPO / "eval" / "bench_generate.py"), "--out", str(out), "--sections", "speed",
                    "--archs", "tiny", "--points", "600x2", "--new-tokens", "6", "--rounds", "1", "--methods", methods],
                   check=True, cwd=tmp_path, timeout=600, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    result = json.loads((out / "bench_generate.json").read_text())
    row = result["speed"][0]
    for m in methods.split(","):  # every method went through generate; on a busy CPU a tiny model's timing may be noise
        if f"{m}_tokens_per_s" in row:
            assert row[f"{m}_tokens_per_s"] > 0 and row[f"{m}_roofline_ms"] > 0 and row[f"{m}_ms_per_step"] > 0
        else:
            assert row["skipped"][m].startswith("timing noise"), row["skipped"]
    assert row["format"].startswith("6 (") and "key channels wide" in row["format"]  # the default storage format
    # what a figure in docs/benchmarks.md needs beside it: the point, the protocol, the versions and the command (the
    # card too, on CUDA)
    assert (row["arch"], row["length"], row["batch"], row["new_tokens"], row["rounds"]) == ("tiny", 600, 2, 6, 1)
    environment = result["environment"]
    assert {"torch", "transformers"} <= set(environment) and "--points 600x2" in environment["command"]


def test_bench_generate_per_call_protocol(tmp_path):
    """The `per-call` section (a fresh cache and a real prefill in every call, static caches too): each method's first
    token and decode step, in rows of their own beside the speed rows."""
    out = tmp_path / "gpu"
    methods = "bf16-static,oscar-eager,oscar-static-eager"
    subprocess.run([sys.executable, str(REPO / "eval" / "bench_generate.py"), "--out", str(out), "--sections",
                    "per-call", "--archs", "tiny", "--points", "300x1", "--new-tokens", "4", "--rounds", "1",
                    "--methods", methods],
                   check=True, cwd=tmp_path, timeout=600, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    result = json.loads((out / "bench_generate.json").read_text())
    assert "errors" not in result and "speed" not in result
    (row,) = result["per_call"]
    assert (row["arch"], row["length"], row["batch"], row["protocol"]) == ("tiny", 300, 1, "per-call")
    for m in methods.split(","):
        assert row[f"{m}_first_token_s"] > 0 and row[f"{m}_roofline_ms"] > 0
        assert row.get(f"{m}_ms_per_step", 0) > 0 or row["skipped"][m].startswith("timing noise"), row["skipped"]
