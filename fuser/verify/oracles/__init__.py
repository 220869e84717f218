"""Plain numpy reference implementations (oracles), kept apart from the WebGPU kernels.

* :mod:`.grouped_matmul`: ONNX ``GroupedMatMul`` (opset 29).
* :mod:`.moe`: ORT ``com.microsoft.MoE`` and ``com.microsoft.QMoE`` (its routing in
  :mod:`.moe_routing`, activations in :mod:`.moe_activation`, argument checks in
  :mod:`.moe_checks`).
* :mod:`.matmul_nbits_qkv`: RMSNorm, ``MatMulNBits`` and ``com.microsoft.MatMulNBitsQkv``.
* :mod:`.quant`: symmetric quantisation of QMoE / MatMulNBits weights and its inverse (the
  packing itself is the contract's, :mod:`onnx_moe_fuse.contract.packing`, re-exported there).
* :mod:`.kernel_calls`: the above keyed by kernel bind keys (``KERNEL_ORACLES``), as the kernel
  tests, the benchmarks and the self-check call them.

Conventions and what was measured against ONNX Runtime: ``docs/oracles.md``.

The submodules are not re-exported here: three of them share a name with their main function
(``moe.moe``, ``grouped_matmul.grouped_matmul``, ``matmul_nbits_qkv.matmul_nbits_qkv``), and
re-exporting the function would hide the module. Import from the submodule.
"""
