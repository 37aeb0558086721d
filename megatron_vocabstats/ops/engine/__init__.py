"""The chunk engine under every op: per chunk of tokens an op supplies the statistics and the
gradient of the chunk (:mod:`.kernel`); the engine runs the chunk loop and its buffers, the one
all-gather of the statistics, the backward loops and the fused head's GEMMs and collectives.
Defines nothing: import names from its modules.
"""
