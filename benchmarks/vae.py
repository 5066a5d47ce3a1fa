"""`bench vae`: bytes per GPU for a patch-parallel VAE decode (or encode) of FLUX.1's VAE (the released
config, by default) at 1024, 2048 and 4096 px on 1, 2 and 4 ranks: the planner's figures (backend/plan/vae.py)
next to the engine's own band code on the meta device (testing/vae_meta.py: torch's MemTracker peak of the
tallest band under the fake process group), and beside them ComfyUI's untiled decode and its tiled one.

ComfyUI's untiled decode holds COMFY_UNTILED_UNITS full-resolution maps at its peak (measured on ComfyUI's own
VAE Decode, below) besides the weights: fewer than the pack's one rank with the whole image (the 1-rank row);
its tiled decode (VAE Decode (Tiled), 512 px tiles) holds one tile's decode at a time on the GPU (the stitched
image lives in ComfyUI's intermediate device, the CPU), so its GPU peak is the weights plus its own decoder's
units on one 512 px tile with its 64 px overlap on each side (640 x 640 px). The last column
is what ComfyUI 0.33.0 frees on the GPU before its untiled decode of an AutoencoderKL (comfy/sd.py,
`VAE.memory_used_decode`: 2178 x 64 bytes per latent pixel per dtype byte, x 2.73 on AMD), its estimate, not a
measurement. Nothing here needs a GPU or weights; no image is computed.

`--cpu-sizes` also decodes those sizes for real on 1, 2 and 4 CPU workers (FLUX.1's released config, random
weights): each rank reports the peak bytes of tensor storages its decode created and held at once, and the
rise of its resident set (backend/vae/peak.py says what each counts); a second table sets the largest over
the ranks beside the planner's bytes for the busiest rank (the tallest band plus, on rank 0, the image).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from ..backend.plan.vae import vae_memory
from ..backend.text import GB
from ..backend.vae.kind import get_vae_kind, vae_kinds
from ..testing.helpers import markdown_row
from ..testing.vae_meta import measure_vae_on_meta

TILE = 512 + 2 * 64  # ComfyUI's VAEDecodeTiled defaults: 512 px tiles overlapping by 64 px
COMFY_DECODE_BYTES = 2178 * 64  # per latent pixel and dtype byte (comfy/sd.py VAE.memory_used_decode)
COMFY_AMD_RATIO = 2.73  # comfy/sd.py VAE_KL_MEM_RATIO when model_management.is_amd()
# ComfyUI's own untiled decode of FLUX.1's VAE: the full-resolution maps (the first block's channels x the
# image's pixels x dtype bytes) alive at its peak, the same in float32 and bfloat16. Measured with the CPU
# workers' counter (backend/vae/peak.py) on ComfyUI's own VAE Decode at two sizes (0.33.0: 5.06-5.07,
# 0.3.75: 5.00-5.01); tests/comfy/test_comfy_vae.py keeps it within 3 %. Its ldm Decoder holds fewer maps
# than the pack's band code on one rank (the planner's 6.0 units in float32, 10.0 in bfloat16).
COMFY_UNTILED_UNITS = 5.07


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vae", choices=[k.name for k in vae_kinds()], default="flux1-vae", help="VAE kind")
    parser.add_argument("--sizes", default="1024,2048,4096", help="square image sides in pixels")
    parser.add_argument("--ranks", default="1,2,4", help="rank counts")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--encode", action="store_true", help="an encode instead of a decode")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument(
        "--cpu-sizes", default="",
        help="also decode these sizes on real CPU workers (FLUX.1's VAE, random weights) and measure each "
        "rank's peak; slow (minutes per size on a few cores) and needs the memory: empty for none",
    )  # fmt: skip


def _weight_bytes(kind: Any, dtype: torch.dtype) -> int:
    from ..backend.vae.load import build_vae

    model = build_vae(kind, dict(kind.released), "meta", dtype)
    return sum(p.numel() for p in model.parameters()) * dtype.itemsize


def measure(
    kind: Any, size: int, ranks: int, dtype: torch.dtype, encode: bool, weights: int
) -> dict[str, Any]:
    config = dict(kind.released)
    planned = vae_memory(kind, config, size, size, ranks=ranks, dtype_bytes=dtype.itemsize,
                         weight_bytes=weights, encode=encode)  # fmt: skip
    measured = measure_vae_on_meta(kind, config, size, size, ranks=ranks, rank=ranks - 1, dtype=dtype,
                                   encode=encode)  # fmt: skip
    return {
        "size": size, "ranks": ranks, "rows": planned.rows, "weights": weights,
        "planned_activations": planned.activations, "planned_image": planned.image,
        "planned_total": planned.total, "measured_activations": measured["activations"],
    }  # fmt: skip


def run(args: argparse.Namespace) -> str:
    kind = get_vae_kind(args.vae)
    dtype = getattr(torch, args.dtype)
    weights = _weight_bytes(kind, dtype)
    full, _ = kind.widths(dict(kind.released))
    # ComfyUI's own decoder on one tile at a time (its units measured on its whole-image decode)
    tile = {"activations": COMFY_UNTILED_UNITS * full * TILE * TILE * dtype.itemsize}
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        for ranks in (int(r) for r in args.ranks.split(",")):
            rows.append(measure(kind, size, ranks, dtype, args.encode, weights))
            print(f"  measured {size} px on {ranks} rank(s)", flush=True)
    what = "encode" if args.encode else "decode"
    lines = [
        f"{kind.title}, released config, {args.dtype}, one {what}, batch 1: GB per GPU (the tallest band; rank 0 "
        f"also gathers the image). Weights {weights / GB:.3f} GB per rank. ComfyUI tiled ({TILE} px tiles with "
        f"overlap): weights + {tile['activations'] / GB:.3f} GB at any size.",
        "",
        "| image | ranks | band (latent rows) | activations plan (GB) | MemTracker (GB) | error | per GPU plan, "
        "total (GB) | ComfyUI untiled (GB) | ComfyUI tiled (GB) | ComfyUI reserves, NVIDIA / AMD (GB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        err = r["planned_activations"] / r["measured_activations"] - 1
        comfy = f"{(weights + COMFY_UNTILED_UNITS * full * r['size'] ** 2 * dtype.itemsize) / GB:.2f}"
        latent_pixels = (r["size"] // kind.downscale) ** 2
        reserve = COMFY_DECODE_BYTES * latent_pixels * dtype.itemsize
        lines.append(
            markdown_row([f"{r['size']}x{r['size']}", r["ranks"], r["rows"], f"{r['planned_activations'] / GB:.2f}",
                          f"{r['measured_activations'] / GB:.2f}", f"{err:+.1%}", f"{r['planned_total'] / GB:.2f}",
                          comfy, f"{(weights + tile['activations']) / GB:.2f}",
                          f"{reserve / GB:.2f} / {reserve * COMFY_AMD_RATIO / GB:.2f}"])
        )  # fmt: skip
    cpu_rows = measure_on_cpu_workers(kind, args) if args.cpu_sizes else []
    if cpu_rows:
        lines += ["", *cpu_table(args, cpu_rows)]
    table = "\n".join(lines)
    print("\n" + table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"planned": rows, "cpu_workers": cpu_rows}, f, indent=2)
    return table


def released_vae_file(kind: Any, folder: str) -> str:
    """A random VAE file of `kind`'s released config, in the layout ComfyUI's VAELoader reads."""
    from ..testing.vae_files import ldm_kl_shapes, write_vae

    if kind.name != "flux1-vae":
        raise SystemExit(f"--cpu-sizes decodes FLUX.1's VAE only (flux1-vae); got --vae {kind.name}")
    return write_vae(f"{folder}/{kind.name}.safetensors", ldm_kl_shapes(ch=128, mult=(1, 2, 4, 4), blocks=2))


def measure_on_cpu_workers(kind: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Decode a random latent of each `--cpu-sizes` size on each `--ranks` count of real CPU workers (one
    group per count); per rank the measured peaks (VaeReply), beside the planner's figure for the busiest rank."""
    import os
    import tempfile

    from ..backend.diffusion.api import ParallelModel
    from ..backend.runtime.client import WorkerGroup
    from ..backend.vae.api import ParallelVae

    if args.encode:
        raise SystemExit("--cpu-sizes measures a decode; leave out --encode")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        path = released_vae_file(kind, folder)
        for ranks in (int(r) for r in args.ranks.split(",")):
            threads = max(1, (os.cpu_count() or 1) // ranks)
            with WorkerGroup(["cpu"] * ranks, threads=threads) as group:
                vae = ParallelVae(ParallelModel(group=group), path, dtype=args.dtype)
                assert vae.request.config == dict(kind.released), "the random file is not the released config"
                vae.load()
                for size in (int(s) for s in args.cpu_sizes.split(",")):
                    side = size // kind.downscale
                    latent = torch.randn(1, kind.latent_channels(vae.request.config), side, side)
                    vae.decode(latent)
                    planned = vae.memory(size, size)
                    rows.append({
                        "size": size, "ranks": ranks, "rows": planned.rows, "seconds": vae.last_seconds,
                        "planned": planned.activations, "image": planned.image, "live": vae.last_peaks,
                        "rss_rise": vae.last_rss_rises,
                    })  # fmt: skip
                    print(f"  {size} px on {ranks} CPU worker(s): {vae.last_seconds:.0f} s", flush=True)
    return rows


def cpu_table(args: argparse.Namespace, rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"Measured on CPU workers ({args.dtype}, random weights, released config, one decode), weights excluded "
        "on both sides. Plan: the tallest band's activations (the planner's per GPU figure adds the image rank "
        "0 gathers, and the weights). Live tensors: the most bytes of tensor storages a rank's decode created "
        "and held at once (torch dispatch; kernel scratch outside tensors not counted), the largest over the "
        "ranks, then each rank's. RSS rise: a rank's resident high-water mark over its size before the decode "
        "(everything the process touched, allocator caching included), the largest over the ranks.",
        "",
        "| image | ranks | band (latent rows) | activations plan (GB) | live tensors (GB) | error | plan + image "
        "(GB) | live tensors per rank (GB) | RSS rise (GB) | seconds |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        live = max(r["live"])
        per_rank = " / ".join(f"{b / GB:.2f}" for b in r["live"])
        lines.append(
            markdown_row([f"{r['size']}x{r['size']}", r["ranks"], r["rows"], f"{r['planned'] / GB:.2f}",
                          f"{live / GB:.2f}", f"{r['planned'] / live - 1:+.1%}",
                          f"{(r['planned'] + r['image']) / GB:.2f}", per_rank,
                          f"{max(r['rss_rise']) / GB:.2f}", f"{r['seconds']:.0f}"])
        )  # fmt: skip
    return lines
