"""The command line (doctor, plan, demo, bench), in both installs:

* ComfyUI's, the pack's folder in custom_nodes/ with only its requirements installed: run the folder itself,
  from ComfyUI's folder `python custom_nodes/rocm-parallel doctor` (Python runs a folder's __main__.py);
* pip's (`pip install -e .` in a checkout): `python -m rocm_parallel doctor`.
"""

import sys

if __package__:  # python -m rocm_parallel: the package is imported already
    from .backend.cli import main
else:  # python <the pack's folder>: no package yet, whatever the folder is called
    import types
    from pathlib import Path

    root = str(Path(__file__).resolve().parent)
    # the folder itself is sys.path[0]: its nodes/, backend/, tests/ would shadow top-level modules
    if sys.path and str(Path(sys.path[0]).resolve()) == root:
        del sys.path[0]
    # the package as the workers import it (launch.py's bootstrap): this folder, named rocm_parallel, without
    # its __init__ (ComfyUI's entry point, which registers the nodes); the torch range is checked as it does
    package = types.ModuleType("rocm_parallel")
    package.__path__ = [root]
    sys.modules["rocm_parallel"] = package
    from rocm_parallel.backend.torch_range import check_torch

    check_torch()
    from rocm_parallel.backend.cli import main

raise SystemExit(main())
