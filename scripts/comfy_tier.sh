#!/usr/bin/env bash
# The real-ComfyUI tier (tests/comfy/, docs/testing.md): ComfyUI's own code, headless on the CPU, with this
# checkout in its custom_nodes/. Sets up everything the tier needs from ComfyUI as released (the folder
# ../shared/comfyui beside the repository, see its README), then runs pytest on the tier:
#
#   scripts/comfy_tier.sh                      the quick part (tests marked comfy_quick) on ComfyUI 0.33.0
#   scripts/comfy_tier.sh --full               every comfy test, on each version (0.33.0, then 0.3.75)
#   scripts/comfy_tier.sh -- -k wan -x         pytest arguments after `--` (with --quick: within comfy_quick)
#
# Environment:
#   COMFY_SHARED     the folder holding <version>/ and custom_nodes/ComfyUI-GGUF (default: ../shared/comfyui
#                    from the repository root). Missing: the script fails, naming the folder (never skips).
#   COMFY_TIER_VENV  the tier's venv; made (torch 2.13.0 CPU first, then ComfyUI's requirements without torch,
#                    torchvision, torchaudio; spandrel without its dependencies; the pack's requirements;
#                    pytest) when it does not exist, reused as is when it does. Default: a fresh one in the
#                    temporary folder, removed at the end.
#   COMFY_TIER_VERSIONS  versions to run (default: 0.33.0 for the quick part, "0.33.0 0.3.75" with --full).
#
# ComfyUI is copied from COMFY_SHARED to a temporary folder and made a git repository there (the tier runs
# `git status` on COMFYUI_PATH to check nothing is written into it); ComfyUI-GGUF is copied beside it
# (COMFYUI_GGUF_PATH). torchvision / torchaudio have no CPU build for torch 2.13: tests/comfy/standins goes
# first on PYTHONPATH (import-only stand-ins; the tier never calls them). The pack is importable as
# `rocm_parallel` through a symlink to this checkout.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
mode=quick
pytest_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) mode=quick ;;
        --full) mode=full ;;
        --) shift; pytest_args=("$@"); break ;;
        *) echo "comfy_tier.sh: unknown argument '$1' (use --quick, --full, or -- pytest arguments)" >&2; exit 2 ;;
    esac
    shift
done
shared="${COMFY_SHARED:-$root/../shared/comfyui}"
if [ "$mode" = quick ]; then versions="${COMFY_TIER_VERSIONS:-0.33.0}"; else versions="${COMFY_TIER_VERSIONS:-0.33.0 0.3.75}"; fi
gguf_source="$shared/custom_nodes/ComfyUI-GGUF"
for version in $versions; do
    if [ ! -f "$shared/$version/main.py" ]; then
        echo "comfy_tier.sh: ComfyUI $version is not in $shared/$version (no main.py). The real-ComfyUI tier runs" \
            "ComfyUI as released from the folder beside the repository (../shared/comfyui, see its README.md);" \
            "set COMFY_SHARED to the folder that holds <version>/ and custom_nodes/ComfyUI-GGUF" >&2
        exit 1
    fi
done
if [ ! -f "$gguf_source/nodes.py" ]; then
    echo "comfy_tier.sh: ComfyUI-GGUF is not in $gguf_source (no nodes.py); set COMFY_SHARED (see above)" >&2
    exit 1
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1

venv="${COMFY_TIER_VENV:-$work/venv}"
python="$venv/bin/python"
if [ ! -x "$python" ]; then
    python3 -m venv "$venv"
    # torch first, the README's CPU build (this machine's pip find-links hold it when download.pytorch.org
    # cannot be reached: no retries, so pip falls through to them at once), so nothing below pulls a CUDA one.
    PIP_RETRIES=0 "$python" -m pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    for version in $versions; do
        grep -v -E '^(torch|torchvision|torchaudio|spandrel)([<>=~ ]|$)' "$shared/$version/requirements.txt" \
            >"$work/requirements-$version.txt"
        "$python" -m pip install -q -r "$work/requirements-$version.txt"
    done
    "$python" -m pip install -q --no-deps spandrel  # it requires torchvision, which would pull a CUDA torch
    "$python" -m pip install -q -r "$root/requirements.txt" pytest pytest-timeout
fi
"$python" -c "import torch, sys; v = torch.__version__.split('+')[0]; sys.exit(0 if v == '2.13.0' else f'the tier venv has torch {v}, not 2.13.0')"

mkdir -p "$work/pack"
ln -s "$root" "$work/pack/rocm_parallel"
cp -r "$gguf_source" "$work/ComfyUI-GGUF"
export COMFYUI_GGUF_PATH="$work/ComfyUI-GGUF"
export PYTHONPATH="$root/tests/comfy/standins:$work/pack"
export PYTHONDONTWRITEBYTECODE=1  # nothing written into the ComfyUI copy, even by in-process imports
status=0
for version in $versions; do
    comfy="$work/ComfyUI-$version"
    cp -r "$shared/$version" "$comfy"
    chmod -R u+w "$comfy"
    rm -rf "$comfy/.git"
    git -C "$comfy" init -q
    git -C "$comfy" add -A
    git -C "$comfy" -c user.name=comfy-tier -c user.email=comfy-tier@localhost commit -q -m "ComfyUI $version as released"
    if [ "$mode" = quick ]; then marker=comfy_quick; else marker=comfy; fi
    echo "comfy tier ($mode): ComfyUI $version, tests marked $marker"
    # in the repository root (pyproject's pytest settings); no cache written into the checkout
    (cd "$root" && COMFYUI_PATH="$comfy" "$python" -m pytest -q -p no:cacheprovider -m "$marker" tests/comfy \
        ${pytest_args[@]+"${pytest_args[@]}"}) || status=$?
done
exit "$status"
