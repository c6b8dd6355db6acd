"""Which GPU library path XLA chose for a product: the GEMM forms of a program's HLO.

Whether a low-precision policy pays on a GPU depends on the library call XLA:GPU rewrites its
dot into, which only the compiled program shows (``jax.jit(f).lower(*args).compile().as_text()``).
:func:`gemm_forms` lists every GEMM of that text as one of :data:`FORMS`:

- ``cublaslt_fp8``: a custom call to ``__cublas$lt$matmul$f8``, cuBLASLt's float8 GEMM. XLA's
  GEMM rewriter makes one from a dot whose operands are float8 values, each either used as it is
  or dequantized as ``convert(f8) * broadcast(scalar)`` (the scalar folded into the call), one of
  them e4m3; the result float32, bfloat16, float16 or float8; one contracting and one
  non-contracting dimension per operand (batch dimensions aside); compute capability 8.9 or
  higher. A multiply of its result by a broadcast scalar is folded into the call as well. Both
  operands need their contracting dimension minor (before Blackwell): the rewriter transposes the
  one that is not.
- ``cublas_int8``: a cuBLAS GEMM of s8 x s8 operands with an s32 result, cuBLAS's integer
  tensor-core (IMMA) path: ``__cublas$gemm`` (XLA sends s8 GEMMs to legacy cuBLAS even where
  cuBLASLt is enabled; ``__cublas$lt$matmul`` counts too). XLA's layout pass gives both operands
  a minor contracting dimension, copying an operand laid out otherwise (a ``(K, N)`` kernel).
- ``cublas``: a cuBLAS GEMM of other operands (float).
- ``triton_dequant``: a Triton GEMM fusion (``kind=kCustom``, backend config kind
  ``__triton_gemm``, or ``__triton_nested_gemm_fusion`` in XLA's newer emitter, whose operands are
  nested fusions) that converts s8, u8, s4 or u4 values to a float type inside: weight-only
  dequantization in the GEMM's own tiles.
- ``triton_int8`` and ``triton_fp8``: a Triton GEMM whose dot multiplies s8 x s8, or float8
  operands; ``triton``: any other Triton GEMM.
- ``cudnn``: a cuDNN GEMM fusion (``__cudnn$fusion``).
- ``pallas_triton``: a Triton kernel written in Pallas (custom call ``__gpu$xla.gpu.triton``).
- ``dot``: a dot instruction left as it is (XLA:CPU, or XLA:GPU's emitters for small products).

:func:`check_forms` says whether a product of one kind (:data:`EXPECTED_FORMS`) took a path that
pays for it; :func:`check_lowered` checks the pattern autopolicy's kernels hand XLA, in the
StableHLO before optimization (``jax.jit(f).lower(*args).as_text()``), which a CPU can produce
for a GPU (``jax.export`` with ``platforms=["cuda"]``).

The names are XLA's (``xla/service/gpu/cublas_cudnn.cc``: the custom call targets;
``xla/service/gpu/transforms/gemm_rewriter.cc``: the float8 pattern and its conditions, s8 GEMMs
on legacy cuBLAS; ``xla/service/gpu/transforms/layout_assignment.cc``: minor contracting
dimensions for s8 x s8 -> s32 and float8 dots; XLA's Triton GEMM tests: the fusion kinds).
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["FORMS", "EXPECTED_FORMS", "GemmForm", "FormCheck", "gemm_forms", "check_forms", "check_lowered"]

#: Every form :func:`gemm_forms` reports (see the module docstring).
FORMS = ("cublaslt_fp8", "cublas_int8", "cublas", "triton_dequant", "triton_int8", "triton_fp8", "triton",
         "cudnn", "pallas_triton", "dot")

#: ``(kind, forms)``: the forms that pay for a product of each kind on a GPU, preferred first.
EXPECTED_FORMS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("float", ("cublas", "triton", "cudnn")),
    ("fp8", ("cublaslt_fp8", "triton_fp8")),
    ("int8", ("cublas_int8", "triton_int8")),
    ("weight_only", ("triton_dequant", "pallas_triton")),
)

_CUBLAS_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul")
_TRITON_GEMM_KINDS = ("__triton_gemm", "__triton_nested_gemm_fusion")
_STORED_INTEGERS = ("s8", "u8", "s4", "u4")


@dataclasses.dataclass(frozen=True)
class GemmForm:
    """One GEMM of a compiled program.

    Attributes:
      form: One of :data:`FORMS`.
      name: The instruction's name.
      operands: The element types of its two operands (of the dot, for a fusion), ``("s8", "s8")``.
      result: The element type of its result.
      in_loop: Whether it runs inside a while loop.
      detail: The custom call target or fusion kind, and the precision config where there is one.
      operand_shapes: The two operands' shapes with their layouts, as printed.
      copied_operands: Operands (0 or 1) made by a copy or transpose right before the GEMM (a
        re-layout at every call, unless hoisted).
    """

    form: str
    name: str
    operands: tuple[str, ...]
    result: str
    in_loop: bool = False
    detail: str = ""
    operand_shapes: tuple[str, ...] = ()
    copied_operands: tuple[int, ...] = ()

    def describe(self) -> str:
        """``cublas_int8 (s8 x s8 -> s32)``, with the copied operands named."""
        copied = f", operand {'/'.join(map(str, self.copied_operands))} copied first" if self.copied_operands else ""
        return f"{self.form} ({' x '.join(self.operands)} -> {self.result}{copied})"


@dataclasses.dataclass(frozen=True)
class FormCheck:
    """What :func:`check_forms` or :func:`check_lowered` found for a product of one kind.

    Attributes:
      kind: The product's kind (of :data:`EXPECTED_FORMS`).
      ok: Whether the product takes the path its kind pays on.
      verdict: One line saying what was found.
      forms: The GEMMs found (:func:`check_forms`; empty from :func:`check_lowered`).
    """

    kind: str
    ok: bool
    verdict: str
    forms: tuple[GemmForm, ...] = ()


@dataclasses.dataclass
class _Instruction:
    name: str
    shape: str
    opcode: str
    operands: list[tuple[str, str]]  # (shape as printed or "", name)
    attributes: str
    root: bool


def _balanced(text: str, start: int) -> int:
    """The index just past the bracket that closes the one at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        depth += text[i] in "([{"
        depth -= text[i] in ")]}"
        if depth == 0:
            return i + 1
    return len(text)


