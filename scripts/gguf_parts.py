#!/usr/bin/env python3
"""Split a file into parts that fit one device call's carry (64 MiB with the wheels), and join them back.

    python3 scripts/gguf_parts.py split FILE [DIR]   # DIR/part1, DIR/part2, ... (default DIR .gguf_parts, git-ignored)
    python3 scripts/gguf_parts.py join DIR OUT [SHA256]  # concatenates DIR/part1.. into OUT, checks the SHA-256

Standard library only (the GPU machine runs it before any wheel is installed).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

PART_BYTES = 47 * 2**20  # two parts of a 98 MB file; each leaves room under 64 MiB for the wheels (6 MiB) and the prebuilt Triton cache (4 MiB)


def split(path: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(path, "rb") as f:
        i = 0
        while chunk := f.read(PART_BYTES):
            i += 1
            (out / f"part{i}").write_bytes(chunk)
            print(f"{out / f'part{i}'}: {len(chunk)} bytes")
    print(f"sha256 {hashlib.sha256(path.read_bytes()).hexdigest()}")


def join(parts: Path, out: Path, sha256: str | None) -> int:
    files = sorted(parts.glob("part*"), key=lambda p: int(p.name[4:]))
    if not files:
        print(f"error: no part files in {parts}", file=sys.stderr)
        return 2
    data = b"".join(p.read_bytes() for p in files)
    digest = hashlib.sha256(data).hexdigest()
    if sha256 and digest != sha256:
        print(f"error: {len(files)} part(s) ({', '.join(p.name for p in files)}) join to sha256 {digest}, expected "
              f"{sha256} (a part is missing or truncated)", file=sys.stderr)
        return 3
    out.write_bytes(data)
    print(f"{out}: {len(data)} bytes from {len(files)} parts, sha256 {digest}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "split":
        split(Path(sys.argv[2]), Path(sys.argv[3] if len(sys.argv) > 3 else ".gguf_parts"))
    elif len(sys.argv) >= 4 and sys.argv[1] == "join":
        sys.exit(join(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None))
    else:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
