"""The ComfyUI nodes without ComfyUI: schema, input parsing, the registry, loading on real workers, and
everything the samplers and the parallel MODEL decide before ComfyUI's sampling runs.

The node classes run against stand-ins for folder_paths / comfy.utils / comfy.model_management /
comfy.samplers (tests/fake_comfy.py) and a real 2-worker CPU group. Sampling itself is ComfyUI's, around
the parallel MODEL (nodes/comfy_model.py): its parity with a real ComfyUI is tested in tests/comfy.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fake_comfy import SAMPLERS, SCHEDULERS, FakeComfy, InterruptProcessingException
from test_sampling import flux_model, positive, reference

import rocm_parallel
from rocm_parallel.backend.checkpoint import save_checkpoint
from rocm_parallel.backend.config import ConfigError, ParallelLayout
from rocm_parallel.backend.diffusion.api import ParallelModel
from rocm_parallel.backend.family import get_family
from rocm_parallel.backend.flux.dims import FluxDims
from rocm_parallel.backend.resident.messages import RankStatus
from rocm_parallel.backend.runtime import preflight
from rocm_parallel.backend.runtime.client import WorkerGroup
from rocm_parallel.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, checks, inputs, loading
from rocm_parallel.nodes import registry as registry_module
from rocm_parallel.nodes.inputs import LayoutRequest, ParallelHandle
from rocm_parallel.nodes.registry import Registry
from rocm_parallel.nodes.runner import ModelRunner, step_of
from rocm_parallel.nodes.status import format_state, status_text
from rocm_parallel.testing.gguf_files import save_gguf

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
        "False ['RocmParallelLoRA', 'RocmParallelLoader', 'RocmParallelModel', 'RocmParallelRingSampler', "
        "'RocmParallelStatus', 'RocmParallelTPSampler', 'RocmParallelTextEncoderLoader', 'RocmParallelVAEDecode', "
        "'RocmParallelVAEEncode']"
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


def test_samplers_offer_all_of_comfyuis_samplers_and_schedulers(comfy: FakeComfy) -> None:
    for node_id in ("RocmParallelTPSampler", "RocmParallelRingSampler"):
        spec = NODE_CLASS_MAPPINGS[node_id].INPUT_TYPES()
        required = spec["required"]
        assert required["sampler_name"][0] == SAMPLERS  # whatever comfy.samplers.KSampler lists
        assert required["scheduler"][0] == SCHEDULERS
        assert required["seed"][1]["control_after_generate"] is True
        assert required["cfg"][1]["default"] == 1.0
        assert list(spec["optional"])[:2] == ["negative", "sigmas"]
        assert [spec["optional"][n][0] for n in ("negative", "sigmas")] == ["CONDITIONING", "SIGMAS"]
    # the degrees each sampler composes with its own dimension (optional: older workflows lack them)
    tp_optional = NODE_CLASS_MAPPINGS["RocmParallelTPSampler"].INPUT_TYPES()["optional"]
    ring_optional = NODE_CLASS_MAPPINGS["RocmParallelRingSampler"].INPUT_TYPES()["optional"]
    assert list(tp_optional)[2:] == ["batch_degree", "ring_degree", "ulysses_degree"]
    assert list(ring_optional)[2:] == ["batch_degree", "tp_degree"]
    for spec in (*tp_optional.values(), *ring_optional.values()):
        if spec[0] == "INT":
            assert (spec[1]["default"], spec[1]["min"]) == (1, 1)
    model = NODE_CLASS_MAPPINGS["RocmParallelModel"]
    assert model.RETURN_TYPES == ("MODEL",)
    layout = model.INPUT_TYPES()["required"]["layout"]
    assert layout[0] == "STRING" and layout[1]["default"] == "tp"  # 'tp', 'context', 'auto' or degrees


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
    assert inputs.parse_devices(text, visible_gpus=lambda: 3) == devices


def test_all_devices_without_gpus_is_an_error_naming_the_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU-only torch used to run a GPU workflow on two CPU workers without a word. (CI's newest torch
    is a CUDA build without a GPU: the CPU-only reading is forced; test_platforms covers the other.)"""
    import torch

    from rocm_parallel.backend import platforms

    monkeypatch.setattr(platforms, "build_kind", lambda: "cpu")

    with pytest.raises(ConfigError) as err:
        inputs.parse_devices("all", visible_gpus=lambda: 0)
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
        inputs.parse_devices(text)
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
    assert inputs.context_layout(ring, ulysses, devices) == layout


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
        inputs.context_layout(ring, ulysses, devices)
    assert str(err.value) == message


def test_dtype_choices() -> None:
    assert inputs.compute_dtype("default") is None
    assert inputs.compute_dtype("bfloat16") == "bfloat16"
    with pytest.raises(ConfigError, match="dtype='fp8' is not offered; use one of default, bfloat16"):
        inputs.compute_dtype("fp8")


def test_weight_dtype_choices() -> None:
    assert inputs.WEIGHT_DTYPES == ("default", "fp8_e4m3fn", "fp8_e5m2")  # ComfyUI UNETLoader's names
    assert inputs.weight_dtype("default") is None and inputs.weight_dtype("fp8_e5m2") == "fp8_e5m2"
    with pytest.raises(ConfigError) as err:
        inputs.weight_dtype("bfloat16")
    assert (
        str(err.value) == "weight_dtype='bfloat16' is not offered; use one of default, fp8_e4m3fn, fp8_e5m2"
    )


def test_only_gpu_workers_evict_comfyui_models() -> None:
    assert loading.needs_gpu_memory(("cuda:0", "cuda:1"))
    assert not loading.needs_gpu_memory(("cpu", "cpu"))


# --- the registry ----------------------------------------------------------------------------------


class RecordingFlux:
    """Stands in for ParallelModel where only the registry's bookkeeping is under test."""

    def __init__(self, devices: tuple[str, ...]) -> None:
        self.devices, self.closed = devices, False
        self.warnings: list[str] = []
        self.started = False
        self.activity: str | None = None  # no job running (the panel reads it)
        self.transport_note: str | None = None  # on the fastest transport

    def close(self) -> None:
        self.closed = True


def test_status_shows_what_start_up_changed() -> None:
    registry = Registry(factory=RecordingFlux)
    registry.group_for(("cpu", "cpu")).warnings.append("started again with NCCL_P2P_DISABLE=1")
    text = status_text(registry, "report")
    assert text.splitlines()[-1] == "warning: started again with NCCL_P2P_DISABLE=1"


