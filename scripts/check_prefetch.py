#!/usr/bin/env python3
"""Checks that the CPU kernels' software prefetches are still in the code the
compiler made. A prefetch is a hint: when a refactor loses it (GCC 12 emitted
none from the SDK's walkers once the fp64 second-line prefetch moved inside
prefetch_ahead, docs/engine.md), every test still passes and only the
benchmark, run by hand, shows the loss (the benchmark binary had 575 prefetch
instructions instead of 4259). This counts the prefetch instructions of each
kernel object (objdump -d) against the floors in
cmake/kernel_prefetch_floors.txt: half of what GCC 12 makes at
-O3, so that a new inlining decision passes and a lost walker does not.

Usage: check_prefetch.py OBJDUMP FLOORS OBJECT... (ctest's kernel_prefetch passes the
library's objects). Exit status 1 names each kernel below its floor."""
import pathlib
import re
import subprocess
import sys

floors = {}
objdump = sys.argv[1]
for line in pathlib.Path(sys.argv[2]).read_text().splitlines():
    line = line.split("#", 1)[0].split()
    if line:
        floors[line[0]] = int(line[1])
found, low = {}, []
for obj in sys.argv[3:]:
    stem = re.sub(r"(\.(cpp|cu))?\.o(bj)?$", "", pathlib.Path(obj).name)
    if stem not in floors:
        continue
    text = subprocess.run([objdump, "-d", "--no-show-raw-insn", obj], check=True, capture_output=True, text=True).stdout
    count = len(re.findall(r"\tprefetch", text))
    found[stem] = count
    print(f"{stem:36} {count:5} prefetches (floor {floors[stem]})")
    if count < floors[stem]:
        low.append(f"{stem}: {count} prefetch instructions, fewer than its floor of {floors[stem]}")
# A kernel of an instruction set this build made, yet missing, was renamed or
# dropped; one of an instruction set the compiler lacks (avx512vbmi) was not built.
built_isas = {stem.rsplit("_", 1)[1] for stem in found}
for stem in sorted(set(floors) - set(found)):
    if stem.rsplit("_", 1)[1] in built_isas:
        low.append(f"{stem}: not among the objects given, though its instruction set was built (renamed?)")
    else:
        print(f"{stem:36} not built here (its instruction set is not in this build)")
if not found:
    low.append("no kernel object of the floors file was given: were the kernels renamed?")
for message in low:
    print("kernel_prefetch: " + message, file=sys.stderr)
sys.exit(1 if low else 0)
