"""notebooks/explore_ling.ipynb runs end to end (every cell, in a fresh kernel, from notebooks/).

Any cell error fails the test (nbclient raises CellExecutionError with the cell's traceback). The
demo checkpoint cache goes to a temporary directory, so a random fallback model is never written to
the home directory.
"""
import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "notebooks")
NOTEBOOK = os.path.join(NOTEBOOKS, "explore_ling.ipynb")
CELL_TIMEOUT_S = 300


def test_notebook_is_stored_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


@pytest.mark.slow
def test_explore_ling_notebook_executes(tmp_path, monkeypatch):
    monkeypatch.setenv("LING_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LING_JAX_CHECKPOINT", raising=False)
    # the kernel runs like a user's session: one CPU device, not the 8 simulated ones of conftest.py
    flags = os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "").strip()
    monkeypatch.setenv("XLA_FLAGS", flags)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, startup_timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": NOTEBOOKS}})
    client.execute()  # raises CellExecutionError on the first failing cell
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs
                   if o.output_type == "stream")
    assert "output == plain greedy output: True" in text
    assert "MLA latents outgrow the KDA states" in text
