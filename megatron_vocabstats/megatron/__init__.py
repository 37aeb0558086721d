"""Everything that knows Megatron's names: the flags and config hook, the run-time settings and
the replaced call sites. What each module holds and may import: docs/layout.md.
"""
