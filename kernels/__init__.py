"""Triton kernels of oscar-hf, installed as `oscar_hf.kernels` (see `custom_ops.py` for the ops they provide).

The top-level import name `kernels` belongs to Hugging Face's `kernels` package, which transformers >= 5.25 depends on
and imports at start-up (`from kernels import CUDAProperties, ...`). This folder sits at the repository root, so
whenever the root is on `sys.path` (Python started there: `python -c`, `python -m pytest`, a notebook) a plain
`import kernels` finds it first. It can never act as `kernels`:
- imported under that name, it hands the import over to the real `kernels` package, found by the import system with
  the repository root left out of `sys.path` (it loads that package and puts it in `sys.modules["kernels"]`, which
  is what the `import` statement returns);
- with no such package installed it stays inert: no version, no attributes, so transformers' probe
  (`is_kernels_available`) says False, as it does without the folder.

Why not a namespace package (no `__init__.py`), which Python would rank below a real `kernels` by itself: the editable
install (`pip install -e .`) maps `oscar_hf.kernels` to this folder through setuptools' finder, which needs this file
(a namespace sub-package mapped outside its parent's folder is not found), and the op registration below must run on
`import oscar_hf.kernels`.
"""

if __name__ == "oscar_hf.kernels":
    from .custom_ops import (decode_attention, quantize_pack, quantize_pack_at, rotate_store_token,  # noqa: F401
                             segment_attention)  # (registers torch.ops.oscar.*)

    __all__ = ["decode_attention", "quantize_pack", "quantize_pack_at", "rotate_store_token", "segment_attention"]
else:
    def _hand_over(name: str, here: str) -> None:
        """Finds the real package `name` with the import system (every meta-path finder: a regular install, an
        editable one) on `sys.path` less the entries holding this folder, loads it and makes it the module `import
        name` returns. Nothing happens when there is none (this module stays, inert)."""
        import importlib.util
        import os
        import sys

        root = os.path.dirname(here)

        def is_root(entry) -> bool:
            try:
                return os.path.samefile(entry or os.getcwd(), root)
            except (OSError, TypeError, ValueError):
                return False

        saved = list(sys.path)
        sys.path[:] = [entry for entry in saved if not is_root(entry)]
        try:
            spec = None
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None)
                spec = find(name, None) if find is not None else None
                if spec is not None:
                    break
        finally:
            sys.path[:] = saved
        origin = os.path.abspath(spec.origin) if spec is not None and spec.origin else ""
        if spec is None or spec.loader is None or origin.startswith(here + os.sep):
            return  # not installed (or only another namespace portion)
        module = importlib.util.module_from_spec(spec)
        inert = sys.modules.get(name)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules[name] = inert
            raise

    _hand_over(__name__, __path__[0])
    del _hand_over
