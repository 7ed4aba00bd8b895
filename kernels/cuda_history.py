"""The CUDA history kernel (`cuda/int2_history.cu`): it reads the INT2 history splits of decode attention in place of
the Triton kernel. `OSCAR_HF_DECODE_KERNEL` picks: `auto` (the default: on CUDA, wherever it covers the layout and
the history is planned at `cuda_history_min_tokens` or more, kernels/attention.py), `cuda` (wherever it covers the
layout), `triton` (never). The Triton kernel runs everything else.

- It ships as PTX built from `cuda/int2_history.cu` (`python -m oscar_hf.kernels.cuda_history --build`, which needs
  `nvcc`); the driver compiles the PTX for the GPU when it is first loaded, so a user's machine needs no compiler.
- It is loaded and launched through the CUDA driver API (`libcuda`), in torch's current context and on torch's
  current stream, so it is ordered with the Triton launches around it and is captured by CUDA graphs like them.
- `history_kernel_problem` says why a launch is not covered (one log line per reason, once): head_dim other than
  128, token-wise keys, value groups, more than 8 query rows per KV head, a GPU below sm_80.
- The stage-1 Triton launch leaves the history splits to it (`SKIP_HISTORY`); it writes their partial outputs and
  log-sum-exps into the same buffers, and the Triton merge combines every split as before.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parent / "cuda" / "int2_history.cu"
PTX = SOURCE.with_suffix(".ptx")
# the entry points: 2-bit heads only, and layers with wide heads (which also stage the low planes)
KERNEL_NAMES = {False: b"int2_history_attention", True: b"int2_history_attention_wide"}
ENV = "OSCAR_HF_DECODE_KERNEL"
PTX_ISA = "7.8"  # the PTX ISA version the shipped PTX declares: the oldest with every instruction it uses
WARPS = {False: 4, True: 4}  # warps per block, per entry point (int2_history.cu: WARPS)
BLOCKS_PER_SM = {False: 3, True: 2}  # (BLOCKS_PER_SM)
MAX_ROWS = 8    # query rows per KV head (MAX_ROWS)
HEAD_DIM = 128  # (D)
_STAGE_BYTES = 64 * 32 * 2 + 64 * 4 + 4 * 128 * 4  # Stage: key and value codes, value meta, key meta rows
_LOW_BYTES = {False: 2 * 16, True: 2 * 64 * 32}  # Stage: a wide head's low planes (16-byte stubs without)
# WarpSmem per warp (STAGES = 2), per entry point
SHARED_BYTES = {wide: WARPS[wide] * (2 * (_STAGE_BYTES + low) + 2 * MAX_ROWS * HEAD_DIM * 2)
                for wide, low in _LOW_BYTES.items()}
# warps an SM keeps resident, per entry point (int2_history.cu: BLOCKS_PER_SM blocks, by registers and shared memory)
RESIDENT_WARPS_PER_SM = {wide: BLOCKS_PER_SM[wide] * warps for wide, warps in WARPS.items()}

logger = logging.getLogger(__name__)
_LOGGED: set = set()


class HistoryParams(ctypes.Structure):
    """The kernel's one argument (`Params` in int2_history.cu, field for field)."""
    _fields_ = [
        ("q", ctypes.c_void_p), ("sq_b", ctypes.c_int64), ("sq_h", ctypes.c_int64), ("sq_m", ctypes.c_int64),
        ("o", ctypes.c_void_p), ("so_b", ctypes.c_int64), ("so_h", ctypes.c_int64), ("so_m", ctypes.c_int64),
        ("so_s", ctypes.c_int64),
        ("lse", ctypes.c_void_p), ("sl_b", ctypes.c_int64), ("sl_h", ctypes.c_int64), ("sl_m", ctypes.c_int64),
        ("sl_s", ctypes.c_int64),
        ("codes_k", ctypes.c_void_p), ("sck_b", ctypes.c_int64), ("sck_h", ctypes.c_int64), ("sck_t", ctypes.c_int64),
        ("codes_v", ctypes.c_void_p), ("scv_b", ctypes.c_int64), ("scv_h", ctypes.c_int64), ("scv_t", ctypes.c_int64),
        ("meta_k", ctypes.c_void_p), ("smk_b", ctypes.c_int64), ("smk_c", ctypes.c_int64), ("smk_r", ctypes.c_int64),
        ("meta_v", ctypes.c_void_p), ("smv_b", ctypes.c_int64), ("smv_h", ctypes.c_int64), ("smv_t", ctypes.c_int64),
        ("key_table", ctypes.c_void_p), ("channel_table", ctypes.c_void_p), ("wide_table", ctypes.c_void_p),
        ("mask", ctypes.c_void_p), ("smask_b", ctypes.c_int64), ("smask_n", ctypes.c_int64),
        ("lengths", ctypes.c_void_p),
        ("batch", ctypes.c_int32), ("heads", ctypes.c_int32), ("rows", ctypes.c_int32),
        ("tokens_per_row_group", ctypes.c_int32), ("q_start", ctypes.c_int32), ("n_sink", ctypes.c_int32),
        ("n_hist", ctypes.c_int32), ("splits", ctypes.c_int32), ("split_tokens", ctypes.c_int32),
        ("first_split", ctypes.c_int32), ("key_chunk", ctypes.c_int32), ("cap_k", ctypes.c_int32),
        ("cap_v", ctypes.c_int32), ("q_bf16", ctypes.c_int32), ("scale", ctypes.c_float),
    ]


