"""A worker group across two "hosts" on this machine: this process's CPU workers and those of an agent on
127.0.0.2 with a models folder of its own (tests/agents.py), through the public API. The same job as on one
host, exact; what a second host adds, refused or named: a different file there, TP across the hosts, a wrong
key, a rank stopped there, its agent killed mid-step. Nothing is sent to an address that is not loopback.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from agents import agent_command, alive, assert_gone, free_port, running_agent, wait_joined, write_key
from test_parallel_sampling import run_case
from test_sampling import flux_model, positive, reference

from rocm_parallel.backend.checkpoint import save_checkpoint
from rocm_parallel.backend.config import ConfigError
from rocm_parallel.backend.diffusion.api import ParallelModel
from rocm_parallel.backend.runtime import hostsettings
from rocm_parallel.backend.runtime.client import WorkerError
from rocm_parallel.backend.runtime.hub import hub

KILL_NAMED_WITHIN = 10.0  # seconds from the agent's SIGKILL to the caller's error (issue 55)


class Hosts:
    """This process's hub on 127.0.0.1 and what the agents need: the key, the two models folders."""

    def __init__(self, base: Path) -> None:
        self.base, self.port = base, free_port()
        self.key = write_key(base / "user" / "rocm_parallel" / "hosts.key")
        self.here, self.there = base / "here" / "models", base / "there" / "models"
        for models in (self.here, self.there):
            (models / "diffusion_models").mkdir(parents=True)
        self.checkpoint = self.here / "diffusion_models" / "tiny-flux-dev.safetensors"
        save_checkpoint(flux_model("dev"), self.checkpoint)
        shutil.copy(self.checkpoint, self.there / "diffusion_models" / self.checkpoint.name)

    @property
    def hub(self) -> str:
        return f"127.0.0.1:{self.port}"

    def agent(self, address: str, name: str = "agent") -> running_agent:
        return running_agent(
            self.hub, self.key, address, self.base / f"{name}-{address}.log", models=self.there
        )


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    found = Hosts(tmp_path_factory.mktemp("hosts"))
    saved = {k: os.environ.get(k) for k in (hostsettings.LISTEN_ENV, hostsettings.KEY_FILE_ENV)}
    os.environ[hostsettings.LISTEN_ENV] = found.hub
    os.environ[hostsettings.KEY_FILE_ENV] = str(found.key)
    hostsettings.configure(folders={str(found.here): ""})  # as the nodes configure ComfyUI's models folder
    yield found
    hostsettings.configure(folders={})
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="module")
def second_host(hosts: Hosts) -> Iterator[object]:
    with hosts.agent("127.0.0.2") as agent:
        hub()  # listening: the agent (retrying every 2 s) joins
        wait_joined("127.0.0.2")
        yield agent


@pytest.fixture(scope="module")
def flux(hosts: Hosts, second_host: object) -> Iterator[ParallelModel]:
    model = ParallelModel("cpu x2, 127.0.0.2:cpu x2", threads=1)
    yield model
    pids = model.group.pids if model.started else []
    model.close()
    assert_gone(pids, "the group's ranks")


def _processes(pids: list[int]) -> list[psutil.Process]:
    return [psutil.Process(p) for p in pids]


def test_tp_inside_each_host_and_the_ring_across_equals_comfyui(
    hosts: Hosts, second_host: object, flux: ParallelModel
) -> None:
    flux.load(str(hosts.checkpoint), layout="tp 2 x ring 2", dtype="float32")
    diff = (run_case(flux, "dev_4steps") - reference("dev_4steps")["output"]).abs().max().item()
    assert diff <= 1e-4, f"tp 2 x ring 2 over two hosts: max |diff| {diff:.3g} vs ComfyUI"
    # ranks 0-1 are this process's children, ranks 2-3 the agent's, connected from 127.0.0.2 to the hub
    ranks = _processes(flux.group.pids)
    assert [p.ppid() for p in ranks] == [os.getpid()] * 2 + [second_host.pid] * 2
    for process in ranks[2:]:
        links = [c for c in process.net_connections("tcp") if c.raddr and c.raddr.port == hosts.port]
        assert links and all(c.laddr.ip == "127.0.0.2" for c in links), links
    # each host's ranks read their own host's copy of the file
    loaded = [s.loaded.checkpoint for s in flux.status()]
    there = str(hosts.there / "diffusion_models" / hosts.checkpoint.name)
    assert loaded == [str(hosts.checkpoint)] * 2 + [there] * 2
    # the pre-flight measured the link inside each host and the network between them
    link = flux.group.hosts_link
    assert link is not None and link.between_gbps > 0 and link.within_gbps > 0 and link.between_groups == 2


