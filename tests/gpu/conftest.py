"""Setup of the GPU tests (``tests/gpu``, run by ``tests/gpu/run.sh``; every test skips without
CUDA or enough GPUs).

Puts ``tests/unit`` (the float64 references and case helpers), ``tests/gpu`` and ``benchmarks``
on ``sys.path``, and asks cuBLAS for its deterministic workspace configuration before CUDA starts:
the CUDA-graph checks compare replays with eager runs bitwise, and cuBLAS guarantees run-to-run
equality across streams only with it.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for path in (os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "tests", "unit"), HERE):
    if path not in sys.path:
        sys.path.insert(0, path)

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
