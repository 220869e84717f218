"""Export transformers' sparse-MoE blocks to ONNX with torch.onnx, as real users get them.

Run it in the export venv (torch is never needed by the package, its tests or CI)::

    python3 -m venv .venv-export
    .venv-export/bin/pip install torch==2.13.0 transformers onnx onnxscript onnxruntime numpy
    .venv-export/bin/python sample_models/export_transformers.py [--only NAME ...]

For each model below it builds the MoE block module of a transformers model from a small
config made in code (no download), fills its parameters from a fixed torch seed, exports it, and
writes into ``sample_models/exported/``:

- ``<name>.onnx``: the export, weights as initializers inside the file.
- ``<name>.npz``: one random input (``hidden_states``, ``[2, 8, H]`` float32) and the PyTorch
  module's output on it (``output``): the reference ``tests/samples/test_exported_models.py``
  checks the committed model against without torch.
- ``<name>.json``: versions, the config, the input, what the layer computes, the fusion it should
  get, the export's op histogram and node listing, and the ORT-vs-PyTorch errors measured here.

and ``index.json`` listing them (plus the exports that failed, with the reason); ``--only``
rewrites just the named models and leaves ``index.json`` as it is.

The models:

- ``mixtral_batched_mm``, ``qwen3_moe_batched_mm``, ``qwen2_moe_batched_mm``,
  ``gpt_oss_batched_mm``: ``torch.onnx.export(..., dynamo=True)`` of ``MixtralSparseMoeBlock``,
  ``Qwen3MoeSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock`` (with its shared expert) and
  ``GptOssMLP``, with ``config._experts_implementation = "batched_mm"`` (the config keyword
  ``experts_implementation="batched_mm"``; the experts classes are decorated with
  ``transformers.integrations.moe.use_experts_implementation``, which dispatches ``forward`` on
  that config field through ``ALL_EXPERTS_FUNCTIONS``). Batch and sequence are dynamic.
- ``mixtral_batched_mm_hf_table``: ``mixtral_batched_mm`` exported with transformers' own
  translation table (see below), as transformers' ONNX exporter does: its ``repeat_interleave``
  translation repeats tokens with Unsqueeze/Tile/Reshape instead of Unsqueeze/Expand/Reshape.
- ``mixtral_grouped_mm``: the ``grouped_mm`` experts implementation (what ``from_pretrained``
  picks by default). Plain torch.onnx cannot translate it (no ONNX function for
  ``transformers::grouped_mm_fallback``), so this one passes transformers' own translation table
  (``transformers.exporters.exporter_onnx._ONNX_TRANSLATION_TABLE``, which transformers' ONNX
  exporter uses): rows sorted by expert, one Range/Gather/MatMul per expert, Concat.
- ``mixtral_eager_torchscript``: the eager per-expert loop (``experts_implementation`` unset).
  ``torch.onnx.export(dynamo=True)`` refuses it (the loop runs over a data-dependent number of
  hit experts: ``GuardOnDataDependentSymNode``; that failure is recorded in ``index.json``), so it
  is exported with the legacy TorchScript exporter (``dynamo=False``). The trace unrolls the loop
  once per expert hit by the example input, so the model only runs when every expert is hit
  (a single token fails in ORT): a form a fuser must leave alone.

``GptOssMLP`` returns ``(hidden_states, router_scores)``; the decoder layer drops the scores, so
the export wraps it and returns only ``hidden_states``, as a full model's graph would.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import math
import sys
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper
import onnxruntime as ort
import torch
from export_records import (  # noqa: E402
    io_record,
    jsonable,
    node_listing,
    ort_session,
    rel_err,
    spellings,
    versions,
)
from export_transformers_llama4 import LLAMA4_SPECS, llama4_moe_inputs  # noqa: E402
from export_transformers_specs import (  # noqa: E402
    CHECK_SHAPES,
    HIDDEN,
    MAX_FILE_BYTES,
    OUT_DIR,
    REF_SHAPE,
    SEED,
    SPECS,
    Spec,
    _FirstOutput,
    build_mixtral,
)

SPECS = [*SPECS, *LLAMA4_SPECS]

# -- export --------------------------------------------------------------------------------------


def export(spec: Spec, module: torch.nn.Module, path: Path) -> None:
    """Export ``module`` with ``spec.exporter`` to ``path`` (weights inside the file)."""
    example = torch.randn(2, 16, HIDDEN, generator=torch.Generator().manual_seed(SEED + 1))
    if spec.exporter == "torchscript":
        torch.onnx.export(
            module,
            (example,),
            str(path),
            dynamo=False,
            input_names=["hidden_states"],
            output_names=["output"],
            dynamic_axes={
                "hidden_states": {0: "batch", 1: "sequence"},
                "output": {0: "batch", 1: "sequence"},
            },
        )
        return
    table = None
    if spec.exporter == "dynamo+transformers-table":
        from transformers.exporters.exporter_onnx import _ONNX_TRANSLATION_TABLE

        table = _ONNX_TRANSLATION_TABLE
    dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("sequence")}
    program = torch.onnx.export(
        module,
        (example,),
        dynamo=True,
        dynamic_shapes={"hidden_states": dims},
        input_names=["hidden_states"],
        output_names=["output"],
        custom_translation_table=table,
        verbose=False,
    )
    program.save(str(path), external_data=False)


def try_dynamo_eager(spec: Spec, module: torch.nn.Module) -> str | None:
    """The error of ``torch.onnx.export(dynamo=True)`` on the eager loop, or None if it worked."""
    example = torch.randn(2, 16, HIDDEN)
    dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("sequence")}
    noise = io.StringIO()  # torch.export prints the whole traced graph on this failure
    try:
        with contextlib.redirect_stdout(noise), contextlib.redirect_stderr(noise):
            torch.onnx.export(
                module, (example,), dynamo=True, dynamic_shapes={"hidden_states": dims}
            )
    except Exception as exc:  # noqa: BLE001 (recorded, not raised)
        cause = exc.__cause__ or exc
        return f"{type(cause).__name__}: {str(cause).splitlines()[0]}"
    return None


def run_spec(spec: Spec, out_dir: Path) -> dict[str, Any]:
    torch.manual_seed(SEED)
    module, cfg = spec.build(spec.impl)
    module.eval()
    path = out_dir / f"{spec.name}.onnx"
    with torch.no_grad():
        export(spec, module, path)
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise RuntimeError(f"{path.name} is {size} bytes, over {MAX_FILE_BYTES}")

    session = ort_session(path)
    gen = torch.Generator().manual_seed(SEED + 2)

    def compare(shape: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray, float]:
        x = torch.randn(*shape, generator=gen)
        with torch.no_grad():
            want = module(x).numpy()
        got = session.run(None, {"hidden_states": x.numpy()})[0]
        assert got.shape == want.shape, (got.shape, want.shape)
        return x.numpy(), want, rel_err(got, want)

    ref_x, ref_y, ref_err = compare(REF_SHAPE)
    np.savez_compressed(out_dir / f"{spec.name}.npz", hidden_states=ref_x, output=ref_y)
    checks = {"x".join(map(str, REF_SHAPE)): ref_err}
    for shape in CHECK_SHAPES:
        if shape in spec.failing_shapes:
            continue
        checks["x".join(map(str, shape))] = compare(shape)[2]
    failures = {}
    for shape in spec.failing_shapes:
        try:
            compare(shape)
        except Exception as exc:  # noqa: BLE001 (the expected failure is the record)
            failures["x".join(map(str, shape))] = str(exc).splitlines()[0][:300]
        else:
            raise RuntimeError(f"{spec.name}: expected {shape} to fail in ORT, it ran")

    extra: dict[str, Any] = {}
    if spec.family == "gpt_oss":
        extra["clamp_active_fraction_on_reference"] = _gpt_oss_clamp_fraction(module, ref_x, cfg)

    if spec.expected_attributes is not None:
        extra["expected_fusion_check"] = expected_moe_check(
            spec.expected_attributes(cfg), module, ref_x
        )
    if spec.equivalent_attributes is not None:
        extra["equivalent_moe_attributes"] = spec.equivalent_attributes(cfg)
        extra["equivalent_moe_check"] = expected_moe_check(
            spec.equivalent_attributes(cfg), module, ref_x
        )

    hist = collections.Counter(n.op_type for n in model.graph.node)
    record = {
        "name": spec.name,
        "file": path.name,
        "file_bytes": size,
        "family": spec.family,
        "exporter": {
            "dynamo": "torch.onnx.export(module, (x,), dynamo=True, dynamic_shapes=...) (optimize=True, default opset)",
            "dynamo+transformers-table": "torch.onnx.export(..., dynamo=True, custom_translation_table="
            "transformers.exporters.exporter_onnx._ONNX_TRANSLATION_TABLE)",
            "torchscript": "torch.onnx.export(..., dynamo=False, dynamic_axes=...) (legacy TorchScript exporter)",
        }[spec.exporter],
        "exporter_kind": spec.exporter,
        "experts_implementation": spec.impl or "eager (config._experts_implementation unset)",
        "versions": versions(),
        "seed": SEED,
        "config_class": type(cfg).__name__,
        "config": jsonable(cfg.to_diff_dict()),
        "opset_import": {(o.domain or "ai.onnx"): o.version for o in model.opset_import},
        "inputs": io_record(model.graph.input),
        "outputs": io_record(model.graph.output),
        "initializers": {
            i.name: list(i.dims) for i in model.graph.initializer if math.prod(i.dims) > 4
        },
        "computes": spec.computes(cfg),
        "expected": spec.expected,
        "expected_attributes": spec.expected_attributes(cfg) if spec.expected_attributes else None,
        "expected_note": spec.expected_note,
        "kept_ops": spec.kept_ops,
        "reference": {
            "file": f"{spec.name}.npz",
            "input": {"name": "hidden_states", "shape": list(REF_SHAPE), "dtype": "float32"},
            "output": {"name": "output", "shape": list(ref_y.shape), "dtype": "float32"},
        },
        "ort_vs_torch_max_rel_err": checks,
        "ort_fails_on": failures,
        **extra,
        "op_histogram": dict(sorted(hist.items(), key=lambda kv: (-kv[1], kv[0]))),
        "node_count": len(model.graph.node),
        "spellings": spellings(model),
        "nodes": node_listing(model),
    }
    (out_dir / f"{spec.name}.json").write_text(
        json.dumps(record, indent=2) + "\n", encoding="utf-8"
    )
    return record


def _gpt_oss_clamp_fraction(module: torch.nn.Module, x: np.ndarray, cfg: Any) -> dict[str, float]:
    """How often the reference input's routed gate/up values pass the limit (the clamps matter)."""
    experts = module.block.experts
    with torch.no_grad():
        h = torch.from_numpy(x).reshape(-1, HIDDEN)
        _, _, idx = module.block.router(h)
        rows = h.repeat_interleave(idx.shape[1], dim=0)
        ids = idx.reshape(-1)
        gate_up = (
            torch.bmm(rows[:, None], experts.gate_up_proj[ids]).squeeze(1)
            + experts.gate_up_proj_bias[ids]
        )
        gate, up = gate_up[:, ::2], gate_up[:, 1::2]
    lim = cfg.swiglu_limit
    return {
        "gate_above_limit": float((gate > lim).float().mean()),
        "up_outside_limit": float((up.abs() > lim).float().mean()),
    }


