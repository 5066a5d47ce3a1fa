"""Benchmarks behind `python -m rocm_parallel bench <name>`; each module has add_arguments() and run().

A benchmark prints a Markdown table (what BENCHMARKS.md records) and returns it; none is a test. This
folder is not part of the installed package: the command runs it from a checkout (backend/cli.py finds
it next to backend/). What it shares with the tests (meta-device tracer, configs, checkpoint writer,
timing, tables) is in testing/.
"""

BENCHMARKS = {
    "group": "worker group: start-up, first vs warm job, per-job overhead against one process",
    "tp": "tensor parallelism: per-rank bytes, collectives, one-rank compute time",
    "load": "checkpoint loading: peak host memory per rank, sharded loader vs a naive full load",
    "cp": "context parallelism (ring / Ulysses / hybrid): activations and bytes per GPU, one-rank compute",
    "planner": "the planner's weights, activations and collectives vs the engine on the meta device",
    "layouts": "the planner's choice among every composition, 2-8 GPUs of 16-48 GB, vs cache-dit's FLUX.2 table",
    "failures": "one rank fails or hangs (OOM, stopped, killed, hung anywhere), slow but healthy ranks, cancel, Ctrl+C: time to the error, rank named, next job",
    "hangs": "40 Python-level hangs and the kernel-level ones (D, SIGSTOP, cgroup freezers), quiet and beside CPU burners: time until the hung rank is named, closing time",
    "step": "one ComfyUI-driven step (a forward request) vs the same forward in one process, 1024x1024",
    "scaling": "sampling steps on 1, 2, 4 CPU workers: latency, time per step, peak memory per worker",
    "call": "one model call broken down: caller wrapper, conditioning key, latent out, compute, collectives, reply",
    "compile": "compiled repeated blocks (inductor) vs eager per step on CPU workers, first compile apart",
    "gguf": "GGUF models: bytes per GPU of FLUX.1-dev Q8_0, FLUX.2 [dev] Q4_K, Qwen-Image Q4_K from headers; host RSS while loading",
    "gpu": "one lent GPU in at most 8 minutes: LSE guard verdicts, TP shards vs the planner, compile, fp8, ComfyUI beside worker 0",
    "vae": "patch-parallel VAE decode/encode: bytes per GPU on 1-4 ranks, planner vs meta device vs ComfyUI's (tiled) decode",
    "caches": "ComfyUI's step caches (EasyCache, LazyCache) on its own model and the parallel MODEL (needs ComfyUI)",
    "video": "a video model's weights per GPU (meta count, one or two resident experts) and the planner's layouts for a video size",
}
