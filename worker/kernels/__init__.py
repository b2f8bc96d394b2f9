"""Fused GPU kernels (Triton), each beside a pure-PyTorch reference in `resident.worker.layers`.

Pick them through `resident.worker.kernels.dispatch.get_kernels(device, backend)`; the
modules here import triton at import time, so import them only where triton exists.
"""