def test_the_panel_says_when_the_group_fell_back_to_a_slower_transport() -> None:
    registry = Registry(factory=RecordingFlux)
    flux = registry.group_for(("cpu", "cpu"))
    assert "transport" not in registry.snapshot()
    flux.transport_note = preflight.short_note(preflight.SHM, fell_back=True)
    assert registry.snapshot()["transport"] == (
        "collectives: NCCL/RCCL through host shared memory (peer-to-peer off) (the faster ones failed at "
        "start: Status node)"
    )


def test_registry_keeps_one_group_per_device_set() -> None:
    made: list[RecordingFlux] = []
    registry = Registry(factory=lambda devices: made.append(RecordingFlux(devices)) or made[-1])
    first = registry.group_for(("cpu", "cpu"))
    assert registry.group_for(("cpu", "cpu")) is first  # same devices: the resident group is reused
    assert registry.snapshot()["devices"] == ["cpu", "cpu"]
    other = registry.group_for(("cpu",) * 4)  # another device set closes the old group first
    assert first.closed and not other.closed
    assert [f.devices for f in made] == [("cpu", "cpu"), ("cpu",) * 4]
    assert status_text(registry, "close") == "ROCm Parallel: no worker group is running"
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
    registry = Registry(factory=lambda devices: ParallelModel(group=group2))
    monkeypatch.setattr(registry_module, "REGISTRY", registry)
    monkeypatch.setattr("rocm_parallel.nodes.classes.REGISTRY", registry)
    yield registry
    registry.current.unload()


@pytest.fixture
def dev_checkpoint(comfy: FakeComfy) -> str:
    save_checkpoint(flux_model("dev"), comfy.models / "tiny-dev.safetensors")
    return "tiny-dev.safetensors"


def test_loader_lists_and_loads_gguf_files(
    comfy: FakeComfy, shared_registry: Registry, dev_checkpoint: str
) -> None:
    """ComfyUI lists no .gguf under diffusion_models (the fake filters them like its supported_pt_extensions);
    the loader adds those of the same folders, subfolders included, and loads one on real workers."""
    (comfy.models / "gguf").mkdir()
    save_gguf(flux_model("dev"), comfy.models / "gguf" / "tiny-dev-Q8_0.gguf", "Q8_0")
    loader = NODE_CLASS_MAPPINGS["RocmParallelLoader"]
    assert loader.INPUT_TYPES()["required"]["checkpoint"][0] == ["gguf/tiny-dev-Q8_0.gguf", dev_checkpoint]
    (handle,) = loader().load(
        checkpoint="gguf/tiny-dev-Q8_0.gguf", devices="cpu x2", dtype="float32", preload="tp"
    )
    assert handle.checkpoint == str(comfy.models / "gguf" / "tiny-dev-Q8_0.gguf")
    state = shared_registry.snapshot()
    assert (state["layout"], state["phase"]) == ("tp 2", "idle")


def test_loader_loads_on_real_workers(
    comfy: FakeComfy, shared_registry: Registry, dev_checkpoint: str
) -> None:
    loader = NODE_CLASS_MAPPINGS["RocmParallelLoader"]
    assert loader.INPUT_TYPES()["required"]["checkpoint"][0] == [dev_checkpoint]
    (handle,) = loader().load(checkpoint=dev_checkpoint, devices="cpu x2", dtype="float32", preload="tp")
    assert handle.devices == ("cpu", "cpu") and handle.checkpoint == str(comfy.models / dev_checkpoint)
    state = shared_registry.snapshot()
    assert (state["checkpoint"], state["layout"], state["phase"]) == (dev_checkpoint, "tp 2", "idle")
    assert [r["parameter_bytes"] > 0 for r in state["ranks"]] == [True, True]
    # CPU workers need no GPU memory: ComfyUI's own models stay where they are.
    assert "unload_all_models" not in comfy.calls and "check_interrupt" in comfy.calls
    status = NODE_CLASS_MAPPINGS["RocmParallelStatus"]().status(action="report", parallel_flux=handle)
    text = status["result"][0]
    assert text.startswith("ROCm Parallel: 2 workers on cpu, cpu (idle)\nmodel: tiny-dev.safetensors, tp 2")
    assert status["ui"]["text"] == [text]


def test_loader_weight_dtype_keeps_fp8_on_the_workers(
    comfy: FakeComfy, shared_registry: Registry, dev_checkpoint: str
) -> None:
    """The loader's weight_dtype widget reaches the workers: fp8_e4m3fn holds the linear weights in one
    byte each (the planner's count), the compute dtype stays float32 for the rest."""
    from rocm_parallel.backend.plan import weight_bytes

    loader = NODE_CLASS_MAPPINGS["RocmParallelLoader"]
    spec = loader.INPUT_TYPES()["required"]
    assert list(spec)[-1] == "weight_dtype" and spec["weight_dtype"][0] == list(inputs.WEIGHT_DTYPES)
    (handle,) = loader().load(
        checkpoint=dev_checkpoint, devices="cpu x2", dtype="float32", preload="tp", weight_dtype="fp8_e4m3fn"
    )
    assert (
        handle.weight_dtype == "fp8_e4m3fn" and shared_registry.current.resident.weight_dtype == "fp8_e4m3fn"
    )
    dims = FluxDims.from_diffusers_config(flux_model("dev").config)
    state = shared_registry.snapshot()
    assert [r["parameter_bytes"] for r in state["ranks"]] == [
        weight_bytes(dims, ParallelLayout(tp=2), 4, rank=rank, linear_bytes=1) for rank in range(2)
    ]


def _ref_inputs(name: str = "dev_4steps") -> dict:
    ref = reference(name)
    return {
        "positive": positive(ref["cond"], ref["pooled"], 3.5),
        "latent_image": {"samples": ref["latent"]},
        "seed": 42,
        "steps": 4,
        "sampler_name": "euler",
        "scheduler": "simple",
        "denoise": 1.0,
    }


def test_ring_degrees_are_checked_before_anything_starts(
    comfy: FakeComfy, dev_checkpoint: str, recording_registry: tuple[Registry, list]
) -> None:
    _, started = recording_registry
    handle = ParallelHandle(str(comfy.models / dev_checkpoint), dev_checkpoint, ("cpu", "cpu"), None)
    with pytest.raises(
        ConfigError, match=r"ring_degree=2 x ulysses_degree=2 = 4 but the loader has 2 devices"
    ):
        NODE_CLASS_MAPPINGS["RocmParallelRingSampler"]().sample(
            parallel_flux=handle, cfg=1.0, ring_degree=2, ulysses_degree=2, **_ref_inputs()
        )
    three = Registry(factory=lambda devices: ParallelModel(list(devices), threads=1))
    with pytest.raises(ConfigError, match="tp_degree=3 does not divide 4 attention heads"):
        loading.load(three, ParallelHandle(handle.checkpoint, "x", ("cpu",) * 3, None), "tp")
    assert not three.current.started  # refused before any worker process started
    assert started == [] and comfy.progress == []


