"""What this machine's torch can do, and the decisions that follow: which devices 'all' means, whether
the worker group can run here at all, which GPU architectures need which environment flags, how many
threads a CPU worker gets. Shared by the nodes, the public API, the worker group and `doctor`.

Cheap to import (torch only inside the functions): the nodes call `parse_devices` at ComfyUI start-up.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Sequence

import psutil

from .config import ConfigError
from .echo import ECHO_CHARS, echo

DEVICES_ALL = "all"
_CPU_TIMES = re.compile(r"^cpu\s*[x*]\s*([0-9]+)$")
# Bounds checked before any work, so that no device text costs time or memory to refuse (the status route
# parses the panel's text on ComfyUI's event loop): 64 GPUs spelled 'cuda:0,...' take 470 characters.
MAX_DEVICE_TEXT = 1000
MAX_COUNT_DIGITS = 9  # a count or index past this is beyond any machine; never an int of 10**4300 digits
# RDNA3 (gfx11xx, RX 7000) and RDNA4 (gfx12xx, RX 9000) get flash/efficient SDPA from AOTriton only
# with this flag set before torch starts; without it SDPA falls back to the math kernel (~10x slower).
AOTRITON_FLAG = "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL"
_AOTRITON_ARCHS = re.compile(r"^gfx1[12]\d\d")
# Host memory one worker process holds besides its model's weights: python, torch, diffusers' model code
# and the process group's buffers. Measured (RSS, diffusers 0.42.1) once it has loaded and sampled a model
# of 2 MB: 0.46 GB with torch 2.13's CPU build, 0.87 GB with torch 2.15's CUDA build (its CUDA libraries,
# even without a GPU), which is what a GPU user's torch is; tests/test_reliability.py
# `test_a_workers_own_memory_is_within_the_bound` measures a real worker against it.
WORKER_HOST_BYTES = 1e9


def torch_build() -> str:
    """'torch 2.13.0+cpu (CPU-only build)', 'torch 2.6.0+rocm6.2 (ROCm/HIP 6.2...)', 'torch 2.5.1+cu124 (CUDA 12.4)'."""
    import torch

    hip, cuda = getattr(torch.version, "hip", None), torch.version.cuda
    kind = f"ROCm build, HIP {hip}" if hip else f"CUDA build, CUDA {cuda}" if cuda else "CPU-only build"
    return f"torch {torch.__version__} ({kind})"


def build_kind() -> str:
    """'rocm', 'cuda' or 'cpu': what this torch was built for."""
    import torch

    return "rocm" if getattr(torch.version, "hip", None) else "cuda" if torch.version.cuda else "cpu"


TRY_CPU = "or use 'cpu x2' to test on CPU workers"  # what a no-GPU error offers instead (plan: a count)


def no_gpu_error(devices: str, instead: str = TRY_CPU) -> ConfigError:
    """The error for `devices` ('all', or the default) on a machine where torch sees no GPU."""
    import torch

    if build_kind() == "cpu":
        why = (
            f"torch {torch.__version__} is a CPU-only build. Install the ROCm or CUDA build of torch "
            "(README, section 'Platforms')"
        )
    else:
        kind = "ROCm" if build_kind() == "rocm" else "CUDA"
        why = (
            f"{torch_build()} sees no GPU. Check the driver ({'rocm-smi' if kind == 'ROCm' else 'nvidia-smi'}), "
            "that this user may open the device (ROCm: groups 'video' and 'render'), and "
            "HIP_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES"
        )
    return ConfigError(f"devices={devices!r} but no GPU is visible: {why}; {instead}")


def visible_gpus() -> int:
    import torch  # only when 'all' is resolved: keeps the pack's import cheap

    return torch.cuda.device_count()


DeviceSpec = str | Sequence[str | int]  # "all", "0,1,2,3", "cuda:0,cuda:1", "cpu x2", or a list of devices


def echo_devices(spec: DeviceSpec) -> str:
    """`spec` as an error message shows it: whole when short, never a thousand entries."""
    if isinstance(spec, str):
        return echo(spec)
    items = list(spec)
    if len(items) <= 8:
        return repr(items)
    return f"[{', '.join(map(repr, items[:3]))}, ... ({len(items)} devices)]"


def parse_devices(spec: DeviceSpec, visible: Callable[[], int] | None = None) -> tuple[str, ...]:
    """The one device vocabulary (API, nodes, doctor, demo, bench) -> device names for the worker group.

    "all" (or empty): every visible GPU, an error naming the torch build when there is none (a CPU-only
    torch would otherwise run a GPU workflow on two CPU workers without saying so). "0,1,2,3" or
    "cuda:0, cuda:1": those GPUs. "cpu x2" (or "cpu*2", "cpu, cpu"): CPU workers, for testing, at most
    as many as this machine's memory holds (`check_cpu_workers`). A list (Python): its items, each a GPU
    index, 'cuda:N' or 'cpu'. Whether those GPUs exist is `validate_devices`'s question, not this one's.
    A text's length and counts are bounded before they cost anything (`MAX_DEVICE_TEXT`, `MAX_COUNT_DIGITS`).
    """
    if not isinstance(spec, str):
        items = list(spec)
        if not items:
            raise ConfigError(
                "devices=[] is empty; give at least one device, e.g. 'all', 'cuda:0,cuda:1' or 'cpu x2'"
            )
        return by_host(tuple(_device(item, spec) for item in items), spec)
    if len(spec) > MAX_DEVICE_TEXT:
        raise ConfigError(
            f"devices={echo_devices(spec)} is longer than {MAX_DEVICE_TEXT} characters; a device list is "
            "short: 'all', '0,1,2,3', 'cuda:0,cuda:1' or 'cpu x2'"
        )
    segments = _host_segments(spec.strip().lower())
    if len(segments) > 1 or segments[0][0] is not None:
        return by_host(_parse_hosts(segments, spec, visible), spec)
    return _parse_local(spec, visible)


def _parse_local(spec: str, visible: Callable[[], int] | None) -> tuple[str, ...]:
    """One machine's devices written as text ('all', '0,1', 'cuda:0,cuda:1', 'cpu x2')."""
    text = spec.strip().lower()
    if text in ("", DEVICES_ALL):
        count = (visible or visible_gpus)()
        if not count:
            raise no_gpu_error(spec)
        return tuple(f"cuda:{i}" for i in range(count))
    match = _CPU_TIMES.match(text)
    if match:
        digits = match.group(1).lstrip("0") or "0"
        workers = int(digits) if len(digits) <= MAX_COUNT_DIGITS else None
        if workers == 0:
            raise ConfigError(
                f"devices={echo_devices(spec)} asks for 0 CPU workers; use at least 1, e.g. 'cpu x2'"
            )
        check_cpu_workers(workers if workers is not None else len(digits), spec, digits=workers is None)
        return ("cpu",) * workers  # type: ignore[operator]  # bounded just above
    return tuple(_device(item, spec) for item in text.split(","))


