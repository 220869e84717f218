"""WebGPU kernels described by JSON manifests, and the runtime that runs them."""
