"""Per-layer diagnostics and `oscar-hf report` on tiny random models."""

import json

import torch

from conftest import char_tokenizer, tiny_model
from oscar_hf.evaluation.diagnostics import format_table, layer_errors
from oscar_hf.evaluation.methods import Method, Windows, main_methods


def test_bf16_has_no_error_and_quantization_has_some():
    model = tiny_model("llama")
    ids = [torch.randint(4, 100, (400,))]
    methods = {k: v for k, v in main_methods(Windows(16, 32, 32)).items() if k in ("naive-int2", "naive-int4")}
    methods["same"] = Method("same", "BF16 again", "bf16")
    res = layer_errors(model, ids, methods, {}, context=320, chunk=64)
    assert res["same"]["mean_attention_kl"] < 1e-6 and res["same"]["logits_kl"] < 1e-6
    assert all(row["key_error"] == 0 for row in res["same"]["layers"])
    for name in ("naive-int2", "naive-int4"):
        assert len(res[name]["layers"]) == 3
        assert all(row["attention_kl"] > 0 and row["key_error"] > 0 for row in res[name]["layers"])
    # INT4 is closer to BF16 than INT2, layer by layer
    for a, b in zip(res["naive-int4"]["layers"], res["naive-int2"]["layers"]):
        assert a["key_error"] < b["key_error"] and a["attention_kl"] < b["attention_kl"]
    assert "naive-int2" in format_table(res)


def test_sliding_layers_are_marked_and_exact_in_the_storage():
    model = tiny_model("gemma3")
    res = layer_errors(model, [torch.randint(4, 100, (300,))], {"naive-int2": main_methods(Windows(8, 16, 32))["naive-int2"]},
                       {}, context=240, chunk=32)
    rows = res["naive-int2"]["layers"]
    assert [r["sliding"] for r in rows] == [True, False, True, False]
    assert rows[0]["key_error"] == 0 and rows[1]["key_error"] > 0


def test_report_command(tmp_path):
    from oscar_hf.cli import main

    model = tiny_model("llama", attn="sdpa")
    model.save_pretrained(tmp_path / "m")
    char_tokenizer().save_pretrained(tmp_path / "m")
    data = tmp_path / "data.txt"
    data.write_text("Some text of my own, about caches and quantization. " * 60)
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    assert main(["report", "--model", str(tmp_path / "m"), "--methods", "naive-int2,hadamard-int2", "--data", str(data),
                 "--context", "320", "--chunk", "32", "--sequences", "1", "--dtype", "float32",
                 "--output", str(out), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"naive-int2", "hadamard-int2"} and png.stat().st_size > 0
