"""The diffusion model's job, shaped like encoders/ and vae/: the caller's API (api.py `ParallelModel`), the
checks and admission made before any rank runs (checks.py, call.py, admission.py), the sampling loop
(sampling.py) and the planner's 'auto' layout (auto.py), the wire (messages.py) and the workers' side (jobs.py:
load; serve.py: one model call, forward_client.py its caller)."""