def test_unload_frees_the_devices(comfy: FakeComfy, shared_registry: Registry, dev_checkpoint: str) -> None:
    NODE_CLASS_MAPPINGS["RocmParallelLoader"]().load(
        checkpoint=dev_checkpoint, devices="cpu x2", dtype="float32", preload="context"
    )
    text = NODE_CLASS_MAPPINGS["RocmParallelStatus"]().status(action="unload")["result"][0]
    assert "model: none loaded" in text
    assert [r["parameter_bytes"] for r in shared_registry.snapshot()["ranks"]] == [0, 0]


def test_threads_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(registry_module.THREADS_ENV, "1")
    flux = registry_module._default_factory(("cpu", "cpu"))
    assert flux.threads == 1 and not flux.started  # workers start on first use, not here
    monkeypatch.delenv(registry_module.THREADS_ENV)
    assert registry_module._default_factory(("cpu",)).threads is None
    assert os.environ.get(registry_module.THREADS_ENV) is None


def test_loader_auto_preload_explains_its_choice(
    comfy: FakeComfy, shared_registry: Registry, dev_checkpoint: str
) -> None:
    NODE_CLASS_MAPPINGS["RocmParallelLoader"]().load(
        checkpoint=dev_checkpoint, devices="cpu x2", dtype="float32", preload="auto"
    )
    state = shared_registry.snapshot()
    assert state["layout"] in ("tp 2", "ring 2", "ulysses 2")  # a batch of 1 per call: no batch degree
    assert state["auto"].startswith(f"auto: {state['layout']} — fits ")
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
    assert (state["checkpoint"], state["layout"], state["loading"]) == (dev_checkpoint, "tp 2", None)
    assert [r.loaded is not None for r in shared_registry.current.status()] == [True, True]
    assert state["error"].startswith("CheckpointError: ") and "not-flux.safetensors" in state["error"]
    assert str(comfy.models) not in state["error"]  # a file name, never the absolute path


def test_the_auto_line_is_cleared_when_a_fixed_layout_runs(
    comfy: FakeComfy, shared_registry: Registry, dev_checkpoint: str
) -> None:
    loader = NODE_CLASS_MAPPINGS["RocmParallelLoader"]()
    (handle,) = loader.load(checkpoint=dev_checkpoint, devices="cpu x2", dtype="float32", preload="auto")
    assert shared_registry.snapshot()["auto"].startswith("auto: ")
    ModelRunner(shared_registry, handle, LayoutRequest(ParallelLayout(tp=2))).prepare((1, 16, 8, 8))
    state = shared_registry.snapshot()
    assert state["auto"] is None and state["layout"] == "tp 2"
    assert "auto:" not in format_state(state)


def test_ring_sampler_auto_plans_a_context_layout_for_the_latent(
    comfy: FakeComfy, shared_registry: Registry, dev_checkpoint: str
) -> None:
    handle = ParallelHandle(str(comfy.models / dev_checkpoint), dev_checkpoint, ("cpu", "cpu"), "float32")
    runner = ModelRunner(shared_registry, handle, LayoutRequest(None, context_only=True))
    runner.prepare((1, 16, 8, 8))
    state = shared_registry.snapshot()
    assert state["layout"] in ("ring 2", "ulysses 2")  # a context layout, never TP, for this sampler
    assert state["auto"].startswith(f"auto: {state['layout']} — fits ")
    assert runner.layout.tp == 1 and runner.layout.describe() == state["layout"]


def test_a_run_reads_the_checkpoint_header_once(
    comfy: FakeComfy, shared_registry: Registry, dev_checkpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The header a node's run read (the Model node, a sampler) is carried through the planner's 'auto',
    check_load and load to the workers' LoadRequest: nothing in this process reads it again (it used to be
    read 4-5 times). Mutation tried: `ensure_loaded` given None instead of the runner's info read it twice."""
    from rocm_parallel.backend import checkpoint
    from rocm_parallel.backend.checkpoint import info, load
    from rocm_parallel.backend.diffusion import api, group

    reads: list[str] = []
    inspect = info.inspect_checkpoint

    def counting(path):
        reads.append(str(path))
        return inspect(path)

    for module in (checkpoint, info, load, api, group):
        monkeypatch.setattr(module, "inspect_checkpoint", counting)
    handle = ParallelHandle(str(comfy.models / dev_checkpoint), dev_checkpoint, ("cpu", "cpu"), "float32")
    runner = ModelRunner(shared_registry, handle, LayoutRequest(None))  # 'auto': planned from the header
    assert runner.comfy_model().config_class == "Flux"
    flux = runner.prepare((1, 16, 8, 8))
    assert reads == [handle.checkpoint]
    assert flux.resident.info is runner.info  # what the workers were sent


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
    assert [r.loaded for r in shared_registry.current.status()] == [None, None]


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
    loading.load(registry, ParallelHandle("/m/x.safetensors", "x.safetensors", ("cpu", "cpu"), None), "none")
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
        # folders with spaces (ComfyUI's subfolders) and home paths leaked whole or mangled before
        (
            "'/data/My Models/private user/flux.safetensors': tensor 'x' holds NaN values",
            "CheckpointError: 'flux.safetensors': tensor 'x' holds NaN values",
        ),
        (
            "/data/My Models/private user/f.safetensors is truncated",
            "CheckpointError: f.safetensors is truncated",
        ),
        ("cannot read ~/secret/x.safetensors: denied", "CheckpointError: cannot read x.safetensors: denied"),
        ("LoRA 'D:\\My LoRAs\\a b.safetensors' is bad", "CheckpointError: LoRA 'a b.safetensors' is bad"),
    ],
)
def test_public_error_names_files_not_paths(message: str, shown: str) -> None:
    from rocm_parallel.backend.checkpoint import CheckpointError

    assert registry_module.public_error(CheckpointError(message)) == shown


# --- the samplers and the parallel MODEL: what is decided before ComfyUI's sampling runs -------------


@pytest.fixture
def recording_registry(monkeypatch: pytest.MonkeyPatch) -> tuple[Registry, list]:
    """The nodes' registry; records every worker group it would start (none must start here)."""
    started: list[tuple[str, ...]] = []
    registry = Registry(factory=lambda devices: started.append(devices) or ParallelModel(list(devices)))
    monkeypatch.setattr(registry_module, "REGISTRY", registry)
    monkeypatch.setattr("rocm_parallel.nodes.classes.REGISTRY", registry)
    return registry, started