def _split_top(text: str) -> list[str]:
    parts, depth, begin = [], 0, 0
    for i, c in enumerate(text):
        depth += c in "([{"
        depth -= c in ")]}"
        if c == "," and depth == 0:
            parts.append(text[begin:i])
            begin = i + 1
    return [p.strip() for p in parts + [text[begin:]] if p.strip()]


def _parse_instruction(line: str) -> _Instruction | None:
    match = re.match(r"\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*", line)
    if not match:
        return None
    rest = re.sub(r"/\*.*?\*/", "", line[match.end():])
    end = _balanced(rest, 0) if rest.startswith("(") else rest.find(" ")
    shape, rest = rest[:end], rest[end:].strip()
    op = re.match(r"([\w\-]+)\(", rest)
    if end < 0 or not op:
        return None
    close = _balanced(rest, op.end() - 1)
    operands = []
    for text in _split_top(rest[op.end():close - 1]):
        shape_text, _, name = text.rpartition(" ")
        operands.append((shape_text.strip(), name.lstrip("%")))
    return _Instruction(match.group(2), shape, op.group(1), operands, rest[close:], bool(match.group(1)))


def _parse(hlo_text: str) -> dict[str, list[_Instruction]]:
    """``{computation: instructions}`` of an HLO module's text."""
    computations: dict[str, list[_Instruction]] = {}
    current = None
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if header and not line.startswith(" "):
            current = header.group(1)
            computations[current] = []
        elif line.strip() == "}":
            current = None
        elif current is not None:
            instruction = _parse_instruction(line)
            if instruction is not None:
                computations[current].append(instruction)
    return computations


def _element_type(shape: str) -> str:
    match = re.match(r"[\s(]*([a-z][a-z0-9]*)\[", shape)
    return match.group(1) if match else ""


def _callees(instruction: _Instruction) -> list[str]:
    names = re.findall(r"\b(?:calls|to_apply|body|condition)=%?([\w.\-]+)", instruction.attributes)
    for group in re.findall(r"\bbranch_computations=\{([^}]*)\}", instruction.attributes):
        names += [n.strip().lstrip("%") for n in group.split(",")]
    return names


def _reachable(computations: dict[str, list[_Instruction]], roots: list[str]) -> set[str]:
    seen, todo = set(roots), list(roots)
    while todo:
        for instruction in computations.get(todo.pop(), []):
            for callee in _callees(instruction):
                if callee not in seen:
                    seen.add(callee)
                    todo.append(callee)
    return seen


