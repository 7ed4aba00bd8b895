"""Triton kernels against their torch twins. On the CPU they run in the Triton interpreter (TRITON_INTERPRET=1,
set by conftest), at small shapes; eval/check_kernels_gpu.py runs the same checks at realistic shapes on a GPU.
Fresh random inputs per case, outputs poisoned before each run, tolerances scaled by the reference's own error."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oscar_hf.ops import quantize_pack_reference, segment_attention_reference
from test_attention import random_segments

kernels = pytest.importorskip("oscar_hf.kernels", reason="Triton is not installed")
from oscar_hf.kernels.attention import segment_attention_triton  # noqa: E402


def _poisoned(b, h, cap, d, groups, meta_dtype=torch.float16):
    codes = torch.full((b, h, cap, d // 4), 0xAA, dtype=torch.uint8)
    meta = torch.full((b, h, cap, groups, 2), float("nan"), dtype=meta_dtype)
    return codes, meta


@pytest.mark.parametrize("d,groups,ratio,rotate,dtype", [
    (64, 1, 0.9, False, torch.bfloat16),
    (128, 1, 1.0, True, torch.bfloat16),
    (128, 2, 0.96, True, torch.float16),
    (64, 4, 0.8, False, torch.float16),
])
def test_quantize_pack_matches_the_torch_twin(d, groups, ratio, rotate, dtype):
    g = torch.Generator().manual_seed(d + groups)
    b, h, n, start, cap = 2, 2, 37, 5, 50
    x = (torch.randn(b, h, n, d, generator=g) * 3).to(dtype)
    rotation = torch.linalg.qr(torch.randn(h, d, d, generator=g))[0].to(dtype) if rotate else None
    ref_codes, ref_meta = _poisoned(b, h, cap, d, groups)
    quantize_pack_reference(x, rotation, ratio, ref_codes, ref_meta, start)
    codes, meta = _poisoned(b, h, cap, d, groups)
    torch.ops.oscar.quantize_pack(x, rotation, ratio, codes, meta, start)
    # rows outside [start, start + n) are untouched, rows inside are all written
    assert (codes[:, :, :start] == 0xAA).all() and (codes[:, :, start + n:] == 0xAA).all()
    assert torch.isnan(meta[:, :, start + n:]).all() and not torch.isnan(meta[:, :, start : start + n]).any()
    from oscar_hf.quant import unpack_2bit_u8

    a, r = unpack_2bit_u8(codes[:, :, start : start + n]).int(), unpack_2bit_u8(ref_codes[:, :, start : start + n]).int()
    differ = (a != r).float().mean().item()
    # identical up to rounding ties and (when rotating) the last bit of the rotated value
    assert differ <= (0.01 if rotate else 0.0005) and (a - r).abs().max() <= 1
    assert torch.allclose(meta[:, :, start : start + n].float(), ref_meta[:, :, start : start + n].float(), rtol=1e-2, atol=1e-3)


def _lowp_reference(args):
    """The twin at the kernel's precision (bf16 probabilities): its error sets the tolerance scale."""
    out, _ = segment_attention_reference(*args, emulate_bf16=True)
    return out.double()


@pytest.mark.parametrize("case", [
    dict(t=1, g=4, d=128),                       # decode, GQA 4
    dict(t=1, g=8, d=64, nh=200),                # decode, GQA 8, several history tiles
    dict(t=5, g=2, d=64, groups=2),              # a short chunk, two scale groups per row
    dict(t=3, g=1, d=128, ne=70, nr=4, groups=4),  # a long chunk in the extra segment, causal inside it
    dict(t=1, g=4, d=64, nh=0, mask=False),      # no history yet
])
def test_segment_attention_kernel_matches_the_twin(case):
    for seed in range(2):
        args, (ref, ref_lse) = random_segments(dtype=torch.bfloat16, seed=seed, **case)
        out, lse = torch.ops.oscar.segment_attention(*args)
        assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
        valid = torch.isfinite(ref_lse)
        err = (out.double() - ref)[valid].abs().max().item()
        lowp_err = (_lowp_reference(args) - ref)[valid].abs().max().item()
        assert err <= 3 * lowp_err + 1e-2, (err, lowp_err)
        assert torch.allclose(lse.double()[valid], ref_lse[valid], atol=5e-2)
        assert (out[~valid.expand_as(out[..., 0])] == 0).all() if not valid.all() else True


def test_many_splits_merge_exactly():
    args, (ref, ref_lse) = random_segments(t=1, g=4, d=64, nh=300, dtype=torch.bfloat16, seed=3)
    one, lse1 = segment_attention_triton(*args, target_programs=1)
    many, lse2 = segment_attention_triton(*args, block_n=16, target_programs=64)
    assert torch.allclose(one.float(), many.float(), atol=2e-2)
    assert torch.allclose(lse1, lse2, atol=1e-3)


def test_custom_ops_have_consistent_fake_implementations():
    args, _ = random_segments(t=1, g=2, d=64, nh=20, dtype=torch.bfloat16, seed=4)
    torch.library.opcheck(torch.ops.oscar.segment_attention.default, args, test_utils=("test_schema", "test_faketensor"))
    x = torch.randn(1, 1, 8, 64, dtype=torch.bfloat16)
    codes, meta = _poisoned(1, 1, 8, 64, 1)
    torch.library.opcheck(torch.ops.oscar.quantize_pack.default, (x, None, 0.9, codes, meta, 0),
                          test_utils=("test_schema", "test_faketensor"))


def test_a_model_through_the_kernels_matches_the_torch_path(monkeypatch):
    from conftest import VOCAB, tiny_model
    from oscar_hf import OscarCache, OscarConfig, OscarRotations

    ids = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    logits = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("OSCAR_HF_KERNELS", mode)
        model = tiny_model("llama", dtype=torch.bfloat16, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=64, num_hidden_layers=2)
        cache = OscarCache(model, OscarRotations.data_free(model, "hadamard"),
                           OscarConfig(sink_tokens=4, window_tokens=8, demotion_block=4, key_clip=0.9, value_clip="none"))
        out = []
        for a, b in [(0, 25), (25, 26), (26, 27), (27, 40)]:
            out.append(model(input_ids=ids[:, a:b], attention_mask=mask[:, :b], past_key_values=cache).logits.float())
        logits[mode] = torch.cat(out, 1)
    ref = logits["0"]
    assert (logits["1"] - ref).abs().max() / ref.abs().max() < 0.05


def test_transformers_imports_cleanly_from_the_repository_root():
    """From the checkout's root, `kernels` resolves to this folder; it must stay inert so transformers' probe for
    Hugging Face's `kernels` package neither crashes nor believes it is installed."""
    repo = Path(__file__).resolve().parents[1]
    code = ("import kernels, transformers.integrations.hub_kernels as hk; "
            "print(hk.is_kernels_available(), hasattr(kernels, 'segment_attention'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_the_kernels_folder_does_not_shadow_huggingface_kernels(tmp_path):
    code = ("import importlib.util, oscar_hf.kernels as k; s = importlib.util.find_spec('kernels'); "
            "print(k.__name__); print(s.origin if s else None)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "oscar_hf.kernels"
    repo = Path(__file__).resolve().parents[1]
    assert out[1] == "None" or not out[1].startswith(str(repo)), out