def _bad_inputs(name: str) -> dict:
    ref = reference("dev_4steps")
    inputs = {**_ref_inputs(), "cfg": 1.0}
    if name == "cfg_without_negative":
        inputs["cfg"] = 2.5
    elif name == "sd_latent":
        inputs["latent_image"] = {"samples": torch.ones(1, 4, 8, 8)}
    elif name == "sdxl_text":
        inputs["positive"] = positive(torch.zeros(1, 77, 2048), ref["pooled"], 3.5)
    elif name == "negative_width":
        inputs["negative"] = positive(ref["cond"], torch.zeros(1, 1280))
        inputs["cfg"] = 2.0
    elif name == "controlnet":
        inputs["positive"][0][1]["control"] = object()
    elif name == "kontext":
        inputs["positive"][0][1]["reference_latents"] = [torch.zeros(1, 16, 8, 8)]
    elif name == "attention_mask":
        inputs["positive"][0][1]["attention_mask"] = torch.zeros(1, 8, 8)
    return inputs


@pytest.mark.parametrize(
    ("case", "message"),
    [
        (
            "cfg_without_negative",
            "cfg=2.5 needs a negative prompt: connect a CONDITIONING to 'negative' (e.g. CLIPTextEncode with "
            "an empty text, or ConditioningZeroOut), or set cfg to 1.0 (guidance-distilled models run at cfg 1.0 "
            "with FluxGuidance instead)",
        ),
        (
            "sd_latent",
            "latent_image has 4 channels but FLUX.1-dev latents have 16: encode the image with the FLUX VAE "
            "(ae.safetensors), or use EmptySD3LatentImage for text-to-image",
        ),
        (
            "sdxl_text",
            "positive: the text embedding is [1, 77, 2048] but FLUX.1-dev takes [batch, tokens, 32]; encode "
            "the prompt with a FLUX DualCLIPLoader (clip_l + t5xxl, type flux) and CLIPTextEncode",
        ),
        (
            "negative_width",
            "negative: pooled_output is [1, 1280] but FLUX.1-dev takes [batch, 24] (CLIP-L); encode the "
            "prompt with a FLUX DualCLIPLoader (clip_l + t5xxl, type flux)",
        ),
        ("controlnet", checks.CONTROLNET_MESSAGE),
        (
            "kontext",
            "the TP / Ring Attention Sampler do not take FLUX.1 Kontext's reference latents (the conditioning "
            "carries ReferenceLatent's): sample with the ROCm Parallel Model and ComfyUI's own sampler nodes "
            "instead (the flux1_kontext_dev_ksampler_parallel_model workflow's graph, with ReferenceLatent on "
            "its conditioning), or remove the ReferenceLatent node",
        ),
        ("attention_mask", checks.ATTENTION_MASK_MESSAGE),
    ],
)
def test_samplers_validate_before_starting_or_loading(
    comfy: FakeComfy, dev_checkpoint: str, recording_registry: tuple[Registry, list], case: str, message: str
) -> None:
    """Refused before any worker process starts and before ComfyUI's models are evicted (GPU devices)."""
    _, started = recording_registry
    handle = ParallelHandle(str(comfy.models / dev_checkpoint), dev_checkpoint, ("cuda:0", "cuda:1"), None)
    for node_id, extra in (
        ("RocmParallelTPSampler", {}),
        ("RocmParallelRingSampler", {"ring_degree": 2, "ulysses_degree": 1}),
    ):
        with pytest.raises(ConfigError) as err:
            NODE_CLASS_MAPPINGS[node_id]().sample(parallel_flux=handle, **_bad_inputs(case), **extra)
        assert str(err.value) == message
    assert started == [] and "unload_all_models" not in comfy.calls


def test_samplers_refuse_a_fill_checkpoint_pointing_to_the_parallel_model(
    comfy: FakeComfy, recording_registry: tuple[Registry, list]
) -> None:
    _, started = recording_registry
    save_checkpoint(flux_model("fill"), comfy.models / "fill.safetensors")
    handle = ParallelHandle(str(comfy.models / "fill.safetensors"), "fill.safetensors", ("cpu", "cpu"), None)
    with pytest.raises(ConfigError) as err:
        NODE_CLASS_MAPPINGS["RocmParallelTPSampler"]().sample(parallel_flux=handle, **_bad_inputs("none"))
    assert str(err.value) == (
        "FLUX.1 Fill needs the masked image and mask in every step, which the TP / Ring Attention Sampler do "
        "not supply: sample it with the ROCm Parallel Model, ComfyUI's InpaintModelConditioning and KSampler"
    )
    assert started == []


def test_the_reference_message_names_each_familys_own_workflow() -> None:
    """FLUX.2's reference images are not Kontext's: each family's message names its own shipped graph."""
    from rocm_parallel.backend.family import families

    root = Path(__file__).resolve().parents[1] / "workflows"
    for family in families():
        message = checks.references_message(family)
        if family.references is None:  # Wan: no ReferenceLatent input at all
            assert message.startswith(f"{family.title} takes no reference latents (ReferenceLatent)")
            continue
        assert family.references.what in message
        if family.references.workflow is None:  # no shipped graph: ComfyUI's own template, named
            assert f"ComfyUI's own {family.title} edit template" in message
            continue
        assert f"the {family.references.workflow} workflow's graph" in message
        assert (root / f"{family.references.workflow}.json").is_file()
    assert "FLUX.2's reference images" in checks.references_message(get_family("flux2"))


@pytest.mark.parametrize(("height", "width"), [(25, 25), (7, 8), (1, 3), (64, 9)])
def test_any_latent_size_comfyui_accepts_passes_the_checks(
    comfy: FakeComfy, dev_checkpoint: str, recording_registry: tuple[Registry, list], height: int, width: int
) -> None:
    """The old 'multiple of 16 pixels' refusal is gone: ComfyUI's Flux pads inside the model (e.g. 200x200
    px -> latent 25x25). A 4-channel all-zero latent (EmptyLatentImage) is widened by ComfyUI itself."""
    registry, started = recording_registry
    handle = ParallelHandle(str(comfy.models / dev_checkpoint), dev_checkpoint, ("cpu", "cpu"), None)
    ref = reference("dev_4steps")
    for samples in (torch.randn(2, 16, height, width), torch.zeros(1, 4, height, width)):
        checks.check_sampler_inputs(
            registry, handle, LayoutRequest(ParallelLayout(tp=2)), positive(ref["cond"], ref["pooled"]),
            None, {"samples": samples}, cfg=1.0,
        )  # fmt: skip
    assert started == [("cpu", "cpu")] and not registry.current.started  # made, never started


