#!/usr/bin/env python3
"""Checks that every C++ or CMake block of docs/guide.md is a verbatim excerpt
of a file in the repository (examples/, include/, cmake/, fused/, ...), so
that the guide cannot drift from code that CI compiles. Blocks marked
```cpp sketch are exempt. Exit status 1 lists the blocks found nowhere."""
import pathlib
import re
import sys

root = pathlib.Path(__file__).resolve().parent.parent
guide = (root / "docs" / "guide.md").read_text()
blocks = re.findall(r"```(cpp|cmake|cuda)\n(.*?)```", guide, flags=re.S)
sources = []
for pattern in ("examples/**/*", "include/**/*", "cmake/**/*", "fused/**/*", "contract/**/*", "scaler/**/*", "tests/**/*"):
    for path in root.glob(pattern):
        if path.is_file() and path.suffix in {".h", ".cpp", ".cu", ".cuh", ".inc", ".txt", ".cmake"}:
            sources.append(path.read_text(errors="replace"))
missing = [body for _, body in blocks if not any(body in text for text in sources)]
for body in missing:
    print("docs/guide.md: block not found verbatim in any source file:\n" + body, file=sys.stderr)
print(f"docs/guide.md: {len(blocks) - len(missing)} of {len(blocks)} code blocks are verbatim excerpts of sources")
sys.exit(1 if missing else 0)
