"""An HBM-traffic model of an optimized XLA HLO module (the text of ``compiled.as_text()``).

The model is deliberately simple, so that its byte counts can be checked by hand:

* every kernel (a fusion, a custom call such as a cuBLAS GEMM, a copy, an async fusion or copy, or any
  unfused op) reads each of its operands once and writes its result once;
* a dynamic slice, a slice or a gather reads only the elements it returns (also inside a fusion, nested
  fusions included, when a fused parameter is used only that way);
* an in-place update (a dynamic-update-slice or a scatter whose base is a fusion parameter, or the op
  itself) touches only the update: the base is neither read nor rewritten;
* a ``while`` body counts times its known trip count (``known_trip_count`` in its backend config); a loop
  without one counts ``unknown_trips`` times (default 1) unless ``trips`` names its count;
* a ``conditional`` counts its costliest branch (its cheapest inside the loops named in
  ``Model.cheap_loops``); a ``call`` (a command buffer) counts its computation.

Control flow that XLA:GPU runs from the host costs a host synchronisation: every iteration of a ``while``
without a known trip count, and every ``conditional``. So does every execution of a dynamic-slice fusion (a
GEMM reading a slice in place) whose offsets XLA cannot compute on the host: its thunk copies them from the
device and waits, unless each is a constant or a function of the enclosing loop's induction variable
(``known_induction_variable``; :meth:`Model.offsets_on_host`). Kernels whose result has the shape of a weight (a
weight-sized copy: no matmul inside, at least ``min_copy_bytes``) are counted as ``weight_copies``.

Only what the model needs is parsed: computations, instructions (name, shape, opcode, operands and the tuple
elements they name, called computations) and of the backend configs a loop's trip count and induction
variable and whether a fusion is a dynamic-slice fusion; layouts and metadata are skipped.
"""
from __future__ import annotations

import collections
import dataclasses
import re
from typing import Iterable, Optional

#: bytes per element of the HLO primitive types (sub-byte types rounded up to a byte)
DTYPE_BYTES = {"pred": 1, "s2": 1, "u2": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4,
               "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
               "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e3m4": 1,
               "f8e8m0fnu": 1, "f4e2m1fn": 1, "token": 0}
_ARRAY = re.compile(r"\b(" + "|".join(sorted(DTYPE_BYTES, key=len, reverse=True)) + r")\[([0-9,<=]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_CALLED = re.compile(r"\b(calls|body|condition|to_apply|true_computation|false_computation|"
                     r"branch_computations|called_computations)=(\{[^}]*\}|%[\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_INDVAR = re.compile(r'"known_induction_variable":\{"tuple_index":"(\d+)"')
#: the custom fusion that runs a kernel (a cuBLAS GEMM) on slices of its operands in place
_DS_FUSION = re.compile(r'"custom_fusion_config":\{[^}]*"name":"(dynamic_slice_fusion|address_computation)"')
#: ops whose result depends on nothing but their operands (an offset computed from host-known values only)
_PURE = frozenset({"fusion", "add", "subtract", "multiply", "divide", "remainder", "convert", "bitcast", "copy",
                   "clamp", "select", "compare", "maximum", "minimum", "negate", "abs", "reshape", "broadcast",
                   "and", "or", "not", "xor", "shift-left", "shift-right-logical", "shift-right-arithmetic"})
#: instructions that launch nothing
NOT_KERNELS = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
                         "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain", "iota-free"})
#: ops inside a fused computation that read only the elements they return from their first operand
_SLICING = frozenset({"dynamic-slice", "slice", "gather"})
#: ops that update their first operand in place (the rest of it untouched)
_IN_PLACE = frozenset({"dynamic-update-slice", "scatter"})
#: ops that do not move data inside a fused computation (a parameter seen through them is still itself)
_VIEWS = frozenset({"bitcast", "reshape"})
_MATMUL = frozenset({"dot", "convolution", "ragged-dot", "scaled-dot"})


# --------------------------------------------------------------------------------------------- shapes