def test_samplers_accept_qwen_images_text_mask(
    comfy: FakeComfy, dev_checkpoint: str, recording_registry: tuple[Registry, list]
) -> None:
    """Qwen-Image's model takes the text encoder's mask (ComfyUI 0.33 passes it when a prompt is padded), so
    the TP / Ring Attention Sampler's checks pass it on; FLUX.1's call has no mask and is refused by name."""
    from rocm_parallel.backend.qwen_image.model import build_qwen_image
    from rocm_parallel.testing.models import tiny_qwen_image_config

    registry, _ = recording_registry
    config = tiny_qwen_image_config(heads=4, head_dim=16, blocks=2, text_dim=32)
    save_checkpoint(build_qwen_image(config, seed=1), comfy.models / "qwen.safetensors", prefix=True)
    mask = torch.ones(1, 11, dtype=torch.long)
    mask[0, 8:] = 0  # three padding tokens
    conditioning = [[torch.randn(1, 11, 32), {"pooled_output": None, "attention_mask": mask}]]
    latent = {"samples": torch.zeros(1, 16, 1, 8, 8)}
    handle = ParallelHandle(str(comfy.models / "qwen.safetensors"), "qwen.safetensors", ("cpu", "cpu"), None)
    for request in (
        LayoutRequest(ParallelLayout(tp=2)),
        LayoutRequest(ParallelLayout(ring=2), context_only=True),
    ):
        info = checks.check_sampler_inputs(
            registry, handle, request, conditioning, conditioning, latent, cfg=2.5
        )
        assert info.model_family.name == "qwen_image"
    flux = ParallelHandle(str(comfy.models / dev_checkpoint), dev_checkpoint, ("cpu", "cpu"), None)
    ref = reference("dev_4steps")
    flux_positive = positive(ref["cond"], ref["pooled"])
    flux_positive[0][1]["attention_mask"] = torch.ones(1, ref["cond"].shape[1])
    with pytest.raises(ConfigError) as err:
        checks.check_sampler_inputs(
            registry, flux, LayoutRequest(ParallelLayout(tp=2)), flux_positive, None,
            {"samples": torch.zeros(1, 16, 8, 8)}, cfg=1.0,
        )  # fmt: skip
    assert str(err.value) == checks.ATTENTION_MASK_MESSAGE


class KV_Attn_Input:  # the class name of ComfyUI's FluxKVCache attention patch, which the check reads
    """Stands in for comfy_extras/nodes_flux.py's KV_Attn_Input (the comfy tier uses the real node)."""


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"control": {"output": []}}, checks.CONTROLNET_MESSAGE),
        ({"extra": {"attention_mask": torch.zeros(1)}}, checks.ATTENTION_MASK_MESSAGE),
        (
            {"extra": {"pulid": torch.zeros(1)}},
            "ComfyUI passed 'pulid' to the diffusion model; the ROCm Parallel Model does not implement it and "
            "ignoring it would change the image. Remove the node that adds it to the conditioning or the model",
        ),
        (
            {"options": {"patches_replace": {"dit": {("double_block", 0): print}}}},
            "a model patch (patches_replace: dit) would change the transformer's blocks or attention, which "
            "run in the ROCm Parallel workers and cannot be patched from ComfyUI; remove the node that adds it "
            "(e.g. a PAG, attention-couple or block-patch node) from the ROCm Parallel Model's path",
        ),
        (
            {"options": {"patches": {"post_input": [print]}}},
            checks.patches_message("patches", ["post_input"]),
        ),
        (  # what ComfyUI 0.33's FluxKVCache node adds (comfy_extras/nodes_flux.py)
            {"options": {"patches": {"attn1_patch": [KV_Attn_Input()], "post_input": [print]}}},
            checks.KV_CACHE_MESSAGE,
        ),
    ],
)
def test_the_proxy_refuses_what_it_would_otherwise_ignore(kwargs: dict, message: str) -> None:
    args = {"control": None, "options": {}, "extra": {}} | kwargs
    takes = get_family("flux1").call_spec.names
    got = checks.unsupported_forward_inputs(args["control"], args["options"], args["extra"], takes)
    assert got == message


def test_the_proxy_runs_what_comfyui_always_passes() -> None:
    options = {
        "patches": {},
        "patches_replace": {},
        # EasyCache's diffusion_model wrapper runs around the call (nodes/comfy_model.py), not refused here
        "wrappers": {"outer_sample": {"rocm_parallel": [print]}, "diffusion_model": {"easycache": [print]}},
        "sigmas": torch.tensor([0.5]),
        "sample_sigmas": torch.tensor([1.0, 0.5, 0.0]),
        "cond_or_uncond": [0, 1],
    }
    extra = {"ref_latents_method": None, "attention_mask": None}
    takes = get_family("flux1").call_spec.names
    assert checks.unsupported_forward_inputs(None, options, extra, takes) is None
    assert checks.unsupported_forward_inputs(None, options, {"ref_latents_method": "index"}, takes) is None
    # a family whose call takes a text mask gets it (Qwen-Image's); FLUX's refuses one by name
    mask = {"attention_mask": torch.ones(1, 4)}
    assert (
        checks.unsupported_forward_inputs(None, options, mask, get_family("qwen_image").call_spec.names)
        is None
    )
    assert checks.unsupported_forward_inputs(None, options, mask, takes) == checks.ATTENTION_MASK_MESSAGE
    assert checks.diffusion_model_wrappers(options) == ["easycache"]


@pytest.mark.parametrize(
    ("now", "run", "step"),
    [
        ([1.0], [1.0, 0.5, 0.2, 0.0], (1, 3)),
        ([0.2], [1.0, 0.5, 0.2, 0.0], (3, 3)),
        ([0.35], [1.0, 0.5, 0.2, 0.0], (2, 3)),  # heun's second evaluation inside step 2
        (None, [1.0, 0.0], None),
    ],
)
def test_the_panel_step_comes_from_comfyuis_sigmas(now, run, step) -> None:
    options = {"sample_sigmas": torch.tensor(run)} | ({} if now is None else {"sigmas": torch.tensor(now)})
    assert step_of(options) == step


