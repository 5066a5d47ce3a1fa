"""Several hosts, the parts that need no second host: the devices' syntax, where ranks go and which layouts
are refused, the planner's price of the network, the files' identity, the key and the listen address, and
the paths a request names for another host. The groups themselves: tests/test_hosts_group.py."""

from __future__ import annotations

import hashlib
import os
import struct

import pytest
import torch
from safetensors.torch import save_file

from rocm_parallel.backend.config import ConfigError, ParallelLayout
from rocm_parallel.backend.plan import Setup, choose, estimate, plan
from rocm_parallel.backend.plan.setup import network
from rocm_parallel.backend.platforms import (
    device_host,
    host_sizes,
    hosts_of,
    local_device,
    parse_devices,
    validate_devices,
)
from rocm_parallel.backend.runtime.fileid import identity
from rocm_parallel.backend.runtime.hostsettings import parse_address, read_key, relative_name
from rocm_parallel.backend.runtime.remote import _mapped

# --------------------------------------------------------------------------------------------------
# Devices on other hosts


@pytest.mark.parametrize(
    ("text", "devices"),
    [
        ("cpu x2, 127.0.0.2:cpu x2", ("cpu", "cpu", "127.0.0.2:cpu", "127.0.0.2:cpu")),
        ("0,1, host2:0,1", ("cuda:0", "cuda:1", "host2:cuda:0", "host2:cuda:1")),
        ("0, host2:cuda:3, host3:1, 2", ("cuda:0", "host2:cuda:3", "host3:cuda:1", "host3:cuda:2")),
        # a host named twice keeps its devices together: the order ranks are placed in, host by host
        ("0, host2:0, host3:0, host2:1", ("cuda:0", "host2:cuda:0", "host2:cuda:1", "host3:cuda:0")),
    ],
)
def test_a_host_prefix_names_its_devices_until_the_next(text: str, devices: tuple[str, ...]) -> None:
    assert parse_devices(text, visible=lambda: 4) == devices


def test_a_list_of_devices_is_placed_host_by_host_this_machine_first() -> None:
    assert parse_devices(["cpu", "127.0.0.2:cpu", "cpu", "127.0.0.2:cpu"]) == (
        "cpu", "cpu", "127.0.0.2:cpu", "127.0.0.2:cpu",
    )  # fmt: skip


