"""Conventions shared by the losses and the packing utilities.

:data:`IGNORE_INDEX`: the label of a token that does not count (-100, the Hugging Face /
PyTorch ``cross_entropy`` convention), defined once here and imported by
:mod:`megatron_vocabstats.losses` and :mod:`megatron_vocabstats.packing`.

May import: nothing (the lowest layer of the package).
"""

IGNORE_INDEX = -100