class ForwardFlux:
    """A ParallelModel stand-in for the runner's bookkeeping: records loads and forwards."""

    def __init__(self, devices: tuple[str, ...]) -> None:
        self.devices, self.started, self.warnings, self.evicted = devices, True, [], []
        self.residents: dict[str, SimpleNamespace] = {}
        self.loads: list[dict] = []
        self.checks: list[dict] = []
        self.forwards: list[tuple] = []
        self.activity: str | None = None  # what the panel shows while a job runs (none here)

    def check_load(self, checkpoint: SimpleNamespace, options) -> None:
        self.checks.append(vars(options))

    def load(self, checkpoint: SimpleNamespace, options, progress=None) -> list:
        self.loads.append(vars(options))
        self.residents[options.slot] = SimpleNamespace(checkpoint=checkpoint.path, layout=options.layout)
        return [RankStatus(rank=0, device="cpu", parameter_bytes=1)]

    def forward(self, x, timestep, slot=None, **inputs):
        self.forwards.append((x.shape, timestep, inputs.get("guidance")))
        self.references = (inputs.get("ref_latents"), inputs.get("ref_latents_method"))
        return x * 2

    def close(self) -> None:
        pass


# What a ModelRunner carries from the node's run to every load (the header, read once): the stand-in
# above only needs its path.
FAKE_INFO = SimpleNamespace(path="/m/dev.safetensors", model_family=get_family("flux1"))


def test_the_runner_loads_once_then_forwards_and_shows_the_step() -> None:
    registry = Registry(factory=ForwardFlux)
    handle = ParallelHandle("/m/dev.safetensors", "dev.safetensors", ("cpu", "cpu"), "float32")
    runner = ModelRunner(registry, handle, LayoutRequest(ParallelLayout(tp=2)), FAKE_INFO)
    x = torch.ones(2, 16, 25, 25)
    with runner.sampling(x.shape, total=3):
        assert registry.snapshot()["phase"] == "sampling"
        out = runner.forward(x, torch.tensor([1.0, 1.0]), {"guidance": torch.tensor([3.5, 3.5])}, (2, 3))
        assert registry.snapshot()["step"] == 2 and registry.snapshot()["total"] == 3
        runner.forward(x, torch.tensor([0.5, 0.5]), {})
    flux = registry.current
    assert torch.equal(out, x * 2) and len(flux.loads) == 1 and len(flux.forwards) == 2
    assert flux.loads[0]["layout"] == ParallelLayout(tp=2) and flux.loads[0]["loras"] == ()
    assert registry.snapshot()["phase"] == "idle"
    flux.residents.clear()  # e.g. the Status node unloaded it between two runs: loaded again, not failed
    runner.forward(x, torch.tensor([1.0, 1.0]), {})
    assert len(flux.loads) == 2
    refs = [torch.zeros(2, 16, 4, 4)]  # Kontext: ComfyUI's ref_latents and their placement reach the service
    runner.forward(x, torch.tensor([1.0, 1.0]), {"ref_latents": refs, "ref_latents_method": "index"})
    assert flux.references == (refs, "index")


def test_a_cancel_during_comfyuis_sampling_is_shown_as_such() -> None:
    registry = Registry(factory=ForwardFlux)
    handle = ParallelHandle("/m/dev.safetensors", "dev.safetensors", ("cpu", "cpu"), None)
    runner = ModelRunner(registry, handle, LayoutRequest(ParallelLayout(tp=2)), FAKE_INFO)
    with pytest.raises(InterruptProcessingException), runner.sampling((1, 16, 8, 8), total=4):
        raise InterruptProcessingException()
    state = registry.snapshot()
    assert (state["phase"], state["last"], state["error"]) == ("idle", "sampling cancelled by the user", None)
    with pytest.raises(RuntimeError), runner.sampling((1, 16, 8, 8), total=4):
        raise RuntimeError("rank 1 (cuda:1): out of memory")
    assert registry.snapshot()["error"] == "RuntimeError: rank 1 (cuda:1): out of memory"


# --- LoRA ------------------------------------------------------------------------------------------


@pytest.fixture
def lora_files(comfy: FakeComfy) -> list[str]:
    from test_sampling import MODELS

    from rocm_parallel.testing.models import tiny_flux_config
    from rocm_parallel.testing.writers import write_random_lora

    config = tiny_flux_config(**MODELS["dev"]["config"])
    comfy.loras.mkdir(exist_ok=True)
    write_random_lora(comfy.loras / "style.safetensors", config, "bfl", rank=4, seed=1)
    write_random_lora(comfy.loras / "kohya.safetensors", config, "kohya", rank=2, seed=2)
    save_checkpoint(flux_model("dev"), comfy.loras / "not-a-lora.safetensors")
    return ["kohya.safetensors", "not-a-lora.safetensors", "style.safetensors"]


def test_lora_node_chains_loras_onto_the_handle(
    comfy: FakeComfy, lora_files: list[str], dev_checkpoint: str
) -> None:
    node = NODE_CLASS_MAPPINGS["RocmParallelLoRA"]
    assert node.INPUT_TYPES()["required"]["lora_name"][0] == lora_files
    base = ParallelHandle(str(comfy.models / dev_checkpoint), "dev.safetensors", ("cpu", "cpu"), None)
    (one,) = node().add_lora(parallel_flux=base, lora_name="style.safetensors", strength_model=0.8)
    (two,) = node().add_lora(parallel_flux=one, lora_name="kohya.safetensors", strength_model=-0.5)
    (same,) = node().add_lora(parallel_flux=two, lora_name="style.safetensors", strength_model=0.0)
    assert two.loras == (
        (str(comfy.loras / "style.safetensors"), 0.8),
        (str(comfy.loras / "kohya.safetensors"), -0.5),
    )
    assert same is two and base.loras == ()  # strength 0 is off, as in LoraLoaderModelOnly
    assert hash(two) != hash(one) != hash(base)
    assert (
        repr(two)
        == "<PARALLEL_FLUX dev.safetensors + style.safetensors x0.8 + kohya.safetensors x-0.5 on cpu, cpu>"
    )


def test_lora_node_refuses_another_models_lora_before_reading_the_checkpoint(comfy: FakeComfy) -> None:
    """An SDXL LoRA or a checkpoint picked as a LoRA is refused from the LoRA's key names alone: the base
    checkpoint is not read (it does not even exist here; reading it imports diffusers, seconds)."""
    from safetensors.torch import save_file

    base = ParallelHandle(
        str(comfy.models / "absent.safetensors"), "absent.safetensors", ("cpu", "cpu"), None
    )
    files = {
        "sdxl.safetensors": ("lora_unet_input_blocks_4_1_proj_in.lora_down.weight", "it is an SDXL LoRA"),
        "model.safetensors": ("model.diffusion_model.input_blocks.0.0.weight", "it is a model checkpoint"),
    }
    comfy.loras.mkdir(parents=True, exist_ok=True)
    for name, (key, what) in files.items():
        save_file({key: torch.zeros(4, 8)}, str(comfy.loras / name))
        with pytest.raises(ConfigError) as err:
            NODE_CLASS_MAPPINGS["RocmParallelLoRA"]().add_lora(
                parallel_flux=base, lora_name=name, strength_model=1.0
            )
        assert str(err.value).startswith(f"'{comfy.loras / name}' has no FLUX LoRA keys")
        assert what in str(err.value)