def mode() -> str:
    """`OSCAR_HF_DECODE_KERNEL`: "auto" (unset), "cuda" or "triton"."""
    value = os.environ.get(ENV, "auto").strip().lower()
    if value not in ("auto", "cuda", "triton"):
        raise ValueError(f"{ENV}={value!r}: expected 'auto' (the default), 'cuda' or 'triton'")
    return value


def requested() -> bool:
    """Whether the process may use the CUDA history kernel (`auto` or `cuda`)."""
    return mode() != "triton"


def wanted(planned_history: int, min_tokens: int, problem) -> bool:
    """Whether a launch on a CUDA device should take the kernel, by `OSCAR_HF_DECODE_KERNEL`: never under `triton`;
    under `cuda` wherever it covers the layout (`problem()`, which says why not, returns None); under `auto` where it
    also has `min_tokens` or more of history to read (below that, its extra launch costs more than it saves).
    `problem` is only called where the policy would take the kernel; a layout it does not cover is logged once."""
    kernel_mode = mode()
    if kernel_mode == "triton" or (kernel_mode == "auto" and planned_history < min_tokens):
        return False
    reason = problem()
    if reason is not None:
        log_fallback(reason)
        return False
    return True


def available(device: torch.device, wide: bool) -> bool:
    """Whether the kernel's module loads on `device` (`load`). Under `auto` a failure (a driver too old for the PTX,
    say) is logged once and leaves the Triton kernel; asked for by `cuda`, it raises."""
    try:
        load(device, wide)
        return True
    except RuntimeError as e:
        if mode() == "cuda":
            raise
        log_fallback(f"its module does not load here ({e})")
        return False


