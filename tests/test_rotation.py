import pytest
import torch

from oscar_hf.rotation import bit_reversal, build_rotation, hadamard, orthogonality_error


@pytest.mark.parametrize("d", [1, 2, 8, 64, 128, 256])
def test_hadamard_is_normalised_and_orthogonal(d):
    h = hadamard(d)
    assert torch.allclose(h.abs(), torch.full((d, d), d**-0.5, dtype=torch.float64))
    assert orthogonality_error(h) < 1e-12
    assert torch.equal(h, h.T)  # Sylvester construction is symmetric


@pytest.mark.parametrize("d", [0, 3, 96, 100])
def test_non_power_of_two_is_refused(d):
    with pytest.raises(ValueError, match="power of two"):
        hadamard(d)
    with pytest.raises(ValueError, match="power-of-two"):
        bit_reversal(d)


def test_bit_reversal_values_and_involution():
    assert bit_reversal(8).tolist() == [0, 4, 2, 6, 1, 5, 3, 7]
    br = bit_reversal(128)
    assert torch.equal(br[br], torch.arange(128))
    assert br[1].item() == 64 and br[2].item() == 32 and br[3].item() == 96


def _random_target(d, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(4 * d, d, generator=g, dtype=torch.float64) * torch.logspace(0, 2, d, dtype=torch.float64)
    return a.T @ a / (4 * d)


def test_rotation_matches_the_reference_construction():
    d = 16
    c = _random_target(d)
    r, lam = build_rotation(c)
    lam_ref, u = torch.linalg.eigh(c)
    order = torch.argsort(lam_ref, descending=True)
    perm = torch.empty(d, dtype=torch.long)
    perm[bit_reversal(d)] = order
    p = torch.eye(d, dtype=torch.float64)[:, perm]
    r_ref = u @ hadamard(d) @ p
    # eigenvectors are defined up to sign; compare through the rotated covariance, which is sign-invariant
    assert torch.allclose(r.T @ c @ r, r_ref.T @ c @ r_ref, atol=1e-9)
    assert torch.allclose(lam, lam_ref)
    assert orthogonality_error(r) < 1e-12


def test_lemma1_hadamard_equalises_importance():
    d = 64
    c = _random_target(d)
    r, lam = build_rotation(c, use_permutation=False)
    diag = torch.diagonal(r.T @ c @ r)
    assert torch.allclose(diag, torch.full_like(diag, lam.sum().item() / d), rtol=1e-9)
    u_only, _ = build_rotation(c, use_hadamard=False, use_permutation=False)
    assert torch.allclose(u_only.T @ c @ u_only, torch.diag(lam), atol=1e-8)


def test_permutation_spreads_top_directions_across_groups():
    d = 128
    c = _random_target(d, seed=1)
    r, lam = build_rotation(c, use_hadamard=False)
    _, u = torch.linalg.eigh(c)
    # R[:, br(i)] is the i-th largest eigenvector: rank 1 -> column 0, rank 2 -> 64, rank 3 -> 32, rank 4 -> 96
    for rank, column in enumerate([0, 64, 32, 96]):
        assert torch.allclose(r[:, column].abs(), u[:, d - 1 - rank].abs(), atol=1e-9)


def test_data_free_rotation_is_hadamard_permuted():
    r, lam = build_rotation(torch.eye(8), use_eigenvectors=False)
    assert torch.equal(lam, torch.ones(8, dtype=torch.float64))
    assert torch.allclose(r[:, bit_reversal(8)], hadamard(8))


def test_bad_targets_are_refused():
    with pytest.raises(ValueError, match="square"):
        build_rotation(torch.ones(3, 4))
    bad = torch.eye(4)
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        build_rotation(bad)
