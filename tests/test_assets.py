"""Offline model assets: the converted tokenizer must tokenize, not spell."""

import pytest

from conftest import char_tokenizer
from oscar_hf.assets import MERGE_SAMPLE, check_tokenizer_merges


def test_a_character_level_tokenizer_is_refused_with_the_reason():
    with pytest.raises(RuntimeError, match=r"splits text into characters \(\d+ tokens for \d+ characters\)"):
        check_tokenizer_merges(char_tokenizer(), "model.gguf")


def test_a_real_subword_tokenizer_passes(smollm2):
    _, tokenizer = smollm2
    check_tokenizer_merges(tokenizer, "smollm2")
    assert len(tokenizer(MERGE_SAMPLE, add_special_tokens=False)["input_ids"]) < len(MERGE_SAMPLE) // 3
