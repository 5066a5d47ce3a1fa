"""The ComfyUI nodes without ComfyUI: schema, input parsing, the registry, and real sampling through them.

The node classes run against stand-ins for folder_paths / comfy.utils / comfy.model_management
(tests/fake_comfy.py) and a real 2-worker CPU group; their latents must equal a real ComfyUI's
KSampler output for the same weights (tests/data/comfy_references.safetensors).
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fake_comfy import FakeComfy, InterruptProcessingException
from test_sampling import flux_model, positive, reference

import rocm_parallel
from rocm_parallel.backend.api import ParallelFlux
from rocm_parallel.backend.client import WorkerGroup
from rocm_parallel.backend.config import ConfigError, ParallelLayout
from rocm_parallel.backend.flux.convert import save_bfl_checkpoint
from rocm_parallel.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, logic
from rocm_parallel.nodes.logic import ParallelHandle, Registry

PACK_ROOT = Path(rocm_parallel.__file__).parent


@pytest.fixture
def comfy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeComfy:
    models = tmp_path / "diffusion_models"
    models.mkdir()
    fake = FakeComfy(models)
    fake.install(monkeypatch)
    return fake


# --- the pack as ComfyUI sees it -------------------------------------------------------------------


def test_pack_import_is_cheap_and_registers_nodes() -> None:
    code = (
        "import rocm_parallel, sys; print('torch' in sys.modules, sorted(rocm_parallel.NODE_CLASS_MAPPINGS))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == (
        "False ['RocmParallelLoader', 'RocmParallelRingSampler', 'RocmParallelStatus', 'RocmParallelTPSampler']"
    )
    assert rocm_parallel.WEB_DIRECTORY == "./js"
    assert list((PACK_ROOT / "js").glob("*.js")), "WEB_DIRECTORY has no extension script"


def test_every_node_is_documented(comfy: FakeComfy) -> None:
    assert set(NODE_DISPLAY_NAME_MAPPINGS) == set(NODE_CLASS_MAPPINGS)
    for node_id, cls in NODE_CLASS_MAPPINGS.items():
        assert node_id.startswith("RocmParallel")
        assert cls.CATEGORY == "ROCm Parallel"
        assert len(cls.DESCRIPTION) > 40, node_id
        spec = cls.INPUT_TYPES()
        inputs = {**spec["required"], **spec.get("optional", {})}
        for name, (_, options) in inputs.items():
            assert options.get("tooltip"), f"{node_id}.{name} has no tooltip"
        assert len(cls.OUTPUT_TOOLTIPS) == len(cls.RETURN_TYPES)
        # Every declared input reaches the function (ComfyUI passes them as keywords).
        params = inspect.signature(getattr(cls, cls.FUNCTION)).parameters
        assert set(inputs) <= set(params), f"{node_id}: {set(inputs) - set(params)} not accepted"


def test_sampler_options_are_what_the_backend_implements(comfy: FakeComfy) -> None:
    for node_id in ("RocmParallelTPSampler", "RocmParallelRingSampler"):
        required = NODE_CLASS_MAPPINGS[node_id].INPUT_TYPES()["required"]
        assert required["sampler_name"][0] == ["euler"]
        assert required["scheduler"][0] == ["simple"]
        assert required["seed"][1]["control_after_generate"] is True


# --- input parsing ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "devices"),
    [
        ("0,1,2,3", ("cuda:0", "cuda:1", "cuda:2", "cuda:3")),
        (" cuda:2, cuda:3 ", ("cuda:2", "cuda:3")),
        ("cpu x2", ("cpu", "cpu")),
        ("CPU*4", ("cpu",) * 4),
        ("cpu, cpu", ("cpu", "cpu")),
        ("all", ("cuda:0", "cuda:1", "cuda:2")),
        ("", ("cuda:0", "cuda:1", "cuda:2")),
    ],
)
def test_parse_devices(text: str, devices: tuple[str, ...]) -> None:
    assert logic.parse_devices(text, visible_gpus=lambda: 3) == devices


def test_all_devices_without_gpus_is_an_error_naming_the_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU-only torch used to run a GPU workflow on two CPU workers without a word. (CI's newest torch
    is a CUDA build without a GPU: the CPU-only reading is forced; test_platforms covers the other.)"""
    import torch

    from rocm_parallel.backend import platforms

    monkeypatch.setattr(platforms, "build_kind", lambda: "cpu")

    with pytest.raises(ConfigError) as err:
        logic.parse_devices("all", visible_gpus=lambda: 0)
    assert str(err.value) == (
        f"devices='all' but no GPU is visible: torch {torch.__version__} is a CPU-only build. Install the "
        "ROCm or CUDA build of torch (README, section 'Platforms'); or use 'cpu x2' to test on CPU workers"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "gpu0",
            "devices='gpu0': 'gpu0' is not a device; use 'all', GPU indices like '0,1,2,3', 'cuda:0,cuda:1' "
            "or CPU workers like 'cpu x2'",
        ),
        ("cpu x0", "devices='cpu x0' asks for 0 CPU workers; use at least 1, e.g. 'cpu x2'"),
        ("0,,1", "devices='0,,1': '' is not a device"),
    ],
)
def test_bad_devices(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        logic.parse_devices(text)
    assert str(err.value).startswith(message)


def test_loader_rejects_bad_devices_at_queue_time(comfy: FakeComfy) -> None:
    validate = NODE_CLASS_MAPPINGS["RocmParallelLoader"].VALIDATE_INPUTS
    assert validate(devices="cpu x2") is True
    assert validate(devices="cpu, 0") == (
        "devices=['cpu', 'cuda:0'] mixes CPU and GPU workers; use only GPUs or only 'cpu'"
    )


@pytest.mark.parametrize(
    ("ring", "ulysses", "devices", "layout"),
    [
        (0, 0, 4, None),  # auto: the planner picks the split for the image being sampled
        (2, 0, 4, ParallelLayout(ring=2, ulysses=2)),
        (0, 4, 4, ParallelLayout(ring=1, ulysses=4)),
        (1, 2, 2, ParallelLayout(ulysses=2)),
    ],
)
def test_context_layout(ring: int, ulysses: int, devices: int, layout: ParallelLayout | None) -> None:
    assert logic.context_layout(ring, ulysses, devices) == layout


@pytest.mark.parametrize(
    ("ring", "ulysses", "devices", "message"),
    [
        (
            0,
            3,
            4,
            "ulysses_degree=3 does not divide the 4 devices, so the other degree cannot fill the rest; "
            "use one of 1, 2, 4",
        ),
        (
            2,
            1,
            4,
            "ring_degree=2 x ulysses_degree=1 = 2 but the loader has 4 devices; make the product 4, "
            "or set one degree to 0 (auto)",
        ),
        (-1, 0, 2, "ring_degree=-1 must be 0 (auto) or a positive integer"),
    ],
)
def test_bad_context_degrees(ring: int, ulysses: int, devices: int, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        logic.context_layout(ring, ulysses, devices)
    assert str(err.value) == message


def test_dtype_choices() -> None:
    assert logic.compute_dtype("default") is None
    assert logic.compute_dtype("bfloat16") == "bfloat16"
    with pytest.raises(ConfigError, match="dtype='fp8' is not offered; use one of default, bfloat16"):
        logic.compute_dtype("fp8")


def test_only_gpu_workers_evict_comfyui_models() -> None:
    assert logic.needs_gpu_memory(("cuda:0", "cuda:1"))
    assert not logic.needs_gpu_memory(("cpu", "cpu"))


# --- the registry ----------------------------------------------------------------------------------


class RecordingFlux:
    """Stands in for ParallelFlux where only the registry's bookkeeping is under test."""

    def __init__(self, devices: tuple[str, ...]) -> None:
        self.devices, self.closed = devices, False
        self.warnings: list[str] = []
        self.started = False

    def close(self) -> None:
        self.closed = True


def test_status_shows_what_start_up_changed() -> None:
    registry = Registry(factory=RecordingFlux)
    registry.flux_for(("cpu", "cpu")).warnings.append("started again with NCCL_P2P_DISABLE=1")
    text = logic.status_text(registry, "report")
    assert text.splitlines()[-1] == "warning: started again with NCCL_P2P_DISABLE=1"


def test_registry_keeps_one_group_per_device_set() -> None:
    made: list[RecordingFlux] = []
    registry = Registry(factory=lambda devices: made.append(RecordingFlux(devices)) or made[-1])
    first = registry.flux_for(("cpu", "cpu"))
    assert registry.flux_for(("cpu", "cpu")) is first  # same devices: the resident group is reused
    assert registry.snapshot()["devices"] == ["cpu", "cpu"]
    other = registry.flux_for(("cpu",) * 4)  # another device set closes the old group first
    assert first.closed and not other.closed
    assert [f.devices for f in made] == [("cpu", "cpu"), ("cpu",) * 4]
    assert logic.status_text(registry, "close") == "ROCm Parallel: no worker group is running"
    assert other.closed and registry.current is None


def test_handle_is_plain_hashable_data() -> None:
    a = ParallelHandle("/m/a.safetensors", "a.safetensors", ("cpu", "cpu"), None)
    assert a == ParallelHandle("/m/a.safetensors", "a.safetensors", ("cpu", "cpu"), None)
    assert hash(a) == hash(ParallelHandle("/m/a.safetensors", "a.safetensors", ("cpu", "cpu"), None))
    assert repr(a) == "<PARALLEL_FLUX a.safetensors on cpu, cpu>"


# --- the nodes, end to end on real workers ---------------------------------------------------------


@pytest.fixture
def shared_registry(group2: WorkerGroup, monkeypatch: pytest.MonkeyPatch) -> Registry:
    """The nodes' registry, serving 'cpu x2' from the session's worker group."""
    registry = Registry(factory=lambda devices: ParallelFlux(group=group2))
    monkeypatch.setattr(logic, "REGISTRY", registry)
    monkeypatch.setattr("rocm_parallel.nodes.classes.REGISTRY", registry)
    yield registry
    registry.current.unload()


@pytest.fixture
def dev_checkpoint(comfy: FakeComfy) -> str:
    save_bfl_checkpoint(flux_model("dev"), comfy.models / "tiny-dev.safetensors")
    return "tiny-dev.safetensors"


def _sample(node_id: str, handle: ParallelHandle, name: str = "dev_4steps", **extra) -> torch.Tensor:
    ref = reference(name)
    (out,) = NODE_CLASS_MAPPINGS[node_id]().sample(
        parallel_flux=handle,
        positive=positive(ref["cond"], ref["pooled"], 3.5),
        latent_image={"samples": ref["latent"]},
        seed=42,
        steps=4,
        sampler_name="euler",
        scheduler="simple",
        denoise=1.0,
        **extra,
    )
    return out["samples"]


def test_nodes_sample_like_comfyui(comfy: FakeComfy, shared_registry: Registry, dev_checkpoint: str) -> None:
    loader = NODE_CLASS_MAPPINGS["RocmParallelLoader"]
    assert loader.INPUT_TYPES()["required"]["checkpoint"][0] == [dev_checkpoint]
    (handle,) = loader().load(checkpoint=dev_checkpoint, devices="cpu x2", dtype="float32", preload="tp")
    assert handle.devices == ("cpu", "cpu") and handle.checkpoint == str(comfy.models / dev_checkpoint)
    state = shared_registry.snapshot()
    assert (state["checkpoint"], state["layout"], state["phase"]) == (
        dev_checkpoint,
        "tensor parallel tp=2",
        "idle",
    )
    assert [r["parameter_bytes"] > 0 for r in state["ranks"]] == [True, True]

    expected = reference("dev_4steps")["output"]
    tp = _sample("RocmParallelTPSampler", handle)
    assert (tp - expected).abs().max().item() <= 1e-4
    assert comfy.progress == [(1, 4), (2, 4), (3, 4), (4, 4)]
    # CPU workers need no GPU memory: ComfyUI's own models stay where they are.
    assert "unload_all_models" not in comfy.calls and "check_interrupt" in comfy.calls

    auto = _sample("RocmParallelRingSampler", handle, ring_degree=0, ulysses_degree=0)
    assert (auto - expected).abs().max().item() <= 1e-4
    state = shared_registry.snapshot()
    chosen = {
        "context parallel ring=2 x ulysses=1": "ring=2",
        "context parallel ring=1 x ulysses=2": "ulysses=2",
    }
    assert state["layout"] in chosen  # the planner picked a context layout, never TP, for this sampler
    assert state["auto"].startswith(f"auto: {chosen[state['layout']]} — fits ")
    assert "predicted" in state["auto"] and "measured" in state["auto"]

    ring = _sample("RocmParallelRingSampler", handle, ring_degree=2, ulysses_degree=1)
    assert (ring - expected).abs().max().item() <= 1e-4
    assert shared_registry.snapshot()["layout"] == "context parallel ring=2 x ulysses=1"

    status = NODE_CLASS_MAPPINGS["RocmParallelStatus"]().status(action="report", parallel_flux=handle)
    text = status["result"][0]
    assert text.startswith(
        "ROCm Parallel: 2 workers on cpu, cpu (idle)\nmodel: tiny-dev.safetensors, context"
    )
    assert status["ui"]["text"] == [text]


def test_cancel_stops_every_rank_and_the_group_survives(
    comfy: FakeComfy, shared_registry: Registry, dev_checkpoint: str
) -> None:
    (handle,) = NODE_CLASS_MAPPINGS["RocmParallelLoader"]().load(
        checkpoint=dev_checkpoint, devices="cpu x2", dtype="float32", preload="none"
    )
    comfy.interrupt_at = 2
    with pytest.raises(InterruptProcessingException):
        _sample("RocmParallelTPSampler", handle)
    assert comfy.progress == [(1, 4), (2, 4)]
    # every rank stopped (mutation tried: `step_done` never raising JobCancelled → replies were ok)
    replies = shared_registry.current.group.last_replies
    errors = [r.error for r in replies.values()]
    assert errors[0] == errors[1] and errors[0] in (
        f"JobCancelled: cancelled after step {s} of 4" for s in (2, 3)
    )
    state = shared_registry.snapshot()  # a Cancel is not an error
    assert (state["last"], state["error"], state["phase"]) == ("sampling cancelled by the user", None, "idle")
    comfy.interrupt_at = None
    out = _sample("RocmParallelTPSampler", handle)  # same workers, next job runs in full
    assert (out - reference("dev_4steps")["output"]).abs().max().item() <= 1e-4


def test_backend_errors_reach_the_node_before_any_step(
    comfy: FakeComfy, shared_registry: Registry, dev_checkpoint: str
) -> None:
    (handle,) = NODE_CLASS_MAPPINGS["RocmParallelLoader"]().load(
        checkpoint=dev_checkpoint, devices="cpu x2", dtype="float32", preload="none"
    )
    with pytest.raises(
        ConfigError, match=r"ring_degree=2 x ulysses_degree=2 = 4 but the loader has 2 devices"
    ):
        _sample("RocmParallelRingSampler", handle, ring_degree=2, ulysses_degree=2)
    three = Registry(factory=lambda devices: ParallelFlux(list(devices), threads=1))
    with pytest.raises(ConfigError, match="tp_degree=3 does not divide 4 attention heads"):
        logic.load(three, ParallelHandle(handle.checkpoint, "x", ("cpu",) * 3, None), "tp")
    assert not three.current.started  # refused before any worker process started
    assert comfy.progress == []


def test_unload_frees_the_devices(comfy: FakeComfy, shared_registry: Registry, dev_checkpoint: str) -> None:
    NODE_CLASS_MAPPINGS["RocmParallelLoader"]().load(
        checkpoint=dev_checkpoint, devices="cpu x2", dtype="float32", preload="context"
    )
    text = NODE_CLASS_MAPPINGS["RocmParallelStatus"]().status(action="unload")["result"][0]
    assert "model: none loaded" in text
    assert [r["parameter_bytes"] for r in shared_registry.snapshot()["ranks"]] == [0, 0]


def test_threads_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(logic.THREADS_ENV, "1")
    flux = logic._default_factory(("cpu", "cpu"))
    assert flux.threads == 1 and not flux.started  # workers start on first use, not here
    monkeypatch.delenv(logic.THREADS_ENV)
    assert logic._default_factory(("cpu",)).threads is None
    assert os.environ.get(logic.THREADS_ENV) is None


def test_loader_auto_preload_explains_its_choice(
    comfy: FakeComfy, shared_registry: Registry, dev_checkpoint: str
) -> None:
    NODE_CLASS_MAPPINGS["RocmParallelLoader"]().load(
        checkpoint=dev_checkpoint, devices="cpu x2", dtype="float32", preload="auto"
    )
    state = shared_registry.snapshot()
    names = {
        "tensor parallel tp=2": "tp=2",
        "context parallel ring=2 x ulysses=1": "ring=2",
        "context parallel ring=1 x ulysses=2": "ulysses=2",
    }
    assert state["layout"] in names
    assert state["auto"].startswith(f"auto: {names[state['layout']]} — fits ")
    assert " GB per CPU worker; predicted " in state["auto"] and "GPU" not in state["auto"]
    text = NODE_CLASS_MAPPINGS["RocmParallelStatus"]().status(action="report")["result"][0]
    assert state["auto"] in text


# --- what the panel and the status node show after failures (issue: one failing GPU) ----------------


def test_a_rejected_checkpoint_is_never_shown_as_the_model(
    comfy: FakeComfy, shared_registry: Registry, dev_checkpoint: str
) -> None:
    loader = NODE_CLASS_MAPPINGS["RocmParallelLoader"]()
    loader.load(checkpoint=dev_checkpoint, devices="cpu x2", dtype="float32", preload="tp")
    (comfy.models / "not-flux.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(Exception, match=r"not-flux\.safetensors"):
        loader.load(checkpoint="not-flux.safetensors", devices="cpu x2", dtype="float32", preload="tp")
    state = shared_registry.snapshot()
    # refused from its header: the resident model stays, and the panel names it, not the rejected file
    assert (state["checkpoint"], state["layout"], state["loading"]) == (
        dev_checkpoint,
        "tensor parallel tp=2",
        None,
    )
    assert [r["loaded"] is not None for r in shared_registry.current.status()] == [True, True]
    assert state["error"].startswith("CheckpointError: ") and "not-flux.safetensors" in state["error"]
    assert str(comfy.models) not in state["error"]  # a file name, never the absolute path


def test_the_auto_line_is_cleared_when_a_fixed_layout_runs(
    comfy: FakeComfy, shared_registry: Registry, dev_checkpoint: str
) -> None:
    loader = NODE_CLASS_MAPPINGS["RocmParallelLoader"]()
    (handle,) = loader.load(checkpoint=dev_checkpoint, devices="cpu x2", dtype="float32", preload="auto")
    assert shared_registry.snapshot()["auto"].startswith("auto: ")
    _sample("RocmParallelTPSampler", handle)
    state = shared_registry.snapshot()
    assert state["auto"] is None and state["layout"] == "tensor parallel tp=2"
    assert "auto:" not in logic.format_state(state)


def test_samplers_validate_before_starting_or_loading(comfy: FakeComfy, dev_checkpoint: str) -> None:
    """A bad latent fails before any worker process starts and before ComfyUI's models are evicted."""
    started: list[tuple[str, ...]] = []
    registry = Registry(factory=lambda devices: started.append(devices) or ParallelFlux(list(devices)))
    handle = ParallelHandle(str(comfy.models / dev_checkpoint), dev_checkpoint, ("cuda:0", "cuda:1"), None)
    ref = reference("dev_4steps")
    with pytest.raises(ConfigError, match=r"^image size 64x56 pixels \(latent 8x7\) is not a multiple of 16"):
        logic.sample(
            registry, handle, ParallelLayout(tp=2), positive(ref["cond"], ref["pooled"]),
            {"samples": torch.zeros(1, 16, 7, 8)}, seed=0, steps=2, denoise=1.0,
            make_room=lambda: comfy.calls.append("make_room"),
        )  # fmt: skip
    assert started == [] and "make_room" not in comfy.calls


def test_cancel_during_a_load_stops_it(
    comfy: FakeComfy, shared_registry: Registry, dev_checkpoint: str
) -> None:
    """Cancel pressed while the weights load: the load stops between tensors, nothing stays resident.
    Mutation tried: `ensure_loaded` not passing its check as the load's progress → the load finished."""
    loader = NODE_CLASS_MAPPINGS["RocmParallelLoader"]()
    comfy.interrupt_at_check = 3
    with pytest.raises(InterruptProcessingException):
        loader.load(checkpoint=dev_checkpoint, devices="cpu x2", dtype="float32", preload="tp")
    state = shared_registry.snapshot()
    assert (state["last"], state["error"], state["checkpoint"]) == (
        "loading cancelled by the user",
        None,
        None,
    )
    assert 0 < state["step"] < state["total"]  # stopped part-way through the tensors
    assert [r["loaded"] for r in shared_registry.current.status()] == [None, None]


def test_workers_starting_are_shown_as_such() -> None:
    phases: list[str] = []

    class Recording(Registry):
        def update(self, **fields):
            super().update(**fields)
            phases.append(self.state["phase"])

    class Slow:
        devices, started, resident = ("cpu", "cpu"), False, None

        def start(self) -> None:
            phases.append("start() called")

    registry = Recording(factory=lambda devices: Slow())
    logic.load(registry, ParallelHandle("/m/x.safetensors", "x.safetensors", ("cpu", "cpu"), None), "none")
    assert phases[phases.index("start() called") - 1] == "starting workers"
    assert phases[-1] == "idle"


@pytest.mark.parametrize(
    ("message", "shown"),
    [
        (
            "checkpoint '/home/me/ComfyUI/models/diffusion_models/flux.safetensors' does not exist; "
            "'/home/me/ComfyUI/models/diffusion_models' has: a.safetensors, b.safetensors. Pick one of those",
            "CheckpointError: checkpoint 'flux.safetensors' does not exist. Pick one of those",
        ),
        (
            "rank 1 (cuda:1): out of memory on cuda:1",
            "CheckpointError: rank 1 (cuda:1): out of memory on cuda:1",
        ),
        ("C:\\Users\\me\\models\\x.safetensors is truncated", "CheckpointError: x.safetensors is truncated"),
    ],
)
def test_public_error_names_files_not_paths(message: str, shown: str) -> None:
    from rocm_parallel.backend.flux.load import CheckpointError

    assert logic.public_error(CheckpointError(message)) == shown
