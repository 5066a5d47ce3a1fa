"""`python -m rocm_parallel doctor` on CPU workers (as CI runs it), and the Status node's `doctor`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from rocm_parallel.backend import doctor
from rocm_parallel.backend.diffusion.api import ParallelModel
from rocm_parallel.backend.runtime.client import WorkerGroup
from rocm_parallel.nodes.inputs import STATUS_ACTIONS
from rocm_parallel.nodes.registry import Registry
from rocm_parallel.nodes.status import status_text


def _doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rocm_parallel", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NCCL_SOCKET_IFNAME": "lo"},
    )


@pytest.mark.torch_api
def test_doctor_checks_a_real_cpu_group() -> None:
    done = _doctor("--devices", "cpu x2", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    machine, group = report["machine"], report["group"]
    assert machine["torch"] == torch.__version__
    assert machine["build"] == (
        "cpu" if torch.version.cuda is None and torch.version.hip is None else machine["build"]
    )
    assert machine["env"]["NCCL_SOCKET_IFNAME"] == "lo"  # the environment as the doctor found it
    assert machine["gpus"] == [] if not torch.cuda.is_available() else len(machine["gpus"]) > 0
    assert group["devices"] == ["cpu", "cpu"]
    assert group["world_size"] == 2 and group["backend"] == "gloo" and group["correct"] is True
    assert group["gbps"] > 0 and group["latency_us"] > 0 and group["all_reduce_ms"] > 0
    cores = len(os.sched_getaffinity(0))
    assert group["threads"] == [max(1, cores // 2)] * 2
    assert group["attention"][0]["kernels"]["math"] == "ok"
    assert "error" not in group
    levels = {f["level"] for f in report["findings"]}
    assert "error" not in levels
    texts = [f["text"] for f in report["findings"]]
    assert f"all-reduce bus bandwidth {group['gbps']:.2f} GB/s" in texts[-2]
    assert texts[-1] == f"2 CPU workers with {max(1, cores // 2)} torch thread(s) each"

    assert group["transport"] == {
        "name": "gloo",
        "what": "gloo through host memory",
        "settings": "the defaults",
        "why": "CPU workers: gloo is their backend",
        "pairs": {"0-1": group["transport"]["pairs"]["0-1"]},
    }
    text = doctor.format_report(report)
    assert (
        "transport: gloo through host memory: CPU workers: gloo is their backend; probe: "
        "all-reduce, all-gather, 1 pair(s) (0-1)"
    ) in text.splitlines()
    assert text.splitlines()[0] == "ROCm Parallel doctor"
    assert f"build:   torch {torch.__version__} (" in text
    assert "group:   2 workers on cpu, cpu, gloo, world size 2, started in " in text
    assert f"bus bandwidth {group['gbps']:.2f} GB/s" in text
    assert "NCCL_SOCKET_IFNAME=lo" in text


def test_doctor_refuses_bad_devices_before_starting_anything() -> None:
    done = _doctor("--devices", "gpu0")
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "error: devices='gpu0': 'gpu0' is not a device; use 'all', GPU indices like '0,1,2,3', "
        "'cuda:0,cuda:1' or CPU workers like 'cpu x2'"
    )
    assert done.stdout == ""


@pytest.mark.torch_api
def test_doctor_reports_a_failed_group_with_advice() -> None:
    """A group that cannot start is a finding with its message, not a traceback."""
    facts = doctor.machine_facts()
    check = {
        "devices": ["cuda:0", "cuda:1"],
        "error": "health check failed: no progress or reply from rank(s) [1]",
    }
    findings = doctor.advise(
        {**facts, "gpus": [{"index": 0, "arch": "gfx1100"}], "peer_access": {"0->1": False}}, check
    )
    levels = [level for level, _ in findings]
    assert levels[-1] == "error"
    assert findings[-1][1].startswith(
        "the worker group on cuda:0, cuda:1 failed: health check failed: no progress"
    )
    assert "try NCCL_P2P_DISABLE=1" in findings[-1][1]
    assert any(
        text.startswith("no peer access between GPU pair(s) 0->1") and "iommu=pt" in text
        for _, text in findings
    )
    assert any("gfx1100 (RDNA3/4)" in text for _, text in findings)


def test_status_node_doctor_runs_over_the_resident_group(
    group2: WorkerGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = Registry(factory=lambda devices: ParallelModel(group=group2))
    registry.group_for(("cpu", "cpu"))
    text = status_text(registry, "doctor")
    assert text.splitlines()[0] == "ROCm Parallel doctor"
    assert "group:   2 workers on cpu, cpu, gloo, world size 2" in text
    assert group2.alive  # the resident group was used, not closed
    assert "doctor" in STATUS_ACTIONS


def test_doctor_refuses_too_many_workers_in_one_line_without_an_nccl_hint() -> None:
    """`cpu x1000` used to print 'cpu, ' a thousand times, advise 43 workers on 2 cores and NCCL_DEBUG."""
    done = _doctor("--devices", "cpu x1000")
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith(
        "error: devices='cpu x1000' asks for 1000 CPU workers, which need at least 1000 GB of host memory "
    )
    advice = re.search(
        r"this machine has (\d+) core\(s\), so use 'cpu x(\d+)' \(CPU workers are for testing\)$", line
    )
    assert advice and advice[1] == str(os.cpu_count()) and 1 <= int(advice[2]) <= int(advice[1])
    assert "NCCL" not in line


def test_an_input_error_in_the_group_gets_no_nccl_advice() -> None:
    facts = doctor.machine_facts()
    check = {"devices": ["cuda:0", "cuda:1"], "error": "devices=... names a GPU twice", "input_error": True}
    assert doctor.advise(facts, check)[-1] == (
        "error",
        "the worker group on cuda:0, cuda:1 failed: devices=... names a GPU twice",
    )