def test_hosts_and_local_names() -> None:
    devices = ("cuda:0", "cuda:1", "host2:cuda:0", "[fe80::1]:cuda:1")
    assert [device_host(d) for d in devices] == [None, None, "host2", "[fe80::1]"]
    assert [local_device(d) for d in devices] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert hosts_of(devices) == [(None, [0, 1]), ("host2", [2]), ("[fe80::1]", [3])]
    assert host_sizes(devices) == (2, 1, 1)
    assert host_sizes(("cpu", "cpu")) == (2,)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("127.0.0.2:cpu x2", "names no device of this machine; rank 0 runs here"),
        ("cpu, host2:all", "name host2's devices, e.g. 'host2:0,1' or 'host2:cpu x2'"),
        ("cpu, host2:0", "mixes CPU and GPU workers"),
        ("cpu, host2:cpu x0", "give host2 1 or more CPU workers"),
    ],
)
def test_device_texts_with_hosts_are_refused_naming_the_fix(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_devices(text)


def test_another_hosts_gpus_are_not_looked_for_here() -> None:
    """This machine has no GPU: a GPU of another host is its agent's to check; one named twice is refused."""
    with pytest.raises(ConfigError, match="asks for GPU 0 but no GPU is visible"):
        validate_devices("0, host2:0")  # this machine's own GPU 0 is checked
    assert parse_devices("cpu, host2:cpu x3") == ("cpu", "host2:cpu", "host2:cpu", "host2:cpu")


# --------------------------------------------------------------------------------------------------
# TP inside a host


def test_tp_across_hosts_is_refused_naming_the_degrees_that_fit() -> None:
    with pytest.raises(ConfigError) as err:
        ParallelLayout(tp=4).check_hosts((2, 2))
    assert str(err.value) == (
        "layout tp 4 would put a tensor-parallel group of 4 ranks across hosts (the hosts hold 2 and 2 devices, "
        "placed host by host); TP must stay inside a host: use tp 2 with ring, Ulysses or batch across the "
        "hosts, e.g. 'tp 2 x ring 2'"
    )
    with pytest.raises(ConfigError, match="no TP degree divides every host's devices"):
        ParallelLayout(tp=2).check_hosts((2, 1))


@pytest.mark.parametrize(
    "layout", ["tp 2 x ring 2", "ring 4", "batch 2 x tp 2", "tp 2 x ulysses 2", "ulysses 2 x ring 2"]
)
def test_layouts_whose_tp_stays_inside_a_host_are_accepted(layout: str) -> None:
    ParallelLayout.parse(layout).check_hosts((2, 2))


def test_which_dimensions_cross_hosts() -> None:
    """Ranks are laid out batch, ring, ulysses, tp (outermost to innermost): on 2 hosts x 4, tp 2 x ulysses 2
    x ring 2 keeps TP and Ulysses inside a host and puts the ring across."""
    layout = ParallelLayout(tp=2, ulysses=2, ring=2)
    crosses = {dim: layout.crosses_hosts(dim, 4) for dim in ("tp", "ulysses", "ring", "cp")}
    assert crosses == {"tp": False, "ulysses": False, "ring": True, "cp": True}
    assert ParallelLayout(batch=2, tp=4).crosses_hosts("batch", 4)
    assert not ParallelLayout(batch=2, tp=4).crosses_hosts("tp", 4)


# --------------------------------------------------------------------------------------------------
# The planner prices the network between hosts


def _setup(gbit: float, hosts: int = 2, devices: int = 8) -> Setup:
    from rocm_parallel.backend.flux.dims import FluxDims
    from rocm_parallel.backend.flux.facts import FLUX_DEV

    dims = FluxDims.from_diffusers_config(FLUX_DEV)
    return Setup(dims, devices=devices, hosts=hosts, inter_host=network(gbit), memory_gb=24.0)


def test_the_planner_offers_no_layout_whose_tp_spans_hosts() -> None:
    layouts = [e.layout for e in plan(_setup(100))]
    assert layouts and all(layout.tp <= 4 for layout in layouts)
    assert ParallelLayout(tp=8) not in layouts
    with pytest.raises(ConfigError, match="TP must stay inside a host"):
        estimate(_setup(100), ParallelLayout(tp=8))


def test_a_slower_network_costs_only_the_dimensions_that_cross_it() -> None:
    fast, slow = _setup(100), _setup(10)
    inside, across = ParallelLayout(tp=4, ring=2), ParallelLayout(tp=2, ring=4)
    # tp 4 x ring 2 on 2 hosts x 4: TP inside, the ring across; its TP collectives cost the same on both
    by_dim = {c.dim: c for c in estimate(fast, inside).collectives}
    assert set(by_dim) >= {"tp", "ring"}
    for layout in (inside, across):
        assert estimate(slow, layout).comm_s > estimate(fast, layout).comm_s
        assert estimate(slow, layout).compute_s == estimate(fast, layout).compute_s
    one_host = Setup(fast.dims, devices=8, memory_gb=24.0)
    assert estimate(fast, inside).comm_s > estimate(one_host, inside).comm_s  # the ring pays the network


def test_a_hosts_network_is_shared_by_its_ranks_that_cross_at_once() -> None:
    """ring 2 x tp 4 on 2 hosts x 4: four rings cross at once (one per TP rank), each at a quarter of the
    network; ring 8 over the same hosts: one ring, crossing each boundary once, at all of it."""
    from rocm_parallel.backend.plan.cost import link_for

    setup = _setup(100)
    assert link_for(setup, ParallelLayout(tp=4, ring=2), "ring").gbps == pytest.approx(12.5 / 4)
    assert link_for(setup, ParallelLayout(ring=8), "ring").gbps == pytest.approx(12.5)
    assert link_for(setup, ParallelLayout(tp=4, ring=2), "tp") is setup.link


def test_auto_across_hosts_explains_both_links() -> None:
    choice = choose(_setup(10))
    assert choice.layout.tp <= 4
    assert "2 hosts x 4 devices, 10 Gb/s and 50 µs per collective between hosts assumed" in choice.explanation


def test_plan_cli_takes_hosts(capsys: pytest.CaptureFixture[str]) -> None:
    from rocm_parallel.backend.cli import main

    assert (
        main(["plan", "--devices", "8", "--hosts", "2", "--inter-host-gbit", "100", "--encoder", "none"]) == 0
    )
    out = capsys.readouterr().out
    assert "2 hosts x 4 devices, 100 Gb/s and 50 µs per collective between hosts assumed" in out
    assert "| tp 8 |" not in out and "| tp 4 x ring 2 |" in out
    assert main(["plan", "--devices", "8", "--hosts", "3", "--encoder", "none"]) == 2
    assert "hosts=3 must be a positive integer that divides devices=8" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# The same file on every host


def test_a_safetensors_identity_is_its_size_and_header(tmp_path) -> None:
    a, b, c = tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path / "c.safetensors"
    save_file({"w": torch.zeros(4, 4)}, str(a))
    save_file({"w": torch.ones(4, 4)}, str(b))  # other values, same header: the header cannot tell
    save_file({"v": torch.zeros(4, 4)}, str(c))  # same size, another tensor name
    ia, ib, ic = identity(str(a)), identity(str(b)), identity(str(c))
    assert ia.header == "safetensors header" and ia.size == os.path.getsize(a)
    assert ia.differs(ib) == "" and ia.size == ic.size
    assert ia.differs(ic).startswith("its safetensors header differs (SHA-256 ")
    d = tmp_path / "d.safetensors"
    save_file({"w": torch.zeros(4, 5)}, str(d))
    assert ia.differs(identity(str(d))) == f"its size is {os.path.getsize(d):,} bytes there, {ia.size:,} here"


def test_a_gguf_identity_hashes_the_header_up_to_the_data(tmp_path) -> None:
    gguf = pytest.importorskip("gguf")
    import numpy as np

    def write(path, name: str, values: np.ndarray) -> None:
        writer = gguf.GGUFWriter(str(path), "flux")
        writer.add_tensor(name, values)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    write(a, "img_in.weight", np.zeros((8, 8), np.float32))
    write(b, "img_in.weight", np.ones((8, 8), np.float32))
    write(c, "img_in.wexght", np.zeros((8, 8), np.float32))
    ia = identity(str(a))
    # the hashed bytes end where the gguf package's reader says the last tensor info ends
    last = gguf.GGUFReader(str(a)).tensors[-1].field
    with open(a, "rb") as f:
        assert (
            ia.digest == hashlib.sha256(f.read(last.offset + sum(p.nbytes for p in last.parts))).hexdigest()
        )
    assert ia.header == "GGUF header"
    assert ia.differs(identity(str(b))) == ""
    assert "GGUF header differs" in ia.differs(identity(str(c)))


def test_a_folder_identity_covers_every_file(tmp_path) -> None:
    (tmp_path / "m").mkdir()
    save_file({"w": torch.zeros(2)}, str(tmp_path / "m" / "x.safetensors"))
    (tmp_path / "m" / "config.json").write_text("{}")
    first = identity(str(tmp_path / "m"))
    assert first.header == "folder of 2 files"
    (tmp_path / "m" / "config.json").write_text('{"a": 1}')
    assert first.differs(identity(str(tmp_path / "m")))


# --------------------------------------------------------------------------------------------------
# The key and the address


def test_a_key_file_is_created_private_and_others_may_not_read_it(tmp_path) -> None:
    path = tmp_path / "rocm_parallel" / "hosts.key"
    key = read_key(path, create=True)
    assert len(key) == 32 and os.stat(path).st_mode & 0o777 == 0o600
    assert read_key(path) == key
    path.chmod(0o644)
    with pytest.raises(ConfigError, match=f"may be read by other users \\(mode 644\\).*chmod 600 {path}"):
        read_key(path)
    path.chmod(0o600)
    path.write_text("not a key")
    with pytest.raises(ConfigError, match="does not hold a key"):
        read_key(path)
    with pytest.raises(ConfigError, match="cannot be read"):
        read_key(tmp_path / "missing.key")


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("192.168.1.10:8190", ("192.168.1.10", 8190)),
        ("[fe80::1]:9000", ("fe80::1", 9000)),
        ("host1", ("host1", 8190)),
    ],
)
def test_listen_addresses(text: str, address: tuple[str, int]) -> None:
    assert parse_address(text, "listen") == address


