"""What every model kept resident on the worker group shares, whatever its kind (a diffusion model, a text
encoder, a VAE): the caller's group with its slots, eviction and host placement (group.py, parking.py), the
records of a load's report and a rank's status (messages.py) and the workers' status and unload methods
(jobs.py)."""
