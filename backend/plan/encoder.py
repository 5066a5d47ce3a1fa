"""What a text encoder costs per GPU, and where it should live while a graph runs.

**Bytes per rank**, exactly what the workers hold: the encoder kind's own model built on the meta device, its
parameters sharded by the kind's tensor-parallel plan with the engine's `shard_pieces` (the same function the
loader reads slices with), linear weights and token embeddings at the bytes of the dtype they are held in
(ComfyUI's: bf16, fp16, fp8), norms and biases in float32 (backend/encoders/load.py).

**Residency** (`place_encoder`): a graph encodes its prompts once, then samples for many steps. On each GPU
the encoder's shard, the diffusion model's shard, the sampling activations and, on GPU 0, ComfyUI's own
process (its models, its CUDA context) compete. The planner picks, per machine:

* "resident": encoder and diffusion model both stay on the GPUs (nothing moves between prompts);
* "host": the encoder's shard moves to pinned host memory (each rank its own) while the model samples and
  back for the next prompt: PCIe time per prompt, GPU memory only during encoding;
* "comfyui": the pack does not run the encoder; ComfyUI's own CLIPLoader does (it streams or offloads the
  whole encoder as it does today). Chosen only when the shard does not fit even alone.

Nothing needs a device: shapes come from the meta device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..dtypes import DType, dtype_named
from ..text import GB

PLACEMENTS = ("resident", "host", "comfyui")
# Bytes ComfyUI's own process keeps on GPU 0 besides the pack's workers: its CUDA context, the VAE it decodes
# with (FLUX's is 168 MB in bf16) and its intermediate tensors (conservative; ComfyUI's own reserve is 0.4-0.6 GB)
COMFYUI_GPU0 = int(1.5 * GB)
MARGIN = 0.9  # of a GPU's memory, what the plan may fill (allocator fragmentation, kernels' workspaces)


def encoder_bytes(
    kind: Any,
    config: Mapping[str, Any],
    degree: int,
    embedding: str = "vocab",
    held: Callable[[str], DType] | DType | str = "bfloat16",
    table: DType | str | None = None,
) -> int:
    """Parameter bytes one rank holds of encoder `kind` (a backend.encoders.kind.EncoderKind) with `config`
    at tensor-parallel `degree`: `held` is the dtype of the linear weights and embeddings, one for all (a
    DType or its name) or per parameter name (a function); `table`, when given, the token table's own (an
    fp8 encoder file, plain or scaled, keeps its token table in bf16: ComfyUI's and the pack's test files)."""
    import torch  # the meta model; imported here so that the planner's other parts stay torch-free

    from ..parallel.tensor import resolve_plan, shard_pieces

    model = kind.build(config, device="meta")
    resolved = resolve_plan(model, kind.tp(embedding).plan)
    dims = kind.dims(config)
    if callable(held):
        by_name = held
    else:
        one = _as_dtype(held)
        by_name = lambda _name: one  # noqa: E731 (one dtype for every parameter)
    token_table = _as_dtype(table) if table is not None else None
    total = 0
    for name, param in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        shape = tuple(param.shape)
        split = resolved.get(module_name)
        if split is not None and degree > 1:
            pieces = shard_pieces(split, leaf, shape, 0, degree, dims)
            shape = pieces.shape(shape) if pieces is not None else shape
        kept = (leaf == "weight" and isinstance(module, torch.nn.Linear | torch.nn.Embedding)) or hasattr(
            module, "out_dtype"
        )
        if token_table is not None and isinstance(module, torch.nn.Embedding):
            size = token_table.bytes
        else:
            size = by_name(name).bytes if kept else 4
        n = 1
        for s in shape:
            n *= s
        total += n * size
    return total


def _as_dtype(dtype: DType | str) -> DType:
    if isinstance(dtype, DType):
        return dtype
    found = dtype_named(dtype)
    if found is None:
        raise ValueError(f"unknown dtype {dtype!r}")
    return found


@dataclass(frozen=True)
class Placement:
    """Where the encoder lives (`PLACEMENTS`) and the bytes per GPU the choice was made from."""

    choice: str
    encoder: int  # the encoder's shard per rank
    model: int  # the diffusion model's weights per rank (0: none planned)
    activations: int  # the sampling activations per rank
    comfyui: int  # ComfyUI's own process on GPU 0
    device: int  # one GPU's memory
    reason: str

    @property
    def usable(self) -> int:
        """What GPU 0 may fill: `MARGIN` of its memory."""
        return int(self.device * MARGIN)

    @property
    def gpu0_peak(self) -> int:
        """GPU 0's bytes at its fullest under this choice (ComfyUI's own share included): while sampling, and
        for "resident" and "host" also while encoding (the model's shard stays; no sampling activations)."""
        if self.choice == "resident":
            return self.comfyui + self.encoder + self.model + self.activations
        if self.choice == "host":
            return self.comfyui + self.model + max(self.encoder, self.activations)
        return self.comfyui + self.model + self.activations

    @property
    def overflows(self) -> bool:
        """Whether GPU 0 cannot hold even the model's shard, its activations and ComfyUI's own process: the
        model fits the GPUs by itself (the planner's table), not the whole graph."""
        return self.comfyui + self.model + self.activations > self.usable

    def explanation(self) -> str:
        return (
            f"text encoder {self.choice}: {self.reason} (per GPU: encoder {self.encoder / GB:.2f} GB, model "
            f"{self.model / GB:.2f} GB, activations {self.activations / GB:.2f} GB, ComfyUI on GPU 0 "
            f"{self.comfyui / GB:.2f} GB; GPU 0 at peak {self.gpu0_peak / GB:.2f} GB of {self.usable / GB:.2f} GB "
            f"usable, {self.device / GB:.1f} GB)"
        )


def place_encoder(
    encoder: int, model: int, activations: int, device: int, comfyui: int = COMFYUI_GPU0
) -> Placement:
    """The residency of an encoder shard of `encoder` bytes per rank beside a diffusion model of `model`
    bytes per rank sampling with `activations` bytes per rank, on GPUs of `device` bytes each (GPU 0 also
    holding ComfyUI's `comfyui`): the cheapest placement that fits GPU 0, the fullest one."""
    usable = int(device * MARGIN) - comfyui
    sampling = model + activations
    facts = {
        "encoder": encoder,
        "model": model,
        "activations": activations,
        "comfyui": comfyui,
        "device": device,
    }
    if sampling > usable:
        return Placement(
            "comfyui",
            reason="the model's shard, its activations and ComfyUI's own process alone fill GPU 0 past its usable "
            "memory: no room for the encoder's shard (and GPU 0 may run out while sampling; use fp8 weights or "
            "more GPUs); ComfyUI's own CLIPLoader runs the encoder",
            **facts,
        )
    if encoder + sampling <= usable:
        return Placement("resident", reason="encoder and model fit together", **facts)
    # while encoding, the model's shard stays but no sampling activations are live
    if encoder + model <= usable and sampling <= usable:
        return Placement(
            "host",
            reason="encoder and model fit together only while no sampling activations are live: the encoder's "
            "shard waits in pinned host memory while the model samples",
            **facts,
        )
    return Placement(
        "comfyui",
        reason="the encoder's shard does not fit a GPU beside the model's: ComfyUI's own CLIPLoader runs it",
        **facts,
    )


__all__ = ["COMFYUI_GPU0", "MARGIN", "PLACEMENTS", "Placement", "encoder_bytes", "place_encoder"]