def expected_moe_check(
    attrs: dict[str, Any], module: torch.nn.Module, x: np.ndarray
) -> dict[str, Any]:
    """Check a MoE with ``attrs`` computes the module's routed experts.

    Builds one ``com.microsoft.MoE`` node by hand from the module's weights and runs it in ORT CPU
    against the routed experts' PyTorch output, so the expected attributes and weight layout are
    right. (Not a rule: the fuser must find all of this in the graph.)
    """
    from onnx import TensorProto, helper

    block = module.block if isinstance(module, _FirstOutput) else module
    router = block.router if hasattr(block, "router") else block.gate
    experts = block.experts
    with torch.no_grad():
        h = torch.from_numpy(x).reshape(-1, HIDDEN)
        if type(block).__name__ == "Llama4TextMoe":
            h, logits, want, fc1, fc2 = llama4_moe_inputs(block, h)
            fc1_bias = fc2_bias = None
        else:
            logits, top_w, top_i = router(h)
            want = experts(h, top_i, top_w).numpy()
        if type(block).__name__ == "Llama4TextMoe":
            pass
        elif getattr(experts, "is_transposed", False):  # gpt-oss: [E, in, out], interleaved
            fc1 = experts.gate_up_proj.transpose(1, 2).numpy()
            fc2 = experts.down_proj.transpose(1, 2).numpy()
            fc1_bias = experts.gate_up_proj_bias.numpy()
            fc2_bias = experts.down_proj_bias.numpy()
        else:  # [E, out, in], [gate; up] halves: interleave rows (2j gate j, 2j+1 up j)
            gate_up = experts.gate_up_proj.numpy()
            inter = gate_up.shape[1] // 2
            fc1 = np.empty_like(gate_up)
            fc1[:, 0::2], fc1[:, 1::2] = gate_up[:, :inter], gate_up[:, inter:]
            fc2 = experts.down_proj.numpy()
            fc1_bias = fc2_bias = None
    inits = [
        onnx.numpy_helper.from_array(np.ascontiguousarray(fc1), "fc1"),
        onnx.numpy_helper.from_array(np.ascontiguousarray(fc2), "fc2"),
    ]
    if fc1_bias is not None:
        inits += [
            onnx.numpy_helper.from_array(fc1_bias, "fc1_bias"),
            onnx.numpy_helper.from_array(fc2_bias, "fc2_bias"),
        ]
    names = ["input", "router_probs", "fc1", "fc1_bias" if fc1_bias is not None else "", "fc2"]
    names += ["fc2_bias"] if fc2_bias is not None else []
    node = helper.make_node("MoE", names, ["output"], domain="com.microsoft", **attrs)
    tokens, n_exp = logits.shape
    graph = helper.make_graph(
        [node],
        "expected_moe",
        [
            helper.make_tensor_value_info("input", TensorProto.FLOAT, [tokens, HIDDEN]),
            helper.make_tensor_value_info("router_probs", TensorProto.FLOAT, [tokens, n_exp]),
        ],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [tokens, HIDDEN])],
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("com.microsoft", 1)]
    )
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    got = sess.run(None, {"input": h.numpy(), "router_probs": logits.numpy()})[0]
    return {
        "what": "one hand-built com.microsoft.MoE with expected_attributes, router_probs = the router's "
        "logits, run in ORT CPU on the reference input, against the routed experts' PyTorch output "
        "(without any shared expert)",
        "max_rel_err": rel_err(got, want),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="export only these")
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    names = [s.name for s in SPECS]
    unknown = [n for n in args.only or [] if n not in names]
    if unknown:
        parser.error(f"unknown model(s): {', '.join(unknown)}; known: {', '.join(names)}")
    args.out_dir.mkdir(parents=True, exist_ok=True)

    entries = []
    for spec in SPECS:
        if args.only and spec.name not in args.only:
            continue
        print(f"== {spec.name}", flush=True)
        try:
            rec = run_spec(spec, args.out_dir)
        except Exception:
            traceback.print_exc()
            return 1
        print(
            f"   {rec['file_bytes']} bytes, {rec['node_count']} nodes, errors {rec['ort_vs_torch_max_rel_err']}"
        )
        entries.append(
            {
                k: rec[k]
                for k in (
                    "name",
                    "file",
                    "family",
                    "experts_implementation",
                    "expected",
                    "file_bytes",
                )
            }
        )

    failed = []
    if not args.only:
        # The eager loop through the dynamo exporter: recorded as it fails.
        torch.manual_seed(SEED)
        module, _ = build_mixtral(None)
        err = try_dynamo_eager(SPECS[0], module.eval())
        failed.append(
            {
                "name": "mixtral_eager_dynamo",
                "what": "torch.onnx.export(MixtralSparseMoeBlock, dynamo=True) with the eager experts loop",
                "error": err or "(exported: this record is stale, update the script)",
            }
        )
        index = {
            "generator": "sample_models/export_transformers.py",
            "versions": versions(),
            "models": entries,
            "failed_exports": failed,
        }
        # export_causal_lm.py's pointer to its own index (causal_lm/index.json): kept.
        old_path = args.out_dir / "index.json"
        if old_path.exists():
            old_index = json.loads(old_path.read_text(encoding="utf-8"))
            if "causal_lm" in old_index:
                index["causal_lm"] = old_index["causal_lm"]
        (args.out_dir / "index.json").write_text(
            json.dumps(index, indent=2) + "\n", encoding="utf-8"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
