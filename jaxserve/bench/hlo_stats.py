"""What a compiled program does that a step should not: read from its optimised HLO text.

* ``conditional`` ops, and ``while`` ops without a ``known_trip_count`` (a data-dependent loop):
  XLA:GPU reads each one's predicate back to the host, once per execution; and host callbacks
  (``jax.pure_callback``, ``jax.debug.print``: custom calls into Python), a round trip each.
* copies of weight- or KV-pool-shaped buffers: a ``copy``/``dynamic-slice`` (or a fusion whose
  root is one) producing a parameter's shape, or one layer's slice of a stacked parameter (what
  a layer scan does to its weights); and, by size alone, any moved buffer of at least a
  given number of bytes (:func:`large_moves`: a KV pool copied through a reshaped view).
* whether every KV pool parameter is aliased to an output (updated in place, never copied).
* custom calls by target, and the kernels behind XLA's Triton custom calls.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Iterator

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]\S*\s+([\w\-]+)\(")
_PARAM = re.compile(r"^\s*%\S+\s*=\s*(\w+)\[([\d,]*)\][^\s]*\s+parameter\((\d+)\)")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(\S+)\s.*\{\s*$")
_CALLS = re.compile(r"calls=%([\w.\-]+)")
_ALIAS = re.compile(r"input_output_alias=\{(.*?)\}\s*(?:,\s*entry_computation_layout|$)")
_COPY_OPS = ("copy", "copy-start", "dynamic-slice", "slice")
# A fusion of only these moves data: with a copy or slice among them, it materialises a copy.
_MOVE_OPS = _COPY_OPS + ("parameter", "constant", "bitcast", "reshape", "transpose", "broadcast")

# Bytes per element of HLO's dtype names (4 for any other).
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
          "f64": 8, "s64": 8, "u64": 8}

# Ops that name a buffer without writing one.
_NOT_MATERIALISED = ("parameter", "get-tuple-element", "bitcast", "tuple", "constant")

Shape = tuple[str, tuple[int, ...]]  # (dtype, dims)


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(",") if d)


def _squeeze(dims: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(d for d in dims if d != 1)


@dataclasses.dataclass
class HloStats:
    conditionals: int
    whiles: int
    data_dependent_whiles: int
    weight_copies: list[str]  # "bf16[1,3072,1024] (copy)" per copy-like op of a weight's shape
    pool_copies: list[str]
    pool_aliased: bool
    custom_calls: dict[str, int]
    triton_kernels: dict[str, int]  # Pallas kernel name -> launches in the program
    host_callbacks: int = 0  # custom calls into Python on the host

    @property
    def host_round_trips(self) -> int:
        return self.conditionals + self.data_dependent_whiles + self.host_callbacks

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"host_round_trips": self.host_round_trips}


def _computations(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = "ENTRY" if line.startswith("ENTRY") else m.group(1)
            out[current] = []
        elif current is not None:
            out[current].append(line)
    return out


def _instruction(line: str) -> tuple[str, Shape | None] | None:
    """(opcode, array shape or None for a tuple) of one HLO instruction line."""
    m = _INSTR.match(line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):  # a tuple shape: skip to its closing parenthesis
        depth = 0
        for i, ch in enumerate(rest):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                op = re.match(r"\s*([\w\-]+)\(", rest[i + 1:])
                return (op.group(1), None) if op else None
        return None
    arr = _ARRAY.match(rest)
    return (arr.group(3), (arr.group(1), _dims(arr.group(2)))) if arr else None


def _is_copy_fusion(lines: list[str]) -> bool:
    ops = [ins[0] for ins in map(_instruction, lines) if ins]
    return bool(ops) and all(op in _MOVE_OPS for op in ops) and any(op in _COPY_OPS for op in ops)


def _matches(shape: Shape, targets: set[Shape]) -> bool:
    dtype, dims = shape
    squeezed = _squeeze(dims)
    for t_dtype, t_dims in targets:
        if t_dtype == dtype and squeezed and (squeezed == _squeeze(t_dims) or squeezed == _squeeze(t_dims[1:])):
            return True
    return False


def analyze_hlo(text: str, weight_shapes: set[Shape], pool_shapes: set[Shape]) -> HloStats:
    """Statistics of an optimised HLO module (``compiled.as_text()``); shapes as (dtype, dims)
    with HLO's dtype names (``bf16``, ``f32``, ``s32``)."""
    comps = _computations(text)
    conditionals = whiles = data_dependent = 0
    weight_copies, pool_copies = [], []
    custom_calls: collections.Counter[str] = collections.Counter()
    kernels: collections.Counter[str] = collections.Counter()
    fused = {c for lines in comps.values() for line in lines if " fusion(" in line for c in _CALLS.findall(line)}
    for comp, lines in comps.items():
        for line in lines:
            ins = _instruction(line)
            if ins is None:
                continue
            op, shape = ins
            if op == "conditional":
                conditionals += 1
            elif op == "while":
                whiles += 1
                data_dependent += "known_trip_count" not in line
            elif op == "custom-call":
                target = re.search(r'custom_call_target="([^"]+)"', line)
                custom_calls[target.group(1) if target else "?"] += 1
                kernel = re.search(r'op_name="[^"]*?([\w\-.]+)/pallas_call"', line)
                if kernel and "triton" in (target.group(1) if target else ""):
                    kernels[kernel.group(1)] += 1
            if shape is None or comp in fused:  # copies count where buffers are materialised
                continue
            copy_like = op in _COPY_OPS
            if op == "fusion":
                called = _CALLS.search(line)
                copy_like = bool(called) and _is_copy_fusion(comps.get(called.group(1), []))
            if copy_like:
                label = f"{shape[0]}[{','.join(map(str, shape[1]))}] ({op})"
                if _matches(shape, pool_shapes):
                    pool_copies.append(label)
                elif _matches(shape, weight_shapes):
                    weight_copies.append(label)
    callbacks = sum(n for target, n in custom_calls.items() if "callback" in target)
    return HloStats(conditionals, whiles, data_dependent, weight_copies, pool_copies,
                    _pool_aliased(text, comps.get("ENTRY", []), pool_shapes), dict(custom_calls), dict(kernels),
                    callbacks)


