"""Every ```python block of README.md runs as written, each in a fresh interpreter (on the bundled SmolLM2-135M),
with transformers' FutureWarnings (e.g. a deprecated cache keyword) turned into errors."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_the_readme_has_python_blocks():
    assert BLOCKS and all("import" in block for block in BLOCKS)


@pytest.mark.real_model
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index, tmp_path):
    script = tmp_path / f"readme_block_{index}.py"
    script.write_text(BLOCKS[index])
    env = {**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-W", "error::FutureWarning", str(script)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"README python block {index} failed:\n{BLOCKS[index]}\n{result.stderr[-3000:]}"
