"""llama.cpp engine check (benchmark, not a test): do our GGUF drafters load in llama.cpp and accept what we measured?

    python benchmarks/llama_cpp_check.py --llama_cpp LLAMA_CPP_DIR --verifier bundled:smollm2 \\
        --drafter eagle3=pretrained/smollm2-eagle3 --prompts mt_bench.jsonl --num_prompts 6 --k 4

The target is the verifier re-encoded as an f32 GGUF (``spectrain-verifier-gguf``'s code: for ``bundled:smollm2``
the very weights our loop decodes with), so llama.cpp's kernels are the only difference between the two sides.
For every drafter (EAGLE-3, DFlash or DSpark) it (1) writes the GGUF with ``spectrain-export --format gguf``'s code
(validated), (2) measures τ and α with our evaluator on the same first turns (fp32, T = 0, chain of ``--k``, a
block drafter's whole block, the chat template: the prompt token ids llama.cpp gets are ours), (3) runs
``llama-server`` on loopback without a draft and with it (``--spec-type draft-eagle3`` / ``draft-dflash`` /
``draft-dspark``, ``--spec-draft-n-max K --spec-draft-p-min 0``: every round drafts K, as ours does) and reads
each completion's tokens and llama.cpp's own ``draft_n`` / ``draft_n_accepted``. The server has two slots and
gets the prompts two at a time, each beside a different prompt (``--server_slots 1``: one at a time), as a server
with several users decodes them; the draft is sampled on the CPU (``--no-spec-draft-backend-sampling``, our
serving advice: with llama.cpp's default backend sampling one slot drafts among the other's candidates,
``benchmarks/llama_cpp_slots.py``; ``--draft_backend_sampling on`` checks that default).

The verdict (``spectrain.eval.engine_verdicts.llama_cpp_verdict``, tested): llama.cpp's speculative output equals its plain greedy output on every
prompt; τ (tokens per target forward, prefill excluded: ``rounds = generated − 1 − accepted``) within
``--tolerance`` of ours. Why a band and not equality: both sides run fp32, but llama.cpp's matmuls accumulate in
another order (and its attention in another kernel), so logits differ by ~1e-6 relative; where the drafter's top two
are closer than that a draft differs, and where the *target's* are, the text parts and the contexts drafted on
differ from then on. Neither is a loss of correctness; both are rare, so τ agrees to a few percent, not exactly.

Controls guard against a draft that loads but is read differently than we think:

- ``control-eagle3``, acceptance known exactly: a drafter that proposes one token at every step *only through d2t*
  (its head scores draft id 0 above all others by a positive margin built from SwiGLU squares, n² > 0,
  and d2t maps draft id 0 to ``--control_token``). Its accepted count follows from llama.cpp's own greedy output
  (runs of that token) and must equal it exactly (``spectrain.eval.engine_controls.predicted_acceptance``); ours is
  checked the same way against our greedy output.
- ``control-dflash``: a block drafter that proposes the token in every slot through the mask token's embedding
  (``spectrain.eval.engine_controls.dflash_control``), predicted the same way: llama.cpp must read the mask token, the final
  norm and the block layout as we do, and borrow the target's embeddings and head.
- two mistaken exports of each trained EAGLE-3 that must be *caught* (τ outside the tolerance): ``wrong-layers``
  (target layers shifted by one, the ids an off-by-one in the capture convention would write) and ``wrong-d2t``
  (the draft→target map rolled by one id). A mistake τ does not see is reported as not caught and fails the check
  (the layers llama.cpp's loader resolved, read from its log, are recorded beside it: they only echo the file).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from spectrain.eval.decode_dtype import cpu_record
from spectrain.eval.engine_compare import (f32_target, first_turns, generation_eos, our_tau, partings, path_spread,
                                           strip_eos)
from spectrain.eval.engine_controls import dflash_control, eagle3_control, mistaken_gguf
from spectrain.eval.engine_verdicts import llama_cpp_verdict
from spectrain.eval.families import evaluator_of
from spectrain.eval.layer_probe import choose_probe, default_probe_layers, layer_probe, probe_prediction
from spectrain.eval.llama_cpp_server import (LLAMA_CPP_VERSION, LlamaServer, binary_version, find_binary,
                                             resolved_layers, rounds_and_tau)
from spectrain.eval.llama_cpp_slots import NO_BACKEND_SAMPLING, paired_completions
from spectrain.heads.serving.dflash_gguf import write_dflash_gguf
from spectrain.heads.serving.eagle_gguf import ARCH, write_eagle3_gguf
from spectrain.heads.errors import SpectrainError, run_command
from spectrain.heads.serving.cli import target_gguf_for
from spectrain.heads.families import family_of
from spectrain.heads.serving.formats import import_drafter, method_of
from spectrain.heads.serving.gguf import write_draft_gguf
from spectrain.heads.serving.llama_cpp import read_metadata
from spectrain.heads.report import finish, format_table
from spectrain.heads.verifier import load_verifier, resolve_verifier


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/llama_cpp_check.py", description=__doc__.split("\n")[0])
    p.add_argument("--llama_cpp", default=None, help="directory with llama-server (or a llama.cpp tree with build/bin)")
    p.add_argument("--verifier", default="bundled:smollm2")
    p.add_argument("--source_gguf", default=None, help="the verifier's GGUF to re-encode as the f32 target "
                                                      "(default: found for bundled:smollm2)")
    p.add_argument("--drafter", action="append", default=[], metavar="NAME=DIR",
                   help="an EAGLE-3, DFlash or DSpark drafter; repeat")
    p.add_argument("--prompts", required=True, help="MT-bench / Alpaca jsonl (the first turn of each row is used)")
    p.add_argument("--num_prompts", type=int, default=6)
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=4, help="draft length (--spec-draft-n-max; our chain length)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv_cache", default="f32", choices=["f32", "f16", "bf16", "q8_0"],
                   help="llama.cpp's KV cache type for target and draft (llama.cpp's default is f16: keys and values "
                        "rounded to half precision, another numeric difference from our fp32 loop)")
    p.add_argument("--control_token", default=" the", help="text of the token the control always proposes")
    p.add_argument("--no_controls", action="store_true")
    p.add_argument("--controls", default="eagle3,dflash,probe",
                   help="which controls run (eagle3, dflash, probe: the EAGLE-3 layer probes and their shifted twins)")
    p.add_argument("--probe_slots", default="0,1,2", help="the aux slots a layer probe reads, one probe each")
    p.add_argument("--server_slots", type=int, default=2, choices=[1, 2],
                   help="llama-server's slots (-np); at 2, prompts are decoded two at a time beside a different "
                        "prompt, as a server with several users decodes them")
    p.add_argument("--draft_backend_sampling", default="off", choices=["off", "on"],
                   help="the draft's backend sampling (llama.cpp's default is on; off is our serving advice at "
                        "several slots: docs/export.md, 'Several slots')")
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--near_tie", type=float, default=1e-3,
                   help="a prompt whose speculative output parts from plain passes when llama.cpp's own plain-path "
                        "margin between the two tokens is at most this (nats) or at most twice the largest "
                        "difference of one token's log-probability between llama.cpp's plain and speculative paths "
                        "in the same run (measured, recorded as kernel_spread)")
    p.add_argument("--near_tie_max", type=float, default=0.01,
                   help="nats: paths that differ by more than this on one token's log-probability are not kernel "
                        "noise (the drafter's row fails), and no parting above it passes as a near-tie")
    p.add_argument("--out", default="runs/llama_cpp_check")
    return p.parse_args(argv)


# -- the check --------------------------------------------------------------------------------------------------
def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    run_command(run, parse_args(argv), shlex.join(["python", "benchmarks/llama_cpp_check.py", *argv]))


def run(args, command: str = "") -> Path:
    start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server = find_binary("llama-server", args.llama_cpp)
    verifier_dir = resolve_verifier(args.verifier)
    loaded = load_verifier(verifier_dir, dtype="float32")
    verifier, tokenizer = loaded.model, loaded.tokenizer
    eos = generation_eos(verifier)
    source = Path(args.source_gguf) if args.source_gguf else target_gguf_for(args.verifier)
    target = f32_target(args.verifier, source, out)
    prompts = first_turns(args.prompts, args.num_prompts, out / "prompts.json", tokenizer)
    layers = verifier.config.num_hidden_layers
    controls = [] if args.no_controls else [c.strip() for c in args.controls.split(",") if c.strip()]
    unknown = [c for c in controls if c not in ("eagle3", "dflash", "probe")]
    if unknown:
        raise SpectrainError(f"--controls: unknown control {unknown[0]!r} (eagle3, dflash, probe)")
    probing = "probe" in controls
    try:
        probe_slots = [int(x) for x in args.probe_slots.split(",") if x.strip()] if probing else []
    except ValueError:
        raise SpectrainError(f"--probe_slots expects slot numbers like 0,1,2, got {args.probe_slots!r}") from None

    # (name, method, our drafter dir or None, gguf, info); a block drafter's k is its drafts per block
    drafters = []
    for spec in args.drafter:
        if "=" not in spec:
            raise SpectrainError(f"--drafter expects NAME=DIR, got {spec!r}")
        name, path = spec.split("=", 1)
        drafter = import_drafter(path, verifier_model=verifier)
        method = method_of(drafter)
        good = out / "gguf" / f"{name}.gguf"
        try:  # the file its family writes, and the flags that serve it
            serve = shlex.split(write_draft_gguf(drafter, good, source, force=True))
        except SpectrainError as why:
            raise SpectrainError(f"{name}: {why}") from None
        expected = list(evaluator_of(family_of(drafter)).capture(drafter))  # the layers it reads
        info = {"source": path, "spec_type": serve[serve.index("--spec-type") + 1], "expected_layers": expected}
        if "--spec-draft-n-max" in serve:  # a block drafter drafts its whole block
            info["k"] = int(serve[serve.index("--spec-draft-n-max") + 1])
        drafters.append((name, method, Path(path), good, info))
        if not args.no_controls and read_metadata(good)["general.architecture"].value == ARCH:  # a vocabulary
            # map and target layers in the file: one copy with each wrong
            for mistake in ("layers", "d2t"):
                wrong = mistaken_gguf(good, out / "gguf" / f"{name}-wrong-{mistake}.gguf", mistake, layers)
                drafters.append((f"{name}-wrong-{mistake}", method, None, wrong,
                                 {"must_differ": mistake, "of": name, "expected_layers": expected,
                                  **({"informational": True} if mistake == "layers" and probing else {})}))
    token = tokenizer(args.control_token, add_special_tokens=False)["input_ids"]
    if len(token) != 1:
        raise SpectrainError(f"--control_token {args.control_token!r} is {len(token)} tokens, not one")
    token = token[0]
    for kind in controls:
        if kind == "probe":
            continue  # built from llama.cpp's plain text, below
        control_dir = out / f"control-{kind}"
        if kind == "eagle3":
            control = eagle3_control(verifier, token)
            write = write_eagle3_gguf
            info = {"expected_layers": list(control.config.aux_layer_ids)}
        else:  # proposes the token in every slot through the mask token's embedding
            control = dflash_control(verifier, tokenizer, token, args.k)
            write = write_dflash_gguf
            info = {"k": control.config.drafts, "expected_layers": list(control.config.capture_ids)}
        control.save_pretrained(control_dir)
        drafters.append((f"control-{kind}", kind, control_dir,
                         write(control, out / "gguf" / f"control-{kind}.gguf", source, force=True),
                         {"control_token": token, **info}))
    if not drafters and not probing:
        raise SpectrainError("nothing to check: pass --drafter or drop --no_controls")

    ours = {name: our_tau(loaded, method, path, prompts, out / "ours" / name, info.get("k", args.k),
                          args.max_new_tokens)
            for name, method, path, _, info in drafters if path is not None}
    for name, _, _, _, info in drafters:
        if "must_differ" in info:
            ours[name] = ours[info["of"]]
    if not ours:  # probes alone: our AR greedy output and prompt ids from a control's evaluation
        control_dir = out / "control-eagle3"
        eagle3_control(verifier, token).save_pretrained(control_dir)
        ours["control-eagle3"] = our_tau(loaded, "eagle3", control_dir, prompts, out / "ours" / "control-eagle3",
                                         args.k, args.max_new_tokens)
    first = next(iter(ours.values()))
    prompt_ids, our_ar = first["prompt_ids"], first["ar_tokens"]
    common = ["-t", str(args.threads), "-tb", str(args.threads), "-c", str(4096 * args.server_slots),
              "-np", str(args.server_slots), "--seed", "0",
              "-ctk", args.kv_cache, "-ctv", args.kv_cache]

    def decode(name: str, extra: list[str]) -> list[dict]:
        with LlamaServer(server, target, common + extra, out / "logs" / f"{name}.log") as s:
            if args.server_slots == 1:
                return [s.complete(ids, args.max_new_tokens, n_probs=2) for ids in prompt_ids]
            return paired_completions(s, prompt_ids, args.max_new_tokens, n_probs=2)

    plain_runs = decode("plain", [])
    plain = [strip_eos(r["tokens"], eos) for r in plain_runs]
    ar_match = sum(a == strip_eos(b, eos) for a, b in zip(plain, our_ar))
    ar_parted = partings(plain_runs, [{"tokens": t, "probs": []} for t in our_ar], prompt_ids, verifier, eos)
    probes = {}  # name -> the probe drafter whose forward predicts that row's acceptance (a twin: its probe's)
    for slot in probe_slots:
        choice = choose_probe(verifier, default_probe_layers(verifier), slot, list(zip(prompt_ids, plain)))
        probe = layer_probe(verifier, slot, choice["dim"], choice["positive"], choice["negative"])
        name = f"probe-slot{slot}"
        good = write_eagle3_gguf(probe, out / "gguf" / f"{name}.gguf", source, force=True)
        twin = mistaken_gguf(good, out / "gguf" / f"{name}-wrong-layers.gguf", "layers", layers)
        expected = list(probe.config.aux_layer_ids)
        drafters.append((name, "eagle3", None, good, {"k": 1, "probe": choice, "expected_layers": expected}))
        drafters.append((f"{name}-wrong-layers", "eagle3", None, twin,
                         {"k": 1, "probe": choice, "must_differ": "layers", "of": name, "expected_layers": expected}))
        probes[name] = probes[f"{name}-wrong-layers"] = probe
    rows, records, ok_all = [], [], True
    for name, method, _, gguf_file, info in drafters:
        k = info.get("k", args.k)
        runs = decode(name, ["-md", str(gguf_file), "--spec-type", info.get("spec_type", f"draft-{method}"),
                             "--spec-draft-n-max", str(k),
                             "--spec-draft-n-min", "0", "--spec-draft-p-min", "0", "-td", str(args.threads),
                             "-tbd", str(args.threads), "-ctkd", args.kv_cache, "-ctvd", args.kv_cache,
                             *([] if args.draft_backend_sampling == "on" else [NO_BACKEND_SAMPLING]),
                             "-lv", "4"])  # -lv 4: the loader's resolved layers
        info = {**info, "engine_layers": resolved_layers(out / "logs" / f"{name}.log")}
        spec = [strip_eos(r["tokens"], eos) for r in runs]
        counts = [rounds_and_tau(r) for r in runs]
        parted = partings(plain_runs, runs, prompt_ids, verifier, eos)
        if name in probes:  # the prediction: our probe's first drafts on llama.cpp's own speculative text
            ours[name], info = probe_prediction(probes[name], verifier, prompt_ids, spec), dict(info)
            info.update(probe_predicted=ours[name]["accepted_per_prompt"], probe_min_margin=ours[name]["min_margin"])
        # a parting's margin against what the two paths' kernels measurably differ by: a margin difference
        # between two tokens can reach twice the largest difference of one token's log-probability
        spread = path_spread(plain_runs, runs, eos)
        near_tie = max(args.near_tie, min(2 * spread, args.near_tie_max)) if spread is not None else args.near_tie
        info = {**info, "kernel_spread": spread, "near_tie_used": near_tie, "near_tie_max": args.near_tie_max}
        ok, note, found = llama_cpp_verdict(info, plain, spec, counts, ours[name], args.tolerance, token, k, parted,
                                            near_tie)
        ok_all &= ok
        tau = found["tau_llama_cpp"]
        rows.append([name, k, ours[name]["tau"], "-" if tau is None else tau,
                     "-" if found["relative_difference"] is None else f"{100 * found['relative_difference']:.1f}%",
                     f"{ours[name]['accepted']}/{ours[name]['rounds']} vs {found['accepted_llama_cpp']}/"
                     f"{found['rounds_llama_cpp']}", f"{found['identical_prompts']}/{len(plain)}",
                     ("pass" if ok else "FAIL") + note])
        records.append({"name": name, "method": method, "gguf": str(gguf_file), "k": k, "tau_ours": ours[name]["tau"],
                        "alpha_ours": ours[name].get("alpha"), "accepted_ours": ours[name]["accepted"],
                        "rounds_ours": ours[name]["rounds"], "ours_identical_to_ar": ours[name]["identical_to_ar"],
                        **info, **found, "ok": ok})
    table = format_table(["drafter", "k", "tau ours", "tau llama.cpp", "diff", "accepted/rounds ours vs llama.cpp",
                          "spec == plain", "check"], rows,
                         title=f"llama.cpp engine check: {args.verifier} as an f32 GGUF, {len(prompt_ids)} prompts, "
                               f"{args.max_new_tokens} new tokens, draft {args.k}, T=0, {args.threads} threads, "
                               f"{args.kv_cache} KV cache, {args.server_slots} slot(s)"
                               + (", prompts two at a time" if args.server_slots == 2 else "")
                               + f", draft backend sampling {args.draft_backend_sampling}")
    summary = {"command": command, "date": time.strftime("%Y-%m-%d"), "llama_cpp": LLAMA_CPP_VERSION,
               "llama_server_version": binary_version(server), "cpu": cpu_record(), "verifier": args.verifier, "target_gguf": str(target),
               "prompts": args.prompts, "num_prompts": len(prompt_ids), "max_new_tokens": args.max_new_tokens,
               "k": args.k, "threads": args.threads, "kv_cache": args.kv_cache, "tolerance": args.tolerance,
               "server_slots": args.server_slots, "draft_backend_sampling": args.draft_backend_sampling,
               "llama_cpp_greedy_equals_our_ar": f"{ar_match}/{len(prompt_ids)}",
               "llama_cpp_greedy_partings_from_our_ar": ar_parted, "near_tie": args.near_tie,
               "plain_tokens_per_second": [r["timings"].get("predicted_per_second") for r in plain_runs],
               "drafters": records, "all_ok": ok_all, "seconds": round(time.time() - start, 1)}
    note = f"llama.cpp greedy (no draft) equals our AR greedy on {ar_match}/{len(prompt_ids)} prompts"
    path = finish(summary, out / "llama_cpp_check.json", [table, note])
    if not ok_all:
        print("llama.cpp check: FAILED (see the check column)", file=sys.stderr)
        raise SystemExit(1)
    return path


if __name__ == "__main__":
    main()
