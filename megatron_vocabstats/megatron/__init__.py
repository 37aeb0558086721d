"""Everything that knows Megatron's names: feature detection (:mod:`.compat`), the flag family
and its config hook (:mod:`.arguments`, :mod:`.flag_types`, :mod:`.run_args`), the run-time
settings (:mod:`.settings`), the replaced call sites (:mod:`.model`) and the reversible patcher
(:mod:`._patching`).

Nothing below it (ops, losses, distill, packing, rollout) imports this subpackage: the
Megatron-core lookups they need live in :mod:`megatron_vocabstats.mcore`.
"""
