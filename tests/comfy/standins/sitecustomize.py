"""Put first on PYTHONPATH for the real-ComfyUI tier on a CPU-only torch: Python imports this module at start-up
(`site`), which installs the torchvision / torchaudio stand-ins (standin_finder.py) before ComfyUI imports them."""

import standin_finder

standin_finder.install()
