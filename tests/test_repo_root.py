"""Python started from the checkout's root (`python -c`, `python -m pytest`, a notebook there) has the root on
`sys.path`, where the folder `kernels/` (installed as `oscar_hf.kernels`) sits under the import name of Hugging Face's
`kernels` package, which transformers >= 5.25 depends on and imports at start-up.

`make check-newest-transformers` (CI runs its two halves, the fetch beside the suite) runs this file with the newest
transformers release (and its `kernels`) on PYTHONPATH, from the repository root, with `OSCAR_HF_EXPECT_TRANSFORMERS`
naming the version it installed."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _python(code: str, **env) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_import_kernels_from_the_root_gets_the_installed_package(tmp_path):
    """Guards: from the root, `from kernels import CUDAProperties` (transformers >= 5.25's first import of it) reaches
    the installed `kernels` package, not the repository's folder (which raised ImportError naming kernels/__init__.py).
    A stand-in for the real package (a regular package with distribution metadata) is installed after the root."""
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("__version__ = '0.19.1'\nclass CUDAProperties:\n    pass\n")
    (site / "kernels" / "layer.py").write_text("NAME = 'real submodule'\n")
    (site / "kernels-0.19.1.dist-info").mkdir()
    (site / "kernels-0.19.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.19.1\n")
    out = _python("import sys; from kernels import CUDAProperties; import kernels, kernels.layer; "
                  "import oscar_hf.kernels as ours; "
                  "print(kernels.__file__, kernels.layer.NAME, sys.modules['kernels'] is kernels, ours.__name__, "
                  "hasattr(ours, 'segment_attention'), sep='|')",
                  PYTHONPATH=str(site))
    assert out.strip().split("|") == [str(site / "kernels" / "__init__.py"), "real submodule", "True",
                                      "oscar_hf.kernels", "True"]


def test_a_tiny_model_generates_from_the_repository_root():
    """Guards: from the root, transformers (any version CI installs) imports, a tiny Llama loads with the "oscar"
    attention, and greedy generation through OscarCache (bits=16) equals DynamicCache token for token."""
    code = """
import torch, transformers
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig
import oscar_hf
from oscar_hf import OscarCache, OscarConfig, OscarRotations
from oscar_hf.metrics import cache_kwarg
torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, pad_token_id=0, eos_token_id=None)
model = AutoModelForCausalLM.from_config(config, attn_implementation="oscar").eval()
ids = torch.randint(1, 64, (1, 24))
cache = OscarCache(model, OscarRotations.data_free(model, "hadamard"),
                   OscarConfig(bits=16, sink_tokens=4, window_tokens=8, key_clip="none", value_clip="none"))
kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
a = model.generate(ids, **kw, **{cache_kwarg(model): cache})
b = model.generate(ids, **kw, **{cache_kwarg(model): DynamicCache(config=model.config)})
print(transformers.__version__, a[0, 24:].tolist() == b[0, 24:].tolist(), a.shape[1])
"""
    version, same, length = _python(code).split()
    assert same == "True" and length == "36"
    expected = os.environ.get("OSCAR_HF_EXPECT_TRANSFORMERS")
    if expected:  # CI's newest-transformers check: the run really used the version it installed
        assert version == expected
