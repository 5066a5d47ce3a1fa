"""The pack's engine. Never imports ComfyUI; imports torch lazily where it can so that the nodes load fast."""
