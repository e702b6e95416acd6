"""The shipped demo model (ling_jax/demo_model/, trained by tools/train_demo.py --ship)."""
import glob
import json
import os

import numpy as np
import pytest

from ling_jax.commands.demo import SHIPPED, demo_checkpoint


def _results():
    with open(os.path.join(SHIPPED, "demo_results.json")) as f:
        return json.load(f)


def test_shipped_demo_model_has_every_feature_in_release_layout():
    from ling_jax.checkpoint.reader import CheckpointReader
    from ling_jax.config import KDA, MLA, LingConfig

    assert demo_checkpoint(verbose=False) == SHIPPED
    cfg = LingConfig.from_json(os.path.join(SHIPPED, "config.json"))
    types = cfg.layer_types
    g = cfg.layer_group_size
    assert KDA in types and MLA in types
    assert cfg.num_hidden_layers % g != 0 and all(t == MLA for t in types[(cfg.num_hidden_layers // g) * g:])
    assert not cfg.is_moe(0) and cfg.is_moe(cfg.num_hidden_layers - 1)
    assert cfg.n_group > 1 and cfg.topk_group < cfg.n_group and cfg.num_shared_experts >= 1
    assert any(cfg.swiglu_limits(i) != (0.0, 0.0) for i in range(cfg.num_hidden_layers))
    assert cfg.has_mtp
    reader = CheckpointReader(SHIPPED)
    names = reader.names()
    fp8 = [n for n in names if reader.info(n).dtype == "F8_E4M3"]
    assert fp8 and all(n[:-len("weight")] + "weight_scale_inv" in names for n in fp8)
    assert os.path.isfile(os.path.join(SHIPPED, "tokenizer.json"))
    size = sum(os.path.getsize(f) for f in glob.glob(os.path.join(SHIPPED, "*")))
    assert size < 12e6  # "a few MB"


def test_demo_cli_generates_from_the_shipped_model(capsys):
    from ling_jax.cli import main

    assert main(["demo", "--prompt", "def ", "--max-new-tokens", "12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["token_ids"]) >= 1 and isinstance(out["text"], str)


def _distinct_line_ratio(text):
    lines = [line.strip() for line in text.split("\n") if line.strip()]
    return len(set(lines)) / len(lines)


def test_demo_default_sampling_is_not_degenerate(capsys):
    """Greedy decoding loops on the demo model (`import os` -> `import sys` over and over); the
    demo's default sampling (temperature 0.7, top-p 0.9, frequency penalty 0.3, seed 0) does not:
    distinct-line ratio of 100 new tokens >= 0.8, against < 0.5 greedy."""
    from ling_jax.cli import main

    def text(*extra):
        assert main(["demo", "--prompt", "import os", "--max-new-tokens", "100", "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"]

    greedy = text("--greedy")
    assert _distinct_line_ratio(greedy) < 0.5, greedy
    default = text()
    assert len(default.split("\n")) >= 6 and _distinct_line_ratio(default) >= 0.8, default
    assert text() == default  # the fixed seed makes it reproducible


@pytest.mark.slow
def test_demo_model_beats_unigram_on_held_out_text():
    """Held-out perplexity (stdlib textwrap.py, excluded from training) is far below a unigram
    model of the training corpus (add-one smoothed, computed here independently), and equals
    the figure recorded in demo_results.json (and the README)."""
    import textwrap

    from ling_jax.commands.eval import perplexity
    from ling_jax.loader import load_model
    from ling_jax.tokenizer import Tokenizer

    res = _results()
    tok = Tokenizer.from_dir(SHIPPED)
    held_out = textwrap.__file__
    assert os.path.basename(held_out) == res["held_out_file"]
    with open(held_out, encoding="utf-8") as f:
        ids = tok.encode(f.read())
    lib = os.path.dirname(os.__file__)
    counts = np.ones(tok.backend.get_vocab_size(), np.float64)
    for path in sorted(glob.glob(os.path.join(lib, "*.py"))):
        if os.path.abspath(path) == os.path.abspath(held_out):
            continue
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", errors="replace")
        counts += np.bincount(tok.encode(text), minlength=len(counts))[:len(counts)]
    p = counts / counts.sum()
    unigram = float(np.exp(-np.log(p[np.asarray(ids[1:])]).mean()))
    model = load_model(SHIPPED, "float32", with_mtp=False, progress=False)
    ppl = perplexity(model, ids)["perplexity"]
    assert ppl < 0.5 * unigram, (ppl, unigram)
    assert ppl == pytest.approx(res["perplexity"], rel=1e-3)
    assert unigram == pytest.approx(res["unigram_perplexity"], rel=1e-2)


def test_generate_cli_penalty_and_logprobs_flags(capsys):
    """`ling-jax generate --logprobs N --json` prints each new token's logprob and the top N of the
    raw distribution; a penalty out of range is one error line naming the flag."""
    from ling_jax.cli import main

    base = ["generate", "--checkpoint", SHIPPED, "--prompt", "import os", "--max-new-tokens", "4", "--json"]
    assert main(base + ["--logprobs", "2", "--frequency-penalty", "0.5"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["logprobs"]) == len(out["token_ids"]) == 4
    for tok, entry in zip(out["token_ids"], out["logprobs"]):
        (i0, v0), (i1, v1) = entry["top"]
        assert 0.0 >= v0 >= v1 and v0 >= entry["logprob"]
        if tok in (i0, i1):
            assert entry["logprob"] == (v0 if tok == i0 else v1)
    assert main(base + ["--presence-penalty", "3"]) == 2
    assert "error: --presence-penalty: presence_penalty must be a number in [-2, 2]" in capsys.readouterr().err
    assert main(base + ["--logprobs", "21"]) == 2
    assert "--logprobs must be <= 20" in capsys.readouterr().err
