#!/usr/bin/env bash
# Triton for flash-linear-attention on the device machine, whose torch 2.11 ships Triton 3.6.0
# (fla 0.6 refuses it on Hopper; it needs >= 3.7.1). The wheel (189 MiB) is over what one device
# call carries (64 MiB), so this builds it as two parts to carry in two calls of one warm machine:
#
#   here:   bench/triton_parts.sh            # .tw1/part.aa and .tw2/part.ab (git-ignored)
#   call 1: carry [".tw1"]: cp .tw1/part.aa /tmp/part.aa
#           (an ignored path a call does not carry is gone from the machine's tree at the next
#           call, so the first part is kept outside it)
#   call 2: carry [".tw2", ".whl"]: cat /tmp/part.aa .tw2/part.ab | python3 -c "import sys,
#           tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall('/tmp/site')"
#           then install .whl's fla wheels into /tmp/site and export PYTHONPATH=/tmp/site
#
# The archive leaves out what a Hopper training run does not load (Blackwell's ptxas, CUPTI's
# static libraries, the instrumentation test library): 95 MiB with xz -9 (about 7 minutes here).
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 -d "$work" triton==3.7.1
(cd "$work" && unzip -q triton-3.7.1-*.whl \
    && rm -rf triton/backends/nvidia/bin/ptxas-blackwell triton/backends/nvidia/lib/cupti/*.a \
        triton/instrumentation \
    && tar -cf - triton triton-3.7.1.dist-info | xz -9 -T0 > triton371.tar.xz \
    && split -b 48M triton371.tar.xz part.)
mkdir -p .tw1 .tw2
mv "$work/part.aa" .tw1/ && mv "$work/part.ab" .tw2/
grep -qx '/.tw1/' .git/info/exclude || printf '/.tw1/\n/.tw2/\n' >> .git/info/exclude
rm -rf "$work"
ls -l .tw1 .tw2