def history_kernel_problem(q, hist_codes_k, hist_meta_k, hist_codes_v, hist_meta_v, key_chunk: int, groups: int,
                           wide_table, meta_words: bool) -> str | None:
    """Why the CUDA history kernel does not cover this launch, or None when it does."""
    b, h, m, d = q.shape
    if d != HEAD_DIM:
        return f"head_dim {d} (the CUDA history kernel is built for {HEAD_DIM})"
    if not key_chunk:
        return "token-wise keys (the CUDA history kernel reads channel-wise key blocks)"
    if groups != 1:
        return f"{groups} value groups per token (the CUDA history kernel reads one (scale, minimum) per token)"
    if m > MAX_ROWS:
        return f"{m} query rows per KV head (the CUDA history kernel takes at most {MAX_ROWS})"
    if not meta_words:
        return "(scale, minimum) pairs that are not aligned 32-bit words"
    if q.stride(-1) != 1 or q.dtype not in (torch.bfloat16, torch.float16):
        return f"queries of dtype {q.dtype} or channel stride {q.stride(-1)}"
    if q.data_ptr() % 16 or any(s % 8 for s in q.stride()[:3]):  # read in 16-byte pieces
        return "query rows that are not 16-byte aligned"
    for name, t in (("key codes", hist_codes_k), ("value codes", hist_codes_v)):
        if t.stride(-1) != 1 or t.shape[-1] != d // 4 or t.stride(-2) % 16 or t.data_ptr() % 16:
            return f"{name} whose packed rows are not 16-byte aligned and contiguous"
    # (scale, minimum) pairs as int32 words: key meta [B, n_chunks, R, d, 1], value meta [B, H, cap, 1, 1]
    if hist_meta_k.stride(3) != 1 or hist_meta_k.data_ptr() % 16 or any(s % 4 for s in hist_meta_k.stride()[:3]):
        return "key (scale, minimum) rows that are not 16-byte aligned"
    if hist_meta_v.stride(2) != 1:
        return "value (scale, minimum) words that are not contiguous over tokens"
    if q.device.type == "cuda" and torch.cuda.get_device_capability(q.device) < (8, 0):
        return f"a GPU of compute capability {torch.cuda.get_device_capability(q.device)} (needs sm_80 or newer)"
    return None


def log_fallback(problem: str) -> None:
    """One log line per reason, the first time a launch it could take falls back to the Triton kernel (a warning where
    `cuda` asked for it)."""
    if problem not in _LOGGED:
        _LOGGED.add(problem)
        level = logging.WARNING if mode() == "cuda" else logging.INFO
        logger.log(level, "%s=%s: the Triton kernel reads this history: %s", ENV, mode(), problem)


def history_params(q, partial, partial_lse, hist_codes_k, hist_meta_k, hist_codes_v, hist_meta_v, key_table,
                   channel_table, wide_table, mask, lengths, host_lengths, queries_per_group: int, hist_splits: int,
                   hist_chunk: int, key_chunk: int, scale_log2: float) -> HistoryParams:
    """The kernel's argument for one launch (`meta` tensors as int32 word views, as the Triton kernel reads them):
    every history split of every (batch, KV head), written at split index 1 onwards (0 is the sink's)."""
    b, h, m, d = q.shape
    n_sink, n_hist, _, _, q_start = host_lengths if host_lengths is not None else (0, 0, 0, 0, 0)
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    return HistoryParams(
        ptr(q), *q.stride()[:3], ptr(partial), *partial.stride()[:4], ptr(partial_lse), *partial_lse.stride(),
        ptr(hist_codes_k), *hist_codes_k.stride()[:3], ptr(hist_codes_v), *hist_codes_v.stride()[:3],
        ptr(hist_meta_k), hist_meta_k.stride(0), hist_meta_k.stride(1), hist_meta_k.stride(2),
        ptr(hist_meta_v), *hist_meta_v.stride()[:3],
        ptr(key_table), ptr(channel_table), ptr(wide_table),
        ptr(mask), *(mask.stride() if mask is not None else (0, 0)), ptr(lengths),
        b, h, m, queries_per_group, q_start, n_sink, n_hist, hist_splits, hist_chunk, 1, key_chunk,
        hist_codes_k.shape[2], hist_codes_v.shape[2], int(q.dtype == torch.bfloat16), scale_log2)


