"""meshd: one daemon per machine that joins a peer-to-peer LLM inference mesh.

The folder is `daemon/` (the project's layout); the import name is `meshd`, so that the
PyPI package python-daemon (import name `daemon`) can live in the same environment.

Importing this package has no side effects. Entry points that run MLX (the CLI, stage
runners, tests, benchmarks) call `meshd.runtime.blas.enable_fast_blas()` before anything
imports `mlx.core`; see that module for why.
"""
