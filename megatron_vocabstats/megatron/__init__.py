"""Everything that knows Megatron's names. The ops never import from here at module level."""
