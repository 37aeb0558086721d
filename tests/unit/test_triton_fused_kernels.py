"""The fused LM head's Triton kernels under Triton's CPU interpreter (``_triton_fused_interp.py``,
in one subprocess with ``TRITON_INTERPRET=1``). A file of its own so that the test runner's
workers run it beside the unfused kernels' interpreter run (``test_triton_kernels.py``)."""

from __future__ import annotations

from test_triton_kernels import _no_forcing, needs_triton, run_interpreted  # noqa: F401 (fixture)


@needs_triton
def test_fused_kernels_under_the_interpreter():
    run_interpreted("_triton_fused_interp.py")
