"""meshd daemon: one process per machine that joins the inference mesh.

Importing the package loads a system OpenBLAS before anything imports `mlx.core`
(see daemon/blas.py): on Linux CPUs it makes float32 matmuls ~60x faster than the
reference BLAS the mlx[cpu] wheel links. `MESHD_BLAS=reference` opts out.
"""

from daemon.blas import enable_fast_blas

enable_fast_blas()
