"""A toy model in ComfyUI's shapes and conventions, with its plan: the model engine's machinery (apply.py,
attention.py) checked on gloo where no ComfyUI is installed (CI's tiers). Test-only.

It has what the engine's kinds meet in ComfyUI's FLUX: a fused q | k | v linear (Columns(3)), a fused
q | k | v | mlp linear (Columns by named sections) and the linear that reads cat(attention, mlp) (Rows by
sections), modulation linears reading one vector (a Gathered bank), a block attribute that counts heads
(per_rank), position ids that change the tokens (split like them, or the output is wrong), and a joint
attention over [text | image] that calls `transformer_options["optimized_attention_override"]` exactly as
ComfyUI's `wrap_attn` does (comfy/ldm/modules/attention.py, 0.3.75 and 0.33.0).

The worker methods (`WorkerGroup(methods=["engine_toy"])`) build it seeded on every rank, apply its plan in a
layout and run its forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rocm_parallel.backend.config import ParallelLayout
from rocm_parallel.backend.models.apply import apply_tensor_parallel
from rocm_parallel.backend.models.attention import OVERRIDE_KEY, apply_context_parallel, attention_override
from rocm_parallel.backend.models.plan import Columns, Gathered, ModelPlan, Rows, SequenceSplit, Stream
from rocm_parallel.backend.parallel.mesh import parallel_groups
from rocm_parallel.backend.runtime.transport import record
from rocm_parallel.backend.runtime.worker import WorkerContext, handler

DIM, HEADS, MLP, TEXT, IMAGE, OUT = 32, 4, 48, 12, 8, 6


def sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, mask: Any = None, **kwargs: Any
) -> torch.Tensor:
    """An attention function as ComfyUI's take them (`skip_reshape`: [B, H, S, D] in, [B, S, H * D] out)."""
    out = F.scaled_dot_product_attention(q, k, v)
    return out.transpose(1, 2).flatten(-2)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, options: dict[str, Any]
) -> torch.Tensor:
    """ComfyUI's `wrap_attn` protocol: the override, when present, gets the function and its arguments."""
    override = options.get(OVERRIDE_KEY)
    kwargs = {"skip_reshape": True, "transformer_options": options}
    return sdpa(q, k, v, heads, **kwargs) if override is None else override(sdpa, q, k, v, heads, **kwargs)


def heads_of(t: torch.Tensor, parts: int, heads: int) -> tuple[torch.Tensor, ...]:
    return t.view(t.shape[0], t.shape[1], parts, heads, -1).permute(2, 0, 3, 1, 4).unbind(0)


class ToyAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_heads = HEADS
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)


class ToyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.hidden_size, self.mlp_hidden = HEADS, DIM, MLP
        self.mod = nn.Linear(DIM, 3 * DIM)
        self.attn = ToyAttention()
        self.fused = nn.Linear(DIM, 3 * DIM + MLP)
        self.out = nn.Linear(DIM + MLP, DIM)

    def forward(
        self, x: torch.Tensor, vec: torch.Tensor, transformer_options: dict[str, Any]
    ) -> torch.Tensor:
        shift, scale, gate = self.mod(F.silu(vec))[:, None].chunk(3, -1)
        h = F.layer_norm(x, (DIM,)) * (1 + scale) + shift
        x = x + self.attn.proj(
            attention(
                *heads_of(self.attn.qkv(h), 3, self.attn.num_heads), self.num_heads, transformer_options
            )
        )
        qkv, mlp = self.fused(h).split([3 * self.hidden_size, self.mlp_hidden], -1)
        a = attention(*heads_of(qkv, 3, self.num_heads), self.num_heads, transformer_options)
        return x + gate * self.out(torch.cat([a, F.gelu(mlp)], -1))


