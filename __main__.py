"""`python -m rocm_parallel …`: the command line (demo run, benchmarks)."""

from .backend.cli import main

raise SystemExit(main())
