"""The core statistics (log-probs, entropy, cross-entropy, argmax and their gradients) over a
vocabulary-parallel shard: ``from_logits`` takes the logits, ``from_hidden`` the hidden states
and the output layer's weight (the fused LM head, no full logits)."""
