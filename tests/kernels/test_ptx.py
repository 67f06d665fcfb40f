"""Every kernel variant compiled for real GPUs (sm_80, sm_90) on the CPU, and its PTX checked.

The interpreter runs the kernels' arithmetic but not Triton's compiler: it cannot tell whether the
vector path really vectorizes (alignment hints are no-ops there), whether a variant lowers at all, or
whether registers spill. ``triton.compile`` can, with no GPU: this file compiles each variant with the
specialization the JIT gives 16-byte aligned tensors and checks the PTX:

- every stream on the vector path, counted one by one: each fp32 stream (gradient, master, moments,
  fp32 parameter) loads and stores with exactly two ``.v4.b32`` accesses per thread (16 bytes), each
  16-bit one with two ``.v2.b32`` (8 bytes), each 8-bit one (compact moments) with none but its
  scalar path's single byte access, so a single stream that loses its alignment hint fails;
- the update kernels move nothing through shared memory (one layout for every stream: see VEC in
  kernels/segments.py), and no variant uses local memory (``.local`` in the PTX, or spill/stack bytes
  in the cubin's resource usage).

tests/conftest.py turns the interpreter on for this process, so the compilation runs in a child
process without it (this file, run as a script). Triton caches what it compiles: a second run takes
seconds.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

ARCHS = (80, 90)
# (parameter dtype, gradient dtype, fp32 master weights)
DTYPES = [("fp32", "fp32", False), ("bf16", "bf16", True), ("bf16", "bf16", False), ("fp16", "fp16", True),
          ("fp16", "fp16", False), ("bf16", "fp32", True)]
FIXED = ("N_COEF", "VEC", "BLOCK", "SCALAR_BLOCK", "HAS_MASTER", "PARAM_BF16", "MOMENTS", "STOCHASTIC")
MOMENT_POINTERS = ("exp_avg_ptr", "exp_avg_sq_ptr", "max_exp_avg_sq_ptr", "momentum_buf_ptr")
# the compact formats (state_format) and stochastic rounding, each with flags off and on, on the two
# dtype combinations they are for: fp32 parameters, and bf16 ones without masters
FORMATS = [("bf16", False), ("int8", False), ("fp32", True), ("int8", True)]  # (moments, stochastic)
STORAGE = {"fp32": "fp32", "bf16": "bf16", "int8": "u8"}


def variants():
    """(kernel name, dtypes, constexprs) of every variant: every dtype combination with every boolean
    flag off, and with every flag on (the most live values: the likeliest to spill); then the compact
    moment formats and stochastic rounding (``moments`` and ``stochastic`` in the dtypes)."""
    from fused_zero.kernels import BF16, BLOCK, FP32, INT8, N_ADAM_COEFS, N_SGD_COEFS, VEC, adam, norm, sgd
    from fused_zero.kernels._common import SCALAR_BLOCK

    code = {"fp32": FP32, "bf16": BF16, "int8": INT8}
    sizes = {"VEC": VEC, "BLOCK": BLOCK, "SCALAR_BLOCK": SCALAR_BLOCK}
    kernels = [("adam", adam._adam_kernel, N_ADAM_COEFS), ("sgd", sgd._sgd_kernel, N_SGD_COEFS),
               ("norm", norm._grad_sumsq_kernel, N_ADAM_COEFS)]
    plain = [(k, d, ("fp32", False), on) for k, d, on in itertools.product(kernels, DTYPES, (False, True))]
    compact = [(k, d, f, on) for k, f, d, on in itertools.product(kernels[:2], FORMATS, DTYPES, (False, True))
               if (d[:2] == ("bf16", "bf16") and not d[2]) or (d == ("fp32", "fp32", False) and not f[1])]
    for (name, fn, n_coef), (pdt, gdt, master), (moments, stochastic), on in plain + compact:
        if name == "norm" and (master or pdt != gdt):
            continue  # the norm reads gradients only
        flags = {p.name: on for p in fn.params if p.is_constexpr and p.name not in FIXED}
        const = {"N_COEF": n_coef, **sizes, **flags}
        if name != "norm":
            const.update(HAS_MASTER=master, PARAM_BF16=pdt == "bf16", MOMENTS=code[moments], STOCHASTIC=stochastic)
        yield name, fn, (pdt, gdt, master, moments, stochastic), const


def compile_one(job: tuple[int, int]) -> dict:
    """Compile variant number ``job[1]`` for sm_``job[0]`` (in a process without TRITON_INTERPRET)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fused_zero.kernels._common import FP_FUSION, NUM_WARPS

    arch, index = job
    name, fn, (pdt, gdt, master, moments, stochastic), const = list(variants())[index]
    dtype_of = {"rows_ptr": "*i64", "grad_ptr": "*" + gdt, "param_ptr": "*" + pdt,
                **{p: "*" + STORAGE[moments] for p in MOMENT_POINTERS}}
    sig = {p.name: "constexpr" if p.is_constexpr else dtype_of.get(p.name, "*fp32") for p in fn.params}
    # what the JIT specializes for tensors whose data_ptr() % 16 == 0
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params) if not p.is_constexpr}
    result = {"kernel": name, "arch": arch, "param": pdt, "grad": gdt, "master": master, "moments": moments,
              "stochastic": stochastic, "flags": {k: v for k, v in const.items() if isinstance(v, bool)}}
    try:
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                           target=GPUTarget("cuda", arch, 32),
                           options={"num_warps": NUM_WARPS, "enable_fp_fusion": FP_FUSION})
    except Exception as e:  # reported, not raised: the test names every failing variant
        return {**result, "error": f"{type(e).__name__}: {str(e)[-1500:]}"}
    ptx = k.asm["ptx"]
    found = re.findall(r"\b(?:ld|st)\.(?:global|shared|local)[.\w]*", ptx)
    result["ops"] = sorted(set(found))
    result["counts"] = {op: found.count(op) for op in result["ops"]}
    result["ptx_local"] = bool(re.search(r"\.local\b", ptx))
    result["resources"] = None
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if os.path.exists(cuobjdump) and "cubin" in k.asm:
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True,
                                   text=True).stdout
        found = re.search(r"STACK:(\d+).*LOCAL:(\d+)", usage)
        result["resources"] = {"stack": int(found[1]), "local": int(found[2])} if found else usage[-500:]
    return result


