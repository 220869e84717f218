"""Cross-check our MatMulNBitsQkv kernel with ONNX Runtime's own fused node on WebGPU.

ORT 1.32 has no CPU kernel for ``com.microsoft.MatMulNBitsQkv``; onnxruntime-webgpu 1.27 runs it
in its WebGPU execution provider, which on a machine without a GPU needs Mesa 25's lavapipe
(Debian 12's Mesa 22.3 lavapipe gives ORT no adapter). This script feeds the same random inputs
to three implementations and prints the largest relative errors
(``max|a - b| / max|b|`` per output) between them:

* ``ours``: this project's kernel package (every variant that fits the case, forced), run in
  the project's venv on the project's default adapter;
* ``ort-webgpu``: one ``MatMulNBitsQkv`` node in ORT's WebGPU EP, with ORT 1.32's input
  positions (``A, skip, norm_scale, q_B, q_scales, "", k_B, k_scales, "", v_B, v_scales``)
  and the CPU fallback disabled (``session.disable_cpu_ep_fallback=1``), so a node that does
  not run on WebGPU is an error, not a silent CPU run;
* ``oracle``: the numpy oracle (float64 inside).

onnxruntime-webgpu has the same import name as onnxruntime, so it lives in its own venv and runs
in a child process (this script again, with ``--worker``), with Mesa 25's lavapipe picked by
``VK_DRIVER_FILES`` for that process only: the system's Vulkan driver is not replaced.

Setup, once (about a minute; ``.venv-*/`` is git-ignored)::

    python3 -m venv .venv-ortweb
    .venv-ortweb/bin/pip install onnxruntime-webgpu==1.27.0 onnx numpy
    # Mesa 25 lavapipe from Debian's bookworm-backports suite (same mirror as the
    # bookworm suite), downloaded and unpacked into the venv, not installed:
    (grep -m1 '^URIs:' /etc/apt/sources.list.d/debian.sources; echo 'Types: deb';
     echo 'Suites: bookworm-backports'; echo 'Components: main';
     echo 'Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg'
    ) > /etc/apt/sources.list.d/bookworm-backports.sources
    apt-get update
    cd /tmp && apt-get download mesa-vulkan-drivers/bookworm-backports libdrm2/bookworm-backports libdrm-amdgpu1/bookworm-backports; cd -
    for f in /tmp/mesa-vulkan-drivers_25*.deb /tmp/libdrm*bpo12*.deb; do dpkg -x "$f" .venv-ortweb/mesa25; done

(mesa-vulkan-drivers 25.0.7 from backports needs libdrm >= 2.4.121, newer than bookworm's; the
unpacked libdrm is put on ``LD_LIBRARY_PATH`` of the child process only.) On a machine with a
GPU whose Vulkan driver ORT can use, pass ``--mesa ''`` to use the system's driver instead.

Run (from the repository root)::

    .venv/bin/python benchmarks/crosscheck_ort_webgpu_qkv.py [--cases 40] [--seed N]

It exits 1 when our kernel is beyond 1e-4 (float32) or 2e-3 (float16) from the oracle or
from ORT's fused node, and 2 when ORT WebGPU cannot run at all. ORT's float16 kernel is itself
up to about 2.5e-3 from the exact result at K=2048 (measured): where ORT's node is beyond the
tolerance from the oracle, ours may differ from ORT by that distance plus the tolerance, and the
run is marked "(ORT's own error)".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TOL = {"float32": 1e-4, "float16": 2e-3}
OUTPUTS = ("qT", "kT", "vT", "residualT")
ORT_OUTPUT_NAMES = ("Q", "K", "V", "input_skip_bias_sum")


# --------------------------------------------------------------------------------------------
# Worker: runs in the onnxruntime-webgpu venv (numpy, onnx, onnxruntime-webgpu only).
# --------------------------------------------------------------------------------------------


def _fused_model(arrays: dict, attrs: dict, want_residual: bool):
    from onnx import helper, numpy_helper

    a = arrays["aT"]
    elem = helper.np_dtype_to_tensor_dtype(a.dtype)
    has_skip = "skipT" in arrays
    inputs = [helper.make_tensor_value_info("A", elem, a.shape)]
    if has_skip:
        inputs.append(helper.make_tensor_value_info("skip", elem, a.shape))
    inits = [
        numpy_helper.from_array(arrays[key], name)
        for key, name in (
            ("normScaleT", "norm_scale"),
            ("qBT", "q_B"),
            ("qScalesT", "q_scales"),
            ("kBT", "k_B"),
            ("kScalesT", "k_scales"),
            ("vBT", "v_B"),
            ("vScalesT", "v_scales"),
        )
    ]
    node_inputs = [
        "A",
        "skip" if has_skip else "",
        "norm_scale",
        "q_B",
        "q_scales",
        "",  # q_bias
        "k_B",
        "k_scales",
        "",  # k_bias
        "v_B",
        "v_scales",
    ]
    outputs = list(ORT_OUTPUT_NAMES[:3]) + (["input_skip_bias_sum"] if want_residual else [])
    node = helper.make_node(
        "MatMulNBitsQkv",
        node_inputs,
        outputs,
        domain="com.microsoft",
        K=attrs["K"],
        Nq=attrs["Nq"],
        Nkv=attrs["Nkv"],
        bits=4,
        block_size=32,
        accuracy_level=0,
        epsilon=attrs["epsilon"],
    )
    graph = helper.make_graph(
        [node],
        "matmul_nbits_qkv",
        inputs,
        [helper.make_tensor_value_info(o, elem, None) for o in outputs],
        initializer=inits,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
        ir_version=10,
    )
    feeds = {"A": a}
    if has_skip:
        feeds["skip"] = arrays["skipT"]
    return model, feeds, outputs


def worker(in_dir: Path, out_dir: Path) -> int:
    import onnxruntime as ort

    manifest = json.loads((in_dir / "cases.json").read_text())
    report = {"ort_version": ort.__version__, "providers": ort.get_available_providers()}
    for case in manifest["cases"]:
        with np.load(in_dir / f"{case['name']}.npz") as z:
            arrays = {k: z[k] for k in z.files}
        model, feeds, outputs = _fused_model(arrays, case["attrs"], case["residual"])
        so = ort.SessionOptions()
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        so.log_severity_level = 3
        session = ort.InferenceSession(
            model.SerializeToString(), so, providers=["WebGpuExecutionProvider"]
        )
        got = session.run(outputs, feeds)
        np.savez(out_dir / f"{case['name']}.npz", **dict(zip(outputs, got, strict=True)))
    (out_dir / "report.json").write_text(json.dumps(report))
    return 0


# --------------------------------------------------------------------------------------------
# Driver: runs in the project's venv.
# --------------------------------------------------------------------------------------------


def _cases(rng: np.random.Generator, count: int):
    """(name, arrays, attrs, residual): every dtype x skip form x shape in turn, rows cycling."""
    from onnx_moe_fuse.verify.oracles.quant import quantize_matmul_nbits

    shapes = [(64, 64, 32), (96, 40, 24), (256, 128, 64), (2048, 2048, 512)]
    leads = [(1,), (5,), (1, 1), (2, 3), (16,)]
    forms = [("noskip", False, False), ("skip", True, False), ("skipsum", True, True)]
    combos = [(d, f, s) for s in shapes for f in forms for d in (np.float32, np.float16)]
    for i in range(count):
        dtype, (form, skip, residual), (k, nq, nkv) = combos[i % len(combos)]
        lead = leads[i % len(leads)]
        arrays = {
            "aT": rng.standard_normal((*lead, k)).astype(dtype),
            "normScaleT": rng.uniform(0.5, 1.5, k).astype(dtype),
        }
        if skip:
            arrays["skipT"] = rng.standard_normal((*lead, k)).astype(dtype)
        for p, n in (("q", nq), ("k", nkv), ("v", nkv)):
            w = rng.standard_normal((n, k)) / np.sqrt(k)
            arrays[f"{p}BT"], arrays[f"{p}ScalesT"] = quantize_matmul_nbits(
                w, 4, 32, rng, scale_dtype=dtype
            )
        name = f"c{i:03d}_{np.dtype(dtype).name}_{form}_{'x'.join(map(str, (*lead, k)))}_{nq}_{nkv}"
        attrs = {"K": k, "Nq": nq, "Nkv": nkv, "block_size": 32, "epsilon": 1e-6}
        yield name, arrays, attrs, residual


def _child_env(mesa: str) -> dict:
    env = dict(os.environ)
    env.setdefault("XDG_RUNTIME_DIR", "/tmp")
    if not mesa:
        return env
    root = Path(mesa).resolve()
    lib = root / "usr" / "lib" / "x86_64-linux-gnu"
    driver = lib / "libvulkan_lvp.so"
    if not driver.is_file():
        raise SystemExit(
            f"no Mesa lavapipe at {driver}: see the setup steps at the top of {__file__}"
        )
    icd = root / "lvp_icd.crosscheck.json"
    icd.write_text(
        json.dumps(
            {
                "file_format_version": "1.0.0",
                "ICD": {"library_path": str(driver), "api_version": "1.4.305"},
            }
        )
    )
    env["VK_DRIVER_FILES"] = str(icd)
    env["VK_ICD_FILENAMES"] = str(icd)  # older Vulkan loaders
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(lib), env.get("LD_LIBRARY_PATH")]))
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=36, help="number of random cases")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: fresh)")
    parser.add_argument(
        "--ort-python",
        default=str(ROOT / ".venv-ortweb" / "bin" / "python"),
        help="python of the venv that has onnxruntime-webgpu",
    )
    parser.add_argument(
        "--mesa",
        default=str(ROOT / ".venv-ortweb" / "mesa25"),
        help="folder where Mesa 25's debs are unpacked ('' = the system's Vulkan driver)",
    )
    parser.add_argument("--json", type=Path, help="also write the per-case errors here")
    parser.add_argument("--worker", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(Path(args.worker[0]), Path(args.worker[1]))

    from common import rel_err

    from onnx_moe_fuse.kernels.runtime import get_kernel
    from onnx_moe_fuse.verify.oracles.kernel_calls import KERNEL_ORACLES

    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    kernel = get_kernel("com.microsoft.MatMulNBitsQkv")
    print(f"seed {seed}; our adapter: {kernel.device.description}")
    cases = list(_cases(rng, args.cases))

    with tempfile.TemporaryDirectory() as tmp:
        in_dir, out_dir = Path(tmp, "in"), Path(tmp, "out")
        in_dir.mkdir()
        out_dir.mkdir()
        for name, arrays, _, _ in cases:
            np.savez(in_dir / f"{name}.npz", **arrays)
        (in_dir / "cases.json").write_text(
            json.dumps({"cases": [{"name": n, "attrs": a, "residual": r} for n, _, a, r in cases]})
        )
        proc = subprocess.run(
            [args.ort_python, __file__, "--worker", str(in_dir), str(out_dir)],
            env=_child_env(args.mesa),
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            print(proc.stdout + proc.stderr, file=sys.stderr)
            print("ORT WebGPU could not run MatMulNBitsQkv (see above)", file=sys.stderr)
            return 2
        report = json.loads((out_dir / "report.json").read_text())
        print(f"onnxruntime-webgpu {report['ort_version']} ({', '.join(report['providers'])})")
        ort_out = {}
        for name, *_ in cases:
            with np.load(out_dir / f"{name}.npz") as z:
                ort_out[name] = {
                    key: z[ort_name]
                    for key, ort_name in zip(OUTPUTS, ORT_OUTPUT_NAMES, strict=True)
                    if ort_name in z.files
                }

    rows, worst, failed, ort_errors = [], {}, False, 0
    print(
        f"\n{'case':<44} {'variant':<14} {'ours-ORTweb':>11} {'oracle-ORTweb':>13} {'ours-oracle':>11}"
    )
    for name, arrays, attrs, residual in cases:
        dtype = arrays["aT"].dtype.name
        oracle = KERNEL_ORACLES["MatMulNBitsQkv"](arrays, attrs)
        if not residual:
            oracle.pop("residualT", None)
        form = "skipsum" if residual else ("skip" if "skipT" in arrays else "norm")
        ort_o = ort_out[name]
        oracle_vs_ort = max(rel_err(oracle[key], ort_o[key]) for key in oracle)
        for variant in (form, f"split_{form}"):
            out = kernel(
                **arrays,
                attrs=attrs,
                variant=variant,
                poison_outputs=True,
                optional_outputs=["residualT"] if residual else [],
            )
            ours_vs_ort = max(rel_err(out[key], ort_o[key]) for key in oracle)
            ours_vs_oracle = max(rel_err(out[key], oracle[key]) for key in oracle)
            if residual and not np.array_equal(out["residualT"], ort_o["residualT"]):
                print(f"{name} {variant}: residual differs from ORT's input_skip_bias_sum")
                failed = True
            # Ours must be within tolerance of the exact answer, and of ORT's node unless ORT
            # is itself that far from the exact answer (its float16 arithmetic): then ours
            # must be no further from ORT than ORT is from the oracle plus the tolerance.
            ort_own_error = oracle_vs_ort > TOL[dtype]
            bad = ours_vs_oracle > TOL[dtype] or (
                ours_vs_ort > TOL[dtype] + (oracle_vs_ort if ort_own_error else 0.0)
            )
            failed |= bad
            ort_errors += ort_own_error
            key = (dtype, variant)
            w = worst.setdefault(key, [0.0, 0.0, 0.0])
            w[0], w[1], w[2] = (
                max(w[0], ours_vs_ort),
                max(w[1], oracle_vs_ort),
                max(w[2], ours_vs_oracle),
            )
            rows.append(
                {
                    "case": name,
                    "variant": variant,
                    "ours_vs_ort_webgpu": ours_vs_ort,
                    "oracle_vs_ort_webgpu": oracle_vs_ort,
                    "ours_vs_oracle": ours_vs_oracle,
                }
            )
            print(
                f"{name:<44} {variant:<14} {ours_vs_ort:>11.2e} {oracle_vs_ort:>13.2e} "
                f"{ours_vs_oracle:>11.2e}"
                + ("  BEYOND TOLERANCE" if bad else "")
                + ("  (ORT's own error)" if ort_own_error and not bad else "")
            )
    print("\nlargest relative errors by dtype and variant:")
    print(
        f"{'dtype':<8} {'variant':<14} {'ours-ORTweb':>11} {'oracle-ORTweb':>13} {'ours-oracle':>11}"
    )
    for (dtype, variant), (a, b, c) in sorted(worst.items()):
        print(f"{dtype:<8} {variant:<14} {a:>11.2e} {b:>13.2e} {c:>11.2e}")
    if args.json:
        args.json.write_text(json.dumps({"seed": seed, "cases": rows}, indent=1) + "\n")
    if ort_errors:
        print(
            f"\n{ort_errors} run(s) where ORT WebGPU's own result is beyond the tolerance from "
            "the float64 oracle (float16 arithmetic in ORT's kernel); ours was compared with "
            "the oracle there"
        )
    print("\nOK" if not failed else "\nFAILED: our kernel is beyond 1e-4 (f32) / 2e-3 (f16)")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
