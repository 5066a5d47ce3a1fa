"""ROCm Parallel: several local GPUs compute one image or video together, from ComfyUI.

ComfyUI's entry point. Imports nothing heavy (no torch, no diffusers) so that loading the pack, or
importing it outside ComfyUI, is cheap; the engine lives in `backend/` and runs in worker processes.
"""

__version__ = "0.1.0"

# The web extension (js/): the live worker-group panel on the loader node.
WEB_DIRECTORY = "./js"

if __package__:  # ComfyUI (custom_nodes/<folder>) or pip-installed as rocm_parallel
    from .backend.torch_range import check_torch

    check_torch()  # a torch below the supported range: one message with the range and the install commands
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
    from .nodes.registry import announce_hosts
    from .nodes.routes import register_routes

    register_routes()  # only does something inside ComfyUI
    announce_hosts()  # inside ComfyUI with ROCM_PARALLEL_LISTEN set: the key and the other hosts' command
else:  # imported as a bare file: pytest collecting a checkout whose folder name is no identifier
    NODE_CLASS_MAPPINGS: dict[str, type] = {}
    NODE_DISPLAY_NAME_MAPPINGS: dict[str, str] = {}

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