def test_a_different_or_missing_file_on_the_second_host_is_refused_before_any_load(
    hosts: Hosts, flux: ParallelModel
) -> None:
    flux.load(str(hosts.checkpoint), layout="tp 2 x ring 2", dtype="float32")
    before = [s.loaded for s in flux.status()]
    other = hosts.here / "diffusion_models" / "tiny-flux-other.safetensors"
    save_checkpoint(flux_model("dev"), other)
    save_checkpoint(
        flux_model("schnell"), hosts.there / "diffusion_models" / other.name
    )  # same name, other model
    with pytest.raises(ConfigError) as err:
        flux.load(str(other), layout="tp 2 x ring 2", dtype="float32")
    there = hosts.there / "diffusion_models" / other.name
    assert str(err.value).startswith(
        f"host 127.0.0.2 (agent pid {psutil.Process(flux.group.pids[2]).ppid()}) does not have this host's files, "
        f"so nothing was loaded: diffusion_models/{other.name}: {there} is not the same file: its size is "
        f"{there.stat().st_size:,} bytes there, {other.stat().st_size:,} here."
    ), err.value
    assert [s.loaded for s in flux.status()] == before  # no rank was sent the load
    there.unlink()
    with pytest.raises(ConfigError, match=f"diffusion_models/{other.name}: not found at {there}"):
        flux.load(str(other), layout="tp 2 x ring 2", dtype="float32")
    assert [s.loaded for s in flux.status()] == before


def test_tp_across_the_hosts_is_refused_before_any_worker_starts(hosts: Hosts, second_host: object) -> None:
    model = ParallelModel("cpu x2, 127.0.0.2:cpu x2", threads=1)
    with pytest.raises(
        ConfigError, match="layout tp 4 would put a tensor-parallel group of 4 ranks across hosts"
    ):
        model.load(str(hosts.checkpoint), layout="tp 4", dtype="float32")
    assert not model.started


