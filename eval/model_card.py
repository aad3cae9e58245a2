"""A shipped drafter's model card (``pretrained/NAME/``, written by ``benchmarks/ship_drafter.py``): ``card.json``
holds the facts, ``README.md`` is that file rendered (:func:`card_text`), so every figure a reader sees is one a
test can recompute from the committed files it came from.

The facts come from committed result files: τ rows from ``spectrain-eval`` / ``spectrain-results`` JSONs
(:func:`eval_rows`), speed tables from ``benchmarks/draft_heads.py`` runs (:func:`speed_facts`), llama.cpp figures
from ``llama_cpp_check.py`` and ``llama_cpp_speed.py`` runs (:func:`llama_cpp_facts`), the learning curve's reach
from another card (:func:`reach_facts`); the llama.cpp file beside the weights is written as ``spectrain-export
--format gguf --dtype q8_0`` writes it (:func:`ship_gguf`). :func:`refresh_card` re-renders a shipped card.
"""

from __future__ import annotations

import hashlib
import math
import shlex
import tempfile
from pathlib import Path

from spectrain.eval.decode_dtype import cpu_line
from spectrain.eval.llama_cpp_modes import mode_of, run_p_min
from spectrain.eval.llama_cpp_slots import NO_BACKEND_SAMPLING
from spectrain.heads.errors import SpectrainError
from spectrain.heads.serving.cli import target_gguf_for
from spectrain.heads.families import family_for_method
from spectrain.heads.serving.formats import import_drafter
from spectrain.heads.io import read_json, write_json
from spectrain.heads.serving.gguf import gguf_export_of, spec_type_of, write_draft_gguf
from spectrain.heads.report import finish, format_table


def eval_rows(paths: list[str], row_name: str | None) -> list[dict]:
    """One row per setting quoted in the card: every setting of each ``spectrain-eval`` JSON, or the rows named
    ``row_name`` of a ``spectrain-results`` JSON."""
    rows = []
    for path in paths:
        e = read_json(path)
        if isinstance(e, dict) and isinstance(e.get("rows"), list):  # spectrain-results
            if not row_name:
                raise SpectrainError(f"--eval {path} is a spectrain-results table: pass --results_row NAME")
            for r in e["rows"]:
                if r["drafter"] == row_name:
                    rows.append({"prompts": f"{r['set']} ({r['prompts']})", "setting": r["setting"],
                                 "temperature": r["temperature"], "dtype": e["settings"].get("dtype", "?"),
                                 "tau": round(r["tau"], 3), "alpha": [None if a is None else round(a, 3)
                                                                      for a in r["alpha"]],
                                 "command": e["command"]})
            continue
        if not isinstance(e, dict) or not isinstance(e.get("results"), dict) or "sampling" not in e:
            raise SpectrainError(f"--eval {path}: neither a spectrain-eval nor a spectrain-results JSON")
        for name, r in e["results"].items():
            if name == "ar":
                continue
            rows.append({"prompts": f"{Path(e['prompts']).name} ({e['num_prompts']})", "setting": name,
                         "temperature": e["sampling"]["temperature"], "dtype": e["dtype"],
                         "tau": round(r["tau"], 3), "alpha": [None if a is None else round(a, 3) for a in r["alpha"]],
                         "command": e["command"]})
    return rows


