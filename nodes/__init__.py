"""ComfyUI node classes: thin wrappers over `backend.client`. Populated by the nodes issue."""

NODE_CLASS_MAPPINGS: dict[str, type] = {}
NODE_DISPLAY_NAME_MAPPINGS: dict[str, str] = {}
