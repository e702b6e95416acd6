"""FP8 block-scaled linear: block-grid convention (`blocks.py`), XLA reference (`reference.py`) and
the Pallas kernel (`kernel.py`)."""
