#!/usr/bin/env bash
# Run from the project's root on a machine with a package index, before running on a GPU machine that has none:
# puts into .gpu/ (git-ignored) the wheels of every pinned package (constraints.txt) that the GPU image lacks
# (~50 MB; the image's own torch, triton, lightning, numpy, transformers... are kept, not replaced), and env.sh,
# which the GPU machine sources first:  source .gpu/env.sh && python3 -m t6.bench.suite   (docs/performance.md)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p .gpu/whl && cp "$here/env.sh" .gpu/env.sh
python3 "$here/missing.py" constraints.txt "$here/image-packages.txt" > .gpu/need.txt
plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_24_x86_64"
while read -r req; do
  [ -n "$req" ] || continue
  ls .gpu/whl | grep -qi "^$(echo "${req%%==*}" | tr '-' '_' )-${req##*==}" && continue
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat -d .gpu/whl "$req" \
    || python3 -m pip wheel -q --no-deps -w .gpu/whl "$req"   # sdist-only (pure Python) packages
done < .gpu/need.txt
du -sh .gpu