def grid(params: HistoryParams) -> int:
    """Blocks of `WARPS` warps, one warp per (batch, KV head, split)."""
    return -(-params.batch * params.heads * params.splits // WARPS[params.wide_table is not None])


# ------------------------------------------------------------------------------------------- the CUDA driver
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_FUNCTIONS: dict = {}
_LIBCUDA = None


def _driver():
    global _LIBCUDA
    if _LIBCUDA is None:
        _LIBCUDA = ctypes.CDLL("libcuda.so.1" if sys.platform != "win32" else "nvcuda.dll")
    return _LIBCUDA


def _check(result: int, what: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(result, ctypes.byref(name))
        raise RuntimeError(f"CUDA history kernel: {what} failed with {name.value.decode() if name.value else result}")


def load(device: torch.device, wide: bool):
    """The kernel (`wide`: the entry point for layers with wide heads) loaded from the shipped PTX into torch's
    context on `device`, cached per device: a layer loads it with its buffers (`ops.make_kernel_tables`), before any
    CUDA-graph capture."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if isinstance(_FUNCTIONS.get((index, wide)), RuntimeError):
        raise _FUNCTIONS[index, wide]
    if (index, wide) not in _FUNCTIONS:
        try:
            _FUNCTIONS[index, wide] = _load_module(index, wide)
        except RuntimeError as e:  # remembered: the next launch falls back without another driver call
            _FUNCTIONS[index, wide] = e
            raise
    return _FUNCTIONS[index, wide][1]


def _load_module(index: int, wide: bool):
    if not PTX.is_file():
        raise RuntimeError(f"{PTX} is missing: build it with `python -m oscar_hf.kernels.cuda_history --build`")
    with torch.cuda.device(index):
        torch.cuda.init()
        torch.empty(1, device=f"cuda:{index}")  # makes torch's primary context current on this thread
        cu = _driver()
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        image = PTX.read_bytes() + b"\0"
        _check(cu.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(image)), "cuModuleLoadData (PTX JIT)")
        _check(cu.cuModuleGetFunction(ctypes.byref(function), module, KERNEL_NAMES[wide]), "cuModuleGetFunction")
        _check(cu.cuFuncSetAttribute(function, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                     SHARED_BYTES[wide]), "cuFuncSetAttribute (shared memory)")
    return module, function


def launch(params: HistoryParams, device: torch.device) -> None:
    """Launches the kernel on torch's current stream of `device` (CUDA-graph capture records it like any launch)."""
    wide = params.wide_table is not None
    function = load(device, wide)
    stream = ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)
    args = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(params), ctypes.c_void_p))
    with torch.cuda.device(device):  # the launch goes to the current context: the device's primary one
        _check(_driver().cuLaunchKernel(function, grid(params), 1, 1, WARPS[wide] * 32, 1, 1, SHARED_BYTES[wide],
                                        stream, args, None), "cuLaunchKernel")


def source_hash() -> str:
    """The source's sha256, which `build` writes into the PTX's first line (a test checks that they match)."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()


def build(nvcc: str = "nvcc") -> Path:
    """Writes `cuda/int2_history.ptx` from the source (PTX for compute_80: the driver compiles it for the GPU at
    hand). The one command: `python -m oscar_hf.kernels.cuda_history --build`."""
    out = subprocess.run([nvcc, "-ptx", "-O3", "-arch=compute_80", "-std=c++17", str(SOURCE), "-o", "-"],
                         check=True, capture_output=True, text=True).stdout
    # nvcc writes its own PTX ISA version (9.0 for CUDA 13), which drivers older than it cannot compile; the source
    # needs 7.8 (movmatrix; CUDA 11.8 drivers), and ptxas checks each feature against the version declared
    out, n = re.subn(r"^\.version \d+\.\d+$", f".version {PTX_ISA}", out, count=1, flags=re.M)
    if n != 1:
        raise RuntimeError("nvcc's PTX has no .version line to set")
    PTX.write_text(f"// built from int2_history.cu, sha256 {source_hash()}, by {nvcc_version(nvcc)}\n" + out)
    return PTX


def nvcc_version(nvcc: str) -> str:
    return subprocess.run([nvcc, "--version"], check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]


if __name__ == "__main__":
    if sys.argv[1:] != ["--build"]:
        sys.exit("usage: python -m oscar_hf.kernels.cuda_history --build")
    print(build())