def llama_cpp_facts(check_path: str, speed_path: str, name: str) -> dict:
    """The card's llama.cpp figures, from a committed ``llama_cpp_check.py`` JSON (the row whose drafter is
    ``pretrained/NAME``: τ ours vs llama.cpp) and a ``llama_cpp_speed.py`` JSON (per target: plain tok/s, this
    drafter's best mode and llama.cpp's best n-gram mode, speedups as median and min–max)."""
    check, speed = read_json(check_path), read_json(speed_path)
    rows = [r for r in check.get("drafters", []) if Path(str(r.get("source", ""))).name == name]
    if len(rows) != 1:
        raise SpectrainError(f"--llama_cpp_check {check_path}: no single row for drafter {name!r}")
    if Path(str(speed.get("drafter", ""))).name != name:
        raise SpectrainError(f"--llama_cpp_speed {speed_path} times {speed.get('drafter')!r}, not {name!r}")
    row = rows[0]

    def best(modes: dict, ours: bool) -> dict:
        """The best median of our draft's modes (``ours``) or of llama.cpp's n-gram modes."""
        chosen = max((m for m in modes if (mode_of(m) is not None if ours else m.startswith("ngram"))),
                     key=lambda m: modes[m]["speedup_median"])
        r = modes[chosen]
        return {"mode": chosen, "speedup": round(r["speedup_median"], 3), "min": round(r["speedup_min"], 3),
                "max": round(r["speedup_max"], 3), "tau": round(r["tau"], 3)}

    targets = {t: {"plain_tok_per_s": round(v["modes"]["plain"]["tok_per_s_median"], 1),
                   "drafter": best(v["modes"], True), "ngram": best(v["modes"], False)}
               for t, v in speed["targets"].items()}
    cpu = speed.get("cpu") or {}
    return {"check": {"file": check_path, "command": check["command"], "k": row["k"],
                      "tau_ours": round(row["tau_ours"], 3), "tau_llama_cpp": round(row["tau_llama_cpp"], 3),
                      "prompts": check["num_prompts"], "max_new_tokens": check["max_new_tokens"],
                      "server_slots": check.get("server_slots", 1)},
            "speed": {"file": speed_path, "command": speed["command"], "threads": speed["threads"],
                      "repeats": speed["repeats"], "cpu": f"{cpu.get('cpus') or cpu.get('cores')}-CPU {cpu.get('model')}"
                      + (", AVX512-BF16" if cpu.get("avx512_bf16") else ", AVX2 only" if cpu.get("avx2") and not
                         cpu.get("avx512f") else "") + (", AMX" if cpu.get("amx_bf16") else ", no AMX"),
                      "targets": targets},
            "llama_cpp": check.get("llama_cpp")}


def reach_facts(card: dict, other_dir: str) -> dict:
    """What this drafter's learning curve says it would take to reach another shipped drafter's measured τ on
    the same held-out prompts: τ against log2(trained tokens) fitted by least squares over the card's ``curve``,
    solved for the other's τ (an extrapolation, which the card says)."""
    other = read_json(Path(other_dir) / "card.json")
    curve = [r for r in card.get("curve") or [] if r.get("tau_measured") is not None]
    if other.get("measured_on") != card.get("measured_on") or len(curve) < 3:
        raise SpectrainError(f"--reach {other_dir}: needs both cards' τ on the same held-out prompts "
                             f"({other.get('measured_on')!r} vs {card.get('measured_on')!r}) and >= 3 curve points")
    xs, ys = [math.log2(r["trained_tokens"]) for r in curve], [r["tau_measured"] for r in curve]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    tokens = 2 ** (mx + (other["tau_measured"] - my) / slope) if slope > 0 else None
    return {"drafter": other["name"], "tau": round(other["tau_measured"], 3), "per_doubling": round(slope, 3),
            "tokens": None if tokens is None else round(tokens), "points": len(curve),
            "times": None if tokens is None else round(tokens / card["trained_tokens"], 1)}


def reach_text(card: dict) -> str:
    """The card's learning-curve line (:func:`reach_facts`), or nothing where the card has no ``reach``."""
    r = card.get("reach")
    if not r:
        return ""
    curve = [c for c in card["curve"] if c.get("tau_measured") is not None]
    first, last = curve[0], curve[-1]
    need = ("it never would at this slope" if r["tokens"] is None else
            f"at that rate reaching {r['drafter']}'s {r['tau']:.3f} would take ~{r['tokens'] / 1e6:.1f}M tokens, "
            f"{r['times']:.1f}× this run's")
    return (f"- Learning curve (`card.json` `curve`, {card['measured_on']}): measured τ {first['tau_measured']:.3f} at "
            f"{first['trained_tokens'] / 1e6:.2f}M tokens to {last['tau_measured']:.3f} at "
            f"{last['trained_tokens'] / 1e6:.2f}M, +{r['per_doubling']:.3f} per doubling of tokens (least squares over "
            f"{r['points']} points); {need} — an extrapolation past the schedule's end, not a promise.\n")


