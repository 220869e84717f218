"""Plain numpy reference implementations (oracles), kept apart from the WebGPU kernels."""
