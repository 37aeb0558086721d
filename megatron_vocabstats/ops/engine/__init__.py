"""The chunk engine under every op: chunk iterators, chunk buffers, gathered statistics, the
recompute-backward loop and the weight-gradient helpers.

The op families (``stats/``, ``topk/``, ``sampling/``, each ``from_logits.py`` and
``from_hidden.py``) hold only their autograd Functions, their public API and the math no
other op uses. Everything they share lives here, behind one narrow seam (:mod:`.kernel`): per
chunk of tokens an op supplies

* the **statistics of this chunk**, a :class:`.kernel.ChunkStats` ``stats(chunk, out)``, and
* the **gradient of this chunk**, a :class:`.kernel.ChunkGrad` ``grad(chunk, out)``,

and the engine does the rest: the chunk loop and its workspace buffers
(:func:`.chunks.logits_chunks` over logits, :func:`.linear.linear_chunks` over hidden states with
the LM-head GEMM per chunk), the one all-gather of the statistics (:func:`.chunks.gathered_stats`),
the backward loops (:func:`.chunks.logits_grad` for logits, :func:`.recompute.recompute_backward`
for the fused LM head, which turns each chunk's gradient into ``dX`` and ``dW``), and the fused
head's collectives and ``main_grad`` contract. A kernel backend (e.g. Triton) plugs in at the
seam: it receives a :class:`.kernel.Chunk` (shapes and dtypes documented there) and an output
tensor.

Modules (import names from them; this package's ``__init__`` defines nothing): :mod:`.kernel`
(the seam: ``Chunk``, ``ChunkStats``, ``ChunkGrad``, the core op's ``ShardStats``/``StatsGrad``),
:mod:`.backends` (one backend object per ``cfg.kernel``: torch, Triton), :mod:`.chunks` (logits
chunks, gathered statistics, the unfused backward loop), :mod:`.linear` (the fused head's config,
buffers, chunk GEMMs and chunk policy), :mod:`.wgrad` (weight/input gradients of a chunk),
:mod:`.recompute` (the fused backward and the forward-gradient mode).
"""