def speed_facts(path: str, drafter_dir: Path) -> dict:
    """The card's speed table from a committed ``draft_heads.py --repeats N --interleave`` JSON: the rows of the
    card's drafter (its own label, and ``hybrid-`` with it), each speedup the median over the repeats with its
    min-max, and the CPU and dtype they ran on."""
    data = read_json(path)
    name = drafter_dir.name
    drafters = data.get("drafters") if isinstance(data, dict) else None  # {label: path}
    label = next((lab for lab, src in drafters.items() if Path(str(src)).name == name), None) \
        if isinstance(drafters, dict) else None
    if label is None or "cpu" not in data or (data.get("repeats") or 1) < 3:
        raise SpectrainError(f"--speed {path}: not a draft_heads.py JSON of {name} with --repeats >= 3 and its CPU "
                             "(every card speed is a median over interleaved repeats on a named CPU)")
    rows = [{"drafter": r["drafter"], "draft_vocab": r["draft_vocab"], "setting": r["setting"],
             "tau": round(r["tau"], 3), "draft_over_verify": round(r["draft_over_verify"], 3),
             "speedup": round(r["speedup"], 3), "min": round(r["speedup_min"], 3), "max": round(r["speedup_max"], 3),
             "identical": r["identical_turns"]}
            for r in data["rows"] if r["drafter"] in (label, f"hybrid-{label}")]
    cases = [case for call in data.get("calls") or [] if call["drafter"] in (label, f"hybrid-{label}")
             for name, r in call["results"].items() if name != "ar"
             for prompt in (r.get("divergences") or {}).get("per_prompt", []) for case in prompt["cases"]]
    if any(not case.get("near_tie") for case in cases):
        raise SpectrainError(f"--speed {path}: a turn parts from AR at no near-tie: not lossless, nothing rendered")
    partings = {"turns": len(cases), "max_margin": max((max(c["margin_verify"], c["margin_ar"]) for c in cases),
                                                        default=0.0),
                "max_ulps": max((round(max(c["margin_verify"], c["margin_ar"]) / c["logit_ulp"]) for c in cases),
                                default=0)}
    return {"file": f"docs/results/{Path(path).name}", "date": data["date"], "command": data["command"],
            "partings": partings,
            "cpu": cpu_line(data["cpu"]), "bf16_native": bool(data["cpu"].get("bf16_native")), "dtype": data["dtype"], "repeats": data["repeats"],
            "prompts": data["num_prompts"], "max_new_tokens": data["max_new_tokens"], "rows": rows}


def vocab_coverage(drafter_dir: Path) -> tuple[int, float] | None:
    """(default draft rows, the share of the ranking's counted tokens they cover) from ``vocab_ranking.json``."""
    path = drafter_dir / "vocab_ranking.json"
    if not path.is_file():
        return None
    ranking = read_json(path)
    counts = sorted(ranking["counts"], reverse=True)
    return ranking["default_size"], sum(counts[:ranking["default_size"]]) / max(sum(counts), 1)


def card_speeds(card: dict) -> list[dict]:
    """The card's speed tables, one per CPU class it was timed on (a card of before 2026-12-05 holds one, as a dict)."""
    sp = card.get("speed") or []
    return [sp] if isinstance(sp, dict) else list(sp)


