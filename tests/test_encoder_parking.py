"""A text encoder beside a diffusion model on one worker group: where its shard waits between jobs
(backend/resident/parking.py). "auto" keeps it on the devices and parks it in host memory only when a job would not
fit beside it; "resident" never parks it; "host" parks it after every encode; the next encode brings it back.

CPU workers share the host's memory, so parking frees nothing there and the group never parks on its own. These
tests make the group believe its devices are GPUs of a fixed size (`fake_gpu`: admission's memory bound is a
budget minus the bytes the encoder holds on the devices, as the ranks report them), so the decisions run as on
a GPU; the ranks really run the park method (`ResidentModel.on_host` is what they report). The GPU tier's
test_gpu.py checks that a parked shard really leaves the GPU's memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest
import torch
from test_service import call_inputs as flux_inputs
from test_service import one_process as flux_one_process

from rocm_parallel.backend.config import ConfigError
from rocm_parallel.backend.diffusion import admission
from rocm_parallel.backend.diffusion.api import ParallelModel
from rocm_parallel.backend.encoders.api import ParallelEncoder
from rocm_parallel.backend.resident import admission as limits
from rocm_parallel.backend.resident.group import ResidentGroup, weight_bytes_per_rank
from rocm_parallel.backend.runtime.client import WorkerGroup
from rocm_parallel.testing.encoder_files import VOCAB, write_encoder

SLOT = "te parked"
TOL = 1e-5


@pytest.fixture(scope="module")
def t5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_encoder("t5", tmp_path_factory.mktemp("text_encoders"))


@pytest.fixture
def flux(group2: WorkerGroup, checkpoints: dict[str, str]) -> Iterator[ParallelModel]:
    group = ParallelModel(group=group2)
    group.unload()  # whatever earlier tests left resident on the session's ranks
    group.load(checkpoints["dev"], layout="tp", dtype="float32")
    yield group
    group.unload()


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))


def _on_host(group: ResidentGroup) -> list[bool]:
    """What every rank reports of the encoder's slot."""
    return [next(m for m in r.models if m.slot == SLOT).on_host for r in group.status()]


def _model_call_bytes(group: ParallelModel) -> float:
    inputs = flux_inputs()
    resident = group.residents["default"]
    return admission.activation_estimate(
        resident.info, resident.layout, tuple(inputs["x"].shape), dtype="float32",
        text_tokens=inputs["context"].shape[1],
    )  # fmt: skip


@contextmanager
def fake_gpu(group: ResidentGroup, encoder: ParallelEncoder, budget: float) -> Iterator[None]:
    """Devices of `budget` bytes for activations while the encoder is parked, its shard less while not."""

    def memory_limit(devices: object, reports: list) -> tuple[float, str]:
        held = sum(m.parameter_bytes for m in reports[0].models if m.slot == SLOT and not m.on_host)
        return budget - held, "the fake GPU"

    with (
        mock.patch.object(type(group), "_parking_frees_memory", return_value=True),
        mock.patch.object(admission, "memory_limit", side_effect=memory_limit),  # a model call's admission
        mock.patch.object(limits, "memory_limit", side_effect=memory_limit),  # the group's parking
    ):
        yield


def test_auto_parks_the_encoder_when_a_model_call_needs_its_room_and_brings_it_back(
    flux: ParallelModel, t5: Path
) -> None:
    encoder = ParallelEncoder(flux, t5, slot=SLOT)
    first = encoder.encode(_ids()).out
    assert _on_host(flux) == [False, False]
    need = _model_call_bytes(flux)
    with fake_gpu(flux, encoder, budget=need + encoder.request.weight_bytes / 2):  # fits only parked
        out = flux.forward(**flux_inputs())
        assert _on_host(flux) == [True, True]
        assert encoder.on_host
        assert (out - flux_one_process(flux_inputs())).abs().max().item() <= TOL
        again = encoder.encode(_ids()).out  # back on the devices first
        assert _on_host(flux) == [False, False] and not encoder.on_host
    assert torch.equal(again, first)
    assert list(flux.residents) == ["default", SLOT] and flux.evicted == []


def test_auto_leaves_the_encoder_where_it_is_when_the_call_fits_beside_it(
    flux: ParallelModel, t5: Path
) -> None:
    encoder = ParallelEncoder(flux, t5, slot=SLOT)
    encoder.encode(_ids())
    with fake_gpu(flux, encoder, budget=_model_call_bytes(flux) + encoder.request.weight_bytes * 2):
        flux.forward(**flux_inputs())
    assert _on_host(flux) == [False, False]


def test_a_resident_encoder_is_never_parked_and_the_call_is_refused(flux: ParallelModel, t5: Path) -> None:
    encoder = ParallelEncoder(flux, t5, slot=SLOT, placement="resident")
    encoder.encode(_ids())
    with (
        fake_gpu(flux, encoder, budget=_model_call_bytes(flux) + encoder.request.weight_bytes / 2),
        pytest.raises(ConfigError, match=r"of activations per CPU worker .* but the fake GPU: the limit is"),
    ):
        flux.forward(**flux_inputs())
    assert _on_host(flux) == [False, False]


