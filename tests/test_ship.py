"""eval/ship.py: files cut into per-call piece folders come back byte for byte; a file with a piece still missing is
skipped, not written half; a piece from another split is refused."""

import importlib.util
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("ship", REPO / "eval" / "ship.py")
ship = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ship)


@pytest.fixture
def files(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    sizes = {"a.whl": 2500, "b.whl": 999, "c.tar.gz": 1000, "empty.txt": 0}  # pieces of 1000 bytes: a file ends on a cut
    for name, size in sizes.items():
        (src / name).write_bytes(os.urandom(size))
    return [src / name for name in sizes]


def test_split_join_round_trip(files, tmp_path):
    manifest = ship.split(files, tmp_path / "ship", piece_bytes=1000)
    folders = sorted(p.name for p in (tmp_path / "ship").iterdir())
    assert folders == ["01", "02", "03", "04", "05"]  # 4499 bytes, folders filled in order, at most 1000 each
    for folder in folders:
        assert sum(f.stat().st_size for f in (tmp_path / "ship" / folder).iterdir() if f.name != ship.MANIFEST) <= 1000
    assert len(manifest["files"]["a.whl"]["pieces"]) == 3
    done = ship.join(tmp_path / "ship", tmp_path / "dest")
    assert done == [f.name for f in files]
    for f in files:
        assert (tmp_path / "dest" / f.name).read_bytes() == f.read_bytes()
    assert ship.join(tmp_path / "ship", tmp_path / "dest") == done  # already complete: kept


def test_join_skips_incomplete_and_refuses_foreign_piece(files, tmp_path):
    ship.split(files, tmp_path / "ship", piece_bytes=1000)
    piece = tmp_path / "ship" / "04"  # the end of b.whl and the start of c.tar.gz
    moved = {p: p.read_bytes() for p in piece.iterdir()}
    for p in moved:
        p.unlink()  # folder 04 has not travelled yet: the files it holds a piece of wait
    done = ship.join(tmp_path / "ship", tmp_path / "dest")
    assert done == ["a.whl", "empty.txt"]
    assert not any(p.suffix == ".partial" for p in (tmp_path / "dest").iterdir())
    for p, data in moved.items():
        p.write_bytes(bytes(len(data)))  # a piece of the same size from something else
    with pytest.raises(ValueError, match="does not match its sha256"):
        ship.join(tmp_path / "ship", tmp_path / "dest")
