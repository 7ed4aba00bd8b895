"""The caches give what they gave before the consolidation (`golden_cases.py`): the same stored bytes, the same
generated tokens, and logits equal up to float32 rounding, for every storage layout, cache and attention path."""

import pytest
import torch
from safetensors.torch import load_file

from golden_cases import CASES, REFERENCE, run_case


@pytest.fixture(scope="module")
def reference():
    return load_file(str(REFERENCE))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_outputs_equal_the_recorded_ones(case, reference):
    got = run_case(*case)
    expected = {k: v for k, v in reference.items() if k.startswith(case[0] + ".")}
    assert sorted(got) == sorted(expected)
    for key, want in expected.items():
        have = got[key]
        assert have.shape == want.shape and have.dtype == want.dtype, key
        if key.endswith(".logits"):
            scale = want.abs().max().item()
            assert (have - want).abs().max().item() <= 1e-5 * max(scale, 1.0), key
        else:
            assert torch.equal(have, want), key