def cpu_worker_bound() -> tuple[int, float, int]:
    """(most CPU workers this machine's available memory holds, that memory in bytes, its cores)."""
    available = psutil.virtual_memory().available
    return max(1, int(available // WORKER_HOST_BYTES)), available, os.cpu_count() or 1


def check_cpu_workers(workers: int, devices: DeviceSpec, *, digits: bool = False) -> None:
    """Each CPU worker is a whole Python process with torch and diffusers: bound the count by host RAM.
    The advice is also bounded by the cores: more CPU workers than cores only share them. `digits`:
    `workers` is the number of digits of a count too large to write out."""
    most, available, cores = cpu_worker_bound()
    if workers <= most and not digits:
        return
    advice = f"this machine has {cores} core(s), so use 'cpu x{max(1, min(most, cores))}' (CPU workers are for testing)"
    if digits:
        raise ConfigError(
            f"devices={echo_devices(devices)} asks for a {workers}-digit number of CPU workers; "
            f"{available / 1e9:.1f} GB of host memory are available, enough for at most {most} "
            f"({WORKER_HOST_BYTES / 1e9:g} GB each, measured on a worker that has loaded a model); {advice}"
        )
    raise ConfigError(
        f"devices={echo_devices(devices)} asks for {workers} CPU workers, which need at least "
        f"{workers * WORKER_HOST_BYTES / 1e9:.0f} GB of host memory ({WORKER_HOST_BYTES / 1e9:g} GB each, "
        "measured on a worker that has loaded a model, besides the model itself) but "
        f"{available / 1e9:.1f} GB are available; {advice}"
    )


def validate_devices(devices: DeviceSpec, backend: str | None = None) -> tuple[str, ...]:
    """Parse (`parse_devices`: 'all', '0,1', 'cuda:0,cuda:1', 'cpu x2' or a list) and check a device spec
    against this machine before any process starts. Cheap: the status route runs it for the panel.

    A GPU may be named twice only with `backend='gloo'` (several workers on one GPU: NCCL/RCCL refuse
    two ranks on one device; gloo does not care, which lets one GPU test the multi-rank paths)."""
    normalized = parse_devices(devices)
    shown = echo_devices(devices)
    kinds = {local_device(d).split(":")[0] for d in normalized}
    if len(kinds) > 1:
        raise ConfigError(f"devices={shown} mixes CPU and GPU workers; use only GPUs or only 'cpu'")
    for host, ranks in hosts_of(normalized):
        _check_host_devices(host, [local_device(normalized[r]) for r in ranks], devices, backend)
    check_platform([local_device(d) for d in normalized], backend)
    return normalized


def _check_host_devices(host: str | None, names: list[str], devices: DeviceSpec, backend: str | None) -> None:
    """One host's devices: this machine's against its memory and GPUs; another host's agent checks its own
    when it joins (runtime/agents.py), so only a GPU named twice is refused here."""
    shown = echo_devices(devices)
    if host is None and names[0] == "cpu":
        check_cpu_workers(len(names), devices)
    if not names[0].startswith("cuda"):
        return
    indices = [int(d.split(":")[1]) for d in names]
    if len(set(indices)) != len(indices) and backend != "gloo":
        where = "a GPU" if host is None else f"a GPU of {host}"
        raise ConfigError(
            f"devices={shown} names {where} twice; each worker needs its own GPU "
            "(backend='gloo' allows several workers on one GPU, for testing)"
        )
    if host is None:
        import torch

        available = torch.cuda.device_count()
        missing = [i for i in indices if i >= available]
        if missing:
            raise missing_gpu_error(devices, missing[0], available)


def check_threads(threads: object, cores: int | None = None) -> None:
    """`threads`: torch threads per worker, a whole number from 1 to this machine's cores, or None (the
    default for the devices). More threads than cores only share them; 10**9 made the worker's thread
    pool fail with std::bad_alloc."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ConfigError(
            f"threads={threads!r} must be a whole number of torch threads per worker (1 or more), or None "
            "for the default (CPU workers: the cores shared out; GPUs: torch's own)"
        )
    cores = cores or os.cpu_count() or 1
    if threads is not None and threads > cores:
        raise ConfigError(
            f"threads={echo(threads)} is more than this machine's {cores} cores; use 1 to {cores} torch threads per "
            "worker, or None for the default (CPU workers: the cores shared out; GPUs: torch's own)"
        )


PRICE_A_COUNT = "or give a count to price GPUs that are not here (--devices 4)"


def planned_gpus(spec: str) -> tuple[int, float | None]:
    """`plan --devices`: a bare count prices that many GPUs like the ones `--memory-gb` describes (they
    need not be here); any other spelling of the one vocabulary ('all', '0,1', 'cuda:0,cuda:1') names this
    machine's GPUs. -> (count, the smallest named GPU's memory in GB, None for a count). CPU workers are
    refused: the planner prices GPU memory, links and TFLOPS."""
    text = spec.strip()
    if text.isascii() and text.isdigit() and len(text.lstrip("0")) <= MAX_COUNT_DIGITS:
        if int(text) < 1:
            raise ConfigError(
                f"devices={echo_devices(spec)} prices no GPU; give a count of 1 or more, e.g. 4"
            )
        return int(text), None
    if text.lower() in ("", DEVICES_ALL) and not visible_gpus():
        raise no_gpu_error(spec, PRICE_A_COUNT)
    named = parse_devices(spec)
    if "cpu" in named:
        raise ConfigError(
            f"devices={echo_devices(spec)} names CPU workers, but the planner prices GPUs; give a GPU count "
            "(--devices 4) or this machine's GPUs ('all', '0,1', 'cuda:0,cuda:1')"
        )
    import torch

    available = torch.cuda.device_count()
    indices = [int(d.split(":")[1]) for d in named]
    missing = [i for i in indices if i >= available]
    if missing:
        raise missing_gpu_error(spec, missing[0], available, PRICE_A_COUNT)
    return len(named), min(torch.cuda.get_device_properties(i).total_memory for i in indices) / 1e9


def _device(item: str | int, spec: DeviceSpec) -> str:
    """One entry of a device list -> 'cpu' or 'cuda:N' (a bare index or 'cuda' names a GPU), or either on
    another host: 'HOST:cpu', 'HOST:cuda:N' (`device_host`)."""
    if isinstance(item, int) and not isinstance(item, bool):
        name = str(item)
    else:
        name = str(item).strip().lower()
    host = _HOST_PREFIX.match(name)
    if host is not None and _is_host(host.group(1)):
        return f"{host.group(1)}:{_device(host.group(2), spec)}"
    index = name.removeprefix("cuda:")
    if index.isascii() and index.isdigit() and (name.startswith("cuda:") or index == name):
        if len(index.lstrip("0")) > MAX_COUNT_DIGITS:
            raise ConfigError(
                f"devices={echo_devices(spec)}: GPU index {index[:12]}... ({len(index)} digits) is beyond any "
                "machine's; GPUs are numbered 0, 1, ... as rocm-smi / nvidia-smi list them (or use 'all')"
            )
        return f"cuda:{int(index)}"
    if name in ("cuda", "cpu"):
        return "cuda:0" if name == "cuda" else name
    other = re.fullmatch(r"(rocm|hip):([0-9]{1,9})", name)
    if other:  # the names a ROCm user reaches for first; torch has only 'cuda' for HIP GPUs too
        raise ConfigError(
            f"devices={echo_devices(spec)}: {name!r} is not a torch device name; ROCm (HIP) GPUs are "
            f"'cuda:N' in torch as NVIDIA ones are: use 'cuda:{int(other.group(2))}' or the index "
            f"{int(other.group(2))}"
        )
    if re.fullmatch(r"cuda:-[0-9]+", name):
        raise ConfigError(
            f"devices={echo_devices(spec)}: a GPU is named 'cuda:N' with N = 0, 1, ... (an index, not {name!r})"
        )
    shown = repr(name) if len(name) <= ECHO_CHARS else f"{name[:ECHO_CHARS]!r}..."
    raise ConfigError(
        f"devices={echo_devices(spec)}: {shown} is not a device; use 'all', GPU indices like '0,1,2,3', "
        "'cuda:0,cuda:1' or CPU workers like 'cpu x2'"
    )


# --------------------------------------------------------------------------------------------------
# Devices on other hosts (docs/hosts.md): 'cpu x2, 127.0.0.2:cpu x2', '0,1, host2:0,1'. A host's name
# prefixes its first device and applies to the devices after it until the next host's; this machine's
# devices come first (rank 0, which holds the rendezvous and reads the caller's cancels, is one of them).
# Inside the group a remote device keeps its host: 'host2:cuda:1' (rank order: hosts contiguous, this
# machine first, so the mesh's innermost dimension, TP, stays inside a host when its degree divides each
# host's count; config.ParallelLayout.check_hosts).

_HOST_PREFIX = re.compile(r"^(\[[0-9a-f:.]+\]|[a-z0-9_][a-z0-9_.-]*)\s*:\s*(.+)$")
_NOT_HOSTS = frozenset({"cuda", "cpu", "rocm", "hip"})


def _is_host(name: str) -> bool:
    """A device entry's prefix names a host (not a device kind, not an index)."""
    return name not in _NOT_HOSTS and not name.isdigit()


def device_host(device: str) -> str | None:
    """The host a group's device is on ('host2' for 'host2:cuda:1'), None for this machine's."""
    if device.startswith("["):
        return device[: device.index("]") + 1]
    head = device.split(":", 1)[0]
    return head if ":" in device and _is_host(head) else None


def local_device(device: str) -> str:
    """The device's name on its own host: 'cuda:1' for 'host2:cuda:1' (and for 'cuda:1')."""
    host = device_host(device)
    return device if host is None else device[len(host) + 1 :]


def hosts_of(devices: Sequence[str]) -> list[tuple[str | None, list[int]]]:
    """[(host, its ranks)] in rank order: (None, this machine's ranks) first when it has any."""
    found: dict[str | None, list[int]] = {}
    for rank, device in enumerate(devices):
        found.setdefault(device_host(device), []).append(rank)
    return list(found.items())


def host_sizes(devices: Sequence[str]) -> tuple[int, ...]:
    """Each host's device count, in rank order (one entry for a group on this machine alone)."""
    return tuple(len(ranks) for _, ranks in hosts_of(devices))


def by_host(devices: tuple[str, ...], spec: DeviceSpec) -> tuple[str, ...]:
    """The devices with each host's together, this machine's first (the order ranks are placed in), and a
    group whose devices are all on other hosts refused: rank 0 runs here."""
    hosts = hosts_of(devices)
    if len(hosts) == 1 and hosts[0][0] is None:
        return devices
    if hosts[0][0] is not None:
        raise ConfigError(
            f"devices={echo_devices(spec)} names no device of this machine; rank 0 runs here (it holds the "
            "group's rendezvous), so name one or more of this machine's devices first, e.g. "
            f"'0, {hosts[0][0]}:0,1' or 'cpu x1, {hosts[0][0]}:cpu x2'"
        )
    return tuple(devices[rank] for _, ranks in hosts for rank in ranks)


def _host_segments(text: str) -> list[tuple[str | None, str]]:
    """'cpu x2, 127.0.0.2:cpu x2' -> [(None, 'cpu x2'), ('127.0.0.2', 'cpu x2')]: each host's devices as
    the text of one machine (a host named twice keeps both parts)."""
    segments: list[tuple[str | None, list[str]]] = [(None, [])]
    for token in text.split(","):
        match = _HOST_PREFIX.match(token.strip())
        if match is not None and _is_host(match.group(1)):
            segments.append((match.group(1), [match.group(2)]))
        else:
            segments[-1][1].append(token)
    return [(host, ",".join(tokens)) for host, tokens in segments if host is not None or tokens]


def _parse_hosts(
    segments: list[tuple[str | None, str]], spec: str, visible: Callable[[], int] | None
) -> tuple[str, ...]:
    devices: list[str] = []
    for host, text in segments:
        if host is None:
            devices += _parse_local(text, visible)
            continue
        if text.strip() in ("", DEVICES_ALL):
            raise ConfigError(
                f"devices={echo_devices(spec)}: name {host}'s devices, e.g. '{host}:0,1' or '{host}:cpu x2' "
                "('all' means this machine's GPUs; the agent on a host offers its own, docs/hosts.md)"
            )
        match = _CPU_TIMES.match(text.strip())
        if match is not None:  # another host's CPU workers: its agent checks its own memory
            count = int(match.group(1)) if len(match.group(1)) <= MAX_COUNT_DIGITS else 0
            if count < 1:
                raise ConfigError(f"devices={echo_devices(spec)}: give {host} 1 or more CPU workers")
            devices += [f"{host}:cpu"] * count
            continue
        devices += [f"{host}:{_device(item, spec)}" for item in text.split(",")]
    return tuple(devices)


def missing_gpu_error(spec: DeviceSpec, wanted: int, available: int, instead: str = TRY_CPU) -> ConfigError:
    """The error for GPU index `wanted` when only `available` GPUs are visible (0 names the build)."""
    if available == 0:
        import torch

        why = (
            f"torch {torch.__version__} is a CPU-only build. Install the ROCm or CUDA build of torch "
            "(README, section 'Platforms')"
            if build_kind() == "cpu"
            else f"{torch_build()} sees no GPU (check the driver and HIP_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES)"
        )
        return ConfigError(
            f"devices={echo_devices(spec)} asks for GPU {wanted} but no GPU is visible: {why}; {instead}"
        )
    which = "index 0" if available == 1 else f"indices 0 to {available - 1}"
    return ConfigError(
        f"devices={echo_devices(spec)} asks for GPU {wanted} but {available} GPU(s) are visible; use {which} "
        "(or 'all')"
    )


def check_platform(
    devices: Sequence[str],
    backend: str | None,
    *,
    system: str | None = None,
    nccl_available: bool | None = None,
) -> None:
    """Refuse, before any process starts, a group this platform cannot run.

    Windows: the control channel is a Unix socket and the workers share /dev/shm, and AMD's Windows
    torch wheels ship without RCCL, so there is no GPU collective either: use Linux or WSL2.
    Elsewhere, GPU workers without NCCL/RCCL run their collectives through gloo (the transport
    pre-flight, preflight.py, chooses it and says what it costs); only an explicit `backend='nccl'` is
    refused there.
    """
    system = sys.platform if system is None else system
    if system.startswith("win"):
        raise ConfigError(
            f"devices={list(devices)}: the worker group does not run on Windows ({system}): it needs Unix "
            "sockets and /dev/shm, and AMD's Windows torch wheels have no RCCL for GPU collectives. Run "
            "ComfyUI with this pack on Linux or in WSL2 with the ROCm/CUDA build of torch (README, 'Platforms')"
        )
    if backend not in (None, "nccl", "gloo"):
        raise ConfigError(
            f"backend={backend!r} is not supported; use 'nccl' (GPUs), 'gloo' or None (automatic)"
        )
    gpus = any(d.startswith("cuda") for d in devices)
    if not gpus:
        if backend == "nccl":
            raise ConfigError(f"backend='nccl' needs GPU devices, not {list(devices)}; use 'gloo' or None")
        return
    if backend != "nccl":
        return
    if nccl_available is None:
        import torch.distributed as dist

        nccl_available = dist.is_available() and dist.is_nccl_available()
    if not nccl_available:
        raise ConfigError(
            f"backend='nccl' but {torch_build()} has no NCCL/RCCL for collectives between "
            f"devices={list(devices)} (AMD's Windows wheels and some custom builds lack it). Install the "
            "Linux ROCm or CUDA build of torch (README, 'Platforms'), or leave the backend to the pack: it "
            "then runs collectives through gloo (slower)"
        )


def gpu_arch(device: str) -> str | None:
    """'gfx1100' (ROCm), 'sm_89' (CUDA) or None when it cannot be read (no GPU, a CPU device)."""
    if not device.startswith("cuda"):
        return None
    try:
        import torch

        props = torch.cuda.get_device_properties(int(device.partition(":")[2] or 0))
    except Exception:  # no driver, no such device: decide without it
        return None
    name = getattr(props, "gcnArchName", "") or ""
    if getattr(torch.version, "hip", None) and name:
        return name.split(":")[0]
    return f"sm_{props.major}{props.minor}"


def needs_aotriton_flag(arch: str | None) -> bool:
    """RDNA3/4 (gfx11xx, gfx12xx) need the AOTriton flag; other known archs do not; unknown: set it,
    since it changes nothing on GPUs that do not need it."""
    return arch is None or bool(_AOTRITON_ARCHS.match(arch))


def default_cpu_threads(workers: int, cores: int | None = None) -> int:
    """Threads per CPU worker when the caller gives none: the cores shared out, at least one.

    Several workers each using every core run far slower than one core each (measured: `cpu x2` on two
    cores, 2.6x slower with torch's default).
    """
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, workers))