def test_lora_node_refuses_a_file_that_is_no_lora_for_this_model(
    comfy: FakeComfy, lora_files: list[str], dev_checkpoint: str
) -> None:
    """The backend's full check, before any worker starts: a model file, and a LoRA for a wider model."""
    base = ParallelHandle(str(comfy.models / dev_checkpoint), "dev.safetensors", ("cpu", "cpu"), None)
    with pytest.raises(ConfigError) as err:
        NODE_CLASS_MAPPINGS["RocmParallelLoRA"]().add_lora(
            parallel_flux=base, lora_name="not-a-lora.safetensors", strength_model=1.0
        )
    assert str(err.value).startswith(f"'{comfy.loras / 'not-a-lora.safetensors'}' has no FLUX LoRA keys")
    from rocm_parallel.testing.models import tiny_flux_config
    from rocm_parallel.testing.writers import write_random_lora

    write_random_lora(comfy.loras / "wide.safetensors", tiny_flux_config(heads=8, head_dim=16), "bfl")
    with pytest.raises(
        ConfigError, match=r"has shape \[4, 128\] but this checkpoint's '[^']+' needs \[4, 64\]"
    ):
        NODE_CLASS_MAPPINGS["RocmParallelLoRA"]().add_lora(
            parallel_flux=base, lora_name="wide.safetensors", strength_model=1.0
        )
    with pytest.raises(FileNotFoundError, match=r"'missing\.safetensors' not found"):
        NODE_CLASS_MAPPINGS["RocmParallelLoRA"]().add_lora(
            parallel_flux=base, lora_name="missing.safetensors", strength_model=1.0
        )


def test_loras_reach_the_backends_check_and_load() -> None:
    registry = Registry(factory=ForwardFlux)
    handle = ParallelHandle(
        "/m/dev.safetensors", "dev.safetensors", ("cpu", "cpu"), None, (("/l/a.safetensors", 0.5),)
    )
    ModelRunner(registry, handle, LayoutRequest(ParallelLayout(tp=2)), FAKE_INFO).prepare((1, 16, 8, 8))
    flux = registry.current
    assert flux.checks[0]["loras"] == (("/l/a.safetensors", 0.5),) == flux.loads[0]["loras"]


def test_missing_comfyui_internals_name_the_version(
    monkeypatch: pytest.MonkeyPatch, comfy: FakeComfy
) -> None:
    from rocm_parallel.nodes import comfy_model

    monkeypatch.setitem(sys.modules, "comfyui_version", SimpleNamespace(__version__="0.9.99"))
    with pytest.raises(RuntimeError) as err:
        comfy_model.require_internals()
    text = str(err.value)
    assert text.startswith("ROCm Parallel Model: ComfyUI 0.9.99 lacks comfy.model_base.Flux, ")
    assert "comfy.samplers.sampler_object" in text  # the fake comfy.samplers has only the lists
    assert text.endswith(
        "which the parallel MODEL needs (checked against ComfyUI 0.3.75 and 0.33.0). Update ComfyUI, or use "
        "the TP / Ring Attention Sampler's pack version made for this ComfyUI"
    )


def test_a_comfyui_without_flux2_names_the_missing_config_class(
    monkeypatch: pytest.MonkeyPatch, comfy: FakeComfy
) -> None:
    """ComfyUI 0.3.64 has no supported_models.Flux2: the FLUX.2 MODEL fails naming it (FLUX.1 still runs)."""
    from rocm_parallel.nodes import comfy_model

    monkeypatch.setitem(sys.modules, "comfyui_version", SimpleNamespace(__version__="0.3.64"))
    monkeypatch.setitem(sys.modules, "comfy.supported_models", SimpleNamespace(Flux=object))
    with pytest.raises(RuntimeError) as err:
        comfy_model.require_internals((("comfy.supported_models", "Flux2"),))
    assert str(err.value) == (
        "ROCm Parallel Model: ComfyUI 0.3.64 lacks comfy.supported_models.Flux2, which the parallel MODEL "
        "needs (checked against ComfyUI 0.3.75 and 0.33.0). Update ComfyUI, or use the TP / Ring Attention "
        "Sampler's pack version made for this ComfyUI"
    )
    comfy_model.require_internals((("comfy.supported_models", "Flux"),))  # present: no error


def test_reference_shapes_are_one_calls_references() -> None:
    """The reference latents one model call carries: the richest conds entry's, never positive + negative."""
    kontext = [torch.zeros(1, 16, 5, 7), torch.zeros(1, 16, 3, 3)]
    conds = {
        "positive": [{"cross_attn": torch.zeros(1, 8, 32), "reference_latents": kontext}],
        "negative": [{"cross_attn": torch.zeros(1, 8, 32), "reference_latents": kontext[1:]}],
    }
    assert checks.reference_shapes(conds) == [(1, 16, 5, 7), (1, 16, 3, 3)]
    assert checks.reference_shapes({"positive": [{"cross_attn": torch.zeros(1, 8, 32)}]}) == []
    assert checks.reference_shapes(None) == []


# --- ComfyUI polish: names without the install path, one unit style, refusals and mismatches on the panel


COMFYUI_IMPORT = """
import importlib.util, sys
# As ComfyUI 0.3.75 / 0.33.0 nodes.py load_custom_node imports a pack folder: named after its path.
name = sys.argv[1]
spec = importlib.util.spec_from_file_location(name, sys.argv[2])
pack = importlib.util.module_from_spec(spec)
sys.modules[name] = pack
spec.loader.exec_module(pack)
config = sys.modules[name + ".backend.config"]
from importlib import import_module
files = import_module(name + ".backend.checkpoint.files")
lora = import_module(name + ".backend.checkpoint.lora.records")
registry = import_module(name + ".nodes.registry")
launch = import_module(name + ".backend.runtime.launch")
watch = import_module(name + ".backend.runtime.watch")
transport = import_module(name + ".backend.runtime.transport")
for cls in (config.ConfigError, files.CheckpointError, lora.LoraError, launch.WorkerError, watch.JobTimeout,
            transport.UnknownRecord):
    print(cls.__module__ + "." + cls.__qualname__)  # ComfyUI's execution.full_type_name
try:
    raise files.CheckpointError("x")
except config.ConfigError as exc:  # still caught as what it is
    print("caught", type(exc) is files.CheckpointError)
"""