def speed_text(card: dict, drafter_dir: Path) -> str:
    """The card's "Draft head" section: which rows each engine drafts over, and a measured speed table for each CPU
    class the card was timed on."""
    speeds = [sp for sp in card_speeds(card) if "rows" in sp]
    if not speeds:
        return ""
    cover = vocab_coverage(drafter_dir)
    ranking = drafter_dir / "vocab_ranking.json"
    full_rows = read_json(ranking)["vocab_size"] if ranking.is_file() else None  # the verifier's whole vocabulary
    text = ("\n## Draft head: which rows each engine drafts over\n\n" if cover else
            "\n## Speed in spectrain's loop (its trained draft vocabulary)\n")
    if cover:
        text += (f"`vocab_ranking.json` counts the tokens of its training prompts' original replies (written by "
                 f"`spectrain-rank-vocab`): the {cover[0]:,} most frequent cover {100 * cover[1]:.1f} % of them. "
                 f"spectrain's evaluator drafts over those {cover[0]:,} rows by default (`--draft_vocab 0` for the "
                 f"full head); SGLang drafts over the same rows with `--speculative-token-map` after "
                 f"`spectrain-export pretrained/{card['name']} --format eagle-sglang` (it writes `token_map.pt`); "
                 f"vLLM serves the full head.\n")

    def head(r: dict) -> str:
        rows = ("full head" if r["draft_vocab"] in (None, 0, full_rows) else
                f"ranked {r['draft_vocab']:,}" if cover else f"draft vocabulary {r['draft_vocab']:,}")
        return ("hybrid with prompt lookup, " if r["drafter"].startswith("hybrid") else "") + rows

    if not any(sp.get("bf16_native") for sp in speeds):
        text += ("On CPUs with native bf16 (AMX / AVX512-BF16) these settings have one pass so far, not a repeated "
                 "run ([docs/evaluation.md](../../docs/evaluation.md#ranked-draft-heads)).\n")
    for sp in speeds:
        kind = "native bf16" if sp.get("bf16_native") else "no native bf16"
        lines = "\n".join(f"| {head(r)} | {r['setting']} | {r['tau']:.3f} | {r['draft_over_verify']:.3f} | "
                          f"{r['speedup']:.3f}× ({r['min']:.3f}–{r['max']:.3f}) | {r['identical']} |"
                          for r in sp["rows"])
        pt = sp.get("partings") or {}
        parted = "" if not pt.get("turns") else (
            f" The {pt['turns']} turns that part from AR (first pass) each do so at a near-tie: both paths' margins at "
            f"most {pt['max_margin']:g} ({pt['max_ulps']} × the logit's rounding step; "
            "`divergences` in the file, [why](../../docs/evaluation.md#precision-and-the-lossless-check)).")
        text += f"""
**{sp['cpu']}** ({kind}: {sp['dtype']}):

| head | setting | MT-bench ({sp['prompts']}) τ | draft / verify pass | speedup over our AR loop, median (min–max) | same text as AR |
|---|---|---|---|---|---|
{lines}

{sp['max_new_tokens']} new tokens; AR and each setting interleaved prompt by prompt, {sp['repeats']} repeats;
`{sp['file']}` ({sp['date']}, `benchmarks/draft_heads.py`). A range that reaches 1.0× is no speedup on that CPU.{parted}
{BASELINE_NOTE}
"""
    return text


# Which plain decoding the card's speedups are over (draft_heads.py times no HF generate()).
BASELINE_NOTE = ("Every speedup here is over spectrain's own plain decoding as it ran that day (the same loop with "
                 "no drafter; in bf16 batch-invariant), not over HF `generate()`, which that file did not time: "
                 "`spectrain-eval` now gives both (`speedup`, `speedup_over_hf`); our plain decoding against HF "
                 "`generate()` per CPU class: [docs/results.md](../../docs/results.md) (`ar_vs_hf_*.json`).")
PRETRAINED_BUDGET_MB = 45  # what pretrained/ may hold in all (tests/test_pretrained.py MAX_MB): two drafters and
# the q8_0 GGUF of the one llama.cpp serves


def gguf_name(card: dict) -> str:
    """The shipped llama.cpp file of a card, beside its safetensors."""
    return f"{card['name']}-q8_0.gguf"


def ship_gguf(drafter_dir: Path, card: dict) -> dict | None:
    """Write the drafter's llama.cpp file into ``drafter_dir`` as ``spectrain-export --format gguf --dtype q8_0``
    writes it (its family's writer; the target's tokenizer copied from the verifier's GGUF), after writing it twice
    and comparing the bytes; an f32 write is measured for its size only. The file is staged beside and renamed into
    place, so a failed write leaves the shipped file as it was. Returns the card's ``gguf`` facts: None where the
    drafter's family writes no llama.cpp file for its method (its weights are not read),
    ``{"refused": why}`` where llama.cpp cannot serve this drafter as trained."""
    if spec_type_of(card["method"]) is None:  # its family writes no llama.cpp file for this method
        return None
    drafter = import_drafter(drafter_dir, fmt=card["format"])  # the layout it ships in, named
    try:
        gguf_export_of(drafter)
    except SpectrainError as why:
        return {"refused": str(why)}
    name, target = gguf_name(card), target_gguf_for(card["verifier"])
    with tempfile.TemporaryDirectory(dir=drafter_dir) as tmp:
        a, b = Path(tmp) / "q8_0-0.gguf", Path(tmp) / "q8_0-1.gguf"
        serve = write_draft_gguf(drafter, a, target, "q8_0")
        write_draft_gguf(drafter, b, target, "q8_0")  # the same weights again: the bytes must not differ
        f32 = Path(tmp) / "f32.gguf"
        write_draft_gguf(drafter, f32, target, "float32")
        facts = {"file": name, "dtype": "q8_0", "serve": serve, "q8_0_mb": round(a.stat().st_size / 2 ** 20, 1),
                 "sha256": hashlib.sha256(a.read_bytes()).hexdigest(),
                 "deterministic": a.read_bytes() == b.read_bytes(), "f32_mb": round(f32.stat().st_size / 2 ** 20, 1)}
        if not facts["deterministic"]:
            raise SpectrainError(f"{drafter_dir}: two q8_0 GGUF exports of the same weights differ; nothing shipped")
        a.replace(drafter_dir / name)
    return facts


