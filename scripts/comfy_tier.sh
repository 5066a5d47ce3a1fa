#!/usr/bin/env bash
# The real-ComfyUI tier (tests/comfy/, docs/testing.md): ComfyUI's own code, headless on the CPU, with this
# checkout in its custom_nodes/. Sets up everything the tier needs from ComfyUI as released (the folder
# ../shared/comfyui beside the repository, see its README), then runs pytest on the tier:
#
#   scripts/comfy_tier.sh                      the quick part (tests marked comfy_quick) on ComfyUI 0.33.0
#   scripts/comfy_tier.sh --full               every comfy test, on each version (0.33.0, then 0.3.75)
#   scripts/comfy_tier.sh -- -k wan -x         pytest arguments after `--` (with the quick part: within it)
#   scripts/comfy_tier.sh --full -- tests/comfy/test_browser.py   one file of the tier (the browser tests)
#   scripts/comfy_tier.sh --setup-only         make COMFY_TIER_VENV and stop (.ci/run does it in the background)
#
# Environment:
#   COMFY_SHARED     the folder holding <version>/ and custom_nodes/ComfyUI-GGUF (default: ../shared/comfyui
#                    from the repository root, or from the nearest folder above it that has one: a worktree
#                    in ../wt/<name>). Missing: the script fails, naming the folder (never skips).
#   COMFY_TIER_VENV  the tier's venv; made when it does not exist (torch 2.13.0 CPU first, then ComfyUI's
#                    requirements without torch, torchvision, torchaudio; spandrel without its dependencies;
#                    the pack's requirements; pytest), reused when it does. Default: a fresh one in a temporary
#                    folder, removed at the end.
#   COMFY_TIER_VERSIONS  versions to run (default: 0.33.0 for the quick part, "0.33.0 0.3.75" with --full).
#
# Each version's ComfyUI is copied to a temporary folder and made a git repository there (the tier runs
# `git status` on COMFYUI_PATH to check nothing is written into it); ComfyUI-GGUF is copied beside it
# (COMFYUI_GGUF_PATH). torchvision / torchaudio have no CPU build for torch 2.13: tests/comfy/standins goes
# first on PYTHONPATH (import-only stand-ins; the tier never calls them). The pack is importable as
# `rocm_parallel` through a symlink to this checkout.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
mode=quick
setup_only=0
pytest_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) mode=quick ;;
        --full) mode=full ;;
        --setup-only) setup_only=1 ;;
        --) shift; pytest_args=("$@"); break ;;
        *) echo "comfy_tier.sh: unknown argument '$1' (use --quick, --full, --setup-only, or -- pytest arguments)" >&2; exit 2 ;;
    esac
    shift
done
find_shared() { # the nearest shared/comfyui beside the checkout or beside a folder above it (a worktree's)
    local dir="$root"
    while [ "$dir" != / ]; do
        dir="$(dirname "$dir")"
        [ -d "$dir/shared/comfyui" ] && { echo "$dir/shared/comfyui"; return; }
    done
    echo "$root/../shared/comfyui"  # not found: named as the default in the error below
}
shared="${COMFY_SHARED:-$(find_shared)}"
if [ "$mode" = quick ]; then
    versions="${COMFY_TIER_VERSIONS:-0.33.0}" marker=comfy_quick
else
    versions="${COMFY_TIER_VERSIONS:-0.33.0 0.3.75}" marker=comfy
fi
gguf_source="$shared/custom_nodes/ComfyUI-GGUF"
for version in $versions; do
    if [ ! -f "$shared/$version/main.py" ] || [ ! -f "$shared/$version/requirements.txt" ]; then
        echo "comfy_tier.sh: ComfyUI $version is not in $shared/$version. The real-ComfyUI tier runs ComfyUI as" \
            "released from the folder beside the repository (../shared/comfyui, see its README.md); set" \
            "COMFY_SHARED to the folder that holds <version>/ and custom_nodes/ComfyUI-GGUF" >&2
        exit 1
    fi
done
if [ ! -f "$gguf_source/nodes.py" ]; then
    echo "comfy_tier.sh: ComfyUI-GGUF is not in $gguf_source; set COMFY_SHARED (the folder that holds" \
        "<version>/ and custom_nodes/ComfyUI-GGUF)" >&2
    exit 1
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1

requirements() { # version: ComfyUI's requirements less torch, torchvision, torchaudio and spandrel
    grep -v -E '^(torch|torchvision|torchaudio|spandrel)([<>=~ ]|$)' "$shared/$1/requirements.txt" >"$work/requirements-$1.txt"
    echo "$work/requirements-$1.txt"
}

venv="${COMFY_TIER_VENV:-$work/venv}"
python="$venv/bin/python"
if [ ! -e "$venv" ]; then
    python3 -m venv "$venv"
    # torch first, the README's CPU build (this machine's pip find-links hold it when download.pytorch.org
    # cannot be reached: no retries, so pip falls through to them at once), so nothing below pulls a CUDA one.
    PIP_RETRIES=0 "$python" -m pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    first=${versions%% *}
    "$python" -m pip install -q -r "$(requirements "$first")" -r "$root/requirements.txt" pytest pytest-timeout
    "$python" -m pip install -q --no-deps spandrel  # it requires torchvision, which would pull a CUDA torch
    touch "$venv/.comfy-tier-ready"
elif [ ! -f "$venv/.comfy-tier-ready" ]; then
    echo "comfy_tier.sh: $venv exists but its setup did not finish (no .comfy-tier-ready in it); remove it" >&2
    exit 1
fi
"$python" -c "import sys, torch; v = torch.__version__.split('+')[0]; sys.exit(0 if v == '2.13.0' else f'the tier venv has torch {v}, not 2.13.0')"
[ "$setup_only" = 1 ] && exit 0

mkdir -p "$work/pack"
ln -s "$root" "$work/pack/rocm_parallel"
cp -r "$gguf_source" "$work/ComfyUI-GGUF"
export COMFYUI_GGUF_PATH="$work/ComfyUI-GGUF"
export PYTHONPATH="$root/tests/comfy/standins:$work/pack"
export PYTHONDONTWRITEBYTECODE=1  # nothing written into the ComfyUI copy, even by in-process imports
tier_path=tests/comfy  # unless the pytest arguments name the files or tests to run
for arg in ${pytest_args[@]+"${pytest_args[@]}"}; do
    case "$arg" in tests/*) tier_path= ;; esac
done
status=0
for version in $versions; do
    "$python" -m pip install -q -r "$(requirements "$version")"  # each version's own frontend and pins
    comfy="$work/ComfyUI-$version"
    cp -r "$shared/$version" "$comfy"
    chmod -R u+w "$comfy"
    rm -rf "$comfy/.git"
    git -C "$comfy" init -q
    git -C "$comfy" add -A
    git -C "$comfy" -c user.name=comfy-tier -c user.email=comfy-tier@localhost commit -q -m "ComfyUI $version as released"
    echo "comfy tier ($mode): ComfyUI $version, the tests marked $marker"
    # from the repository root (pyproject.toml's pytest settings); no pytest cache written into the checkout
    (cd "$root" && COMFYUI_PATH="$comfy" "$python" -m pytest -q -p no:cacheprovider -m "$marker" \
        ${pytest_args[@]+"${pytest_args[@]}"} $tier_path) || status=$?
done
exit "$status"
