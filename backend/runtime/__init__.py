"""The process runtime: the worker group seen from the caller (client.py `WorkerGroup`; launch.py, watch.py,
liveness.py, procstat.py, exits.py) and from a worker (worker.py, heartbeat.py, cancel_points.py, probe.py),
the wire between them (transport.py, messages.py) and the transport pre-flight (preflight.py).

It imports no model code (no family, checkpoint, plan, parallel, resident, diffusion, encoders or vae
module; tests/test_structure.py checks): the models import the runtime. A worker serves the models' methods
by importing their modules by name (worker.py `BUILTIN_METHODS`).
"""
