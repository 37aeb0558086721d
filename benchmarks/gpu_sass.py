"""Read what a compiled Triton kernel is for sm_90: its SASS (``cuobjdump -sass`` of the cubin,
Triton's bundled binary), registers and local memory (``cuobjdump -res-usage``), and per-warp
instruction counts per execution pipe with loop trip counts applied.

Loops are the SASS back-edges (a branch to an earlier address; the trap ``BRA`` to itself after
``EXIT`` is not one); a loop's depth is the number of loops containing it. The caller gives the
trip count of each depth (``trips[d - 1]`` for depth d, from the launch's arguments); every
instruction counts once per iteration of each loop around it, predicated or not, and both sides
of a branch count (an upper bound where a branch skips code). Pipes and their cost in cycles of
one SM sub-partition (SMSP, 4 per SM, one warp instruction issued per cycle each) per warp
instruction, from the sm_90 per-SM rates (CUDA C Programming Guide, "Arithmetic Instructions",
compute capability 9.0: 128 fp32 FMA, 64 int32 add/compare/logic, 16 special-function results
per clock per SM):

* ``fma`` 1 (FFMA, FADD, FMUL, IMAD, packed half ops), ``alu`` 2 (integer add/logic/shift,
  compares, min/max, selects, packing conversions), ``xu`` 8 (MUFU: exp2, rcp, ...; scalar
  conversions F2F/I2F/F2I);
* ``mio``: the SM's load/store and shuffle path, one warp instruction per SM cycle at most, a
  wide access ``32 x bytes / 128`` cycles (128 bytes per clock per SM of L1/shared memory);
* ``tensor``: ``HGMMA``/``HMMA`` with their shapes, FLOPs per warpgroup (or warp) instruction.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field

_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_HGMMA = re.compile(r"^HGMMA\.(\d+)x(\d+)x(\d+)")
_HMMA = re.compile(r"^HMMA\.(16)(8)(\d+)")  # m16n8kK
_WIDTH = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}

_FMA = ("FFMA", "FADD", "FMUL", "IMAD", "IMUL", "HFMA2", "HADD2", "HMUL2", "FSWZADD", "IDP",
        "DFMA")
_ALU = ("IADD3", "IADD", "LOP3", "LOP", "ISETP", "FSETP", "HSETP2", "FMNMX", "IMNMX", "VIMNMX",
        "SEL", "FSEL", "SHF", "SHL", "SHR", "PRMT", "LEA", "IABS", "BMSK", "SGXT", "PLOP3",
        "P2R", "R2P", "FCHK", "FLO", "POPC", "BREV", "F2FP", "I2IP", "CSET", "CSETP", "HMNMX2",
        "LEPC")
_XU = ("MUFU", "F2F", "I2F", "F2I", "FRND", "I2I")
_MIO = ("LDG", "STG", "LDS", "STS", "LDSM", "STSM", "LDGSTS", "SHFL", "ATOM", "ATOMS", "ATOMG",
        "RED", "LD", "ST", "LDL", "STL", "MATCH", "VOTE")
COST = {"fma": 1, "alu": 2, "xu": 8}


def _bin(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


@dataclass
class Instr:
    addr: int
    opcode: str  # with modifiers, e.g. "LDG.E.128"
    operands: str
    predicated: bool

    @property
    def root(self) -> str:
        return self.opcode.split(".")[0]


@dataclass
class Sass:
    """One kernel's SASS and resources."""

    instrs: list
    regs: int
    local_bytes: int  # per thread: spills (and local arrays)
    loops: list = field(default_factory=list)  # (start, end, depth)

    @property
    def spill_instrs(self) -> int:
        return sum(i.root in ("LDL", "STL") for i in self.instrs)

    @property
    def max_depth(self) -> int:
        return max((d for _, _, d in self.loops), default=0)

    def count(self, pred) -> int:
        """Static count of instructions matching ``pred``."""
        return sum(1 for i in self.instrs if pred(i))


def _parse(text: str) -> list:
    instrs = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        body = m.group(2)
        predicated = body.startswith("@")
        if predicated:
            body = body.split(None, 1)[1]
        op, _, rest = body.partition(" ")
        instrs.append(Instr(int(m.group(1), 16), op, rest.strip(), predicated))
    return instrs


def _loops(instrs: list) -> list:
    spans = []
    for i in instrs:
        if i.root == "BRA":
            m = re.search(r"0x([0-9a-f]+)", i.operands)
            if m and int(m.group(1), 16) < i.addr:
                spans.append((int(m.group(1), 16), i.addr))
    out = []
    for s, e in spans:
        depth = sum(1 for s2, e2 in spans if s2 <= s and e <= e2)
        out.append((s, e, depth))
    return sorted(out)