def _backend_kind(instruction: _Instruction) -> str:
    match = re.search(r'"kind"\s*:\s*"(__[^"]+)"', instruction.attributes)
    return match.group(1) if match else ""


def _precision(attributes: str) -> str:
    """``precision default,default`` and the dot algorithm, where an instruction names them (in its
    backend config or as a dot's attributes): DEFAULT float32 lets cuBLAS run TF32."""
    found = re.search(r'"operand_precision"\s*:\s*\[([^\]]*)\]|\boperand_precision=\{([^}]*)\}', attributes)
    algorithm = re.search(r'"algorithm"\s*:\s*"(\w+)"|\balgorithm=(\w+)', attributes)
    parts = [f"precision {(found.group(1) or found.group(2)).replace(chr(34), '').lower()}"] if found else []
    name = algorithm and (algorithm.group(1) or algorithm.group(2))
    if name and name != "ALG_UNSET":
        parts.append(f"algorithm {name.lower()}")
    return ", ".join(parts)


class _Module:
    """An HLO module's computations, with the shapes of their instructions by name."""

    def __init__(self, hlo_text: str):
        self.computations = _parse(hlo_text)
        self.shapes = {c: {i.name: i.shape for i in body} for c, body in self.computations.items()}
        self.producers = {c: {i.name: i for i in body} for c, body in self.computations.items()}
        bodies = [callee for body in self.computations.values() for i in body if i.opcode == "while"
                  for callee in _callees(i)]
        self.in_loop = _reachable(self.computations, bodies)

    def operand_shapes(self, computation: str, instruction: _Instruction) -> tuple[str, ...]:
        return tuple(shape or self.shapes[computation].get(name, "") for shape, name in instruction.operands[:2])

    def copied(self, computation: str, instruction: _Instruction) -> tuple[int, ...]:
        out = []
        for index, (_, name) in enumerate(instruction.operands[:2]):
            producer = self.producers[computation].get(name)
            if producer is None:
                continue
            root = producer
            if producer.opcode == "fusion":
                called = [c for c in _callees(producer) if c in self.computations]
                root = next((i for i in self.computations[called[0]] if i.root), None) if called else None
            if root is not None and root.opcode in ("copy", "transpose"):
                out.append(index)
        return tuple(out)

    def form(self, computation: str, instruction: _Instruction, form: str, detail: str,
             dot: tuple[str, _Instruction] | None = None) -> GemmForm:
        where, product = dot or (computation, instruction)
        shapes = self.operand_shapes(where, product)
        return GemmForm(form, instruction.name, tuple(_element_type(s) for s in shapes),
                        _element_type(instruction.shape), computation in self.in_loop, detail, shapes,
                        self.copied(computation, instruction) if dot is None else ())


def _custom_call_form(module: _Module, computation: str, instruction: _Instruction) -> GemmForm | None:
    target = re.search(r'custom_call_target="([^"]*)"', instruction.attributes)
    target = target.group(1) if target else ""
    detail = ", ".join(filter(None, [target, _precision(instruction.attributes)]))
    if "__cublas$lt$matmul$f8" in target:
        return module.form(computation, instruction, "cublaslt_fp8", detail)
    if target in _CUBLAS_TARGETS:
        types = tuple(_element_type(s) for s in module.operand_shapes(computation, instruction))
        integer = types == ("s8", "s8") and _element_type(instruction.shape) == "s32"
        return module.form(computation, instruction, "cublas_int8" if integer else "cublas", detail)
    if "triton" in target:
        return module.form(computation, instruction, "pallas_triton", detail)
    return None


def _fusion_form(module: _Module, computation: str, instruction: _Instruction) -> GemmForm | None:
    kind = _backend_kind(instruction)
    called = [c for c in _callees(instruction) if c in module.computations]
    dots = [i for c in called for i in module.computations[c] if i.opcode == "dot"]
    if not dots or not (kind in _TRITON_GEMM_KINDS or kind == "__cudnn$fusion"):
        return None
    dot = (called[0], dots[0])
    detail = ", ".join(filter(None, [kind, _precision(dots[0].attributes)]))
    if kind == "__cudnn$fusion":
        return module.form(computation, instruction, "cudnn", detail, dot)
    types = tuple(_element_type(s) for s in module.operand_shapes(*dot))
    converts = [i for c in _reachable(module.computations, called) for i in module.computations.get(c, [])
                if i.opcode == "convert" and _element_type(i.shape).startswith(("f", "bf"))
                and _element_type(module.operand_shapes(c, i)[0]) in _STORED_INTEGERS]
    if types == ("s8", "s8"):
        form = "triton_int8"
    elif all(t.startswith("f8") for t in types):
        form = "triton_fp8"
    else:
        form = "triton_dequant" if converts else "triton"
    return module.form(computation, instruction, form, detail, dot)


