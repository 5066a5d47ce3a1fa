"""The worker group: transport, progress, cancel, timeouts, failures, clean exits, no orphans."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from worker_jobs import OnRank, Scale, Scaled, Steps

from rocm_parallel.backend.config import ConfigError
from rocm_parallel.backend.flux.dims import FluxDims
from rocm_parallel.backend.runtime.client import JobTimeout, WorkerError, WorkerGroup, validate_devices
from rocm_parallel.backend.runtime.transport import UnknownRecord

TESTS_DIR = str(Path(__file__).resolve().parent)  # on the workers' sys.path: worker_jobs lives here


def _gone(pids: list[int], within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = [
            p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        ]
        if not alive:
            return True
        time.sleep(0.1)
    return False


def test_progress_reaches_the_caller(group2: WorkerGroup) -> None:
    seen: list[tuple[int, int]] = []
    results = group2.call_all("steps", Steps(n=4), progress=lambda s, t: seen.append((s, t)))
    assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert [r.sum for r in results] == [8.0, 8.0]  # 4 steps x all-reduce of 1 over 2 ranks


class Interrupted(Exception):
    pass


def test_cancel_stops_every_rank_within_a_step(group2: WorkerGroup) -> None:
    seen: list[int] = []

    def interrupt_at_two(step: int, total: int) -> None:
        seen.append(step)
        if step == 2:
            raise Interrupted("user pressed Cancel")

    with pytest.raises(Interrupted, match="user pressed Cancel"):
        group2.call("steps", Steps(n=50, seconds=0.05), progress=interrupt_at_two)
    assert seen == [2] or seen[:2] == [1, 2]
    assert len(seen) <= 3  # stopped at the next step boundary
    # what the workers did, not the client's progress filter: every rank stopped with the agreed cancel
    # (mutation tried: `step_done` never raising JobCancelled made every rank reply ok after 50 steps)
    assert all(r.error_type == "JobCancelled" for r in group2.last_replies.values())
    # the group is still usable
    assert group2.call("steps", Steps(n=2)).sum == 4.0


def test_timeout_cancels_and_keeps_the_group(group2: WorkerGroup) -> None:
    started = time.monotonic()
    with pytest.raises(JobTimeout, match=r"'steps' ran past its time limit of 1 s and was cancelled"):
        group2.call("steps", Steps(n=100, seconds=0.1), timeout=1.0)
    assert time.monotonic() - started < 5
    assert group2.alive
    assert group2.call("ping").rank == 0


@pytest.mark.torch_api
def test_large_tensors_travel_through_shared_files(group2: WorkerGroup) -> None:
    big = torch.randn(512, 1024)  # 2 MiB: above the inline limit
    before = set(os.listdir(group2._workers.shm))  # the shared group's folder as earlier tests left it
    results = group2.call_all("scale", Scale(big))
    assert torch.equal(results[0].scaled, big)
    assert torch.equal(results[1].scaled, big * 2)
    assert any(name.startswith("request-") for name in results[0].files)  # it was a file, not a pickle
    assert set(os.listdir(group2._workers.shm)) == before  # and every file of this call is gone after it


def test_a_request_is_its_methods_record_and_nothing_else(group2: WorkerGroup) -> None:
    """Every method declares the record it takes and returns one (or none); the rest is refused, on
    either side, before anything runs. Mutation tried: without the type check in `worker._run` the
    `steps` handler ran with a Scale and failed with an AttributeError deep inside."""
    with pytest.raises(TypeError, match=r"^'steps': a request is a registered record or None; got dict$"):
        group2.call("steps", {"n": 1})
    with pytest.raises(WorkerError, match=r"worker method 'steps' takes a Steps; got a Scale\n"):
        group2.call("steps", Scale(torch.zeros(1)))
    with pytest.raises(WorkerError, match=r"worker method 'ping' takes no request; got a Steps\n"):
        group2.call("ping", Steps(n=1))
    with pytest.raises(
        WorkerError, match=r"worker method 'returns_a_dict' returned a dict; a method returns a"
    ):
        group2.call("returns_a_dict")
    assert group2.alive and group2.call("steps", Steps(n=1)).steps == 1


def test_a_record_the_caller_does_not_know_is_refused(group2: WorkerGroup) -> None:
    """Only registered records are rebuilt, by name: a reply naming another is an error, not a guess.
    Mutation tried: `_record_class` answering an unknown name with a SimpleNamespace returned the reply's
    data as if it were a record."""
    with pytest.raises(
        UnknownRecord, match=r"carries a 'OnlyOnTheWorkers' record, which this process does not know"
    ):
        group2.call("returns_an_unknown_record")
    assert group2.alive


def test_messages_are_plain_data_and_a_class_in_one_is_refused() -> None:
    """What a peer sends is unpickled with every class refused: bytes cannot name code to run (a tensor
    travels as raw bytes, a record as a tagged dict). Mutation tried: the plain `pickle.loads` ran
    `os.system` here."""
    import pickle
    from multiprocessing import Pipe

    from rocm_parallel.backend.runtime.transport import ProtocolError, Reply, pack, recv, send

    class Exploit:
        def __reduce__(self):
            return (os.system, ("touch /tmp/rocm-parallel-should-not-exist",))

    a, b = Pipe()
    a.send_bytes(pickle.dumps(("Reply", {"job": 1, "rank": 0, "ok": True, "result": Exploit()})))
    with pytest.raises(ProtocolError, match=r"names posix.system; only plain data is accepted"):
        recv(b)
    assert not os.path.exists("/tmp/rocm-parallel-should-not-exist")
    packed = pack(Scaled(0, torch.arange(6.0).reshape(2, 3), ("x",)), "/nonexistent", "t")
    send(a, Reply(job=2, rank=0, ok=True, result=packed))  # small tensors inline: no file at all
    got = recv(b)
    assert isinstance(got, Reply) and got.result["fields"]["files"] == ("x",)


@pytest.mark.torch_api
def test_out_of_memory_names_the_device_and_the_remedy(group2: WorkerGroup) -> None:
    with pytest.raises(WorkerError) as err:
        group2.call("out_of_memory", OnRank(rank=1))
    assert str(err.value) == (
        "rank 1 (cpu): out of memory on cpu (rank 1 of 2): CUDA out of memory. Tried to allocate 20.00 GiB. "
        "To fit: use more GPUs, use tensor parallelism (it splits the weights; context parallelism keeps a "
        "full copy per GPU), or lower the resolution"
    )
    assert err.value.rank == 1


def test_unknown_method(group2: WorkerGroup) -> None:
    with pytest.raises(WorkerError, match=r"unknown worker method 'nope'; known: .*ping"):
        group2.call("nope")


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        ([], "devices=[] is empty; give at least one device, e.g. 'all', 'cuda:0,cuda:1' or 'cpu x2'"),
        (
            ["cpu", "cuda:0"],
            "devices=['cpu', 'cuda:0'] mixes CPU and GPU workers; use only GPUs or only 'cpu'",
        ),
        (
            ["mps"],
            "devices=['mps']: 'mps' is not a device; use 'all', GPU indices like '0,1,2,3', 'cuda:0,cuda:1' or "
            "CPU workers like 'cpu x2'",
        ),
    ],
)
def test_bad_devices_fail_before_any_process(devices: list[str], message: str) -> None:
    before = psutil.Process().children()
    with pytest.raises(ConfigError) as err:
        WorkerGroup(devices)
    assert str(err.value) == message
    assert psutil.Process().children() == before


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="needs a machine without GPUs")
def test_more_gpus_than_exist() -> None:
    with pytest.raises(ConfigError) as err:
        validate_devices(["cuda:0", "cuda:1"])
    assert str(err.value) == (
        f"devices=['cuda:0', 'cuda:1'] asks for GPU 0 but no GPU is visible: {_no_gpu_reason()}; or use 'cpu x2' "
        "to test on CPU workers"
    )


def test_killed_worker_is_reported_and_a_new_group_works() -> None:
    group = WorkerGroup(["cpu", "cpu"], threads=1, extra_sys_path=[TESTS_DIR], methods=["worker_jobs"])
    victim, held = group.pids[1], []

    def kill() -> None:
        held.append(psutil.Process(victim).memory_info().rss)
        os.kill(victim, signal.SIGKILL)

    threading.Timer(1.0, kill).start()
    started = time.monotonic()
    with pytest.raises(WorkerError) as err:
        group.call("steps", Steps(n=1000, seconds=0.02))
    assert time.monotonic() - started < 10
    found = re.search(
        rf"^worker rank 1 \(cpu, pid {victim}\) exited with code -9 \(SIGKILL\) while running 'steps': it was "
        r"killed from outside the pack \(the kernel's out-of-memory killer recorded no kill\); its resident "
        r"memory was (\d+\.\d\d) GB when last read \(\d+\.\d s before\), with \d+\.\d\d GB of the machine's "
        rf"{psutil.virtual_memory().total / 1e9:.2f} GB available",
        str(err.value),
    )
    assert found, str(err.value)
    assert float(found[1]) == pytest.approx(held[0] / 1e9, rel=0.1, abs=0.011)  # what the victim held
    assert err.value.rank == 1
    assert _gone(group.pids)
    with WorkerGroup(["cpu", "cpu"], threads=1, extra_sys_path=[TESTS_DIR], methods=["worker_jobs"]) as fresh:
        assert fresh.call("steps", Steps(n=2)).sum == 4.0


def test_workers_exit_when_the_parent_dies(tmp_path) -> None:
    script = textwrap.dedent(
        """
        import os, sys
        from rocm_parallel.backend.runtime.client import WorkerGroup
        group = WorkerGroup(["cpu", "cpu"], threads=1)
        print(" ".join(map(str, group.pids)), flush=True)
        sys.stdin.read()  # wait to be killed
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
    parent.kill()  # SIGKILL: no atexit, no finalizers — only the death pipe is left
    parent.wait()
    assert _gone(pids), "workers outlived their parent"


