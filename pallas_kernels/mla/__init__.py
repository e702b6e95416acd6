"""Absorbed-MLA latent attention: XLA reference (`reference.py`) and the flash-decoding Pallas
kernel (`kernel.py`)."""
