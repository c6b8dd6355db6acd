"""The GPU benchmark and the device session's script, checked where there is no GPU:
``benchmarks/bench_gpu_kernels.py --small`` writes its page (columns, finite errors under the
bound, nothing timed outside its loop), and ``benchmarks/gpu_session.sh`` parses, calls only files
that exist, and fits its time limits into 10 minutes."""

import functools
import importlib.util
import math
import os
import pathlib
import re
import shlex
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SESSION = ROOT / "benchmarks" / "gpu_session.sh"
#: Stated here as well as in the benchmark: a row over it is a wrong product, not quantization.
ERROR_BOUND = 0.2
CPU_KERNELS = ["float32", "float32/highest", "bfloat16", "fp8_dot", "fp8 dot only", "int8/s8s8", "s8 dot only",
               "gptq/8 xla", "gptq/4 xla"]


@functools.cache
def _bench():
    """``benchmarks/bench_gpu_kernels.py`` as a module, registered in ``sys.modules`` (its
    dataclasses look their module up while being defined)."""
    spec = importlib.util.spec_from_file_location("bench_gpu_kernels", ROOT / "benchmarks" / "bench_gpu_kernels.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _table(page, heading):
    """The rows of the first table under ``## heading``, as lists of cells (header first)."""
    section = page.split(f"## {heading}\n", 1)[1]
    lines = [line for line in section.split("\n## ", 1)[0].splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines if not line.startswith("|---")]


@pytest.mark.slow  # 8-13 s on a 2-core EPYC: 20 small compilations and the timing rounds
def test_the_small_benchmark_writes_its_page(tmp_path):
    page_path = tmp_path / "page.md"
    run = subprocess.run([sys.executable, "benchmarks/bench_gpu_kernels.py", "--small", "--out", str(page_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    page = page_path.read_text(encoding="utf-8")
    bench = _bench()
    assert bench.ERROR_BOUND == ERROR_BOUND
    products = _table(page, "Products")
    assert products[0] == list(bench.TABLE_COLUMNS)
    rows = products[1:]
    assert [(r[0], r[1]) for r in rows] == [("square", "32 x 256 x 256")] * len(CPU_KERNELS) + [
        ("q/o", "1 x 256 x 256")] * len(CPU_KERNELS)
    assert [r[2] for r in rows] == CPU_KERNELS * 2
    for row in rows:
        error = float(row[6].split()[0])
        assert math.isfinite(error) and error < ERROR_BOUND, row
        median, low, high = map(float, re.findall(r"[\d.]+", row[3]))
        assert 0 < low <= median <= high, row
        assert "outside the timing loop" not in row[7], row
    assert {r[2]: float(r[6]) for r in rows[:3]} == {"float32": 0.0, "float32/highest": 0.0,
                                                     "bfloat16": pytest.approx(3e-3, rel=0.5)}
    verdicts = _table(page, "HLO forms")
    assert [v[0] for v in verdicts[1:]] == CPU_KERNELS
    # A CPU takes none of the GPU paths; the StableHLO of the fp8 and int8 kernels has their patterns.
    assert all(v[4].startswith("NO (") for v in verdicts[1:])
    lowered = {v[0]: v[2] for v in verdicts[1:]}
    assert lowered["fp8_dot"] == "ok: dots f8e4m3fn x f8e4m3fn -> f32"
    assert lowered["int8/s8s8"] == "ok: dots s8 x s8 -> s32"
    assert "`gptq/8 pallas`: not runnable here" in page
    assert run.stdout.startswith("| kernel | kind | StableHLO before XLA |")


def test_the_timing_loop_keeps_every_product_and_its_weights_work_inside():
    bench = _bench()
    products = {p.name: p for p in bench.make_products(64, 32, 4, 0, [])}
    for name in ("gptq/4 xla", "fp8_dot"):
        p = products[name]
        program = jax.jit(bench.loop_program(p.fn, 2)).lower(p.x, p.weights, jnp.float32(0.0), jnp.int32(3))
        compiled = program.compile()
        assert bench.outside_loop_work(compiled.as_text()) == [], name
        # A runtime zero leaves the input as it was: the loop's last product is the product.
        y = compiled(p.x, p.weights, jnp.float32(0.0), jnp.int32(3))
        assert jnp.array_equal(y, jax.jit(p.fn)(p.x, p.weights)), name


@pytest.mark.slow  # 2.5 s on a 2-core EPYC
def test_every_timing_loop_lowers_for_cuda_without_a_gpu():
    # What the GPU session compiles, lowered here (compiling needs the GPU): the loop, its barrier
    # and in-place update around each kernel, the Pallas kernel as Triton (not its interpreter).
    from jax import export  # pylint: disable=import-outside-toplevel

    from autopolicy.numerics import pallas_weight_only  # pylint: disable=import-outside-toplevel

    bench = _bench()
    products = bench.make_products(256, 64, 16, 0, [])
    gptq = next(p for p in products if p.name == "gptq/4 xla")
    pallas = functools.partial(pallas_weight_only.einsum_kernel, "mk,kn->mn", layout=(4, bench.GROUP),
                               compute_dtype=jnp.bfloat16, interpret=False)
    products.append(bench.Product("gptq/4 pallas", "weight_only", pallas, gptq.x, gptq.weights))
    triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    for p in products:
        exported = export.export(jax.jit(bench.loop_program(p.fn, 8)), platforms=["cuda"], disabled_checks=[triton])
        text = exported(p.x, p.weights, jnp.float32(0.0), jnp.int32(2)).mlir_module()
        assert "stablehlo.while" in text and text.count("stablehlo.optimization_barrier") == 8, p.name
    assert text.count("@__gpu$xla.gpu.triton") == 8


def test_work_hoisted_out_of_a_loop_is_named():
    bench = _bench()
    text = """HloModule m

%fused_zeros (p: f32[]) -> bf16[4,8] {
  %p = f32[] parameter(0)
  ROOT %b = bf16[4,8]{1,0} broadcast(%p), dimensions={}
}

ENTRY %main (x: s8[4,8], k: s8[8,16]) -> s32[4,16] {
  %x = s8[4,8]{1,0} parameter(0)
  %k = s8[8,16]{1,0} parameter(1)
  %zeros = bf16[4,8]{1,0} fusion(%c), kind=kLoop, calls=%fused_zeros
  %copy.1 = s8[4,8]{1,0} copy(%x)
  %copy.2 = s8[8,16]{0,1} copy(s8[8,16]{1,0} %k)
  %gemm = (s32[4,16]{1,0}, s8[64]{0}) custom-call(%copy.1, %copy.2), custom_call_target="__cublas$gemm"
  ROOT %w = s32[4,16]{1,0} get-tuple-element(%gemm), index=0
}
"""
    # The zeros and the copy of x keep their layout: not work a call of the product would repeat.
    assert bench.outside_loop_work(text) == ["copy.2", "gemm"]


def test_the_full_run_measures_the_issue_shapes():
    bench = _bench()
    shapes = bench.full_shapes()
    assert shapes[0] == ("square", 4096, 4096, 4096) and len(shapes) == 21
    assert {(k, n) for _, _, k, n in shapes[1:]} == {(2048, 2048), (2048, 512), (2048, 8192), (8192, 2048),
                                                      (2048, 49152)}
    assert [rows for _, rows, _, _ in shapes[1::5]] == [1, 512, 16, 64]


# --- the device session's script --------------------------------------------------------------


def _session_lines():
    return SESSION.read_text(encoding="utf-8")


def test_the_session_script_parses():
    subprocess.run(["bash", "-n", str(SESSION)], check=True)


def test_every_file_and_module_the_session_calls_exists():
    text = _session_lines()
    scripts = re.findall(r"python (benchmarks/[\w./-]+\.py)", text)
    assert "benchmarks/bench_gpu_kernels.py" in scripts
    for script in scripts:
        assert (ROOT / script).is_file(), script
    for module in re.findall(r"python -m ([\w.]+)", text):
        path = ROOT.joinpath(*module.split("."))
        assert path.with_suffix(".py").is_file() or (path / "__main__.py").is_file(), module
    # The benchmark takes the options the session gives it.
    given = re.search(r"bench_gpu_kernels\.py (.*?) \\\n", text).group(1).replace('"$out/"', "out/")
    args = _bench().parse_args(shlex.split(given))
    assert (args.out, args.rounds, args.target_ms, args.budget_s) == ("out/", 5, 10.0, 150.0)


def test_each_session_fits_ten_minutes():
    text = _session_lines()
    for session in ("kernels", "timing"):
        branch = re.search(rf"^  {session}\)\n(.*?)^    ;;", text, re.MULTILINE | re.DOTALL).group(1)
        limits = [int(s) for s in re.findall(r"\b(?:limited|timeout) (\d+) ", branch)]
        assert limits and sum(limits) < 600, (session, limits)
    assert re.findall(r"tune (\w+)", text.split("  timing)")[0]) == ["bert_base", "decoder_1b", "decoder_1b"]
    assert "--option batch=1 " in text and "--option batch=64 " in text


def test_the_session_refuses_an_unknown_session_naming_the_valid_ones(tmp_path):
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}")
    for tool in ("nvidia-smi", "python"):  # stand-ins: the checks before the sessions are not under test
        (tmp_path / tool).write_text("#!/bin/sh\nexit 0\n")
        (tmp_path / tool).chmod(0o755)
    run = subprocess.run(["bash", str(SESSION), str(tmp_path / "out"), "profile"], capture_output=True, text=True,
                         env=env, check=False)
    assert run.returncode == 2
    assert run.stderr.strip() == ("gpu_session.sh: invalid session. Expected one of kernels, timing. "
                                  "Received: profile")
