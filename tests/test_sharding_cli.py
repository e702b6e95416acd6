"""`--mesh` on the CLI: sharded logits and greedy tokens equal the single-device results."""
import json

import numpy as np
import pytest

from ling_jax.checkpoint.synthetic_config import synthetic_config
from ling_jax.checkpoint.writer import write_checkpoint
from ling_jax.cli import main as cli_main


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("mesh") / "ck")
    write_checkpoint(synthetic_config(num_hidden_layers=4), d, dtype="fp8", seed=5, progress=False)
    return d


@pytest.mark.parametrize("mesh", ["expert=4,model=2", "data=1,expert=8", "data=2,model=4"])
def test_cli_logits_and_generate_on_mesh(ckpt, tmp_path, capsys, mesh):
    ref, got = tmp_path / "ref.npz", tmp_path / "got.npz"
    ids = "5,17,3,99,42,7"
    assert cli_main(["logits", "--checkpoint", ckpt, "--input-ids", ids, "--out", str(ref), "--mtp"]) == 0
    assert cli_main(["logits", "--checkpoint", ckpt, "--input-ids", ids, "--out", str(got), "--mtp",
                     "--mesh", mesh]) == 0
    a, b = np.load(ref), np.load(got)
    for k in ("logits", "mtp_logits"):
        assert np.linalg.norm(a[k] - b[k]) / np.linalg.norm(a[k]) < 1e-5
    capsys.readouterr()
    base = ["generate", "--checkpoint", ckpt, "--input-ids", ids, "--max-new-tokens", "8", "--json",
            "--stop-ids", "511"]
    assert cli_main(base) == 0
    one = json.loads(capsys.readouterr().out)
    assert cli_main(base + ["--mesh", mesh]) == 0
    sharded = json.loads(capsys.readouterr().out)
    assert sharded["token_ids"] == one["token_ids"]