class Toy(nn.Module):
    """forward(img, img_ids, txt, txt_ids, y) like ComfyUI's FLUX: the streams go through `forward_orig`."""

    def __init__(self) -> None:
        super().__init__()
        self.img_in, self.txt_in, self.vec_in = (
            nn.Linear(OUT, DIM),
            nn.Linear(TEXT, DIM),
            nn.Linear(IMAGE, DIM),
        )
        self.pos = nn.Linear(3, DIM)
        self.blocks = nn.ModuleList([ToyBlock(), ToyBlock()])
        self.final_mod = nn.Linear(DIM, 2 * DIM)
        self.final = nn.Linear(DIM, OUT)
        self.num_heads, self.hidden_size = HEADS, DIM

    def forward(self, img, img_ids, txt, txt_ids, y, transformer_options=None):
        return self.forward_orig(img, img_ids, txt, txt_ids, y, transformer_options or {})

    def forward_orig(self, img, img_ids, txt, txt_ids, y, transformer_options):
        txt = self.txt_in(txt) + self.pos(txt_ids)
        x = torch.cat([txt, self.img_in(img) + self.pos(img_ids)], 1)
        vec = self.vec_in(y)
        for block in self.blocks:
            x = block(x, vec, transformer_options)
        shift, scale = self.final_mod(F.silu(vec))[:, None].chunk(2, -1)
        return self.final(F.layer_norm(x[:, txt.shape[1] :], (DIM,)) * (1 + scale) + shift)


TOY_PLAN = ModelPlan(
    name="toy",
    model_class=f"{__name__}.Toy",
    heads="num_heads",
    width="hidden_size",
    linears={
        "blocks.*.mod": Gathered("vec"),
        "blocks.*.attn.qkv": Columns(3),
        "blocks.*.attn.proj": Rows(),
        "blocks.*.fused": Columns(("hidden_size",) * 3 + ("mlp_hidden",)),
        "blocks.*.out": Rows(("hidden_size", "mlp_hidden")),
        "final_mod": Gathered("vec"),
    },
    per_rank={"blocks.*": ("num_heads", "hidden_size", "mlp_hidden"), "blocks.*.attn": ("num_heads",)},
    blocks=("ToyBlock",),
    sequence=SequenceSplit(
        method="forward_orig",
        streams=(Stream("txt", ("txt", "txt_ids")), Stream("img", ("img", "img_ids"))),
        output="img",
    ),
    attention=("blocks.*",),
)


def build(seed: int = 0) -> Toy:
    torch.manual_seed(seed)
    return Toy().eval()


def inputs(images: int, texts: int, batch: int = 2, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randn(batch, n, 3, generator=g)  # noqa: E731
    return {
        "img": torch.randn(batch, images, OUT, generator=g), "img_ids": ids(images),
        "txt": torch.randn(batch, texts, TEXT, generator=g), "txt_ids": ids(texts),
        "y": torch.randn(batch, IMAGE, generator=g),
    }  # fmt: skip


@record
@dataclass(frozen=True)
class ToyLayout:
    layout: ParallelLayout
    seed: int = 0


@record
@dataclass(frozen=True)
class ToyInputs:
    inputs: dict[str, Any]


@record
@dataclass(frozen=True)
class ToyOutput:
    out: torch.Tensor | None
    bytes: int


@handler("toy_engine", ToyLayout)
def toy_engine(ctx: WorkerContext, request: ToyLayout) -> ToyOutput:
    """The toy, seeded alike on every rank, with its plan applied in `layout` (kept resident)."""
    model = build(request.seed)
    groups = parallel_groups(request.layout, ctx.device)
    apply_tensor_parallel(model, TOY_PLAN, groups.tp_group)
    state = apply_context_parallel(model, TOY_PLAN, request.layout, groups.cp_mesh, ctx.device, torch.float32)
    model._toy_state = state
    ctx.resident.set(model, request)
    return ToyOutput(None, sum(p.numel() * p.element_size() for p in model.parameters()))


@handler("toy_forward", ToyInputs)
def toy_forward(ctx: WorkerContext, request: ToyInputs) -> ToyOutput:
    model = ctx.resident.require()
    state = model._toy_state
    options = {} if state is None else {OVERRIDE_KEY: attention_override(state)}
    with torch.inference_mode():
        out = model(**request.inputs, transformer_options=options)
    return ToyOutput(out if ctx.rank == 0 else None, 0)