def array_dims(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """Every array in a shape string, as (dtype, dims): ``"(f32[2,3]{1,0}, s8[4])"`` ->
    ``[("f32", (2, 3)), ("s8", (4,))]``."""
    out = []
    for dtype, dims in _ARRAY.findall(_strip_comments(shape)):
        out.append((dtype, tuple(int(d.lstrip("<=")) for d in dims.split(",") if d)))
    return out


def shape_bytes(shape: str) -> int:
    """Bytes of every array in a shape string (a tuple's elements summed)."""
    total = 0
    for dtype, dims in array_dims(shape):
        n = 1
        for d in dims:
            n *= d
        total += n * DTYPE_BYTES[dtype]
    return total


def tuple_elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape (``"(a, (b, c))"`` -> ``["a", "(b, c)"]``); an array shape
    is its own single element."""
    s = _strip_comments(shape).strip()
    if not s.startswith("("):
        return [s]
    parts, depth, cur = [], 0, []
    for ch in s[1:-1]:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur).strip())
    return parts


def _strip_comments(s: str) -> str:
    return re.sub(r"/\*.*?\*/", "", s)


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        depth += text[i] in "([{"
        depth -= text[i] in ")]}"
        if depth == 0:
            return i + 1
    raise ValueError(f"unbalanced brackets in {text[:80]!r}")


# --------------------------------------------------------------------------------------------- parsing


@dataclasses.dataclass(frozen=True)
class Instr:
    """One HLO instruction: ``name = shape opcode(operands), attributes``."""

    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    called: tuple[str, ...] = ()
    body: Optional[str] = None  # while
    condition: Optional[str] = None  # while
    trip_count: Optional[int] = None  # while: known_trip_count
    root: bool = False
    index: Optional[int] = None  # get-tuple-element, parameter
    #: per operand, the tuple element it names (``%p#2``: 2; None: the whole value)
    elements: tuple[Optional[int], ...] = ()
    induction: Optional[int] = None  # while: the tuple index of its known induction variable
    slice_fusion: bool = False  # fusion: a dynamic-slice fusion (``_DS_FUSION``)


@dataclasses.dataclass
class Module:
    """Computations (name -> instructions in order) and the entry computation's name."""

    computations: dict[str, list[Instr]]
    entry: str
    _index: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def instr(self, comp: str) -> dict[str, Instr]:
        """The instructions of computation ``comp`` by name."""
        if comp not in self._index:
            self._index[comp] = {i.name: i for i in self.computations[comp]}
        return self._index[comp]


def parse_instr(line: str) -> Optional[Instr]:
    """One instruction line, or None for anything else."""
    m = _INSTR.match(line)
    if not m:
        return None
    root, name, rhs = m.groups()
    rhs = rhs.strip()
    end = _balanced(rhs, 0) if rhs.startswith("(") else rhs.index(" ")
    shape, rest = rhs[:end], rhs[end:].strip()
    op = re.match(r"([\w\-]+)\(", rest)
    if not op:
        return None
    close = _balanced(rest, op.end() - 1)
    refs = re.findall(r"%([\w.\-]+)(?:#(\d+))?", rest[op.end():close - 1])
    operands = tuple(name for name, _ in refs)
    elements = tuple(int(e) if e else None for _, e in refs)
    attrs = rest[close:]
    called, body, cond = [], None, None
    for key, val in _CALLED.findall(attrs):
        names = re.findall(r"%([\w.\-]+)", val)
        called += names
        body = names[0] if key == "body" else body
        cond = names[0] if key == "condition" else cond
    trip = _TRIP.search(attrs)
    indvar = _INDVAR.search(attrs)
    index = re.search(r"\bindex=(\d+)", attrs) if op.group(1) == "get-tuple-element" else None
    if op.group(1) == "parameter":
        index = re.match(r"\s*(\d+)", rest[op.end():])
    return Instr(name=name, shape=shape, opcode=op.group(1), operands=operands, called=tuple(called), body=body,
                 condition=cond, trip_count=int(trip.group(1)) if trip else None, root=bool(root),
                 index=int(index.group(1)) if index else None, elements=elements,
                 induction=int(indvar.group(1)) if indvar else None,
                 slice_fusion=bool(_DS_FUSION.search(attrs)))


def parse_module(text: str) -> Module:
    """The computations of an HLO module's text (``HloModule ...`` then computations)."""
    comps: dict[str, list[Instr]] = {}
    cur, entry = None, None
    for line in text.splitlines():
        h = _HEADER.match(line)
        if h:
            cur = comps.setdefault(h.group(2), [])
            entry = h.group(2) if h.group(1) else entry
            continue
        if line.startswith("}"):
            cur = None
            continue
        if cur is not None:
            ins = parse_instr(line)
            if ins is not None:
                cur.append(ins)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return Module(comps, entry)


# --------------------------------------------------------------------------------------------- kernels


def _operand_shape(idx: dict[str, Instr], ref: str) -> str:
    ins = idx.get(ref)
    return "" if ins is None else ins.shape


def _param_reads(module: Module, fused: str) -> dict[int, Optional[int]]:
    """Per parameter of a fused computation: the bytes it reads of it when every use is a slice / gather
    (their results) or the base of an in-place update (0); None when some use reads it whole."""
    body = module.computations.get(fused, [])
    users = collections.defaultdict(list)
    for ins in body:
        for k, o in enumerate(ins.operands):
            users[o].append((ins, k))
    out = {}
    for p in body:
        if p.opcode != "parameter":
            continue
        frontier, reads, whole = [p.name], 0, False
        while frontier and not whole:
            for user, k in users[frontier.pop()]:
                if user.opcode in _VIEWS:
                    frontier.append(user.name)
                elif user.opcode in _SLICING and k == 0:
                    reads += shape_bytes(user.shape)
                elif user.opcode in _IN_PLACE and k == 0:
                    pass
                elif user.opcode == "fusion" and user.called:  # a nested fusion (a Triton GEMM's operand)
                    inner = _param_reads(module, user.called[0]).get(k)
                    whole = inner is None
                    reads += inner or 0
                else:
                    whole = True
        out[p.index] = None if whole else reads
    return out


def _root_writes(module: Module, fused: str) -> Optional[int]:
    """Bytes a fused computation writes when its root (or a root tuple element) is an in-place update:
    the updates' bytes plus the other elements' whole bytes; None when nothing is in place."""
    body = module.computations.get(fused, [])
    idx = {i.name: i for i in body}
    root = next((i for i in body if i.root), None)
    if root is None:
        return None
    outs = [idx[o] for o in root.operands] if root.opcode == "tuple" else [root]
    total, in_place = 0, False
    for ins in outs:
        while ins.opcode in _VIEWS and ins.operands[0] in idx:
            ins = idx[ins.operands[0]]
        if ins.opcode in _IN_PLACE:
            in_place = True
            updates = ins.operands[1:2] if ins.opcode == "dynamic-update-slice" else ins.operands[-1:]
            total += sum(shape_bytes(_operand_shape(idx, u)) for u in updates)
        else:
            total += shape_bytes(ins.shape)
    return total if in_place else None


def result_bytes(shape: str) -> int:
    """A kernel's written bytes: its result, without a GEMM's ``s8[...]`` workspace tuple element."""
    parts = tuple_elements(shape)
    if len(parts) > 1:
        return sum(shape_bytes(p) for p in parts if not p.startswith("s8["))
    return shape_bytes(shape)


def _fusion_bytes(module: Module, comp: str, ins: Instr, fused: str, out_shape: str) -> int:
    idx = module.instr(comp)
    reads = _param_reads(module, fused)
    total = 0
    for k, o in enumerate(ins.operands):
        r = reads.get(k)
        total += shape_bytes(_operand_shape(idx, o)) if r is None else r
    w = _root_writes(module, fused)
    return total + (result_bytes(out_shape) if w is None else w)


def _async_result(module: Module, ins: Instr) -> str:
    """The result shape of an async start (``((operands), result, context)``)."""
    parts = tuple_elements(ins.shape)
    return parts[1] if len(parts) > 1 else ins.shape


def kernel_bytes(module: Module, comp: str, ins: Instr) -> int:
    """Bytes one execution of the kernel ``ins`` (an instruction of the non-fused computation ``comp``) reads
    and writes, by the model's rules."""
    idx = module.instr(comp)
    op = ins.opcode
    if op == "fusion" and ins.called:
        return _fusion_bytes(module, comp, ins, ins.called[0], ins.shape)
    if op == "fusion-start" and ins.called:
        return _fusion_bytes(module, comp, ins, ins.called[0], _async_result(module, ins))
    if op == "async-start" and ins.called:
        wrapped = next((i for i in module.computations.get(ins.called[0], []) if i.root), None)
        if wrapped is not None and wrapped.opcode == "fusion" and wrapped.called:
            inner = Instr(ins.name, wrapped.shape, "fusion", ins.operands, wrapped.called)
            return _fusion_bytes(module, comp, inner, wrapped.called[0], wrapped.shape)
        inner_shape = _async_result(module, ins)
        return sum(shape_bytes(_operand_shape(idx, o)) for o in ins.operands) + result_bytes(inner_shape)
    if op == "copy-start":
        return 2 * shape_bytes(_operand_shape(idx, ins.operands[0]))
    if op in ("dynamic-slice", "slice", "gather"):
        rest = sum(shape_bytes(_operand_shape(idx, o)) for o in ins.operands[1:])
        return 2 * shape_bytes(ins.shape) + rest
    if op in _IN_PLACE:  # the update read and written, the indices read; the base untouched
        upd = ins.operands[1:2] if op == "dynamic-update-slice" else ins.operands[-1:]
        rest = ins.operands[2:] if op == "dynamic-update-slice" else ins.operands[1:-1]
        return (2 * sum(shape_bytes(_operand_shape(idx, u)) for u in upd)
                + sum(shape_bytes(_operand_shape(idx, o)) for o in rest))
    return sum(shape_bytes(_operand_shape(idx, o)) for o in ins.operands) + result_bytes(ins.shape)


def has_matmul(module: Module, ins: Instr) -> bool:
    """Whether a kernel multiplies matrices: a dot/convolution in its fused computation (searched through
    nested calls), or a custom call (cuBLAS, cuDNN)."""
    if ins.opcode == "custom-call":
        return True
    seen, todo = set(), list(ins.called)
    while todo:
        c = todo.pop()
        if c in seen or c not in module.computations:
            continue
        seen.add(c)
        for i in module.computations[c]:
            if i.opcode in _MATMUL or i.opcode == "custom-call":
                return True
            todo += i.called
    return False


# --------------------------------------------------------------------------------------------- walking


@dataclasses.dataclass
class Traffic:
    """The model's totals for one execution of a computation (loops and branches included)."""

    bytes: float = 0.0
    kernels: float = 0.0
    host_syncs: float = 0.0
    weight_copies: float = 0.0
    by_kernel: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def add(self, other: "Traffic", times: float = 1.0) -> None:
        self.bytes += times * other.bytes
        self.kernels += times * other.kernels
        self.host_syncs += times * other.host_syncs
        self.weight_copies += times * other.weight_copies
        for k, v in other.by_kernel.items():
            self.by_kernel[k] += times * v


@dataclasses.dataclass(frozen=True)
class Loop:
    """A ``while`` reachable from the entry: its path of enclosing control flow, its known trip count, the
    number of times it runs per execution of the entry, whether it sits in an unknown-trip loop, how many
    loops enclose it, and its body computation."""

    name: str
    path: str
    trip_count: Optional[int]
    runs: float
    in_unknown_loop: bool
    depth: int = 0
    body: str = ""


def _squeeze(dims: Iterable[int]) -> tuple[int, ...]:
    return tuple(d for d in dims if d != 1)


class Model:
    """The traffic model of one module. ``weight_shapes``: the shapes (dims) a weight-sized copy would have
    (1-dims ignored); ``unknown_trips``: iterations counted for a ``while`` without a known trip count;
    ``trips``: counts per ``while`` name that override both (0 leaves a loop out)."""

    def __init__(self, module: Module, weight_shapes: Iterable[tuple[int, ...]] = (), unknown_trips: float = 1.0,
                 trips: Optional[dict[str, float]] = None, min_copy_bytes: int = 1 << 20):
        self.module = module
        self.weight_shapes = {_squeeze(s) for s in weight_shapes}
        self.unknown_trips = unknown_trips
        self.trips = dict(trips or {})
        self.min_copy_bytes = min_copy_bytes
        #: loops (by name) inside which every conditional counts its cheapest branch instead
        self.cheap_loops: set[str] = set()
        #: loop body -> the induction variable's tuple index of the ``while`` loops running it (None: unknown)
        self._induction: dict[str, Optional[int]] = {}
        for instrs in module.computations.values():
            for ins in instrs:
                if ins.opcode == "while" and ins.body:
                    # (a body shared by loops that disagree has none)
                    seen = self._induction.get(ins.body, ins.induction)
                    self._induction[ins.body] = ins.induction if seen == ins.induction else None
        self._host_known: dict[tuple, bool] = {}

    # An offset's operands are resolved top down: ``env`` binds the parameters of the computation being read
    # to the operands of the instruction that called it there (``(caller computation, caller name, first
    # operand, caller's env)``; None: the entry, or a loop body, whose carry only the induction variable
    # makes known).

    def _bound(self, env: Optional[tuple], index: Optional[int], element: Optional[int]) -> bool:
        if env is None or index is None:
            return False
        comp, name, first, outer = env
        caller = self.module.instr(comp)[name]
        k = first + index
        if k >= len(caller.operands):
            return False
        if caller.elements[k] is not None and element is not None:  # (an element of an element: not followed)
            return False
        return self._known(comp, caller.operands[k], caller.elements[k] if element is None else element, outer)

    def _known(self, comp: str, name: str, element: Optional[int], env: Optional[tuple]) -> bool:
        """Whether the value ``name`` (its tuple element ``element``) of ``comp`` is a function of constants
        and the enclosing loop's induction variable only (XLA:GPU then evaluates it on the host)."""
        key = (comp, name, element, env)
        if key not in self._host_known:
            self._host_known[key] = False  # (a cycle proves nothing)
            self._host_known[key] = self._derive(comp, name, element, env)
        return self._host_known[key]

    def _derive(self, comp: str, name: str, element: Optional[int], env: Optional[tuple]) -> bool:
        ins = self.module.instr(comp).get(name)
        if ins is None:
            return False
        if ins.opcode == "constant":
            return True
        if ins.opcode == "parameter":
            if comp in self._induction:  # a loop body's carry: only its induction variable is known
                return element is not None and element == self._induction[comp]
            return self._bound(env, ins.index, element)
        if ins.opcode == "get-tuple-element":
            src = self.module.instr(comp).get(ins.operands[0])
            return src is not None and src.opcode == "parameter" and self._derive(comp, src.name, ins.index, env)
        if ins.opcode == "tuple" and element is not None and element < len(ins.operands):
            return self._known(comp, ins.operands[element], ins.elements[element], env)
        if ins.opcode in _PURE:  # (a fusion's result depends on its operands only)
            return all(self._known(comp, o, e, env) for o, e in zip(ins.operands, ins.elements))
        return False

    def _offsets_known(self, fused: str, env: tuple) -> bool:
        """Whether every slice offset inside the fused computation ``fused`` (nested fusions included) is
        known on the host, its parameters bound by ``env``."""
        for f in self.module.computations[fused]:
            if f.opcode in ("dynamic-slice", "dynamic-update-slice"):
                first = 1 if f.opcode == "dynamic-slice" else 2
                if not all(self._known(fused, o, e, env) for o, e in zip(f.operands[first:], f.elements[first:])):
                    return False
            elif f.opcode == "fusion" and f.called and f.called[0] in self.module.computations:
                if not self._offsets_known(f.called[0], (fused, f.name, 0, env)):
                    return False
        return True

    def offsets_on_host(self, comp: str, ins: Instr, env: Optional[tuple] = None) -> bool:
        """For a dynamic-slice fusion ``ins`` of ``comp``: whether XLA:GPU knows its slice offsets on the host
        (constants, or functions of the enclosing loop's induction variable, also when computed inside the
        fusion); if not, its thunk copies them from the device and waits for them at every execution (a host
        synchronisation). ``env``: how ``comp``'s parameters are bound (:meth:`_bound`; None at the top)."""
        return self._offsets_known(ins.called[0], (comp, ins.name, 0, env))

    def _offset_syncs(self, comp: str, ins: Instr, env: Optional[tuple]) -> int:
        """Host synchronisations of one execution of ``ins``: a dynamic-slice fusion whose offsets are not
        known on the host (:meth:`offsets_on_host`), also inside an async computation it starts."""
        if ins.opcode == "fusion" and ins.slice_fusion:
            return int(not self.offsets_on_host(comp, ins, env))
        if ins.opcode.endswith("-start") and ins.called and ins.called[0] in self.module.computations:
            inner, inner_env = ins.called[0], (comp, ins.name, 0, env)
            return sum(self._offset_syncs(inner, i, inner_env) for i in self.module.computations[inner])
        return 0

    def is_weight_copy(self, ins: Instr, nbytes: int) -> bool:
        if not self.weight_shapes or ins.opcode in ("custom-call",):
            return False
        shape = _async_result(self.module, ins) if ins.opcode.endswith("-start") else ins.shape
        if ins.opcode == "copy-start":
            shape = tuple_elements(ins.shape)[0]
        hit = any(_squeeze(d) in self.weight_shapes and shape_bytes(f"{t}[{','.join(map(str, d))}]")
                  >= self.min_copy_bytes for t, d in array_dims(shape))
        return hit and nbytes >= self.min_copy_bytes and not has_matmul(self.module, ins)

    def iterations(self, ins: Instr) -> float:
        if ins.name in self.trips:
            return self.trips[ins.name]
        return float(ins.trip_count) if ins.trip_count is not None else self.unknown_trips

    def run(self, comp: Optional[str] = None) -> Traffic:
        """The totals of one execution of ``comp`` (default: the entry)."""
        return self._walk(comp or self.module.entry, False, None)

    def _walk(self, comp: str, cheap: bool, env: Optional[tuple]) -> Traffic:
        acc = Traffic()
        for ins in self.module.computations[comp]:
            op = ins.opcode
            if op in NOT_KERNELS or op.endswith("-done") or op.endswith("-update"):
                continue
            if op == "while":
                n = self.iterations(ins)
                inner = cheap or ins.name in self.cheap_loops
                one = self._walk(ins.body, inner, None)
                one.add(self._walk(ins.condition, inner, None))
                if ins.trip_count is None:
                    one.host_syncs += 1
                acc.add(one, n)
            elif op == "conditional":  # (branch k takes operand 1 + k)
                branches = [self._walk(b, cheap, (comp, ins.name, 1 + k, env)) for k, b in enumerate(ins.called)]
                pick = min if cheap else max
                acc.add(pick(branches, key=lambda t: t.bytes) if branches else Traffic())
                acc.host_syncs += 1
            elif op == "call" and ins.called:
                acc.add(self._walk(ins.called[0], cheap, (comp, ins.name, 0, env)))
            else:
                b = kernel_bytes(self.module, comp, ins)
                acc.bytes += b
                acc.kernels += 1
                acc.by_kernel[f"{op}:{ins.name}"] += b
                acc.weight_copies += self.is_weight_copy(ins, b)
                acc.host_syncs += self._offset_syncs(comp, ins, env)
        return acc

    def loops(self) -> list[Loop]:
        """Every ``while`` reachable from the entry (through branches, calls and loop bodies)."""
        out: list[Loop] = []

        def visit(comp: str, path: str, runs: float, in_unknown: bool, depth: int) -> None:
            for ins in self.module.computations[comp]:
                if ins.opcode == "while":
                    out.append(Loop(ins.name, path, ins.trip_count, runs, in_unknown, depth, ins.body))
                    n = self.iterations(ins)
                    for c in (ins.body, ins.condition):
                        visit(c, f"{path}/{ins.name}", runs * n, in_unknown or ins.trip_count is None, depth + 1)
                elif ins.opcode == "conditional":
                    for b in ins.called:
                        visit(b, f"{path}/{ins.name}", runs, in_unknown, depth)
                elif ins.opcode == "call" and ins.called:
                    visit(ins.called[0], path, runs, in_unknown, depth)

        visit(self.module.entry, "", 1.0, False, 0)
        return out

    def reads_array(self, comp: str, dims: tuple[int, ...]) -> bool:
        """Whether a kernel of ``comp`` (or of the control flow nested in it) takes an operand with these dims
        (1-dims ignored): e.g. whether a loop body reads the LM head."""
        want = _squeeze(dims)
        idx = self.module.instr(comp)
        for ins in self.module.computations[comp]:
            if ins.opcode in ("while", "conditional", "call"):
                if any(self.reads_array(c, dims) for c in ins.called if c in self.module.computations):
                    return True
            elif ins.opcode not in NOT_KERNELS:
                for o in ins.operands:
                    if any(_squeeze(d) == want for _, d in array_dims(_operand_shape(idx, o))):
                        return True
        return False

    def with_trips(self, loop: str, n: float) -> Traffic:
        """The entry's totals with the ``while`` named ``loop`` counted ``n`` times."""
        saved = dict(self.trips)
        try:
            self.trips[loop] = float(n)
            return self.run()
        finally:
            self.trips = saved

    def without(self, loop: str) -> Traffic:
        """The entry's totals without the ``while`` named ``loop`` (what runs around it)."""
        return self.with_trips(loop, 0)

    def per_iteration(self, loop: str) -> Traffic:
        """What one more iteration of the ``while`` named ``loop`` adds to the entry's totals (its body and
        condition, everything nested in them, and its host synchronisation when its trip is unknown), for a
        loop that runs once per execution of the entry (not inside another loop)."""
        one, zero = self.with_trips(loop, 1), self.with_trips(loop, 0)
        diff = Traffic(one.bytes - zero.bytes, one.kernels - zero.kernels, one.host_syncs - zero.host_syncs,
                       one.weight_copies - zero.weight_copies)
        diff.by_kernel = collections.Counter({k: v - zero.by_kernel.get(k, 0) for k, v in one.by_kernel.items()
                                              if v - zero.by_kernel.get(k, 0)})
        return diff
