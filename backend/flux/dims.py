"""The FLUX transformers' shape facts (FLUX.1's and FLUX.2's; their folders' `dims(config)` give one)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..config import ModelDims


@dataclass(frozen=True)
class FluxDims(ModelDims):
    """ModelDims plus what only the FLUX families read: double- and single-stream block counts, whether a
    guidance embedder exists, the pooled text width (CLIP-L's 768; FLUX.2 has none) and the MLP ratio
    (FLUX.1's built-in 4, FLUX.2's 3). `mlp`, `text_dim` and `token_channels` follow from them when not
    given (`in_channels`: the patchified latent's 64 features per token for FLUX.1)."""

    double_blocks: int = 0
    single_blocks: int = 0
    guidance: bool = False
    mlp_ratio: float = 4.0
    pooled_dim: int = 768
    in_channels: int = 64

    def __post_init__(self) -> None:
        # diffusers computes the single-block MLP width as int(dim * mlp_ratio); FeedForward uses dim * 4.
        if not self.mlp:
            object.__setattr__(self, "mlp", int(self.hidden * self.mlp_ratio))
        if not self.text_dim:
            object.__setattr__(self, "text_dim", 4096)
        object.__setattr__(self, "token_channels", self.in_channels)

    def blocks_text(self) -> str:
        return f"{self.double_blocks}+{self.single_blocks} blocks"

    @classmethod
    def from_diffusers_config(cls, config: Mapping[str, Any]) -> FluxDims:
        return cls(
            heads=int(config["num_attention_heads"]),
            head_dim=int(config["attention_head_dim"]),
            double_blocks=int(config["num_layers"]),
            single_blocks=int(config["num_single_layers"]),
            guidance=bool(config.get("guidance_embeds", False)),
            # FLUX.1's config has no mlp_ratio (4.0 is built in); FLUX.2's has 3.0.
            mlp_ratio=float(config.get("mlp_ratio", 4.0)),
            text_dim=int(config.get("joint_attention_dim", 4096)),
            pooled_dim=int(config.get("pooled_projection_dim", 768)),
            in_channels=int(config.get("in_channels", 64)),
        )


__all__ = ["FluxDims"]