@functools.cache
def _disassemble(cubin: bytes) -> tuple:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([_bin("cuobjdump"), "-sass", path], capture_output=True,
                              text=True, check=True).stdout
        res = subprocess.run([_bin("cuobjdump"), "-res-usage", path], capture_output=True,
                             text=True, check=True).stdout
    return sass, res


def read(compiled) -> Sass:
    """The :class:`Sass` of a ``triton.compile`` result."""
    return read_cubin(bytes(compiled.asm["cubin"]))


def read_cubin(cubin: bytes) -> Sass:
    """The :class:`Sass` of a cubin."""
    text, res = _disassemble(cubin)
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    local = int(re.search(r"LOCAL:(\d+)", res).group(1))
    instrs = _parse(text)
    return Sass(instrs, regs, local, _loops(instrs))


def _mio_cycles(i: Instr) -> float:
    width = 4
    for part in i.opcode.split(".")[1:]:
        width = _WIDTH.get(part, width)
    return max(1.0, 32 * width / 128) if i.root != "SHFL" else 1.0


@dataclass
class Counts:
    """Dynamic per-warp counts of one CTA's program: ``issue`` (every instruction),
    ``pipes`` (SMSP cycles per pipe), ``mio`` (SM cycles), ``mma_flops`` (per CTA, from the
    tensor instructions and the warps that issue them), ``outer_issue`` (issue slots outside the
    deepest loop: the epilogue work that a lone CTA cannot overlap with its MMAs)."""

    issue: float = 0.0
    pipes: dict = field(default_factory=lambda: {k: 0.0 for k in COST})
    mio: float = 0.0
    mma_flops: float = 0.0
    mma_instrs: float = 0.0
    global_load_trips: float = 0.0  # iterations that wait on a synchronous global load
    outer_issue: float = 0.0


def loop_body(sass: Sass, loop: tuple) -> list:
    """The instructions of ``loop`` (``(start, end, depth)``) outside its inner loops."""
    s, e, d = loop
    return [i for i in sass.instrs if s <= i.addr <= e and not any(
        s2 <= i.addr <= e2 and d2 > d for s2, e2, d2 in sass.loops)]


def dynamic_counts(sass: Sass, trips, num_warps: int) -> Counts:
    """Counts of one CTA of ``num_warps`` warps. ``trips``: a list, ``trips[d - 1]`` iterations
    of every loop at depth d; or a function of a loop ``(start, end, depth)`` and its body
    (:func:`loop_body`) giving its iterations (per iteration of the loops around it). Raises
    ``ValueError`` if the SASS has loops deeper than a list says."""
    if not callable(trips):
        if sass.max_depth > len(trips):
            raise ValueError(f"SASS has loops {sass.loops} of depth {sass.max_depth}, the model "
                             f"gives trip counts for {len(trips)} levels")
        per_level = trips
        trips = (lambda loop, body: per_level[loop[2] - 1])  # noqa: E731
    count = {loop: trips(loop, loop_body(sass, loop)) for loop in sass.loops}
    c = Counts()
    deepest = sass.max_depth
    sync_loads: dict = {}
    for i in sass.instrs:
        around = [loop for loop in sass.loops if loop[0] <= i.addr <= loop[1]]
        depth = len(around)
        mult = 1.0
        for loop in around:
            mult *= count[loop]
        c.issue += mult
        if depth < deepest or not sass.loops:
            c.outer_issue += mult
        r = i.root
        if r in _FMA:
            c.pipes["fma"] += mult * (2 if ".WIDE" in i.opcode else 1)
        elif r in _ALU:
            c.pipes["alu"] += mult
        elif r in _XU:
            c.pipes["xu"] += mult
        elif r in _MIO:
            c.mio += mult * _mio_cycles(i)
            if r in ("LDG", "LD") and depth:
                sync_loads[around[-1]] = mult
        m = _HGMMA.match(i.opcode)
        if m:  # one per warpgroup: every warp of it issues the instruction
            flops = 2 * int(m.group(1)) * int(m.group(2)) * int(m.group(3))
            c.mma_flops += mult * flops * num_warps / 4
            c.mma_instrs += mult * num_warps / 4
        m = _HMMA.match(i.opcode)
        if m:
            flops = 2 * int(m.group(1)) * int(m.group(2)) * int(m.group(3))
            c.mma_flops += mult * flops * num_warps
            c.mma_instrs += mult * num_warps
    # Round trips that wait on a synchronous load: one per iteration of each loop that has one.
    c.global_load_trips = sum(sync_loads.values())
    return c
