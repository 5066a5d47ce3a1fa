"""The whole graph on the GPUs: where the text encoder lives beside the diffusion model (`plan`'s last table).

`plan` prices the diffusion model's layouts; a graph also encodes its prompts, and with the ROCm Parallel Text
Encoder Loader the encoder's shard sits on the same GPUs (tensor-parallel over all of them), beside the
model's shard, its sampling activations and, on GPU 0, ComfyUI's own process. `plan_graph` prices that for
the layout `plan` chose and names the placement (`encoder.place_encoder`: resident, host memory between
phases, or left to ComfyUI).

The encoder's bytes per rank come from encoders.json, written by tests/tools/make_encoder_facts.py from the
encoder built on the meta device (`encoder.encoder_bytes`); tests/test_encoder_facts.py keeps the file equal to
it. Reading the file keeps `plan` free of torch (the encoder kinds build torch models).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..config import _one_of
from ..family import families
from ..text import GB, markdown_table
from .encoder import COMFYUI_GPU0, PLACEMENTS, Placement, place_encoder

ENCODERS_FILE = Path(__file__).with_name("encoders.json")
MAX_DEGREE = 8  # the largest tensor-parallel degree the file stores (the pack's machines have 2-8 GPUs)
ENCODER_DTYPES = {"bf16": "bfloat16", "fp8": "float8_e4m3fn"}  # how the encoder's weights are held
# the token table's dtype where it differs from the weights': ComfyUI's fp8 encoder files (plain and scaled)
# keep it in bf16, and the workers hold it as the file does
ENCODER_TABLES = {"fp8": "bfloat16"}


def model_encoders() -> dict[str, str]:
    """Model preset -> the text encoder its ComfyUI template loads (each family's `text.encoders`): what
    `plan --encoder auto` prices."""
    return {preset: encoder for f in families() for preset, encoder in f.text.encoders.items()}


@functools.cache
def stored_encoders() -> dict[str, dict[str, Any]]:
    """encoders.json: encoder preset -> {"kind", "title", "bytes": {degree: {dtype name: rank 0's bytes}}}."""
    return json.loads(ENCODERS_FILE.read_text())


def encoder_dtype(weight_dtype: str) -> str:
    """The encoder's held dtype when none is asked for: bf16 beside bf16 weights, else fp8 (the files ComfyUI's
    templates pair with fp8 or GGUF models are fp8; the pack holds an fp8 file in fp8)."""
    return "bf16" if weight_dtype == "compute" else "fp8"


@dataclass(frozen=True)
class GraphPlan:
    """One encoder beside one priced layout: its size, its split and where it lives."""

    encoder: str  # the encoder preset (encoders.json's key)
    title: str
    dtype: str  # "bf16" or "fp8"
    degree: int  # its tensor-parallel degree: every GPU of the group
    whole: int  # its bytes unsharded (what ComfyUI's own CLIPLoader holds or streams)
    placement: Placement
    layout: str = ""  # the model's layout the placement was priced beside
    step_s: float = 0.0  # its predicted step
    fastest: str = (
        ""  # the model's fastest fitting layout alone (`auto`), when another was chosen for the graph
    )
    fastest_step_s: float = 0.0
    fastest_choice: str = ""  # where the encoder would go beside `fastest`

    def as_dict(self) -> dict[str, Any]:
        p = self.placement
        return {
            "layout": self.layout,
            "step_s": self.step_s,
            "model_alone_layout": self.fastest or self.layout,
            "encoder": self.encoder,
            "title": self.title,
            "dtype": self.dtype,
            "tp": self.degree,
            "choice": p.choice,
            "encoder_gb": p.encoder / GB,
            "whole_gb": self.whole / GB,
            "model_gb": p.model / GB,
            "activations_gb": p.activations / GB,
            "comfyui_gb": p.comfyui / GB,
            "gpu0_peak_gb": p.gpu0_peak / GB,
            "usable_gb": p.usable / GB,
            "reason": p.reason,
        }


def place_beside_layouts(
    encoder: str, dtype: str, devices: int, memory_gb: float, layouts: Sequence[Any]
) -> GraphPlan:
    """Encoder preset `encoder` (held in `dtype`, split over `devices` GPUs of `memory_gb` GB) beside the
    model's fitting `layouts`, fastest first (the planner's Estimates: name, weights, activations, step_s):
    the fastest layout with the best placement, resident before host before comfyui. An encoder left to
    ComfyUI is loaded whole for every new prompt (Mistral 24B: 23-46 GB over PCIe, or a CPU encode), and
    one in host memory moves its shard both ways, which a layout a few percent slower per step costs less
    than; so the graph may take a slower layout than `auto` does for the model alone."""
    plans = [
        replace(
            plan_graph(encoder, dtype, devices, e.weights, e.activations, memory_gb),
            layout=e.name,
            step_s=e.step_s,
        )
        for e in layouts
    ]
    # a layout GPU 0 cannot hold beside ComfyUI's own process is the last resort, whatever its placement
    best = min(
        range(len(plans)),
        key=lambda i: (plans[i].placement.overflows, PLACEMENTS.index(plans[i].placement.choice), i),
    )
    if best == 0:
        return plans[0]
    first = plans[0]
    return replace(
        plans[best], fastest=first.layout, fastest_step_s=first.step_s, fastest_choice=first.placement.choice
    )


def plan_graph(
    encoder: str, dtype: str, devices: int, weights: float, activations: float, memory_gb: float
) -> GraphPlan:
    """Encoder preset `encoder` held in `dtype` ("bf16" / "fp8"), split over `devices` GPUs of `memory_gb` GB,
    beside a model layout holding `weights` and `activations` bytes per GPU."""
    record = stored_encoders()[encoder]
    held = ENCODER_DTYPES[dtype]
    per_degree = record["bytes"]
    whole = per_degree["1"][held]
    device = int(memory_gb * GB)
    if str(devices) in per_degree:
        placement = place_encoder(per_degree[str(devices)][held], int(weights), int(activations), device)
    else:
        valid = [int(d) for d in per_degree if d != "1"]
        placement = Placement(
            "comfyui", encoder=whole, model=int(weights), activations=int(activations), comfyui=COMFYUI_GPU0,
            device=device, reason=f"{record['title']} cannot be split over {devices} GPUs (its heads, key/value "
            f"heads and MLP split over {_one_of(valid)}): ComfyUI's own CLIPLoader runs it",
        )  # fmt: skip
    degree = devices if str(devices) in per_degree else 1  # unsplit: ComfyUI holds the whole encoder
    return GraphPlan(encoder, record["title"], dtype, degree, whole, placement)


SHORT_HEADER = ["text encoder", "encoder per GPU (GB)", "GPU 0 at peak (GB)", "choice"]
FULL_HEADER = ["text encoder", "tp", "encoder per GPU (GB)", "whole (GB)", "model (GB)", "activations (GB)",
               "ComfyUI on GPU 0 (GB)", "GPU 0 at peak (GB)", "usable (GB)", "choice"]  # fmt: skip


def format_graph(graph: GraphPlan, full: bool = False) -> str:
    """The whole-graph table (one row) and the placement's reason."""
    p = graph.placement
    name = f"{graph.title} ({graph.encoder}, {graph.dtype})"
    if full:
        gbs = (p.encoder, graph.whole, p.model, p.activations, p.comfyui, p.gpu0_peak, p.usable)
        row = [name, graph.degree, *(f"{b / GB:.2f}" for b in gbs), p.choice]
        table = markdown_table(FULL_HEADER, [row], ["---", "---:", *["---:"] * 7, "---"])
    else:
        row = [name, f"{p.encoder / GB:.2f}", f"{p.gpu0_peak / GB:.2f}", p.choice]
        table = markdown_table(SHORT_HEADER, [row], ["---", "---:", "---:", "---"])
    text = f"Whole graph on the GPUs (text encoder + model + activations + ComfyUI on GPU 0):\n\n{table}\n{p.explanation()}"
    if graph.layout:
        text += f"\nmodel layout for the graph: {graph.layout}, {graph.step_s:.2f} s/step"
    return text


# how the answer names a placement (encoder.PLACEMENTS)
PLACEMENT_WORDS = {
    "resident": "resident",
    "host": "waiting in host memory",
    "comfyui": "left to ComfyUI's own CLIPLoader",
}


def graph_answer(graph: GraphPlan, memory_gb: float, device_word: str = "GPU") -> tuple[str, bool]:
    """`plan`'s one answer when it planned the whole graph: (the line, whether it is a refusal). The model's
    fastest fitting layout (`auto`, what the loader picks for the model alone) when the encoder's placement
    beside it is the best one; another layout, and how to set it, when that keeps the encoder on the GPUs;
    a refusal when GPU 0 cannot hold any fitting layout beside ComfyUI's own process."""
    p = graph.placement
    if p.overflows:
        return (
            f"auto: no layout fits the whole graph on these {device_word}s: {graph.layout} fits the model alone "
            f"({(p.model + p.activations) / GB:.2f} GB per {device_word}), but GPU 0 also holds ComfyUI's own process "
            f"({p.comfyui / GB:.2f} GB): {p.gpu0_peak / GB:.2f} GB at peak of {p.usable / GB:.2f} GB usable "
            f"({memory_gb:g} GB); use fp8 weights, more {device_word}s or a smaller image",
            True,
        )
    if not graph.fastest:
        return "", False  # the planner's own `auto` line is the answer
    return (
        f"auto for the whole graph: {graph.layout} — {graph.step_s:.2f} s/step with the text encoder {p.choice} "
        f"beside it; set layout '{graph.layout}' on the ROCm Parallel Model (its 'auto' plans the model alone "
        f"and takes {graph.fastest}, {graph.fastest_step_s:.2f} s/step, beside which the text encoder would be "
        f"{PLACEMENT_WORDS[graph.fastest_choice]})",
        False,
    )


__all__ = [
    "ENCODERS_FILE",
    "ENCODER_DTYPES",
    "ENCODER_TABLES",
    "MAX_DEGREE",
    "GraphPlan",
    "encoder_dtype",
    "format_graph",
    "graph_answer",
    "model_encoders",
    "place_beside_layouts",
    "plan_graph",
    "stored_encoders",
]
