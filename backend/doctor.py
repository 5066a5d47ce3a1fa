"""`python -m rocm_parallel doctor`: what this machine can do for the pack, measured, with advice.

The torch build, the visible GPUs (memory, architecture), the environment flags that matter, peer
access between each pair of GPUs, then a real worker group: its start-up health check, a timed
all-reduce and all-gather, the measured bus bandwidth (`probe.measure_link`) and which attention
kernels run. Every finding that needs action comes with the action. The Status node's `doctor` action
shows the same text.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from typing import Any

from .config import ConfigError
from .platforms import (
    AOTRITON_FLAG,
    build_kind,
    echo_devices,
    gpu_arch,
    needs_aotriton_flag,
    torch_build,
    visible_gpus,
)
from .runtime.client import WorkerError, WorkerGroup, validate_devices
from .runtime.messages import HealthRequest, LinkRequest

# The environment variables that change how the workers' collectives and kernels behave.
ENV_FLAGS = (
    "NCCL_P2P_DISABLE",
    "NCCL_PROTO",
    "NCCL_SOCKET_IFNAME",
    "NCCL_DEBUG",
    "HSA_FORCE_FINE_GRAIN_PCIE",
    AOTRITON_FLAG,
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "CUDA_VISIBLE_DEVICES",
    "HSA_OVERRIDE_GFX_VERSION",
    "PYTORCH_HIP_ALLOC_CONF",
    "PYTORCH_CUDA_ALLOC_CONF",
    "OMP_NUM_THREADS",
    "ROCM_PARALLEL_THREADS",
    "ROCM_PARALLEL_BACKEND",
)
DEFAULT_TIMEOUT = 30.0


def default_devices() -> tuple[str, ...]:
    """Every visible GPU; two CPU workers when there is none (doctor still checks the group)."""
    count = visible_gpus()
    return tuple(f"cuda:{i}" for i in range(count)) if count else ("cpu", "cpu")


def _devices_text(devices: Sequence[str]) -> str:
    """'cpu, cpu' for a report line; a long list shortened (never a thousand names)."""
    return ", ".join(devices) if len(devices) <= 8 else echo_devices(devices)


def machine_facts() -> dict[str, Any]:
    """Facts read in this process: torch build, GPUs, environment flags, peer access."""
    import torch
    import torch.distributed as dist

    gpus = []
    for i in range(visible_gpus()):
        props = torch.cuda.get_device_properties(i)
        gpus.append(
            {
                "index": i,
                "name": props.name,
                "memory_gb": props.total_memory / 1e9,
                "arch": gpu_arch(f"cuda:{i}"),
            }
        )
    peer = {
        f"{a}->{b}": bool(torch.cuda.can_device_access_peer(a, b))
        for a in range(len(gpus))
        for b in range(len(gpus))
        if a != b
    }
    return {
        "torch": torch.__version__,
        "build": build_kind(),
        "build_text": torch_build(),
        "hip": getattr(torch.version, "hip", None),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "system": f"{platform.system()} {platform.release()}",
        "nccl": bool(dist.is_available() and dist.is_nccl_available()),
        "gloo": bool(dist.is_available() and dist.is_gloo_available()),
        "gpus": gpus,
        "env": {name: os.environ.get(name) for name in ENV_FLAGS},
        "peer_access": peer,
    }


def check_group(
    devices: Sequence[str], timeout: float = DEFAULT_TIMEOUT, group: WorkerGroup | None = None
) -> dict[str, Any]:
    """Start a group on `devices` (or use `group`), then time its collectives and kernels.

    Start-up runs the health check itself (and the retry without P2P on GPUs); a failure is reported,
    not raised, so the rest of the report still prints.
    """
    result: dict[str, Any] = {"devices": list(group.devices if group else devices)}
    started = time.perf_counter()
    own = group is None
    try:
        if group is None:
            group = WorkerGroup(devices, health_timeout=timeout, start_timeout=max(timeout, 120.0))
        result["start_s"] = time.perf_counter() - started
        result["warnings"] = list(group.warnings)
        result["transport"] = {
            "name": group.transport.name,
            "what": group.transport.what,
            "settings": group.transport.settings,
            "why": group.transport_why,
            "pairs": {k: v for p in group.pairs for k, v in p.pairs.items()},  # the pre-flight's exchanges
        }
        health = group.call_all("health_check", HealthRequest(), timeout=timeout)
        result["world_size"] = health[0].world_size
        result["backend"] = health[0].backend
        result["threads"] = [h.threads for h in health]
        result["correct"] = all(h.correct for h in health)
        result["all_reduce_ms"] = max(h.all_reduce_s for h in health) * 1e3
        result["all_gather_ms"] = max(h.all_gather_s for h in health) * 1e3
        result["worker_env"] = health[0].env
        link = group.call_all("measure_link", LinkRequest(megabytes=8.0, repeats=3), timeout=timeout)
        for key in ("gbps", "latency_us", "tflops"):
            if getattr(link[0], key) is not None:
                result[key] = min(getattr(r, key) for r in link)
        # the report is plain data (`--json` prints it)
        result["attention"] = [
            dataclasses.asdict(r) for r in group.call_all("attention_kernels", timeout=timeout)
        ]
    except ConfigError as exc:
        result["error"], result["input_error"] = str(exc), True
    except WorkerError as exc:
        result["error"] = str(exc)
    finally:
        if own and group is not None:
            group.close()
    return result


def advise(facts: dict[str, Any], check: dict[str, Any]) -> list[tuple[str, str]]:
    """(level, text) for each finding: 'ok', 'note', 'warn' or 'error', with the action to take."""
    out: list[tuple[str, str]] = []
    gpus = facts["gpus"]
    if facts["build"] == "cpu":
        out.append(
            (
                "note",
                f"torch {facts['torch']} is a CPU-only build: only 'cpu xN' workers (testing). For GPUs install "
                "the ROCm build (Linux: pip install torch --index-url https://download.pytorch.org/whl/rocmX.Y, "
                "X.Y from pytorch.org's install selector) "
                "or the CUDA build of torch (README, 'Platforms')",
            )
        )
    elif not gpus:
        out.append(
            (
                "warn",
                f"{facts['build_text']} sees no GPU: check the driver (rocm-smi / nvidia-smi), "
                "the user's groups 'video' and 'render' (ROCm), and HIP/CUDA_VISIBLE_DEVICES",
            )
        )
    if gpus and not facts["nccl"]:
        out.append(
            (
                "error",
                "this torch has no NCCL/RCCL (AMD's Windows wheels lack it): GPU workers cannot "
                "exchange tensors; use Linux or WSL2 with the ROCm/CUDA build of torch",
            )
        )
    if len(gpus) == 1:
        out.append(
            ("note", "one GPU visible: nothing to split; the pack needs two or more GPUs for parallelism")
        )
    no_peer = [pair for pair, ok in facts["peer_access"].items() if not ok]
    if no_peer:
        out.append(
            (
                "warn",
                f"no peer access between GPU pair(s) {', '.join(no_peer)}: collectives go through "
                "host memory. Check that the GPUs sit on CPU-attached PCIe slots, enable IOMMU "
                "passthrough (kernel parameter iommu=pt; AMD: amd_iommu=on iommu=pt) and, on ROCm, "
                "HSA_FORCE_FINE_GRAIN_PCIE=1",
            )
        )
    archs = {g["arch"] for g in gpus}
    rdna = sorted(a for a in archs if a and a.startswith("gfx") and needs_aotriton_flag(a))
    if rdna:
        value = facts["env"].get(AOTRITON_FLAG)
        if value not in (None, "1"):
            out.append(
                (
                    "warn",
                    f"{AOTRITON_FLAG}={value} in this environment disables flash attention on "
                    f"{', '.join(rdna)} (RDNA3/4): unset it or set it to 1 (the workers keep your value)",
                )
            )
        else:
            out.append(
                ("ok", f"{', '.join(rdna)} (RDNA3/4): the workers set {AOTRITON_FLAG}=1 for flash attention")
            )
    for warning in check.get("warnings", []):
        out.append(("warn", warning))
    if "error" in check:
        # The NCCL advice only where NCCL ran: GPU workers whose start or collectives failed, not a
        # refused input (check["input_error"]) or CPU workers on gloo.
        nccl = any(str(d).startswith("cuda") for d in check["devices"]) and not check.get("input_error")
        hint = (
            "; try NCCL_P2P_DISABLE=1 in ComfyUI's environment"
            if nccl and facts["env"].get("NCCL_P2P_DISABLE") != "1"
            else ""
        )
        advice = ". Run with NCCL_DEBUG=INFO to see where RCCL/NCCL stops" if nccl else ""
        out.append(
            (
                "error",
                f"the worker group on {_devices_text(check['devices'])} failed: {check['error']}{hint}{advice}",
            )
        )
        return out
    if not check.get("correct", True):
        out.append(
            ("error", "collectives returned wrong results: set NCCL_P2P_DISABLE=1 and report your GPUs")
        )
    gbps = check.get("gbps")
    on_gpu = check["devices"][0].startswith("cuda")
    if gbps is not None:
        if on_gpu and gbps < 5.0:
            out.append(
                (
                    "warn",
                    f"all-reduce bus bandwidth {gbps:.1f} GB/s is low for GPUs (PCIe 4.0 x16: ~24): "
                    "tensor parallelism will wait on the link; prefer the context layout (ring/Ulysses) "
                    "or fix P2P (iommu=pt, HSA_FORCE_FINE_GRAIN_PCIE=1, x16 slots)",
                )
            )
        else:
            out.append(
                (
                    "ok",
                    f"all-reduce bus bandwidth {gbps:.2f} GB/s, latency {check.get('latency_us', 0):.0f} µs",
                )
            )
    for report in check.get("attention", [])[:1]:
        if on_gpu and not report["fast"]:
            out.append(
                (
                    "warn",
                    f"only the math SDPA kernel runs on {report['device']} (~10x slower attention): "
                    f"flash: {report['kernels'].get('flash')}. On RDNA3/4 set {AOTRITON_FLAG}=1; "
                    "otherwise install a torch build with flash attention for this GPU",
                )
            )
        elif on_gpu:
            out.append(("ok", f"fast attention kernels on {report['device']}: {', '.join(report['fast'])}"))
    threads = check.get("threads")
    if threads and not on_gpu:
        out.append(("ok", f"{len(threads)} CPU workers with {threads[0]} torch thread(s) each"))
    return out


def collect(
    devices: Sequence[str] | None = None, timeout: float = DEFAULT_TIMEOUT, group: WorkerGroup | None = None
) -> dict[str, Any]:
    """The whole report as plain data (what `--json` prints)."""
    facts = machine_facts()
    check = check_group(tuple(devices) if devices else default_devices(), timeout, group)
    findings = advise(facts, check)
    return {"machine": facts, "group": check, "findings": [{"level": lv, "text": t} for lv, t in findings]}


def format_report(report: dict[str, Any]) -> str:
    facts, check = report["machine"], report["group"]
    lines = [
        "ROCm Parallel doctor",
        f"build:   {facts['build_text']}; python {facts['python']} on {facts['system']}; "
        f"NCCL/RCCL {'yes' if facts['nccl'] else 'no'}, gloo {'yes' if facts['gloo'] else 'no'}",
    ]
    if facts["gpus"]:
        for g in facts["gpus"]:
            lines.append(
                f"gpu {g['index']}:   {g['name']}, {g['memory_gb']:.1f} GB, {g['arch'] or 'arch unknown'}"
            )
    else:
        lines.append("gpus:    none visible")
    if facts["peer_access"]:
        lines.append(
            "peer:    " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in facts["peer_access"].items())
        )
    flags = ", ".join(f"{k}={v}" for k, v in facts["env"].items() if v is not None)
    lines.append(f"env:     {flags or 'none of ' + ', '.join(ENV_FLAGS[:5]) + ', ... is set'}")
    group = f"group:   {len(check['devices'])} workers on {_devices_text(check['devices'])}"
    if "error" in check:
        lines.append(f"{group}: FAILED")
    else:
        lines.append(
            f"{group}, {check['backend']}, world size {check['world_size']}, started in {check['start_s']:.1f} s; "
            f"collectives {'correct' if check['correct'] else 'WRONG'}"
        )
        lines.append(transport_line(check))
        lines.append(
            f"timing:  all-reduce {check['all_reduce_ms']:.2f} ms, all-gather {check['all_gather_ms']:.2f} ms "
            "(first call, 4 KB)"
            + (
                f"; bus bandwidth {check['gbps']:.2f} GB/s, latency {check['latency_us']:.0f} µs (8 MB all-reduce)"
                if "gbps" in check
                else "; one worker: no link to measure"
            )
        )
        for kernels_seen in check.get("attention", [])[:1]:
            kernels = ", ".join(
                f"{k} {'ok' if v == 'ok' else 'no'}" for k, v in kernels_seen["kernels"].items()
            )
            lines.append(f"sdpa:    {kernels_seen['device']}: {kernels}")
    marks = {"ok": "OK  ", "note": "NOTE", "warn": "WARN", "error": "FAIL"}
    lines.append("")
    lines.extend(f"[{marks[f['level']]}] {f['text']}" for f in report["findings"])
    return "\n".join(lines)


def transport_line(check: dict[str, Any]) -> str:
    """Which transport the group uses and why (preflight.py), and the pairs its probe exchanged over."""
    transport = check["transport"]
    pairs = sorted(transport["pairs"])
    probed = f"; probe: all-reduce, all-gather, {len(pairs)} pair(s) ({', '.join(pairs)})" if pairs else ""
    settings = "" if transport["settings"] == "the defaults" else f" ({transport['settings']})"
    return f"transport: {transport['what']}{settings}: {transport['why']}{probed}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--devices",
        help="devices for the test group: 'all', '0,1', 'cuda:0,cuda:1' or 'cpu x2' "
        "(default: every visible GPU, else 2 CPU workers)",
    )
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds each collective may take"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def run(args: argparse.Namespace) -> int:
    """Print the report; exit 1 when a finding is an error, 2 when the devices are wrong."""
    try:
        devices = validate_devices(args.devices) if args.devices else None
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = collect(devices, args.timeout)
    print(json.dumps(report, indent=2, default=str) if args.json else format_report(report))
    return 1 if any(f["level"] == "error" for f in report["findings"]) else 0
