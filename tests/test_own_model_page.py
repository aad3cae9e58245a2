"""docs/own-model.md, run as a newcomer would, in order, on a tiny stand-in of the verifier on CPU.

The page's commands run through ``python benchmarks/doc_commands.py --run`` (bash, one environment, in order,
stopping at the first failure) in a scratch directory that holds the repository's ``configs/`` and ``benchmarks/``.
What changes is scale only, each replacement named in :data:`TINY`: the page's verifier is a random 8-layer Llama
with the tiny tokenizer, ``vllm serve`` is an in-process OpenAI-compatible engine answering with that verifier's own
greedy replies (``tests/fake_engine.py``), and the caps, block size, steps and prompts shrink. Commands that need
the network, a GPU or an engine that is not here are reported as skipped (:data:`SKIP`); the llama.cpp steps run
where ``SPECTRAIN_LLAMA_CPP`` names a llama.cpp build (as in ``tests/test_llama_cpp.py``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spectrain.heads.verifier import load_verifier
from tests.fake_engine import FakeEngine

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "own-model.md"
# The page's values at full scale -> the tiny run's (plain text replacements, applied to every command).
TINY = {
    "--dtype bfloat16 --data": "--dtype float32 --data",  # the stand-in engine serves fp32
    "--max_new_tokens 2048 --max_prompt_tokens 2048 --block_size 4096 --in_flight 64":
        "--max_new_tokens 12 --max_prompt_tokens 200 --block_size 160 --in_flight 2",
    "--data.path replies.jsonl --run_dir runs/my-drafter":
        "--data.path replies.jsonl --run_dir runs/my-drafter --data.block_size 160 "
        "--trainer.max_steps 2 --trainer.accelerator cpu --trainer.precision 32-true --trainer.val_check_interval 2 "
        "--trainer.limit_val_batches 1 --logger none",
    "--block_size 4096 --layer_ids auto": "--block_size 160 --layer_ids auto",
    "--num_prompts 16 --k 5": "--num_prompts 2 --k 3 --max_new_tokens 12 --dtype float32",
    # The engine checks' controls and mistaken files tell a broken load apart only where a trained drafter accepts
    # tokens over enough prompts (the committed SmolLM2 checks); a 2-step drafter is checked as itself: τ in the
    # engine equals ours, outputs equal plain greedy, the layers the engine resolved are the drafter's.
    "--prompts mt_bench.jsonl --k 4": "--prompts mt_bench.jsonl --k 3 --num_prompts 2 --max_new_tokens 16 --no_controls",
}
SKIP = [r"^pip install", r"load_dataset", r"^vllm serve", r"sglang", r"quickstart_advanced", r"^torchrun",
        r"--trainer\.devices 8", r"engine_check\.py", r"^llama-server"]
LLAMA_CPP_STEPS = [r"LLAMA_CPP", r"--format gguf"]


def tiny_chat(path: Path, n: int) -> None:
    """ShareGPT-style prompts (the replies are regenerated), as the page's UltraChat file holds them."""
    words = "the king sat on a green hill and the queen spoke of rivers birds and night".split()
    rows = [{"messages": [{"role": "user", "content": " ".join(words[(i + k) % len(words)] for k in range(6 + i % 5))},
                          {"role": "assistant", "content": "an old reply"}]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def stand_in(out: Path) -> Path:
    """A random 8-layer Llama with SmolLM2-135M-Instruct's tokenizer and chat template (``bundled:smollm2``): a
    real chat template, 49,152 tokens (the recipe's 32,000-token draft vocabulary fits) and a tokenizer llama.cpp's
    converter recognizes; 4,096 positions, so the recipe's block fits its context."""
    from transformers import AutoTokenizer

    from spectrain.heads.verifier import resolve_verifier
    from tests.conftest import make_verifier

    tokenizer = AutoTokenizer.from_pretrained(resolve_verifier("bundled:smollm2"))
    make_verifier("llama", False, len(tokenizer), hidden=32, layers=8, max_pos=4096).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.integration
def test_the_page_runs_in_order_on_a_stand_in(tmp_path):
    verifier_dir = stand_in(tmp_path / "stand-in")
    work = tmp_path / "work"
    work.mkdir()
    for name in ("configs", "benchmarks"):
        os.symlink(ROOT / name, work / name)
    (work / "docs").mkdir()
    (work / "docs" / "own-model.md").write_text(PAGE.read_text())
    tiny_chat(work / "ultrachat.jsonl", 24)
    (work / "mt_bench.jsonl").write_text("".join(json.dumps({"turns": [f"tell me of the king {i}"]}) + "\n"
                                                 for i in range(3)))
    engine = FakeEngine(load_verifier(str(verifier_dir), dtype="float32"), name="stand-in")
    llama_cpp = os.environ.get("SPECTRAIN_LLAMA_CPP")
    values = {"meta-llama/Llama-3.1-8B-Instruct": str(verifier_dir), "http://127.0.0.1:8000/v1": engine.url + "/v1",
              **TINY, **({"LLAMA_CPP": llama_cpp} if llama_cpp else {})}
    argv = [sys.executable, str(ROOT / "benchmarks" / "doc_commands.py"), "--run", "docs/own-model.md",
            "--workdir", str(work), "--timeout", "900", "--out", str(tmp_path / "doc_commands")]
    argv += [f"--set={placeholder}={value}" for placeholder, value in values.items()]  # replaced in this order
    argv += [f"--skip={pattern}" for pattern in SKIP + ([] if llama_cpp else LLAMA_CPP_STEPS)]
    try:  # the stand-in engine answers from this process while the page's commands run
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    finally:
        engine.close()
    record = tmp_path / "doc_commands" / "run.json"
    assert record.is_file(), proc.stderr[-3000:]
    rows = json.loads(record.read_text())["rows"]
    failed = [r for r in rows if not r["ok"]]
    assert not failed, f"{failed[0]['command']}\n{failed[0]['stderr_tail']}"
    assert proc.returncode == 0, proc.stderr[-3000:]
    ran = [r["command"] for r in rows if r["last_line"] != "skipped (--skip)"]
    # Every step a newcomer takes on CPU ran: fit check, replies from the engine, store size, training,
    # evaluation, export (and the llama.cpp file and check where llama.cpp is built).
    for step in (r"--dry_run true", r"^spectrain-distill --server", r"^spectrain-extract .*--dry_run",
                 r"^spectrain-train .*--run_dir runs/my-drafter", r"^spectrain-eval", r"--format eagle3"):
        assert any(re.search(step, c) for c in ran), f"no command ran for {step}"
    assert engine.completions > 0  # the replies came from the engine
    summary = json.loads((work / "replies.jsonl.summary.json").read_text())
    assert summary["served"]["verifier_check"]["endpoints"] and summary["truncation"]["block_size"] == 160
    assert json.loads((work / "runs" / "my-drafter" / "summary.json").read_text())["steps"] == 2
    assert (work / "runs" / "my-drafter" / "export" / "eagle3" / "model.safetensors").is_file()
    if llama_cpp:  # the drafter served by llama.cpp beside the verifier's own GGUF, and checked there
        check = json.loads((work / "runs" / "llama_cpp_check" / "llama_cpp_check.json").read_text())
        drafter = check["drafters"][0]
        assert check["all_ok"] and drafter["ok"] and drafter["engine_layers"] == drafter["expected_layers"]
        assert (work / "my-drafter.gguf").is_file()
