#!/usr/bin/env bash
# Prepare the carry folder for a lent GPU machine (docs/gpu.md): the wheels `bench gpu` needs there and the
# machine lacks. Those machines have Python 3.12, torch 2.11.0+cu130, transformers and safetensors (with
# numpy, huggingface-hub, pyyaml, packaging that they bring), no network, and take at most 64 MiB of files
# carried with the working tree. So: diffusers and accelerate (the pack's), psutil (the workers'), and what
# diffusers imports that transformers does not bring (Pillow, requests and its four, importlib_metadata and
# zipp). Nothing that is there already is carried: a carried copy would shadow it.
#
#   scripts/gpu_carry.sh [folder]      (default .gpu-carry, git-ignored: name it in the run's `carry`)
#
# GPU_PYTHON=3.11 makes a folder for another Python (the same wheels, other tags: how it was tried on a
# machine without Python 3.12). Fails when the folder and the tracked tree together pass 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-.gpu-carry}"
python_version="${GPU_PYTHON:-3.12}"
abi="cp${python_version/./}"
rm -rf "$dest"
mkdir -p "$dest"
# The versions the suite runs against (pyproject.toml's ranges); binary wheels for manylinux x86_64.
PIP_CONSTRAINT=/dev/null python3 -m pip download --no-deps --only-binary=:all: --disable-pip-version-check \
    --python-version "$python_version" --implementation cp --abi "$abi" --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$dest" \
    "diffusers==0.42.1" "accelerate==1.15.0" "psutil==7.2.2" "pillow==13.0.0" "requests==2.34.2" \
    "urllib3==2.8.0" "idna==3.20" "certifi==2026.10.19.post1" "charset_normalizer==3.5.3" \
    "importlib_metadata==10.2.0" "zipp==4.1.2"
limit=$((64 * 1024 * 1024))
carried=$(du -cb "$dest" | tail -1 | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
echo "$dest: $(ls "$dest" | wc -l) wheels, $((carried / 1024)) KiB; tracked tree $((tree / 1024)) KiB; together $(((carried + tree) / 1024)) KiB of $((limit / 1024)) KiB"
if [ $((carried + tree)) -gt "$limit" ]; then
    echo "error: more than 64 MiB would be carried" >&2
    exit 1
fi
