"""FLUX.1 as a model family, all in this folder: family.py (the registered `ModelFamily`), model.py
(released configs, build), keys.py (checkpoint layout, detection, configs from shapes), tp.py (the
tensor-parallel plan and fused double block), forward.py (ComfyUI's model call), sampling.py (ComfyUI's
euler/simple arithmetic)."""
