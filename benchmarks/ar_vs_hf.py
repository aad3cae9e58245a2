"""Our plain decoding (the AR loop every speedup is measured over) against HF ``generate()`` on the same prompts,
interleaved, per verifier and dtype (benchmark, not a test); with ``--baseline REF``, our AR loop as it was at a
git commit decodes beside them (the decoder modules of REF's ``eval/``, imported from a temporary copy).

Each repeat decodes every prompt once with each decoder, prompt by prompt, the decoders' order rotated from one
prompt to the next, so that the machine's drift falls on all alike. Reported per decoder: tokens/s (prefill
included) and decode ms per token (the tokens after the prefill's), median and range over the repeats; the ratios
per repeat (ours over HF, ours over the baseline); and how many turns each decoder's tokens share with ours::

    python benchmarks/ar_vs_hf.py --verifiers bundled:tinyshakespeare bundled:smollm2 \\
        --prompts bundled:tinyshakespeare $D/prompts/mt_bench.jsonl --dtypes bfloat16 float32 \\
        [--num_prompts 3] [--max_new_tokens 128] [--repeats 3] [--baseline HEAD] [--out docs/results/ar_vs_hf.json]

Prints a table and writes the JSON (with the command and the CPU); its path is the last line printed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import importlib.util
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

import torch

from spectrain.eval.decode import generate
from spectrain.eval.decode_dtype import cpu_line, cpu_record
from spectrain.eval.drafters import Autoregressive
from spectrain.eval.prompts import BUNDLED, load_prompts
from spectrain.eval.runs import HFGenerate, encode_turn, eos_ids, speed_on, turn_record
from spectrain.eval.settings import EvalSettings
from spectrain.eval.static_model import StaticCausalLM
from spectrain.heads.errors import SpectrainError, run_command
from spectrain.heads.report import finish, format_table, median_range
from spectrain.heads.verifier import load_verifier

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
REPO = Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ar_vs_hf.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--verifiers", nargs="+", default=["bundled:tinyshakespeare"])
    p.add_argument("--prompts", nargs="+", default=[BUNDLED],
                   help="one prompt file for every verifier, or one per verifier (MT-bench jsonl, or bundled)")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=sorted(DTYPES))
    p.add_argument("--num_prompts", type=int, default=3)
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline", default=None, metavar="REF", help="also our AR loop at this git commit")
    p.add_argument("--out", default="runs/bench/ar_vs_hf.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    run_command(run, parse_args(argv), shlex.join(["python", "benchmarks/ar_vs_hf.py", *argv]))


def baseline_decoder(ref: str):
    """REF's ``eval/`` as a package of its own (its ``spectrain.eval`` imports pointed at it); its decode module."""
    try:
        commit = subprocess.run(["git", "rev-parse", ref], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.strip()
        archive = subprocess.run(["git", "archive", commit, "eval"], cwd=REPO, capture_output=True, check=True).stdout
    except subprocess.CalledProcessError as e:
        raise SpectrainError(f"--baseline {ref}: not a commit of {REPO} ({e.stderr.strip()})") from None
    name = f"spectrain_eval_{commit[:10]}"
    root = Path(tempfile.mkdtemp(prefix="ar_vs_hf_"))
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(root, filter="data")
    (root / "eval").rename(root / name)
    for path in (root / name).glob("*.py"):
        path.write_text(path.read_text().replace("spectrain.eval.", f"{name}."))
    # imported as a package found in ``root`` alone, registered by name: nothing added to sys.path
    spec = importlib.machinery.PathFinder.find_spec(name, [str(root)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    return importlib.import_module(f"{name}.decode"), commit


def decoders(verifier, dtype, settings: EvalSettings, max_len: int, baseline):
    """name -> ``decode(ids) -> turn record``: ours, the baseline's (when given) and HF ``generate()``'s."""
    model, eos = verifier.model, eos_ids(verifier.tokenizer)
    runner = StaticCausalLM(model, max_len=max_len)
    out = {"ours": lambda ids: turn_record(ids, generate(runner, Autoregressive(), ids, settings.max_new_tokens,
                                                         eos_ids=eos))}
    if baseline is not None:
        old = baseline.StaticCausalLM(model, max_len=max_len)
        drafter = importlib.import_module(baseline.__name__.rsplit(".", 1)[0] + ".drafters").Autoregressive()
        out["baseline"] = lambda ids: turn_record(ids, baseline.generate(old, drafter, ids, settings.max_new_tokens,
                                                                         eos_ids=eos))
    hf = HFGenerate(model, verifier.tokenizer, settings, prompts=0)
    out["hf_generate"] = lambda ids: hf.decode(ids, settings.max_new_tokens)
    return out, runner


def measure(verifier_name: str, prompts_spec: str, dtype: str, args, baseline) -> dict:
    verifier = load_verifier(verifier_name, dtype=DTYPES[dtype])
    tokenizer = verifier.tokenizer
    use_template = prompts_spec != BUNDLED and bool(getattr(tokenizer, "chat_template", None))
    prompts = load_prompts(prompts_spec, args.num_prompts, tokenizer, first_turns=True)
    ids = [encode_turn(tokenizer, [{"role": "user", "content": p[0]}], use_template) for p in prompts]
    settings = EvalSettings(max_new_tokens=args.max_new_tokens)
    # the cache spectrain-eval sizes for these prompts (a chain of 4 beside AR)
    max_len = max(len(x) for x in ids) + args.max_new_tokens + 16 + 80
    run_of, runner = decoders(verifier, dtype, settings, max_len, baseline)
    names = list(run_of)
    for name in names:  # warm-up, untimed
        run_of[name](ids[0])
    repeats = []
    for r in range(args.repeats):
        records = {name: [] for name in names}
        for i, x in enumerate(ids):
            shift = (r + i) % len(names)
            for name in names[shift:] + names[:shift]:
                records[name].append({"prompt": i, "turns": [run_of[name](x)]})
        repeats.append(records)
    speeds = [{name: speed_on(rec[name], len(ids)) for name in names} for rec in repeats]
    out = {"verifier": verifier_name, "prompts": prompts_spec, "num_prompts": len(ids), "dtype": dtype,
           "batch_invariant": runner.batch_invariant, "max_len": max_len, "fused_packed_weights": runner.weights.copied,
           "decoders": {name: {key: median_range([s[name][key] for s in speeds])
                               for key in ("tokens_per_second", "decode_ms_per_token")} for name in names},
           "ratios": {}, "identical_turns_to_ours": {}}
    for other in names[1:]:  # ours over each other decoder, decode ms per token, per repeat
        out["ratios"][f"ours_over_{other}"] = median_range(
            [s[other]["decode_ms_per_token"] / s["ours"]["decode_ms_per_token"] for s in speeds], 3)
        out["identical_turns_to_ours"][other] = sum(
            a["turns"][0]["tokens"] == b["turns"][0]["tokens"] for rec in repeats
            for a, b in zip(rec["ours"], rec[other])) / args.repeats
    if "baseline" in names:
        out["ratios"]["baseline_over_hf_generate"] = median_range(
            [s["hf_generate"]["decode_ms_per_token"] / s["baseline"]["decode_ms_per_token"] for s in speeds], 3)
    return out


def run(args: argparse.Namespace, command: str) -> Path:
    if len(args.prompts) not in (1, len(args.verifiers)):
        raise SpectrainError("--prompts takes one prompt file for every verifier, or one per verifier")
    prompts = args.prompts * len(args.verifiers) if len(args.prompts) == 1 else args.prompts
    baseline, commit = baseline_decoder(args.baseline) if args.baseline else (None, None)
    runs = [measure(v, p, dtype, args, baseline) for v, p in zip(args.verifiers, prompts) for dtype in args.dtypes]
    cpu = cpu_record()
    summary = {"command": command, "date": time.strftime("%Y-%m-%d"), "cpu": cpu, "torch": torch.__version__,
               "transformers": importlib.import_module("transformers").__version__, "baseline": args.baseline,
               "baseline_commit": commit, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "runs": runs}
    rows = []
    for r in runs:
        for name, d in r["decoders"].items():
            ratio = r["ratios"].get(f"ours_over_{name}")
            rows.append([r["verifier"], r["dtype"], name, d["tokens_per_second"]["median"],
                         d["decode_ms_per_token"]["median"],
                         f"{d['decode_ms_per_token']['min']}-{d['decode_ms_per_token']['max']}",
                         "-" if ratio is None else f"{ratio['median']} ({ratio['min']}-{ratio['max']})",
                         r["identical_turns_to_ours"].get(name, "-")])
    table = format_table(["verifier", "dtype", "decoder", "tok/s", "ms/token", "ms/token range", "ours faster by",
                          "same turns as ours"], rows,
                         title=f"our AR vs HF generate(), interleaved, {args.repeats} repeats — {cpu_line(cpu)}")
    return finish(summary, args.out, tables=[table])


if __name__ == "__main__":
    main()
