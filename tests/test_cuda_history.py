"""The CUDA history kernel (kernels/cuda/int2_history.cu) run on the CPU by tests/cuda_emulation.h (one thread per
CUDA thread, warps in lockstep at every MMA, ldmatrix and shuffle, cp.async copies done as late as the hardware may do
them), through the decode launcher with the Triton kernel in the interpreter for the sink and window, against the
torch twin; and the launcher's coverage rules. On a GPU, eval/gpu_check.sh runs the same comparison on the device."""

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from oscar_hf import ops
from oscar_hf.kernels import cuda_history
from oscar_hf.kernels.attention import decode_attention_triton
from test_kernels import _check_decode_kernel, _static_buffers

HERE = Path(__file__).resolve().parent
ENTRY = """
#define OSCAR_EMULATE 1
#include "cuda_emulation.h"
#include "int2_history.cu"
extern "C" void launch(unsigned grid, const oscar::Params* p) {
  if (p->wide_table == nullptr)
    emulate_launch(int2_history_attention, grid, oscar::WARPS<false> * 32,
                   oscar::WARPS<false> * sizeof(oscar::WarpSmem<false>), *p);
  else
    emulate_launch(int2_history_attention_wide, grid, oscar::WARPS<true> * 32, oscar::WARPS<true> * sizeof(oscar::WarpSmem<true>),
                   *p);
}
extern "C" size_t shared_bytes(int wide) {
  return wide ? oscar::WARPS<true> * sizeof(oscar::WarpSmem<true>) : oscar::WARPS<false> * sizeof(oscar::WarpSmem<false>);
}
extern "C" size_t params_bytes() { return sizeof(oscar::Params); }
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """The kernel built for the CPU with g++ (C++20: std::barrier), as a ctypes library."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("no g++ on this machine: the CUDA kernel's CPU emulation is built with it")
    folder = tmp_path_factory.mktemp("cuda_emulation")
    (folder / "entry.cpp").write_text(ENTRY)
    library = folder / "int2_history_emulated.so"
    subprocess.run([compiler, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", f"-I{HERE}",
                    f"-I{cuda_history.SOURCE.parent}", str(folder / "entry.cpp"), "-o", str(library)], check=True)
    lib = ctypes.CDLL(str(library))
    lib.launch.argtypes = [ctypes.c_uint, ctypes.POINTER(cuda_history.HistoryParams)]
    lib.shared_bytes.restype = lib.params_bytes.restype = ctypes.c_size_t
    lib.shared_bytes.argtypes = [ctypes.c_int]
    return lib


def test_the_launcher_mirrors_the_kernels_argument_and_shared_memory(emulated):
    """Guards the ctypes mirror of `Params` and the shared memory the driver launch asks for: a field added on one
    side only would shift every field after it."""
    assert emulated.params_bytes() == ctypes.sizeof(cuda_history.HistoryParams)
    assert [emulated.shared_bytes(wide) for wide in (0, 1)] == [cuda_history.SHARED_BYTES[w] for w in (False, True)]


CASES = [
    dict(b=2, h=2, g=4, t=1, capacity=256, n_hist=256, blocks=(64, 64)),                     # a full history
    dict(b=2, h=2, g=4, t=1, capacity=384, n_hist=200, blocks=(128, 64)),                    # ends inside a tile
    # no mask: whole tiles skip the per-token test, the split's last tile keeps it
    dict(b=2, h=2, g=4, t=1, capacity=384, n_hist=328, blocks=(128, 64), mask=False, ring=96, n_recent=90),
    dict(b=1, h=3, g=4, t=2, capacity=384, n_hist=200, blocks=(64, 32, 128), head_bits=(2, 4, 2), mask=False),
    dict(b=1, h=3, g=4, t=1, capacity=256, n_hist=168, blocks=(64, 32, 128), wide_channels=(5, 0, 17)),
    dict(b=2, h=2, g=4, t=2, capacity=256, n_hist=136, blocks=(16, 128)),                    # 8 rows, 2 positions
    dict(b=2, h=2, g=4, t=1, capacity=256, n_hist=0, blocks=(64, 64)),                       # no history yet
    dict(b=1, h=2, g=7, t=1, capacity=512, n_hist=512, blocks=(32, 64), wide_channels=(64, 3)),  # GQA 7
    dict(b=2, h=3, g=4, t=1, capacity=256, n_hist=200, blocks=(64, 32, 128), head_bits=(2, 4, 4)),  # wide heads
    dict(b=1, h=3, g=4, t=2, capacity=384, n_hist=328, blocks=(32, 64, 128), head_bits=(2, 4, 2),
         wide_channels=(64, 0, 3)),                                                           # ... with wide channels
    # key chunks that tiles straddle (48 tokens), and a block of 384 tokens (not a power of two) over 3 chunks' worth
    dict(b=1, h=2, g=4, t=1, capacity=384, n_hist=376, blocks=(16, 16), chunk=48, mask=False),
    dict(b=1, h=2, g=4, t=1, capacity=1152, n_hist=1100, blocks=(384, 32), chunk=384),
]


