"""Wan 2.1 and Wan 2.2 video transformers (T2V, I2V, the A14B experts, TI2V-5B) as a model family, all in this
folder: family.py (the registered `ModelFamily`), model.py (released configs, build), keys.py (ComfyUI's key
layout, detection, configs from shapes), attention.py (the attention processor with ComfyUI's image-context
split), forward.py (ComfyUI's model call: positions, timestep embedding, per-frame timesteps), tp.py (the
tensor-parallel plan), cp.py (context parallelism over the video tokens), call.py (the call as data),
sampling.py (the templates' schedule)."""
