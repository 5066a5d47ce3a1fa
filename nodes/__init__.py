"""ComfyUI node classes: thin wrappers over `logic` (plain Python) and, through it, the backend.

Display names live here, in one place.
"""

from .classes import RocmParallelLoader, RocmParallelRingSampler, RocmParallelStatus, RocmParallelTPSampler

NODE_CLASS_MAPPINGS: dict[str, type] = {
    "RocmParallelLoader": RocmParallelLoader,
    "RocmParallelTPSampler": RocmParallelTPSampler,
    "RocmParallelRingSampler": RocmParallelRingSampler,
    "RocmParallelStatus": RocmParallelStatus,
}
NODE_DISPLAY_NAME_MAPPINGS: dict[str, str] = {
    "RocmParallelLoader": "ROCm Parallel Loader",
    "RocmParallelTPSampler": "TP Sampler",
    "RocmParallelRingSampler": "Ring Attention Sampler",
    "RocmParallelStatus": "ROCm Parallel Status",
}
