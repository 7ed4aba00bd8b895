"""Executes notebooks/quickstart.ipynb top to bottom (real model: SmolLM2-135M from PyPI)."""

from pathlib import Path

import pytest

pytestmark = pytest.mark.real_model
NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_runs(tmp_path):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=1200, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "bits/element" in text and "greedy tokens identical" in text
    assert (tmp_path / "smollm2-oscar" / "oscar_rotations.safetensors").is_file()
    assert any(o.get("data", {}).get("image/png") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
