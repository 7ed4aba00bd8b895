"""The rotation R = U·H·P, built once from a covariance target (oscar-method.md §1.4).

- U: eigenvectors of the target, columns in ascending eigenvalue order (`torch.linalg.eigh`), so that RᵀCR is diagonal.
- H: the normalised Sylvester Hadamard matrix, which makes every diagonal entry of (UH)ᵀC(UH) equal (Lemma 1) and
  spreads outlier coordinates over all channels.
- P: the bit-reversal permutation: column br(i) of R is column argsort(λ, descending)[i] of U·H, so that the leading
  directions land in different quantization groups when the group is smaller than head_dim.

Keys are stored as k·R_K (and queries rotated by the same R_K), values as v·R_V (outputs un-rotated by R_Vᵀ).
Everything here is float64; callers cast.
"""

from __future__ import annotations

import torch


def rotate(states: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """`[B, H, n, d] @ [H, d, d]` per KV head: one batched GEMM over H. Unlike `torch.matmul`, which broadcasts the
    rotations over B (and a query's group axis) by materialising copies of them, this reads each R_h once (in a
    compiled decode step those copies were two extra kernels per layer, eval/KERNEL_NOTES.md)."""
    if states.shape[0] == 1:  # the same bmm without einsum's per-call planning (eager decode: 4 calls per layer)
        return torch.matmul(states[0], rotation).unsqueeze(0)
    return torch.einsum("bhnd,hde->bhne", states, rotation)


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def hadamard(d: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Normalised Sylvester Hadamard matrix of order d (a power of two): H = [[H, H], [H, -H]] / √2, HᵀH = I."""
    if not is_power_of_two(d):
        raise ValueError(
            f"head_dim {d} is not a power of two: the Sylvester Hadamard factor of OSCAR's rotation needs one. "
            "Use use_hadamard=False (U·P only) for such models."
        )
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / d**0.5).to(dtype)


def bit_reversal(d: int) -> torch.Tensor:
    """br(i): i with its log2(d) bits reversed, for i in [0, d). br is its own inverse."""
    if not is_power_of_two(d):
        raise ValueError(f"bit-reversal permutation needs a power-of-two size, got {d}")
    bits = d.bit_length() - 1
    idx = torch.arange(d)
    out = torch.zeros_like(idx)
    for b in range(bits):
        out |= ((idx >> b) & 1) << (bits - 1 - b)
    return out


def build_rotation(
    target: torch.Tensor,
    *,
    use_eigenvectors: bool = True,
    use_hadamard: bool = True,
    use_permutation: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Builds R = U·H·P for one symmetric target.

    Args:
        target: `[d, d]` symmetric positive semi-definite covariance target. With `use_eigenvectors=False` only its
            size is used (U = I, all eigenvalues treated as equal: the data-free H·P rotation).
        use_eigenvectors, use_hadamard, use_permutation: which factors to include (ablations drop some).

    Returns:
        `(R, eigenvalues)`: R is `[d, d]` float64 orthogonal; eigenvalues `[d]` float64 in ascending order (ones
        when eigenvectors are not used).
    """
    if target.ndim != 2 or target.shape[0] != target.shape[1]:
        raise ValueError(f"rotation target must be a square matrix, got shape {tuple(target.shape)}")
    if not torch.isfinite(target).all():
        raise ValueError("rotation target contains NaN or Inf: the calibration statistics are broken")
    d = target.shape[0]

    if use_eigenvectors:
        sym = 0.5 * (target.double() + target.double().T)
        eigenvalues, u = torch.linalg.eigh(sym)
    else:
        eigenvalues, u = torch.ones(d, dtype=torch.float64), torch.eye(d, dtype=torch.float64)
    rotation = u @ hadamard(d) if use_hadamard else u
    if use_permutation:
        # perm[br(i)] = argsort(λ, descending)[i]; P = I[:, perm]  =>  R[:, br(i)] = (U·H)[:, argsort_desc(λ)[i]].
        order = torch.argsort(eigenvalues, descending=True, stable=True)
        perm = torch.empty(d, dtype=torch.long)
        perm[bit_reversal(d)] = order
        rotation = rotation[:, perm]
    return rotation, eigenvalues


def orthogonality_error(rotation: torch.Tensor) -> float:
    """max |RᵀR − I| over one matrix or a stack `[..., d, d]`."""
    r = rotation.double()
    eye = torch.eye(r.shape[-1], dtype=torch.float64)
    return (r.transpose(-1, -2) @ r - eye).abs().max().item()
