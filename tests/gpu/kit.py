"""What a GPU check run carries beside the working tree, and how much travels in all.

A run on the GPU machine copies the git working tree (tracked files and untracked files git does not ignore, plus a
``shared/`` folder inside the checkout) and the git-ignored paths named in its carry list, 64 MiB in all. The kit keeps
under ``LIMIT`` (60 MiB) to leave room. ``python tests/gpu/kit.py`` prints the carry list and the bytes that would
travel, and exits 1 when the carried files are missing or the total is over the limit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# paro's extension for the GPU machine's CPython 3.12 and torch 2.11 (built by scripts/gpu_kit.sh; git-ignored)
CARRY = ["paro_torch/_C.cpython-312-x86_64-linux-gnu.so"]
LIMIT = 60 << 20


def _size(path: Path) -> int:
    if path.is_symlink() or path.is_file():
        return path.lstat().st_size
    if path.is_dir():
        return sum(p.lstat().st_size for p in path.rglob("*") if p.is_symlink() or p.is_file())
    return 0


def travel_bytes(root: Path = ROOT, carry: list[str] = CARRY) -> dict[str, int]:
    """Bytes per part: the working tree as git sees it, ``shared/`` in the checkout, and the carried paths."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        check=True,
        capture_output=True,
    ).stdout
    files = {f for f in out.decode().split("\0") if f}
    tree = sum(_size(root / f) for f in files)
    shared = _size(root / "shared") if (root / "shared").is_dir() else 0
    carried = sum(_size(root / c) for c in carry)
    return {"tree": tree, "shared": shared, "carried": carried, "total": tree + shared + carried}


def main() -> int:
    sizes = travel_bytes()
    missing = [c for c in CARRY if not (ROOT / c).exists()]
    print("carry: " + json.dumps(CARRY))
    for c in CARRY:
        print(f"  {c}: {_size(ROOT / c) if c not in missing else 'MISSING'} bytes")
    print(
        f"travel: {sizes['total']} bytes ({sizes['total'] / 2**20:.1f} MiB; working tree {sizes['tree']}, "
        f"shared/ {sizes['shared']}, carried {sizes['carried']}); limit {LIMIT} ({LIMIT >> 20} MiB)"
    )
    if missing:
        print(f"kit: missing {missing}: run scripts/gpu_kit.sh")
        return 1
    if sizes["total"] > LIMIT:
        print("kit: too large to travel")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