def gemm_forms(hlo_text: str) -> tuple[GemmForm, ...]:
    """Every GEMM of a compiled program's text (``compiled.as_text()``), in program order.

    A dot inside a library fusion counts once, as that fusion.

    >>> text = '''ENTRY %main (p0: s8[4,8], p1: s8[8,16]) -> s32[4,16] {
    ...   %p0 = s8[4,8]{1,0} parameter(0)
    ...   %p1 = s8[8,16]{0,1} parameter(1)
    ...   %gemm = (s32[4,16]{1,0}, s8[512]{0}) custom-call(%p0, %p1), custom_call_target="__cublas$gemm"
    ...   ROOT %out = s32[4,16]{1,0} get-tuple-element((s32[4,16]{1,0}, s8[512]{0}) %gemm), index=0
    ... }'''
    >>> [f.describe() for f in gemm_forms(text)]
    ['cublas_int8 (s8 x s8 -> s32)']
    """
    module = _Module(hlo_text)
    inside = set()  # computations of library fusions: their dots are the fusions'
    forms = []
    for computation, body in module.computations.items():
        for instruction in body:
            if instruction.opcode == "custom-call":
                found = _custom_call_form(module, computation, instruction)
            elif instruction.opcode == "fusion":
                found = _fusion_form(module, computation, instruction)
                if found is not None:
                    inside |= _reachable(module.computations, _callees(instruction))
            else:
                found = None
            if found is not None:
                forms.append(found)
    for computation, body in module.computations.items():
        if computation not in inside:
            forms += [module.form(computation, i, "dot", _precision(i.attributes)) for i in body if i.opcode == "dot"]
    return tuple(forms)


def _expected(kind: str) -> tuple[str, ...]:
    expected = dict(EXPECTED_FORMS)
    if kind not in expected:
        raise ValueError(f"Invalid product kind. Expected one of {tuple(expected)}. Received: kind={kind!r}")
    return expected[kind]


def check_forms(hlo_text: str, kind: str) -> FormCheck:
    """Whether a compiled product of ``kind`` runs one of its :data:`EXPECTED_FORMS`.

    Args:
      hlo_text: The compiled program's text (``jax.jit(f).lower(*args).compile().as_text()``).
      kind: ``"float"``, ``"fp8"``, ``"int8"`` or ``"weight_only"``.

    Raises:
      ValueError: for an unknown kind.

    >>> check_forms("ENTRY %e (p: f32[2]) -> f32[2] {\\n  ROOT %p = f32[2]{0} parameter(0)\\n}", "fp8").verdict
    'fp8: none of cublaslt_fp8, triton_fp8; no GEMM at all'
    """
    expected = _expected(kind)
    forms = gemm_forms(hlo_text)
    hits = [f for f in forms if f.form in expected]
    found = "; ".join(dict.fromkeys(f.describe() for f in forms)) or "no GEMM at all"
    if hits:
        return FormCheck(kind, True, f"{kind}: {found}", forms)
    return FormCheck(kind, False, f"{kind}: none of {', '.join(expected)}; {found}", forms)


# --- StableHLO, before XLA's optimizations ----------------------------------------------------

_MLIR_ELEMENT = {"f8E4M3FN": "f8e4m3fn", "f8E5M2": "f8e5m2", "i8": "s8", "ui8": "u8", "i4": "s4", "ui4": "u4",
                 "i32": "s32"}


def _tensor_type(text: str) -> tuple[int, str]:
    """``(rank, element type)`` of ``tensor<16x32xf8E4M3FN>`` (``(2, "f8e4m3fn")``)."""
    dims = text.split("<", 1)[1].rstrip(">").split("x")
    return len(dims) - 1, _MLIR_ELEMENT.get(dims[-1], dims[-1])


def _ops(function: str, name: str) -> list[tuple[str, list[str], str]]:
    """``(result, operands, type signature)`` of each ``stablehlo.<name>`` op of one function."""
    pattern = rf"^\s*(%[\w#:]+)\s*=\s*stablehlo\.{name}\s+(.*?)\s*:\s*(.*?)(?:\s+loc\(.*\))?$"
    found = []
    for match in re.finditer(pattern, function, re.MULTILINE):
        operands = re.findall(r"%[\w#]+", match.group(2))
        found.append((match.group(1).split(":")[0], operands, match.group(3)))
    return found


