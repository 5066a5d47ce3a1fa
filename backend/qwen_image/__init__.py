"""Qwen-Image (Qwen-Image-Edit, -2509, -2511) as a model family, all in this folder: family.py (the registered
`ModelFamily`), model.py (released configs, build), keys.py (checkpoint layout, detection, configs from
shapes), tp.py (the tensor-parallel plan and fused block forwards), cp.py (context parallelism with the text
mask), forward.py (ComfyUI's model call and positions), sampling.py (the template's schedule)."""