def serve_flags(card: dict) -> str:
    """The card's ``llama-server`` draft flags: the f32 target's best measured mode where the card has llama.cpp
    figures (its draft length, and its p-min or else the run's ``--p_min``), else the flags its family's writer
    serves the file with."""
    speed = (card.get("llama_cpp") or {}).get("speed") or {}
    targets = speed.get("targets") or {}
    best = (targets.get("f32") or next(iter(targets.values()), None) or {}).get("drafter")
    mode = mode_of(best["mode"]) if best else None
    if mode is None:
        spec_type = spec_type_of(card["method"])
        return (card.get("gguf") or {}).get("serve") or (f"--spec-type {spec_type}" if spec_type else "")
    p_min = run_p_min(speed.get("command", "")) if mode.p_min is None else mode.p_min
    return shlex.join(["--spec-type", mode.spec_type, "--spec-draft-n-max", str(mode.k), "--spec-draft-p-min",
                       f"{p_min:g}"])


def llama_cpp_text(card: dict) -> str:
    """The card's "Serve with llama.cpp" section (only where the drafter's family writes a llama.cpp file)."""
    if spec_type_of(card["method"]) is None and not card.get("gguf"):  # llama.cpp serves no such drafter
        return ""
    g = card.get("gguf") or {}
    if g.get("refused"):
        return f"\n## Serve with llama.cpp\n\nNot as trained: {g['refused']}\n"
    shipped = f"pretrained/{card['name']}/{g['file']}" if g.get("file") else f"{card['name']}.gguf"
    text = f"""
## Serve with llama.cpp

```bash
spectrain-verifier-gguf {card['verifier']} --out target-f32.gguf    # the weights it trained on (or serve the Q4_1 file)
llama-server -m target-f32.gguf -md {shipped} {serve_flags(card)} {NO_BACKEND_SAMPLING}
```

(`{NO_BACKEND_SAMPLING}` keeps acceptance at several slots, `-np` 2 and above: docs/export.md, "Several
slots".)

"""
    if g.get("file"):
        text += f"""
`{g['file']}` ({g['q8_0_mb']} MB, q8_0, the target's tokenizer inside; sha256 `{g['sha256'][:16]}…`) is this directory's
weights as `spectrain-export pretrained/{card['name']} --format gguf --dtype q8_0 --out {card['name']}.gguf` writes
them (tokenizer from {card['verifier']}'s GGUF): the export is deterministic (written twice, the same bytes;
a test re-exports and compares), so either serves the same draft. At f32 the file would be {g['f32_mb']} MB.
"""
    facts = card.get("llama_cpp")
    if not facts:
        return text
    c, sp = facts["check"], facts["speed"]
    slots = ", two slots with the prompts two at a time" if c.get("server_slots", 1) == 2 else ""
    rows = "\n".join(f"| {t} | {v['plain_tok_per_s']} | {v['drafter']['speedup']:.3f}× ({v['drafter']['min']:.3f}–"
                     f"{v['drafter']['max']:.3f}), `{v['drafter']['mode']}`, τ {v['drafter']['tau']:.3f} | "
                     f"{v['ngram']['speedup']:.3f}× ({v['ngram']['min']:.3f}–{v['ngram']['max']:.3f}), "
                     f"`{v['ngram']['mode']}` |" for t, v in sp["targets"].items())
    return text + f"""
Measured in llama.cpp ({facts['llama_cpp']}): τ {c['tau_llama_cpp']:.3f} in `llama-server` against {c['tau_ours']:.3f}
in our loop (draft {c['k']}, {c['prompts']} MT-bench first turns × {c['max_new_tokens']} tokens, f32 target{slots};
`{Path(c['file']).name}`). Speed against llama.cpp's plain decoding ({sp['cpu']}, {sp['threads']} threads,
{sp['repeats']} interleaved repeats, median (min–max); `{Path(sp['file']).name}`):

| target | plain tok/s | this drafter, best mode | llama.cpp's best n-gram mode |
|---|---|---|---|
{rows}

Below 1× on both: on a 135M target a llama.cpp round costs more than the tokens this drafter's acceptance buys
(docs/export.md, "Where a round's time goes in llama.cpp").
"""