@pytest.mark.parametrize("case", CASES)
def test_the_emulated_kernel_matches_the_twin(emulated, case):
    """Decode attention with the INT2 history read by the CUDA kernel (emulated) and the sink and window by the
    Triton kernel (interpreter), merged by the Triton merge: within twice the bf16 emulation's error of the fp32
    twin, as the Triton kernel is held (`_check_decode_kernel`). The masks hide a left-padded row's first 9 positions,
    history included."""
    case = dict(case)
    masked = case.pop("mask", True)
    args = _static_buffers(**{"ring": 24, "n_recent": 20, "chunk": 128, **case}, d=128, ring_lo=10,
                           seed=case["capacity"] + case["n_hist"])
    if not masked:
        args = (*args[:3], None, *args[4:])
    q, buffers, fmt, mask, lengths, queries_per_group, scale = args
    blocks, chunk, wide_rows, wide_channels = ops._kernel_layout(fmt.keys)
    launches = []

    def history(params):
        launches.append(params.splits)
        assert (params.wide_table is not None) == bool(case.get("head_bits"))
        emulated.launch(cuda_history.grid(params), ctypes.byref(params))

    b = buffers
    out = decode_attention_triton(q, b.sink_keys, b.sink_values, b.key_codes, b.key_meta, b.value_codes,
                                  b.value_meta, b.ring_keys, b.ring_values, mask, lengths, queries_per_group, scale,
                                  blocks, chunk, wide_rows=wide_rows, wide_channels=wide_channels,
                                  history_kernel=history, target_programs=12)  # several splits a head
    assert len(launches) == 1 and launches[0] >= (2 if case["n_hist"] > 128 else 1)
    _check_decode_kernel(args, out)


def test_the_cuda_kernels_splits_follow_its_own_warp_count_unless_a_program_count_is_asked_for(emulated):
    """Without `target_programs`, a launch with the CUDA history kernel plans about `cuda_history_warps_per_sm` warps
    (splits) per SM (one SM on the CPU), not the Triton kernel's program count."""
    from oscar_hf.kernels.attention import DEFAULT_LAUNCH

    args = _static_buffers(b=1, h=2, g=4, t=1, d=128, capacity=1024, n_hist=1024, ring=24, n_recent=20, ring_lo=10,
                           blocks=(64, 64), chunk=128, seed=5)
    q, b, fmt, mask, lengths, qpg, scale = args
    blocks, chunk, wide_rows, wide_channels = ops._kernel_layout(fmt.keys)
    splits = []

    def history(params):
        splits.append((params.splits, params.split_tokens))
        emulated.launch(cuda_history.grid(params), ctypes.byref(params))

    for warps in (8, 2):  # 2 KV heads: 4 splits of 256 tokens, then 1 of 1,024
        DEFAULT_LAUNCH["cuda_history_warps_per_sm"], saved = warps, DEFAULT_LAUNCH["cuda_history_warps_per_sm"]
        try:
            out = decode_attention_triton(q, b.sink_keys, b.sink_values, b.key_codes, b.key_meta, b.value_codes,
                                          b.value_meta, b.ring_keys, b.ring_values, mask, lengths, qpg, scale, blocks,
                                          chunk, history_kernel=history)
        finally:
            DEFAULT_LAUNCH["cuda_history_warps_per_sm"] = saved
        _check_decode_kernel(args, out)
    assert splits == [(4, 256), (1, 1024)]