def dequantized_copies(text: str, float_shapes: set[Shape]) -> list[str]:
    """Buffers materialised with a quantized weight's dims in a float dtype (``float_shapes``: the
    weights' dims under bf16/f16/f32): a dequantized copy of the weight, where the convert should
    have been fused into the dot's operand read instead."""
    found = []
    for _line, op, shape in _unfused_instructions(_computations(text)):
        if op not in _NOT_MATERIALISED and _matches(shape, float_shapes):
            found.append(f"{shape[0]}[{','.join(map(str, shape[1]))}] ({op})")
    return found


def _unfused_instructions(comps: dict[str, list[str]]) -> Iterator[tuple[str, str, Shape]]:
    """(line, op, shape) of every instruction with an array result outside the
    bodies of fusions (what the program materialises)."""
    fused = {c for lines in comps.values() for line in lines if " fusion(" in line for c in _CALLS.findall(line)}
    for comp, lines in comps.items():
        if comp in fused:
            continue
        for line in lines:
            ins = _instruction(line)
            if ins is not None and ins[1] is not None:
                yield line, ins[0], ins[1]


def large_moves(text: str, min_bytes: int) -> list[str]:
    """Buffers of at least ``min_bytes`` that an optimised HLO module materialises only to move
    data: a ``copy``/``transpose``/``dynamic-slice``/``slice``, or a fusion of nothing but such
    moves. Measured in bytes rather than matched by shape, so a copy made through a reshaped view
    (a KV pool flattened to its slots) is found too."""
    comps = _computations(text)
    found = []
    for line, op, (dtype, dims) in _unfused_instructions(comps):
        moves = op in _COPY_OPS or op == "transpose"
        if op == "fusion":
            called = _CALLS.search(line)
            moves = bool(called) and _is_copy_fusion(comps.get(called.group(1), []))
        if moves and math.prod(dims) * _BYTES.get(dtype, 4) >= min_bytes:
            found.append(f"{dtype}[{','.join(map(str, dims))}] ({op})")
    return found


def _pool_aliased(text: str, entry: list[str], pool_shapes: set[Shape]) -> bool:
    """Every entry parameter of a pool's shape appears in the module's input/output aliasing."""
    header = text.split("\n", 1)[0]
    alias = _ALIAS.search(header)
    aliased = {int(p) for p in re.findall(r"\(\s*(\d+)\s*,", alias.group(1))} if alias else set()
    pools = [int(m.group(3)) for m in map(_PARAM.match, entry)
             if m and (m.group(1), _dims(m.group(2))) in pool_shapes]
    return bool(pools) and all(p in aliased for p in pools)