@pytest.mark.parametrize("text", ["0.0.0.0:8190", "[::]:8190"])
def test_a_wildcard_address_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="would listen on every network of this host; name the one address"):
        parse_address(text, "ROCM_PARALLEL_LISTEN")


# --------------------------------------------------------------------------------------------------
# What a request names, on another host


def test_a_requests_files_are_named_by_the_other_hosts_copy(tmp_path) -> None:
    models = tmp_path / "models"
    (models / "diffusion_models").mkdir(parents=True)
    checkpoint = models / "diffusion_models" / "flux.safetensors"
    checkpoint.write_bytes(b"x")
    shared = tmp_path / "shared.safetensors"
    shared.write_bytes(b"y")
    payload = {"__rocm_parallel_record__": "LoadRequest", "fields": {
        "path": str(checkpoint), "loras": [str(shared)], "dtype": "float32", "gone": "/nowhere/x.safetensors",
        "tensor": {"__rocm_parallel_bytes__": str(checkpoint).encode(), "dtype": "uint8", "shape": [1]},
    }}  # fmt: skip
    files: list[tuple[str, str, str]] = []
    mapped = _mapped(payload, "/there/models", ((str(models), ""),), files)["fields"]
    assert mapped["path"] == "/there/models/diffusion_models/flux.safetensors"
    assert mapped["loras"] == [str(shared)]  # in no models folder: the same path there (a shared disk)
    assert mapped["dtype"] == "float32" and mapped["gone"] == "/nowhere/x.safetensors"
    assert mapped["tensor"] == payload["fields"]["tensor"]
    assert files == [
        (
            str(checkpoint),
            "/there/models/diffusion_models/flux.safetensors",
            "diffusion_models/flux.safetensors",
        ),
        (str(shared), str(shared), str(shared)),
    ]
    assert relative_name(str(checkpoint), ((str(models / "unet"), "unet"), (str(models), ""))) == (
        "diffusion_models/flux.safetensors"
    )


