"""oscar-hf: a 2-bit KV cache for Hugging Face Transformers with OSCAR rotations (arXiv 2605.17757).

    import oscar_hf
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="oscar")
    cache = oscar_hf.OscarCache(model, oscar_hf.OscarRotations.from_pretrained(model))  # rotations beside the model
    model.generate(**inputs, cache=cache)

`StaticOscarCache(model, rotations, max_cache_len=N)` stores the same in fixed buffers: generate compiles its decode
step and replays it as a CUDA graph. `calibrate.calibrate(model, tokenizer)` makes the rotations.
"""

from . import assets
from .attention import register as _register_attention
from .cache import OscarCache, OscarLayer, StaticOscarCache
from .config import CalibrationConfig, OscarConfig
from .models import UnsupportedModelError
from .rotations_io import OscarRotations, RotationFileError, weight_fingerprint

_register_attention()

__version__ = "0.1.0"
__all__ = [
    "CalibrationConfig", "OscarCache", "OscarConfig", "OscarLayer", "OscarRotations", "RotationFileError", "StaticOscarCache",
    "UnsupportedModelError", "assets", "weight_fingerprint",
]
