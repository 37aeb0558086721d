"""The chunk engine under every op: chunk iterators and buffers, gathered statistics, the backward
loops and the fused LM head's GEMMs and ``main_grad`` contract.

Per chunk of tokens an op supplies the **statistics of this chunk** (a
:class:`.kernel.ChunkStats`) and the **gradient of this chunk** (a :class:`.kernel.ChunkGrad`);
the engine does the rest: the chunk loop and its workspace buffers, the one all-gather of the
statistics, the backward loops (the logits gradient, or ``dX`` and ``dW`` in the fused head) and
the fused head's collectives. A kernel backend (e.g. Triton) plugs in at that seam
(:mod:`.kernel`). This package's ``__init__`` defines nothing: import names from its modules.
"""