def fmt(value, spec: str = ".3f") -> str:
    """A card's figure, or ``n/a`` where it was not measured."""
    return "n/a" if value is None else format(value, spec)


def card_text(card: dict, drafter_dir: Path) -> str:
    """README.md of a shipped drafter: ``card.json`` rendered (every figure from it; ``drafter_dir`` for its
    vocabulary ranking)."""
    measured = "\n".join(f"| {r['prompts']} | {r['setting']} | {r['temperature']:g} | {r['dtype']} | {r['tau']:.3f} |"
                         for r in card["eval"])
    family = family_for_method(card["method"], "card.json").name  # what spectrain-eval --method names
    return f"""# {card['name']}

{card['method']} drafter for **{card['verifier_hub_id']}** (spectrain verifier `{card['verifier']}`), {card['dtype']},
{card['format']} layout ({card['size_mb']:.1f} MB).

- Verifier: `{card['verifier']}` — {card['verifier_note']}
- Data: {card['data']}
- Trained: {card['steps']:,} steps, {card['trained_tokens']:,} tokens, {card['train_seconds'] / 60:.0f} min of training
  ({card['precision']}, {card['machine']}); held-out τ predicted {fmt(card['tau_pred'])}, measured
  {fmt(card['tau_measured'])} ({card['measured_on']}).
- Command: `{card['command']}` (recipe: `train_config.yaml`; data steps: docs/smollm2.md).
{reach_text(card)}
## Use

```bash
spectrain-eval --verifier {card['verifier']} --method {family} \\
    --drafter pretrained/{card['name']} --prompts PROMPTS.jsonl --num_prompts 8
```

## Measured (spectrain's lossless loop, T = 0 unless stated)

| prompts | setting | T | dtype | τ |
|---|---|---|---|---|
{measured or '| – | – | – | – | – |'}
""" + speed_text(card, drafter_dir) + llama_cpp_text(card)


def refresh_card(target: Path, eval_paths: list[str] = (), results_row: str | None = None,
                 speed: list[str] = (), reach: str | None = None, llama_cpp_check: str | None = None,
                 llama_cpp_speed: str | None = None) -> Path:
    """Re-render a shipped card (README.md from card.json): its τ rows from ``eval_paths`` (``results_row``: this
    drafter's row of a ``spectrain-results`` file), its speed tables from ``speed``, its learning-curve reach towards
    the card in ``reach``, and its llama.cpp figures from ``llama_cpp_check`` and ``llama_cpp_speed`` (together),
    each where given; its GGUF (where llama.cpp serves it) re-written from the card's own weights (which are not
    touched). Every file is written beside and renamed into place. Returns card.json's path."""
    target = Path(target)
    if not (target / "card.json").is_file():
        raise SpectrainError(f"--refresh {target}: no card.json (not a shipped drafter)")
    card = read_json(target / "card.json")
    if llama_cpp_check or llama_cpp_speed:
        if not (llama_cpp_check and llama_cpp_speed):
            raise SpectrainError("--llama_cpp_check and --llama_cpp_speed go together")
        card["llama_cpp"] = llama_cpp_facts(llama_cpp_check, llama_cpp_speed, card["name"])
    if eval_paths:
        card["eval"] = eval_rows(eval_paths, results_row)
    if speed:
        card["speed"] = [speed_facts(path, target) for path in speed]
    if reach:
        card["reach"] = reach_facts(card, reach)
    gguf = ship_gguf(target, card)
    if gguf is not None:
        card["gguf"] = gguf
    write_json(target / "card.json", card)
    tmp = target / "README.md.tmp"
    tmp.write_text(card_text(card, target))
    tmp.replace(target / "README.md")
    return finish(card, target / "card.json", [format_table(["", "value"], [["refreshed", target]], title="card")])