def test_host_parks_the_encoder_after_every_encode(flux: ParallelModel, t5: Path) -> None:
    encoder = ParallelEncoder(flux, t5, slot=SLOT, placement="host")
    first = encoder.encode(_ids()).out
    assert _on_host(flux) == [True, True]
    assert torch.equal(encoder.encode(_ids()).out, first)
    assert _on_host(flux) == [True, True]


def test_cpu_workers_never_park_on_their_own(flux: ParallelModel, t5: Path) -> None:
    """The host is their device: parking would free nothing, so a call that does not fit is refused as
    before (the encoder stays where it is)."""
    encoder = ParallelEncoder(flux, t5, slot=SLOT)
    encoder.encode(_ids())
    with (
        mock.patch.object(admission, "memory_limit", return_value=(1.0, "the host")),
        pytest.raises(ConfigError, match=r"but the host: the limit is"),
    ):
        flux.forward(**flux_inputs())
    assert _on_host(flux) == [False, False]


def test_a_model_load_parks_the_encoder_instead_of_unloading_it(
    flux: ParallelModel, t5: Path, checkpoints: dict[str, str]
) -> None:
    """When the weights do not fit together, a parkable encoder waits in host memory (it is not read again
    from its file) before any model is unloaded."""
    encoder = ParallelEncoder(flux, t5, slot=SLOT)
    first = encoder.encode(_ids()).out
    model = weight_bytes_per_rank(flux.residents["default"], "cpu")
    with (
        mock.patch.object(type(flux), "_parking_frees_memory", return_value=True),
        mock.patch.object(
            type(flux), "_weight_limit", return_value=2 * model + 1.0
        ),  # two models, no encoder
    ):
        flux.load(checkpoints["schnell"], layout="tp", dtype="float32", slot="other")
    assert flux.evicted == [] and set(flux.residents) == {"default", SLOT, "other"}
    assert _on_host(flux) == [True, True]
    loads = []
    real = flux.group.call_all

    def call_all(method: str, request: object = None, **kwargs: object) -> object:
        loads.append(method)
        return real(method, request, **kwargs)

    with mock.patch.object(flux.group, "call_all", side_effect=call_all):
        again = encoder.encode(_ids()).out
    assert "encoder_load" not in loads and loads[0] == "encoder_offload"
    assert torch.equal(again, first)


def test_the_panel_and_the_status_node_say_where_the_encoder_waits(flux: ParallelModel, t5: Path) -> None:
    from rocm_parallel.nodes.registry import Registry
    from rocm_parallel.nodes.status import format_state

    registry = Registry(factory=lambda devices: flux)
    registry.group_for(flux.devices)
    registry.watch_residency(flux)
    encoder = ParallelEncoder(flux, t5, slot=SLOT, placement="host")
    encoder.encode(_ids())
    size = f"{encoder.request.weight_bytes / 1e6:.1f} MB"
    entry = next(m for m in registry.snapshot()["models"] if m["checkpoint"] == t5.name)
    assert entry == {
        "checkpoint": t5.name,
        "layout": "text encoder, tp 2",
        "placement": f"{size} per device, in host memory",
    }
    assert (
        f"resident: tiny-flux-dev.safetensors (tp 2), {t5.name} (text encoder, tp 2, {size} per device, in host memory)"
        in format_state(registry.snapshot())
    )
    encoder.place(True)
    entry = next(m for m in registry.snapshot()["models"] if m["checkpoint"] == t5.name)
    assert entry["placement"] == f"{size} per device, on the devices"


def test_an_encode_brings_the_encoder_back_beside_the_model_within_the_encode_bound(
    flux: ParallelModel, t5: Path
) -> None:
    """Encoder and model may fit together only while no sampling activations are live (the planner's "host":
    FLUX.2 [dev]'s bf16 Mistral beside its fp8 model on 24 GB GPUs). Bringing the parked encoder back for the
    next prompt must not unload the model: an encode is bounded by `_encode_limit`, not by the share that keeps
    room for sampling."""
    encoder = ParallelEncoder(flux, t5, slot=SLOT)
    model = weight_bytes_per_rank(flux.residents["default"], "cpu")
    shard = encoder.request.weight_bytes
    with (
        mock.patch.object(type(flux), "_parking_frees_memory", return_value=True),
        mock.patch.object(type(flux), "_weight_limit", return_value=model + shard / 2),
        mock.patch.object(type(flux), "_encode_limit", return_value=model + shard * 2),
    ):
        first = encoder.encode(_ids()).out
        flux.park(SLOT)
        assert _on_host(flux) == [True, True]
        assert torch.equal(encoder.encode(_ids()).out, first)
    assert _on_host(flux) == [False, False]
    assert flux.evicted == [] and set(flux.residents) == {"default", SLOT}