def test_a_wrong_key_and_an_unauthenticated_peer_are_refused_unread(hosts: Hosts, tmp_path: Path) -> None:
    hub()
    agent = subprocess.run(
        agent_command(hosts.hub, write_key(tmp_path / "other.key"), "127.0.0.4"),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert agent.returncode == 2
    assert (
        f"the hub at {hosts.hub} refused the key: copy the key file from the first host again" in agent.stderr
    )
    assert hub().find("127.0.0.4") is None
    # a peer without the key that sends a pickle naming code instead of the challenge's answer: never read
    marker = tmp_path / "ran"
    payload = pickle.dumps(_Exploit(str(marker)))
    with socket.create_connection(("127.0.0.1", hosts.port), timeout=15) as sock:
        assert b"#CHALLENGE#" in sock.recv(4096)  # the hub speaks first
        sock.sendall(len(payload).to_bytes(4, "big") + payload)
        with contextlib.suppress(OSError):
            while sock.recv(4096):  # until the hub closes the connection
                pass
    assert not marker.exists()


class _Exploit:
    """A pickle that creates a file when it is unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (open, (self.path, "w"))


@pytest.mark.slow
def test_a_stopped_rank_on_the_second_host_is_named(hosts: Hosts, second_host: object) -> None:
    """What the agent relays (the rank's reports and the OS's view of it) is what names it, as on one host."""
    with ParallelModel("cpu x2, 127.0.0.2:cpu x2", threads=1) as model:
        model.load(str(hosts.checkpoint), layout="tp 2 x ring 2", dtype="float32")
        victim = model.group.pids[3]
        ref = reference("dev_4steps")

        def stop_at_step(step: int, total: int) -> None:
            if step == 1:
                os.kill(victim, signal.SIGSTOP)

        with pytest.raises(WorkerError) as err:
            model.sample(positive(ref["cond"], ref["pooled"], 3.5), {"samples": ref["latent"]}, seed=0, steps=50,
                         progress=stop_at_step)  # fmt: skip
        assert f"worker rank 3 (127.0.0.2:cpu, pid {victim}) is stopped (SIGSTOP or a debugger)" in str(
            err.value
        )
        assert_gone([victim], "the stopped rank")


@pytest.mark.slow
def test_killing_the_second_agent_mid_step_is_named_and_the_first_host_goes_on(hosts: Hosts) -> None:
    with hosts.agent("127.0.0.3", "killed") as agent:
        wait_joined("127.0.0.3")
        model = ParallelModel("cpu x2, 127.0.0.3:cpu x2", threads=1)
        model.load(str(hosts.checkpoint), layout="tp 2 x ring 2", dtype="float32")
        pids = list(model.group.pids)
        ref = reference("dev_4steps")
        killed: list[float] = []

        def kill_at_step(step: int, total: int) -> None:
            if step == 2 and not killed:
                killed.append(time.monotonic())
                threading.Thread(target=os.kill, args=(agent.pid, signal.SIGKILL)).start()

        with pytest.raises(WorkerError) as err:
            model.sample(positive(ref["cond"], ref["pooled"], 3.5), {"samples": ref["latent"]}, seed=0, steps=400,
                         progress=kill_at_step)  # fmt: skip
        named = time.monotonic() - killed[0]
        assert named <= KILL_NAMED_WITHIN, f"the gone host was named after {named:.1f} s"
        assert str(err.value).startswith(
            f"host 127.0.0.3 (agent pid {agent.pid}) is gone while running 'model_call': its connection closed "
            "(the agent exited or was killed, or its host went down); its rank(s) 2, 3 (127.0.0.3:cpu, "
            "127.0.0.3:cpu) are lost with it"
        ), err.value
        agent.wait(timeout=10)
        assert_gone(
            pids, "a rank on either host"
        )  # this host's stopped by the group, the other's by their death pipe
        assert not model.started
    with ParallelModel("cpu x2", threads=1) as alone:  # the next job on the first host alone
        alone.load(str(hosts.checkpoint), layout="tp", dtype="float32")
        diff = (run_case(alone, "dev_4steps") - ref["output"]).abs().max().item()
        assert diff <= 1e-4
    assert not any(alive(p) for p in pids)


@pytest.mark.slow
def test_a_frozen_second_host_is_named_and_its_ranks_leave(hosts: Hosts) -> None:
    """The agent and its ranks stopped together (a host that froze, a network that dropped): nothing closes, the
    hub hears nothing more and names the host after hub.SILENCE seconds; once thawed, the ranks find their
    connections closed and leave, and the agent stops what is left and waits for the hub again."""
    from rocm_parallel.backend.runtime.hub import SILENCE

    with hosts.agent("127.0.0.5", "frozen") as agent:
        wait_joined("127.0.0.5")
        model = ParallelModel("cpu x2, 127.0.0.5:cpu x2", threads=1)
        model.load(str(hosts.checkpoint), layout="tp 2 x ring 2", dtype="float32")
        pids = list(model.group.pids)
        frozen = [agent.pid, *pids[2:]]
        ref, stopped = reference("dev_4steps"), []

        def freeze_at_step(step: int, total: int) -> None:
            if step == 2 and not stopped:
                stopped.append(time.monotonic())
                for pid in frozen:
                    os.kill(pid, signal.SIGSTOP)

        try:
            with pytest.raises(WorkerError) as err:
                model.sample(positive(ref["cond"], ref["pooled"], 3.5), {"samples": ref["latent"]}, seed=0,
                             steps=400, progress=freeze_at_step)  # fmt: skip
            named = time.monotonic() - stopped[0]
        finally:
            for pid in frozen:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        assert named <= SILENCE + 5.0, f"the frozen host was named after {named:.1f} s"
        print(f"named after {named:.1f} s: {err.value}")
        assert "127.0.0.5" in str(err.value), err.value
        assert_gone(pids, "a rank on either host")
        wait_joined("127.0.0.5")  # the agent, thawed, joins again
        assert alive(agent.pid)
