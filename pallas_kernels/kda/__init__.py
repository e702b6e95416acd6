"""Kimi Delta Attention's gated delta rule: XLA reference (`reference.py`) and Pallas kernels
(`chunk_kernel.py` for chunked prefill, `step_kernel.py` for token-by-token decode)."""