def test_layouts_it_does_not_cover_are_named():
    """The reasons `history_kernel_problem` gives, one per layout the kernel leaves to Triton."""
    args = _static_buffers(b=1, h=2, g=4, t=1, d=128, capacity=256, n_hist=128, ring=24, n_recent=20, ring_lo=10,
                           blocks=(64, 64), chunk=128, seed=1)
    q, buffers, fmt = args[:3]
    b = buffers
    words = lambda t: t.view(torch.int32)  # noqa: E731  (as the launcher passes them)
    base = (b.key_codes, words(b.key_meta), b.value_codes, words(b.value_meta))
    assert cuda_history.history_kernel_problem(q, *base, 128, 1, None, True) is None
    assert "head_dim 64" in cuda_history.history_kernel_problem(q[..., :64], *base, 128, 1, None, True)
    assert "token-wise" in cuda_history.history_kernel_problem(q, *base, 0, 1, None, True)
    assert "value groups" in cuda_history.history_kernel_problem(q, *base, 128, 2, None, True)
    assert "12 query rows" in cuda_history.history_kernel_problem(q.repeat(1, 1, 3, 1), *base, 128, 1, None, True)
    assert "aligned 32-bit words" in cuda_history.history_kernel_problem(q, *base, 128, 1, None, False)
    shifted = torch.zeros(*q.shape[:3], 129, dtype=q.dtype)[..., 1:]  # rows 258 bytes apart, read in 16-byte pieces
    assert "16-byte aligned" in cuda_history.history_kernel_problem(shifted, *base, 128, 1, None, True)


def test_the_kernel_choice_follows_the_environment(monkeypatch):
    """OSCAR_HF_DECODE_KERNEL: `auto` (unset) takes the CUDA kernel for covered layouts from `min_tokens` of history,
    `cuda` for every covered layout, `triton` never; anything else is refused."""
    covered, uncovered = (lambda: None), (lambda: "head_dim 64")
    monkeypatch.delenv(cuda_history.ENV, raising=False)
    assert cuda_history.mode() == "auto" and cuda_history.requested()
    assert cuda_history.wanted(8192, 8192, covered) and not cuda_history.wanted(8191, 8192, covered)
    assert not cuda_history.wanted(100_000, 8192, uncovered)
    monkeypatch.setenv(cuda_history.ENV, "cuda")
    assert cuda_history.wanted(16, 8192, covered) and not cuda_history.wanted(100_000, 8192, uncovered)
    monkeypatch.setenv(cuda_history.ENV, "Triton")
    assert not cuda_history.requested() and not cuda_history.wanted(100_000, 8192, covered)
    monkeypatch.setenv(cuda_history.ENV, "cuda-graphs")
    with pytest.raises(ValueError, match="expected 'auto'"):
        cuda_history.requested()


def test_the_shipped_ptx_is_built_from_the_source():
    """The PTX in the package is what `--build` makes of int2_history.cu (the driver compiles it on the user's GPU):
    its entry point and its build's source hash."""
    text = cuda_history.PTX.read_text()
    assert ".entry int2_history_attention" in text
    assert cuda_history.source_hash() in text
    # the PTX ISA version drivers back to CUDA 11.8 compile (`build` sets it; ptxas checks each feature against it)
    assert f"\n.version {cuda_history.PTX_ISA}\n" in text


def test_a_module_that_does_not_load_leaves_the_triton_kernel_under_auto(monkeypatch):
    """A driver that cannot load the PTX (too old for its ISA, say): under `auto` the launcher is told the kernel is not
    available, once per device and entry point (the failure is remembered, not retried per launch); asked for by
    `cuda`, the failure raises."""
    calls = []

    def refuse(index, wide):
        calls.append((index, wide))
        raise RuntimeError("CUDA history kernel: cuModuleLoadData (PTX JIT) failed with CUDA_ERROR_UNSUPPORTED_PTX_VERSION")

    monkeypatch.setattr(cuda_history, "_load_module", refuse)
    monkeypatch.setattr(cuda_history, "_FUNCTIONS", {})
    device = torch.device("cuda", 0)
    monkeypatch.delenv(cuda_history.ENV, raising=False)
    assert not cuda_history.available(device, False) and not cuda_history.available(device, False)
    assert calls == [(0, False)]
    monkeypatch.setenv(cuda_history.ENV, "cuda")
    with pytest.raises(RuntimeError, match="UNSUPPORTED_PTX_VERSION"):
        cuda_history.available(device, False)
