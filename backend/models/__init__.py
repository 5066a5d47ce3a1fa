"""The model engine: ComfyUI's own diffusion model classes on the workers, sharded by a plan written as data
(issue 51). `load(..., engine="comfy")` selects it; the default engine is each family's diffusers model.

Every rank builds the model ComfyUI's own loader builds for the file (its detection, `model_config`,
`comfy.ops`) on the meta device, applies the model's plan (which linears split by columns or rows, fused
sections included; which attributes shrink per rank; where the token sequence splits for ring / Ulysses),
reads only its slices of the file, and runs ComfyUI's own forward on each call. The modules, one job each:

- options.py: the caller's checks (torch-free): the engine's name, the ComfyUI checkout, what it reads;
- comfyui.py: importing ComfyUI's `comfy` package safely in a worker;
- build.py: ComfyUI's model for a file on the meta device, each parameter traced to its stored tensor;
- plan.py: the plan format; plans/: the plans, one module per ComfyUI model family (FLUX.1, FLUX.2);
- apply.py: a plan's tensor parallelism on ComfyUI's modules;
- load.py: each rank's slices from the file, by the pack's reading rules;
- lora.py: LoRAs by ComfyUI's own LoRA code on each rank's slices;
- attention.py: ring / Ulysses through ComfyUI's attention hook;
- engine.py: the resident `EngineModel` and `load_engine_model` (the workers' load job calls it).

Only this package's worker-side modules import ComfyUI; the runtime never does. The design, FLUX.1's plan as
the worked example and the porting checklist: docs/internals.md, "The model engine".
"""
