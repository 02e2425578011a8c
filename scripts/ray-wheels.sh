#!/usr/bin/env bash
# Download, on a machine with a package index, the wheels that the GPU machine needs for the
# Ray integration (scripts/ray-wheels-py312.txt), in two halves that each fit one device call's
# carry limit (64 MiB): .whl-ray/1 holds the first 54 MiB of the ray wheel, .whl-ray/2 the rest
# of it and every other wheel. scripts/gpu-ray.sh puts them together there.
#
#   scripts/ray-wheels.sh
#   call 1: carry .whl-ray/1, run  mkdir -p /tmp/raywhl && cp .whl-ray/1/* /tmp/raywhl/
#   call 2: carry .whl and .whl-ray/2, run  bash scripts/gpu-ray.sh
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)
grep -qx '/.whl-ray/' "$exclude" 2>/dev/null || echo '/.whl-ray/' >> "$exclude"
rm -rf .whl-ray && mkdir -p .whl-ray/1 .whl-ray/2
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
    manylinux1_x86_64 manylinux_2_5_x86_64; do
    plat+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" -d .whl-ray/2 -r scripts/ray-wheels-py312.txt
ray_whl=$(ls .whl-ray/2/ray-2.*.whl)
split -b 54M "$ray_whl" .whl-ray/1/ray.whl.part-
mv .whl-ray/1/ray.whl.part-ab .whl-ray/2/
basename "$ray_whl" > .whl-ray/2/ray.whl.name
rm "$ray_whl"
du -sh .whl-ray/1 .whl-ray/2
