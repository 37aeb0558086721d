"""Which ranks, steps and trials to profile: the selection flags, parsed without a process group
or files so that every rank refuses a bad one before building a model.
"""

from __future__ import annotations

TRIAL_KINDS = ("memory", "kernels")


def _parse_int_list(spec: str, flag: str, limit: int) -> tuple[list[int], list[str]]:
    """``"0,2-4"`` -> ``([0, 2, 3, 4], [])``: the numbers up to ``limit`` and the parts beyond
    it, unexpanded; ``ValueError`` naming ``flag`` for a malformed list."""
    out: set[int] = set()
    beyond: list[str] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"{flag} {spec!r}: empty item (write e.g. 0,2-4)")
        lo, sep, hi = part.partition("-")
        try:
            first = int(lo)
            last = int(hi) if sep else first
        except ValueError:
            raise ValueError(f"{flag} {spec!r}: {part!r} is not a number or a range a-b"
                             ) from None
        if first < 0 or last < first:
            raise ValueError(f"{flag} {spec!r}: {part!r} is not a range a-b with 0 <= a <= b")
        out.update(range(first, min(last, limit) + 1))
        if last > limit:
            low = max(first, limit + 1)
            beyond.append(str(low) if low == last else f"{low}-{last}")
    return sorted(out), beyond


def default_ranks(world: int, pipeline_stages: int = 1) -> list[int]:
    """Rank 0 of each pipeline stage in Megatron's tp-cp-dp-pp order; ``ValueError`` unless
    ``pipeline_stages`` divides ``world``."""
    if pipeline_stages < 1 or world % pipeline_stages:
        raise ValueError(f"the pipeline-parallel size {pipeline_stages} must divide the world "
                         f"size {world}")
    block = world // pipeline_stages
    return [s * block for s in range(pipeline_stages)]


def parse_ranks(spec: str | None, world: int, pipeline_stages: int = 1,
                flag: str = "--ranks") -> list[int]:
    """The ranks to profile, sorted: ``spec`` None -> :func:`default_ranks`, ``""`` -> all, else
    ranks and inclusive ranges (``"0,2-4"``). ``ValueError`` naming ``flag`` for a malformed list
    or a rank ``>= world``."""
    if spec is None:
        return default_ranks(world, pipeline_stages)
    if not spec.strip():
        return list(range(world))
    ranks, missing = _parse_int_list(spec, flag, world - 1)
    if missing:
        raise ValueError(f"{flag} {spec!r} names rank(s) {','.join(missing)} but the world has "
                         f"{world} rank(s) (0-{world - 1})")
    return ranks


def parse_steps(spec: str, last_step: int, flag: str = "--profile-steps") -> list[int]:
    """Training steps to profile (1-based), sorted; ``ValueError`` naming ``flag`` for a malformed
    list, step 0, or a step after ``last_step`` (the run's ``--steps``)."""
    steps, beyond = _parse_int_list(spec, flag, last_step)
    if steps and steps[0] < 1:
        raise ValueError(f"{flag} {spec!r}: steps count from 1")
    if beyond:
        raise ValueError(f"{flag} {spec!r}: step(s) {','.join(beyond)} beyond the run, which "
                         f"has --steps {last_step}")
    return steps


def parse_trials(spec: str, flag: str = "--trials") -> list[str]:
    """``"memory,kernels"`` -> kinds in the given order, each once; ``ValueError`` naming flag."""
    kinds = [k.strip() for k in spec.split(",")]
    bad = [k for k in kinds if k not in TRIAL_KINDS]
    if bad or not kinds:
        raise ValueError(f"{flag} {spec!r}: choose from {', '.join(TRIAL_KINDS)}")
    return list(dict.fromkeys(kinds))