def compile_all() -> list[dict]:
    """Every variant for every arch, on every core."""
    jobs = list(itertools.product(ARCHS, range(len(list(variants())))))
    with concurrent.futures.ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return list(pool.map(compile_one, jobs))


def has_nvidia_backend() -> bool:
    try:
        from triton.backends import backends
    except ImportError:
        return False
    return "nvidia" in backends


@pytest.fixture(scope="module")
def compiled():
    if not has_nvidia_backend():
        pytest.skip("the installed triton has no NVIDIA backend: nothing to compile PTX with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=840)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def describe(r: dict) -> str:
    on = sorted(k for k, v in r["flags"].items() if v)
    return (f"{r['kernel']} sm_{r['arch']} param={r['param']} grad={r['grad']} master={r['master']} "
            f"moments={r['moments']} stochastic={r['stochastic']} on={on}")


def test_every_variant_compiles(compiled):
    # adam and sgd: every dtype combination, flags off and on; norm: three gradient dtypes, off and on;
    # adam and sgd again for the formats: bf16/int8 moments on two dtype combinations, stochastic
    # rounding (fp32/int8 moments) on bf16 without masters, flags off and on
    assert len(compiled) == len(ARCHS) * (2 * 2 * len(DTYPES) + 2 * 3 + 2 * 2 * (2 * 2 + 2))
    failed = [f"{describe(r)}: {r['error']}" for r in compiled if "error" in r]
    assert not failed, "\n".join(failed)


def test_no_variant_uses_local_memory(compiled):
    for r in compiled:
        if "error" in r:
            continue
        assert not r["ptx_local"], f"{describe(r)}: .local in the PTX"
        if r["resources"] is not None:
            assert r["resources"] == {"stack": 0, "local": 0}, f"{describe(r)}: {r['resources']}"


def streams(r: dict) -> dict[str, list[tuple[str, str]]]:
    """The variant's streams on the vector path, ``{"ld": [(name, dtype), ...], "st": [...]}``: what the
    kernel reads and writes per element (the scalar operands, loaded once per program, are not
    streams). Moments in their storage dtype: fp32, bf16 or u8 (8-bit codes)."""
    kernel, flags, low = r["kernel"], r["flags"], r["param"]
    stored = STORAGE[r["moments"]]
    weight = [("master", "fp32")] if r["master"] else [("param", low)]
    if kernel == "norm":
        return {"ld": [("grad", r["grad"])], "st": []}
    if kernel == "adam":
        moments = [("exp_avg", stored), ("exp_avg_sq", stored)] + \
            ([("max_exp_avg_sq", stored)] if flags.get("AMSGRAD") else [])
    else:
        moments = [("momentum_buffer", stored)] if flags.get("HAS_MOMENTUM") else []
    stores = moments + ([("master", "fp32")] if r["master"] else []) + [("param", low)]
    return {"ld": [("grad", r["grad"])] + weight + moments, "st": stores}


PER_STREAM = 2
"""Vector accesses per stream and per thread on the aligned path: BLOCK = 2048 elements over 8 warps is
8 elements a thread, VEC = 4 per access."""
ACCESS = {"fp32": ("v4.b32", PER_STREAM), "bf16": ("v2.b32", PER_STREAM), "fp16": ("v2.b32", PER_STREAM),
          "u8": ("b8", 1)}
"""What each stream dtype is counted by, and how many: 8-bit codes by their scalar path's byte access."""


def test_every_stream_is_vectorized(compiled):
    """Exact counts of vector accesses, stream by stream: fp32 streams ``.v4.b32`` (16 bytes), 16-bit
    ones ``.v2.b32`` (8 bytes), PER_STREAM of each per stream. A stream whose alignment hint is lost
    goes scalar and takes its two vector accesses out of the count (the gradient's, in Adam fp32: 8
    ``ld.global.v4.b32`` become 6), whichever stream it is. 8-bit codes move four to a 32-bit access on
    the vector path, which the PTX cannot tell from other 32-bit ones: their byte accesses are counted
    instead, exactly one per 8-bit stream (the scalar path's); a vector row cut to bytes would add
    four per stream."""
    for r in compiled:
        if "error" in r:
            continue
        want: dict[str, int] = {}
        for kind, listed in streams(r).items():
            for _, dtype in listed:
                access, count = ACCESS[dtype]
                want[f"{kind}.global.{access}"] = want.get(f"{kind}.global.{access}", 0) + count
        got = {op: n for op, n in r["counts"].items() if ".v" in op or op.endswith(".b8")}
        assert got == want, f"{describe(r)}: accesses {got}, the streams {streams(r)} need {want}"


def test_vector_path_streams_16_bytes_fp32_and_8_bytes_16_bit(compiled):
    for r in compiled:
        if "error" in r:
            continue
        ops, what = set(r["ops"]), describe(r)
        sixteen_bit = {"bf16", "fp16"}
        if r["kernel"] == "norm":
            want = {"ld.global.v4.b32"} if r["grad"] == "fp32" else {"ld.global.v2.b32"}
        else:
            # fp32 streams: moments (adam), momentum (sgd), master weights, fp32 parameters or gradients
            fp32_moments = r["moments"] == "fp32" and (r["kernel"] == "adam" or r["flags"].get("HAS_MOMENTUM"))
            fp32_state = fp32_moments or r["master"] or r["param"] == "fp32"
            want = {"ld.global.v4.b32", "st.global.v4.b32"} if fp32_state else set()
            if r["grad"] == "fp32":
                want.add("ld.global.v4.b32")
            if r["grad"] in sixteen_bit:
                want.add("ld.global.v2.b32")
            if r["param"] in sixteen_bit:
                want.add("st.global.v2.b32")
                if not r["master"]:
                    want.add("ld.global.v2.b32")
            # one layout for every stream: nothing converted through shared memory (8-bit moments take
            # their block's largest magnitude across the warps there)
            if r["moments"] != "int8":
                assert not any(op.startswith(("ld.shared", "st.shared")) for op in ops), f"{what}: {sorted(ops)}"
        assert want <= ops, f"{what}: missing {sorted(want - ops)} in {sorted(ops)}"
        # the ragged ends still have their scalar path (the hints did not leak onto it)
        if r["kernel"] == "norm":
            scalar = "ld.global.b16" if r["grad"] in sixteen_bit else None
        else:
            scalar = "st.global.b32" if fp32_state else "st.global.b16"
        assert scalar is None or scalar in ops, f"{what}: no scalar path left in {sorted(ops)}"


if __name__ == "__main__":
    print(json.dumps(compile_all()))
