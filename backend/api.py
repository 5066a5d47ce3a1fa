"""The public Python API, where scripts import it: `ParallelModel` and what goes with it (the README's
`from rocm_parallel.backend.api import ParallelModel`, `ParallelFlux` for older scripts).

The diffusion model's API lives in diffusion/api.py beside its job; the text encoders' and the VAE's are
encoders/api.py `ParallelEncoder` and vae/api.py `ParallelVae`, which take a `ParallelModel` as their group.
"""

from .diffusion.api import (
    LoadOptions,
    ParallelFlux,
    ParallelModel,
    SamplingRequest,
    default_devices,
    make_layout,
)

__all__ = [
    "LoadOptions",
    "ParallelFlux",
    "ParallelModel",
    "SamplingRequest",
    "default_devices",
    "make_layout",
]