def test_errors_reach_comfyui_named_by_the_package_not_the_install_path(tmp_path: Path) -> None:
    """ComfyUI imports a custom-node folder under its absolute path and shows an error as module.qualname."""
    installed = tmp_path / "custom_nodes" / "rocm_parallel_pack"
    installed.parent.mkdir()
    installed.symlink_to(PACK_ROOT, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", COMFYUI_IMPORT, str(installed), str(installed / "__init__.py")],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "rocm_parallel.backend.config.ConfigError",
        "rocm_parallel.backend.checkpoint.files.CheckpointError",
        "rocm_parallel.backend.checkpoint.lora.records.LoraError",
        "rocm_parallel.backend.runtime.launch.WorkerError",
        "rocm_parallel.backend.runtime.watch.JobTimeout",
        "rocm_parallel.backend.runtime.transport.UnknownRecord",
        "caught True",
    ]


def test_the_panel_and_the_status_node_say_the_same_sizes_in_the_same_words() -> None:
    registry = Registry(factory=RecordingFlux)
    registry.group_for(("cpu", "cuda:1"))
    memory = {"allocated_gb": 6.2, "peak_gb": 7.0, "free_gb": 50.0, "total_gb": 63.98}
    registry.update(
        ranks=[
            {"rank": 0, "device": "cpu", "parameter_bytes": 2_300_000},
            {"rank": 1, "device": "cuda:1", "parameter_bytes": 23_800_000_000, **memory},
        ]
    )
    shown = [r["text"] for r in registry.snapshot()["ranks"]]  # what the panel draws
    assert shown == [
        "rank 0 cpu: 2.3 MB weights",
        "rank 1 cuda:1: 23.80 GB weights, 6.20 / 64.0 GB allocated",
    ]
    assert format_state(registry.snapshot()).splitlines()[2:] == [f"  {line}" for line in shown]


def test_a_refusal_before_any_worker_starts_is_the_panels_last_error(
    comfy: FakeComfy, dev_checkpoint: str, recording_registry: tuple[Registry, list]
) -> None:
    registry, _ = recording_registry
    handle = ParallelHandle(str(comfy.models / dev_checkpoint), dev_checkpoint, ("cpu",) * 3, None)
    with pytest.raises(ConfigError, match="tp_degree=3"):
        NODE_CLASS_MAPPINGS["RocmParallelModel"]().model(
            parallel_flux=handle, layout="tp", ring_degree=0, ulysses_degree=0
        )
    assert not registry.current.started
    state = registry.snapshot()
    assert (state["phase"], state["error"]) == (
        "idle",
        "ConfigError: tp_degree=3 does not divide 4 attention heads; use 2 or 4",
    )
    # With no group running (closed), a refused loader input is still shown, under "no group".
    registry.close()
    (comfy.models / "not-flux.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(ConfigError):
        NODE_CLASS_MAPPINGS["RocmParallelLoader"]().load(
            checkpoint="not-flux.safetensors", devices="cpu x2", dtype="float32", preload="auto"
        )
    assert not registry.current.started
    text = format_state({**registry.snapshot(), "devices": []})
    assert text.splitlines()[0] == "ROCm Parallel: no worker group is running"
    assert text.splitlines()[-1].startswith("last error: CheckpointError: 'not-flux.safetensors' ")
    assert str(comfy.models) not in text
    # A cancel is no error.
    registry.update(error=None)
    with pytest.raises(InterruptProcessingException), registry.refusals():
        raise InterruptProcessingException()
    assert registry.snapshot()["error"] is None


def _running(**fields: object) -> dict:
    return {"devices": ["cpu", "cpu"], "checkpoint": "tiny-dev.safetensors", "layout": "tp 2", **fields}


@pytest.mark.parametrize(
    ("widgets", "state", "notice"),
    [
        ({"checkpoint": "tiny-dev.safetensors", "devices": "cpu x2", "preload": "tp"}, _running(), None),
        # another spelling of the same devices, a subfolder, or no layout asked: the same request
        (
            {"checkpoint": "flux/tiny-dev.safetensors", "devices": "cpu, cpu", "preload": "none"},
            _running(),
            None,
        ),
        ({"checkpoint": "tiny-dev.safetensors", "devices": "cpu x2", "preload": "auto"}, _running(), None),
        ({"checkpoint": "other.safetensors", "devices": "cpu x2", "preload": "tp"}, {"devices": []}, None),
        (  # a loader whose devices would be refused is told the group shown is not its own, and why
            {"checkpoint": "tiny-dev.safetensors", "devices": "cpu x0", "preload": "tp"},
            _running(),
            "showing the running group of tiny-dev.safetensors on cpu, cpu (tp 2), not this loader's: its "
            "devices would be refused (devices='cpu x0' asks for 0 CPU workers; use at least 1, e.g. 'cpu x2')",
        ),
        (
            {"checkpoint": "other.safetensors", "devices": "cpu x4", "preload": "tp"},
            _running(),
            "showing the running group of tiny-dev.safetensors on cpu, cpu (tp 2); this loader asks for "
            "other.safetensors on cpu, cpu, cpu, cpu (tp 4); it will load when queued",
        ),
        (
            {"checkpoint": "tiny-dev.safetensors", "devices": "cpu x2", "preload": "context"},
            _running(),
            "showing the running group of tiny-dev.safetensors on cpu, cpu (tp 2); this loader asks for "
            "tiny-dev.safetensors on cpu, cpu (ring 2); it will load when queued",
        ),
        (
            {"checkpoint": "other.safetensors", "devices": "cpu x2", "preload": "none"},
            _running(),
            "showing the running group of tiny-dev.safetensors on cpu, cpu (tp 2); this loader asks for "
            "other.safetensors on cpu, cpu; it will load when queued",
        ),
        (
            {"checkpoint": "tiny-dev.safetensors", "devices": "cpu x3", "preload": "none"},
            _running(checkpoint=None, layout=None),
            "showing the running group of no model on cpu, cpu; this loader asks for "
            "tiny-dev.safetensors on cpu, cpu, cpu; it will load when queued",
        ),
    ],
)
def test_the_panel_says_when_the_running_group_is_not_what_the_loader_asks_for(
    widgets: dict, state: dict, notice: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rocm_parallel.nodes import routes

    registry = Registry(factory=RecordingFlux)
    registry.state = {**registry.state, **state}
    monkeypatch.setattr(registry_module, "REGISTRY", registry)
    assert routes.answer(widgets)["mismatch"] == notice
    assert "mismatch" not in routes.answer({})  # the plain snapshot, for the Status node and old pages