@pytest.mark.slow
@pytest.mark.torch_api
def test_clean_exit_after_a_parallel_forward() -> None:
    from model_methods import BuildRandom, Inputs

    from rocm_parallel.testing.models import random_inputs, tiny_flux_config

    config = tiny_flux_config(heads=4, head_dim=16)
    group = WorkerGroup(["cpu", "cpu"], threads=1, extra_sys_path=[TESTS_DIR], methods=["model_methods"])
    group.call_all("build_random", BuildRandom(config, seed=0, dtype="float32", tp=2))
    group.call("forward", Inputs(random_inputs(FluxDims.from_diffusers_config(config)).as_kwargs()))
    group.close()
    assert group.exit_codes == [0, 0]
    for output in group.final_output:
        assert "terminate called" not in output and "Abort" not in output
    assert _gone(group.pids)


def test_workers_listen_on_loopback_only(group2: WorkerGroup) -> None:
    group2.call("ping")
    listening = [
        c.laddr.ip
        for pid in group2.pids
        for c in psutil.Process(pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]
    assert listening, "a group of two talks over sockets: something must listen"
    assert all(ip in ("127.0.0.1", "::1") for ip in listening), listening


def _no_gpu_reason() -> str:
    """What the message says of this torch build on a machine without a GPU (CI runs a CPU-only torch and
    a CUDA build that sees no GPU)."""
    from rocm_parallel.backend.platforms import build_kind, torch_build

    if build_kind() == "cpu":
        return (
            f"torch {torch.__version__} is a CPU-only build. Install the ROCm or CUDA build of torch (README, "
            "section 'Platforms')"
        )
    return f"{torch_build()} sees no GPU (check the driver and HIP_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES)"


def test_a_peer_with_the_wrong_key_is_refused_at_once(tmp_path: Path) -> None:
    """The control socket's HMAC handshake: a peer that answers the challenge with another key is refused
    (AuthenticationError on both sides) within a second, before anything it sends is read. Mutations
    tried: a server ignoring the failed answer (`deliver_challenge`'s error swallowed) and one without the
    handshake both accepted the peer (before this test, removing the HMAC was caught only by a 300 s
    pytest timeout)."""
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Client, Listener

    from rocm_parallel.backend.runtime.launch import _authenticated_accept

    address = str(tmp_path / "control.sock")
    listener = Listener(address, family="AF_UNIX", authkey=b"the group's key")
    peer_error: list[str] = []

    def peer() -> None:
        try:
            Client(address, family="AF_UNIX", authkey=b"another key")
        except Exception as exc:
            peer_error.append(type(exc).__name__)

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    started = time.monotonic()
    try:
        with pytest.raises(AuthenticationError):
            _authenticated_accept(listener, seconds=5.0)
        assert time.monotonic() - started < 1.0
        thread.join(5.0)
        assert peer_error == ["AuthenticationError"]
    finally:
        listener.close()


def test_every_launch_draws_its_own_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The key the workers authenticate with is 32 random bytes per launch (another local user cannot
    guess it). Mutation tried: a fixed key gave three equal keys."""
    from rocm_parallel.backend.runtime import launch

    keys: list[bytes] = []

    class Seen(Exception):
        pass

    def listener(address: str, family: str, authkey: bytes) -> None:
        keys.append(authkey)
        raise Seen

    monkeypatch.setattr(launch, "Listener", listener)
    for _ in range(3):
        workers = launch.Workers(("cpu", "cpu"), start_timeout=5.0)
        try:
            with pytest.raises(Seen):
                workers.start(lambda rank, address, shm: {})
        finally:
            workers.stop(grace=0.0)
    assert len(keys) == 3 and len(set(keys)) == 3 and all(len(k) == 32 for k in keys)
