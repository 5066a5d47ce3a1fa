"""What the nodes' widgets mean, in plain Python: device lists, dtypes, layouts, and the handle that flows
between the nodes. No ComfyUI and no torch at import time (the pack's entry point imports the nodes).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..backend.config import DEFAULT_SLOT, ConfigError, ParallelLayout

# The socket type between the loader and the samplers (ComfyUI matches custom types by string).
HANDLE_TYPE = "PARALLEL_FLUX"
CATEGORY = "ROCm Parallel"

DEVICES_ALL = "all"
DTYPES = ("default", "bfloat16", "float16", "float32")
# The loader's weight_dtype choices, ComfyUI UNETLoader's names (config.WEIGHT_DTYPE_BYTES says what each does).
WEIGHT_DTYPES = ("default", "fp8_e4m3fn", "fp8_e5m2")
PRELOAD_LAYOUTS = ("none", "tp", "context", "auto")
MODEL_LAYOUTS = ("tp", "context", "auto")  # the ROCm Parallel Model's words; degrees are written out
STATUS_ACTIONS = ("report", "unload", "close", "doctor")
# The loader's compile choices (backend/compile.py; 'aot_eager' is for tests, not offered).
COMPILE_CHOICES = ("off", "inductor")


# ComfyUI lists its own extensions in models/diffusion_models and models/unet, not GGUF's (ComfyUI-GGUF adds
# them under a key of its own, "unet_gguf"); the loader reads GGUF diffusion models from the same folders.
GGUF_SUFFIX = ".gguf"


def diffusion_model_files(folder_paths: Any) -> list[str]:
    """The loader's checkpoint list: ComfyUI's diffusion_models files plus the GGUF files in the same
    folders (names relative to their folder, as ComfyUI lists them and `get_full_path` finds them)."""
    names = set(folder_paths.get_filename_list("diffusion_models"))
    for folder in folder_paths.get_folder_paths("diffusion_models"):
        if os.path.isdir(folder):
            found, _ = folder_paths.recursive_search(folder, excluded_dir_names=[".git"])
            names.update(folder_paths.filter_files_extensions(found, {GGUF_SUFFIX}))
    return sorted(names)


def parse_devices(text: str, visible_gpus: Callable[[], int] | None = None) -> tuple[str, ...]:
    """The loader's `devices` text -> device names for the worker group (`backend.platforms.parse_devices`).

    "all" (or empty): every visible GPU, an error naming the torch build when there is none. "0,1,2,3"
    or "cuda:0, cuda:1": those GPUs. "cpu x2" (or "cpu*2", "cpu, cpu"): CPU workers, for testing.
    """
    from ..backend.platforms import parse_devices as parse

    return parse(text, visible_gpus)


def compute_dtype(choice: str) -> str | None:
    """'default' -> None (bfloat16 on GPUs that support it, float32 on CPU); otherwise the name."""
    if choice not in DTYPES:
        raise ConfigError(f"dtype={choice!r} is not offered; use one of {', '.join(DTYPES)}")
    return None if choice == "default" else choice


def weight_dtype(choice: str) -> str | None:
    """The loader's weight_dtype widget -> ParallelModel.load's weight_dtype ('default' -> None: an fp8
    checkpoint's weights stay fp8)."""
    if choice not in WEIGHT_DTYPES:
        raise ConfigError(f"weight_dtype={choice!r} is not offered; use one of {', '.join(WEIGHT_DTYPES)}")
    return None if choice == "default" else choice


def compile_choice(choice: str) -> str:
    """The loader's optional compile widget ('off' when an older workflow lacks it) -> ParallelModel.load's."""
    if choice not in COMPILE_CHOICES:
        raise ConfigError(
            f"compile={choice!r} is not offered; use one of {', '.join(COMPILE_CHOICES)} ('inductor' compiles "
            "the repeated transformer blocks on every worker at the first call, 'off' runs eager)"
        )
    return choice


ENGINE_ENV = "ROCM_PARALLEL_ENGINE"


def engine_choice() -> str:
    """The engine loaders run their models on: ROCM_PARALLEL_ENGINE when set ('comfy': ComfyUI's own model
    classes sharded by a plan, backend/models/; the default 'diffusers': each family's diffusers model)."""
    from ..backend.models.options import check_engine

    return check_engine(os.environ.get(ENGINE_ENV) or "diffusers")


def tp_layout(devices: int, batch: int = 1, ring: int = 1, ulysses: int = 1) -> ParallelLayout:
    """The TP Sampler's layout: tensor parallelism over the devices its other degrees leave (all of them
    by default); `batch`, `ring`, `ulysses` compose with it ('batch 2 x tp 2')."""
    return ParallelLayout.filling(devices, "tp", batch=batch, ring=ring, ulysses=ulysses)


def context_layout(
    ring: int, ulysses: int, devices: int, batch: int = 1, tp: int = 1
) -> ParallelLayout | None:
    """The Ring Attention Sampler's degrees: ring x ulysses over the devices `batch` x `tp` leave, 0 fills
    the rest; both 0 is `None`, the planner's choice for the image being sampled (see `sample`)."""
    if ring == 0 and ulysses == 0:
        ParallelLayout.filling(
            devices, "ring", "ring x ulysses", batch=batch, tp=tp
        )  # the others must divide
        return None
    return ParallelLayout.make("context", devices, ring, ulysses, batch=batch, tp=tp)


def describe_layout(layout: ParallelLayout) -> str:
    return layout.describe()


@dataclass(frozen=True)
class LayoutRequest:
    """The layout a node asks for: a fixed one, or `None` for the planner's choice for the latent being
    sampled, among the layouts that keep the degrees `fixed()` names: tp 1 with `context_only` (the Ring
    Attention Sampler's auto, unless its `tp`), its `batch` when given."""

    layout: ParallelLayout | None
    context_only: bool = False
    batch: int | None = None
    tp: int | None = None

    def fixed(self) -> dict[str, int]:
        """The degrees auto keeps."""
        kept = {} if self.batch is None else {"batch": self.batch}
        if self.tp is not None or self.context_only:
            kept["tp"] = self.tp if self.tp is not None else 1
        return kept

    def describe(self) -> str:
        if self.layout is not None:
            return self.layout.describe()
        kept = " x ".join(f"{k} {v}" for k, v in self.fixed().items() if v != 1)
        what = "auto (context parallel)" if self.context_only else "auto"
        return f"{what} with {kept}" if kept else what


def model_layout(layout: str, ring: int, ulysses: int, devices: int) -> LayoutRequest:
    """The ROCm Parallel Model node's layout field: 'tp' (every device), 'context' (ring_degree x
    ulysses_degree; 0 fills the rest, both 0 = auto split), 'auto' (the planner, every composition), or
    degrees such as 'batch 2 x tp 2' / 'tp2xulysses2' (config.ParallelLayout.parse). The degree widgets
    belong to 'context': set with anything else they are refused, never ignored."""
    if not isinstance(layout, str) or not layout.strip():
        raise ConfigError(
            f"layout={layout!r} is empty; use {', '.join(MODEL_LAYOUTS)} or degrees such as 'batch 2 x tp 2'"
        )
    kind = layout.strip().lower()
    if kind == "context":
        return LayoutRequest(context_layout(ring, ulysses, devices), context_only=True)
    for name, value in (("ring_degree", ring), ("ulysses_degree", ulysses)):
        if value:
            raise ConfigError(
                f"{name}={value} applies to layout 'context' only, but layout is {layout!r}; set it to 0, "
                "or write the degree into the layout (e.g. 'tp 2 x ring 2')"
            )
    if kind == "auto":
        return LayoutRequest(None)
    return LayoutRequest(ParallelLayout.make(kind, devices))


# --------------------------------------------------------------------------------------------------
# The handle between the nodes


@dataclass(frozen=True)
class ParallelHandle:
    """What flows over a PARALLEL_FLUX link: which checkpoint, on which devices, in which compute dtype
    (`dtype`) and weight dtype (`weight_dtype`, None: the checkpoint's own fp8 stays fp8).

    Plain, hashable data: the resident worker group itself stays in the registry, so a handle from a
    cached node output still finds (or restarts) the group that serves its devices. `slot` names the
    loader's model among the group's resident ones (a graph with two loaders on the same devices keeps both
    models resident).
    """

    checkpoint: str  # absolute path
    name: str  # as listed in ComfyUI's diffusion_models
    devices: tuple[str, ...]
    dtype: str | None
    loras: tuple[tuple[str, float], ...] = ()  # (absolute path, strength), applied in this order
    weight_dtype: str | None = None
    compile: str = "off"  # the loader's compile widget: the repeated blocks compiled on every worker
    # which resident model of the group this loader's is (its node: two loaders keep two models resident)
    slot: str = DEFAULT_SLOT
    engine: str = "diffusers"  # 'comfy': ComfyUI's own model class on the workers (backend/models/)
    detection: str = ""  # JSON: values over ComfyUI's model detection (the comfy engine; tests' small files)

    def __repr__(self) -> str:
        with_loras = "".join(f" + {os.path.basename(p)} x{s:g}" for p, s in self.loras)
        return f"<{HANDLE_TYPE} {self.name}{with_loras} on {', '.join(self.devices)}>"

    def with_lora(self, path: str, strength: float) -> ParallelHandle:
        """This handle plus one LoRA (the ROCm Parallel LoRA node; chainable). Strength 0 changes nothing,
        as with ComfyUI's LoraLoaderModelOnly."""
        if strength == 0:
            return self
        return dataclasses.replace(self, loras=(*self.loras, (path, float(strength))))


def loader_slot(unique_id: str | None) -> str:
    """The resident-model slot of a loader node: its node id (ComfyUI's UNIQUE_ID), so two loaders on the
    same devices keep two models resident and a loader's next run finds its own; the default slot without
    one (a caller outside ComfyUI's executor)."""
    return f"loader {unique_id}" if unique_id not in (None, "") else DEFAULT_SLOT


def checkpoint_tooltip() -> str:
    """The loader's checkpoint tooltip, naming the registered families (imports them: only from INPUT_TYPES)."""
    from ..backend.family import families

    titles = ", ".join(f.title for f in families())
    return (
        f"A diffusion transformer from models/diffusion_models or models/unet ({titles}): a safetensors file as "
        "ComfyUI's Load Diffusion Model reads it, a GGUF file as ComfyUI-GGUF reads it (Q8_0, Q4_K, ...; kept "
        "quantized on the GPUs), or a diffusers folder. Sample it through the ROCm Parallel Model with ComfyUI's "
        "own sampler nodes, or with the TP / Ring Attention Sampler."
    )
