"""The core statistics (log-probs, entropy, logsumexp, cross-entropy and their gradients) over a
vocabulary-parallel shard: ``from_logits`` takes the logits, ``from_hidden`` the hidden states
and the output layer's weight (the fused LM head, no full logits; it also gives the argmax).
This ``__init__`` exports nothing: import from the module, or from ``megatron_vocabstats``."""
