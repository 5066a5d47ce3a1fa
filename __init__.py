"""ROCm Parallel: compute one FLUX.1 image on several local GPUs from ComfyUI.

ComfyUI's entry point. Imports nothing heavy (no torch, no diffusers) so that loading the pack, or
importing it outside ComfyUI, is cheap; the engine lives in `backend/` and runs in worker processes.
"""

from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__version__ = "0.1.0"
__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