def _lowered_findings(text: str) -> tuple[list[tuple[str, str, str]], bool, bool, bool]:
    """The dots (operand, operand, result types), whether one is scaled by a broadcast scalar
    (or used unscaled), whether a stored integer is converted to a float, and any gathers."""
    dots, scalar_scaled, dequantized = [], False, False
    for function in re.split(r"\n\s*func\.func ", text):
        broadcast_scalars = {r for r, ops, sig in _ops(function, "broadcast_in_dim") if "(tensor<" in sig
                             and _tensor_type(sig.split("(")[1].split(")")[0])[0] == 0}
        products = {}
        for result, _, sig in _ops(function, "dot_general"):
            types = re.findall(r"tensor<[^>]*>", sig)
            dots.append(tuple(_tensor_type(t)[1] for t in types[:3]))
            products[result] = dots[-1]
        for name in ("multiply", "divide"):
            scalar_scaled |= any(set(ops) & set(products) and set(ops) & broadcast_scalars
                                 for _, ops, _ in _ops(function, name))
        for _, _, sig in _ops(function, "convert"):
            types = [_tensor_type(t)[1] for t in re.findall(r"tensor<[^>]*>", sig)]
            dequantized |= len(types) == 2 and types[0] in _STORED_INTEGERS and types[1].startswith(("f", "bf"))
    gathers = bool(re.search(r"stablehlo\.(dynamic_)?gather\b", text))
    return dots, scalar_scaled, dequantized, gathers


def check_lowered(stablehlo_text: str, kind: str) -> FormCheck:
    """Whether a product's StableHLO (before optimization) has the pattern XLA:GPU needs for the
    library path of ``kind``.

    - ``"fp8"``: a dot of e4m3 (or one e4m3 and one e5m2) operands to float32, bfloat16 or
      float16, its result multiplied or divided by a broadcast scalar (the per-tensor scales
      outside the dot), and no reduction anywhere: with delayed scaling an inference forward
      reduces over nothing (the amax is the backward pass's).
    - ``"int8"``: a dot of s8 x s8 operands to s32.
    - ``"weight_only"``: stored integers converted to a float type, then a float dot, with no
      gather (XLA's Triton GEMM fusions take no gather: scales gathered by ``g_idx`` make the
      dequantization a pass of its own, outside the GEMM).
    - ``"float"``: a dot of float operands.

    Args:
      stablehlo_text: ``jax.jit(f).lower(*args).as_text()``, or ``jax.export``'s ``mlir_module()``.
      kind: One of :data:`EXPECTED_FORMS`'s kinds.

    Raises:
      ValueError: for an unknown kind.

    >>> check_lowered("%0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : "
    ...               "(tensor<2x4xi8>, tensor<4x3xi8>) -> tensor<2x3xi32>", "int8")
    FormCheck(kind='int8', ok=True, verdict='int8: dots s8 x s8 -> s32', forms=())
    """
    _expected(kind)
    dots, scalar_scaled, dequantized, gathers = _lowered_findings(stablehlo_text)
    listed = ", ".join(f"{a} x {b} -> {c}" for a, b, c in dots) or "none"
    problems = []
    if kind == "fp8":
        fp8 = [d for d in dots if {d[0], d[1]} <= {"f8e4m3fn", "f8e5m2"} and "f8e4m3fn" in d[:2]
               and d[2] in ("f32", "bf16", "f16")]
        problems += [] if fp8 else ["no float8 dot to f32/bf16/f16"]
        problems += [] if scalar_scaled else ["no scale by a broadcast scalar on the dot's result"]
        problems += ["a reduction in the forward pass"] if re.search(r"stablehlo\.reduce\b", stablehlo_text) else []
    elif kind == "int8":
        problems += [] if ("s8", "s8", "s32") in dots else ["no s8 x s8 -> s32 dot"]
    elif kind == "weight_only":
        problems += [] if dequantized else ["no conversion of stored integers to a float type"]
        problems += [] if any(d[0].startswith(("f", "bf")) and d[1].startswith(("f", "bf")) for d in dots) else [
            "no float dot"]
        problems += ["scales gathered by index (a gather)"] if gathers else []
    else:
        problems += [] if any(d[0].startswith(("f", "bf")) for d in dots) else ["no float dot"]
    verdict = f"{kind}: dots {listed}" + (f"; {'; '.join(problems)}" if problems else "")
    return FormCheck(kind, not problems, verdict)