def test_a_gguf_header_walk_rejects_garbage(tmp_path) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1, 1) + b"\xff" * 32)
    assert identity(str(path)).header == "first MiB"  # not a header this reader walks: its first bytes


# --------------------------------------------------------------------------------------------------
# docs/hosts.md's planner table


def test_the_docs_table_of_two_hosts_is_the_planners() -> None:
    """Every cell of docs/hosts.md's table (2 hosts x 4 GPUs of 24 GB, FLUX.1-dev bf16 1024x1024, cfg 1 and
    3.5 at 100 and 10 Gb/s): the layouts that fit, their memory and step time, auto's pick in bold."""
    from pathlib import Path

    from rocm_parallel.backend.flux.dims import FluxDims
    from rocm_parallel.backend.flux.facts import FLUX_DEV
    from rocm_parallel.backend.plan import call_batch

    text = (Path(__file__).resolve().parents[1] / "docs" / "hosts.md").read_text()
    table = text.split("<!-- hosts-table -->\n", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    columns = [(1.0, 100.0), (1.0, 10.0), (3.5, 100.0), (3.5, 10.0)]
    dims = FluxDims.from_diffusers_config(FLUX_DEV)
    setups = [
        Setup(dims, batch=call_batch(1, cfg), devices=8, hosts=2, inter_host=network(gbit), memory_gb=24.0)
        for cfg, gbit in columns
    ]
    fitting = [{e.name: e for e in plan(s) if e.fits} for s in setups]
    picks = [str(choose(s).layout) for s in setups]
    shown = set()
    for row in table:
        name, memory, *cells = [c.strip() for c in row.strip("|").split("|")]
        shown.add(name)
        priced = [f.get(name) for f in fitting]
        assert memory == f"{max(e.per_gpu for e in priced if e) / 1e9:.1f}", name
        for cell, estimate_, pick in zip(cells, priced, picks, strict=True):
            expected = "—" if estimate_ is None else f"{estimate_.step_s:.2f}"
            assert cell == (f"**{expected}**" if name == pick else expected), (name, cell)
    assert shown == set().union(*fitting)  # every layout that fits in any column, none other
