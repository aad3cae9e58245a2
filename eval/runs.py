"""An evaluation's runs and summaries: every prompt's turns decoded by AR, HF ``generate()`` and each setting's
drafter, interleaved prompt by prompt (:func:`run_prompts`), a setting's τ, α, histogram and speeds
(:func:`summarize`, :func:`in_loop_costs`), its speed against HF ``generate()`` on the same turns
(:func:`speed_on`, :func:`speedup_over`) and its T = 0 partings from AR measured where they part
(:func:`divergences`)."""

from __future__ import annotations

import math
import time

import torch

from spectrain.heads.errors import SpectrainError

from . import metrics
from .decode import Trace, generate
from .drafters import Autoregressive, Drafter
from .settings import EvalSettings
from .static_model import StaticCausalLM

HF_GENERATE = "hf_generate"  # HF generate()'s records in run_prompts' answer


def encode_turn(tokenizer, history: list[dict], use_template: bool) -> list[int]:
    if use_template:
        return tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True, return_dict=False)
    return tokenizer("\n".join(m["content"] for m in history), add_special_tokens=False)["input_ids"]


def eos_ids(tokenizer) -> set[int]:
    return {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()


def run_prompts(runner: StaticCausalLM, drafters: dict[str, Drafter], prompts: list[list[str]], tokenizer,
                use_template: bool, s: EvalSettings, hf: "HFGenerate | None" = None) -> dict[str, list[dict]]:
    """Every turn of every prompt by each of ``drafters`` (and by ``hf`` on its first ``hf.prompts``), interleaved:
    prompt 0 by each in turn, then prompt 1, ..., the order rotated by one from each prompt to the next, so that a
    slower or busier stretch of the machine, and the cache another decoder left cold, fall on every decoder alike.
    Later turns see the decoder's own earlier answers, as MT-bench does. Each drafter draws from a generator of its
    own, seeded alike. AR and HF are warmed up first on the first turn (untimed).

    Returns:
        per name (``HF_GENERATE`` for ``hf``), one record per prompt: ``{"prompt": i, "turns": [turn_record]}``.
    """
    eos = eos_ids(tokenizer)
    baselines = {name: d for name, d in drafters.items() if isinstance(d, Autoregressive)}  # AR, then HF, then the rest
    decoders = {name: _ours(runner, d, s, eos) for name, d in baselines.items()}
    decoders.update({HF_GENERATE: hf.decode} if hf is not None else {})
    decoders.update({name: _ours(runner, d, s, eos) for name, d in drafters.items() if name not in baselines})
    first = encode_turn(tokenizer, [{"role": "user", "content": prompts[0][0]}], use_template)
    for drafter in baselines.values():  # the baselines' warm-up (a generator of its own: the timed runs' is kept)
        _ours(runner, drafter, s, eos)(first, min(s.max_new_tokens, 8))
    if hf is not None:
        hf.decode(first, min(s.max_new_tokens, 8))
    records = {name: [] for name in decoders}
    names = list(decoders)
    for i, turns in enumerate(prompts):
        for name in names[i % len(names):] + names[:i % len(names)]:
            if name == HF_GENERATE and i >= hf.prompts:
                continue
            decode = decoders[name]
            draft = 0 if name == HF_GENERATE else drafters[name].max_nodes + 1  # HF's cache grows as it goes
            records[name].append(_prompt(i, turns, decode, tokenizer, use_template, s.max_new_tokens,
                                         runner.max_len - draft))
    return records


def _ours(runner: StaticCausalLM, drafter: Drafter, s: EvalSettings, eos: set[int]):
    """Our loop with ``drafter`` as a ``decode(ids, max_new_tokens) -> turn record`` function."""
    generator = torch.Generator(device=runner.device).manual_seed(s.seed)

    def decode(ids: list[int], max_new_tokens: int) -> dict:
        if not runner.buckets:  # eager: each drafter's forwards keep only the layers it reads
            runner.capture = drafter.capture_layers
        return turn_record(ids, generate(runner, drafter, ids, max_new_tokens, s.sampling, eos, generator))

    return decode


def _prompt(i: int, turns: list[str], decode, tokenizer, use_template: bool, max_new_tokens: int,
            room: int) -> dict:
    """One prompt's turns by one decoder; ``room``: the positions a turn's prompt and new tokens may take."""
    history, record = [], {"prompt": i, "turns": []}
    for turn in turns:
        history.append({"role": "user", "content": turn})
        ids = encode_turn(tokenizer, history, use_template)
        if len(ids) + max_new_tokens > room:
            raise SpectrainError(f"prompt {i}: {len(ids)} prompt tokens + max_new_tokens {max_new_tokens} "
                                 f"exceed the {room} positions the decoder's cache leaves them")
        turn_record_ = decode(ids, max_new_tokens)
        history.append({"role": "assistant", "content": tokenizer.decode(turn_record_["tokens"],
                                                                          skip_special_tokens=True)})
        record["turns"].append(turn_record_)
    return record


def turn_record(ids: list[int], gen) -> dict:
    """One generated turn as the summaries read it."""
    return {"prompt_tokens": len(ids), "new_tokens": len(gen.tokens), "stop": gen.stop,
            "accept_lengths": gen.accept_lengths, "emitted_per_round": gen.emitted_per_round,
            "drafted_depths": gen.drafted_depths, "prefill_seconds": gen.prefill_seconds,
            "decode_seconds": gen.decode_seconds,
            "round_seconds": gen.round_seconds,
            "tokens": gen.tokens, "sequence": ids + gen.tokens}


def summarize(records: list[dict], depth: int) -> dict:
    """τ (pooled), α by depth, the accept-length histogram and speeds of one setting's records."""
    turns = [t for r in records for t in r["turns"]]
    accept = [a for t in turns for a in t["accept_lengths"]]
    # Each round's drafted depth (None for records written before rounds recorded it: every round then counts as
    # reaching every depth, as before). Its mean is a chain's drafts per round (a tree's: its depth bound).
    drafted = (None if any("drafted_depths" not in t for t in turns) else
               [d for t in turns for d in t["drafted_depths"]])
    new_tokens = sum(t["new_tokens"] for t in turns)
    decode = sum(t["decode_seconds"] for t in turns)
    total = decode + sum(t["prefill_seconds"] for t in turns)
    # Decode throughput counts the tokens made by verify rounds (the prefill's token is timed with the prefill).
    decode_tokens = sum(sum(t["emitted_per_round"]) for t in turns)
    # Where a round's time goes, measured in the rounds themselves (ms per round, pooled over turns).
    # (None for records written before rounds were timed: a reused reference from an older file.)
    round_ms = (None if not accept or any("round_seconds" not in t for t in turns) else
                {phase: 1000 * sum(t["round_seconds"][phase] for t in turns) / len(accept)
                 for phase in ("draft", "verify", "other")})
    return {
        "round_ms": round_ms,
        "tau": metrics.tau([t["emitted_per_round"] for t in turns]),
        "alpha": metrics.alphas(accept, depth, drafted),
        "mean_drafted_depth": None if drafted is None else sum(drafted) / max(len(drafted), 1),
        "accept_histogram": metrics.histogram(accept, depth),
        "verifier_forwards": len(accept),
        "new_tokens": new_tokens,
        "wall_seconds": total,
        "tokens_per_second": new_tokens / max(total, 1e-9),
        "decode_ms_per_token": 1000 * decode / max(decode_tokens, 1),
        "distinct_4gram": metrics.distinct_ngram_ratio([t["tokens"] for t in turns]),
    }


def in_loop_costs(summary: dict, ar: dict) -> dict:
    """A setting's costs from its own rounds: ``draft_over_verify`` (a round's drafting in verify passes),
    ``ideal_speedup`` (τ × AR's ms per token / a round's draft + verify ms: these rounds with no time outside
    the two passes, against AR as it runs) and ``speedup_vs_ideal`` (measured / ideal = the share of a round spent in the two passes)."""
    ms = summary["round_ms"]
    if ms is None or ar.get("round_ms") is None:  # no rounds (or records from before rounds were timed)
        return {"draft_over_verify": None, "ideal_speedup": None, "speedup_vs_ideal": None}
    passes = ms["draft"] + ms["verify"]
    ideal = summary["tau"] * ar["decode_ms_per_token"] / max(passes, 1e-9)
    return {"draft_over_verify": ms["draft"] / max(ms["verify"], 1e-9), "ideal_speedup": ideal,
            "speedup_vs_ideal": summary["speedup"] / max(ideal, 1e-9)}


def identical_turns(reference: list[dict], records: list[dict]) -> int:
    """Turns whose tokens equal the reference's."""
    return sum(a["tokens"] == b["tokens"] for ra, rb in zip(reference, records) for a, b in zip(ra["turns"], rb["turns"]))


def ulp(magnitude: float, dtype: torch.dtype) -> float:
    """The spacing of ``dtype``'s numbers at ``magnitude`` (bf16 at 20: 0.125)."""
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(magnitude, torch.finfo(dtype).tiny)))


@torch.no_grad()
def divergences(runner: StaticCausalLM, spec: Drafter, ar_records: list[dict], spec_records: list[dict],
                s: EvalSettings, eos: set[int]) -> dict:
    """Every T = 0 turn whose output parts from AR's, measured where it parts, with each path's own logits.

    Both paths are decoded again up to the first differing token t with a :class:`~.decode.Trace` (the same
    forwards in the same order, so the same numbers: checked against the recorded tokens). At t: the top-1 vs
    top-2 margin of the verify pass that chose the speculative token and of the AR step that chose the greedy
    one, each token's logit in the other path, and ``flip`` = how far the two paths' logit differences between
    the two tokens lie apart (gap in verify + gap in AR). ``spread``: the same quantity where the paths agree —
    how much the top-2 margin differs between the two paths at every position before t (same tokens, each path
    its own KV cache and kernels). A divergence is a ``near_tie`` when its flip is within what rounding moves:
    the spread's maximum, or two units in the last place of the decoding dtype at that logit's magnitude (the
    logits are rounded to it), whichever is larger. In fp32 the paths agree to ~1e-6 before t and the ulp is as
    small, so any divergence there is flagged. A turn whose prompt already differs (an earlier turn parted) is ``inherited``, not measured.
    """
    cases, spread, turns, inherited, replayed = [], [], 0, 0, True
    for ra, rs in zip(ar_records, spec_records):
        for turn, (ta, ts) in enumerate(zip(ra["turns"], rs["turns"])):
            turns += 1
            prompt = ta["sequence"][:ta["prompt_tokens"]]
            if ts["sequence"][:ts["prompt_tokens"]] != prompt:
                inherited += 1
                continue
            t = next((i for i, (a, b) in enumerate(zip(ta["tokens"], ts["tokens"])) if a != b), None)
            if t is None:
                continue
            traces, reproduced = {}, True
            for name, drafter, record in (("ar", Autoregressive(), ta), ("verify", spec, ts)):
                generator = torch.Generator(device=runner.device).manual_seed(s.seed)  # T = 0: unused, but local
                gen = generate(runner, drafter, prompt, t + 1, s.sampling, eos, generator, trace=Trace(keep=t))
                reproduced &= gen.tokens == record["tokens"][:t + 1]
                traces[name] = gen.trace
            if not reproduced:  # another decoder than the records' (a reused reference): nothing to measure here
                replayed = False
                cases.append({"prompt": ra["prompt"], "turn": turn, "position": t, "replayed": False})
                continue
            verify, ar = traces["verify"], traces["ar"]
            s_tok, g_tok = ts["tokens"][t], ta["tokens"][t]
            rv, rg = verify.row, ar.row
            margin = lambda tr: float(tr.top_values[t, 0] - tr.top_values[t, 1])  # noqa: E731
            gap_verify, gap_ar = float(rv[s_tok] - rv[g_tok]), float(rg[g_tok] - rg[s_tok])
            cases.append({"prompt": ra["prompt"], "turn": turn, "position": t, "replayed": True, "token_verify": s_tok,
                          "token_ar": g_tok, "margin_verify": margin(verify), "margin_ar": margin(ar),
                          "verify_logit_of_ar_token": float(rv[g_tok]), "ar_logit_of_verify_token": float(rg[s_tok]),
                          "flip": gap_verify + gap_ar, "logit_magnitude": float(max(rv[s_tok].abs(), rg[g_tok].abs()))})
            cases[-1]["logit_ulp"] = ulp(cases[-1]["logit_magnitude"], runner.dtype)
            same = (verify.top_ids[:t] == ar.top_ids[:t]).all(-1)  # positions whose top 2 agree, in order
            both = (verify.top_values[:t, 0] - verify.top_values[:t, 1]) - (ar.top_values[:t, 0] - ar.top_values[:t, 1])
            spread.append(both[same].abs())
    spread = torch.cat(spread) if spread else torch.zeros(0)
    bound = float(spread.max()) if spread.numel() else 0.0
    measured = [c for c in cases if c["replayed"]]
    for case in measured:
        case["near_tie"] = case["flip"] <= max(bound, 2 * case["logit_ulp"])
    return {
        "turns": turns, "diverged": len(cases), "inherited": inherited, "replayed_identically": replayed,
        "max_margin": max((max(c["margin_verify"], c["margin_ar"]) for c in measured), default=0.0),
        "max_flip": max((c["flip"] for c in measured), default=0.0),
        "near_ties": sum(c["near_tie"] for c in measured),
        "spread": {"positions": spread.numel(), "max": bound,
                   "p99": float(spread.quantile(0.99)) if spread.numel() else 0.0,
                   "median": float(spread.median()) if spread.numel() else 0.0},
        "cases": cases}


class _FirstToken:
    """A ``generate()`` streamer that stamps when the first new token arrives (its second ``put``: the first is
    the prompt): the end of HF's prefill, so that its decode time is timed as ours is."""

    def __init__(self):
        self.puts, self.first = 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


class HFGenerate:
    """HF ``generate()`` on the verifier as one more decoder of :func:`run_prompts` (greedy or sampled as
    configured), on its first ``prompts`` prompts. Open it (``with``) around the runs: on CUDA with ``compile`` its
    forward runs compiled over HF's static cache while it is open, and each prompt length is compiled and warmed
    up before its timed run."""

    def __init__(self, model, tokenizer, s: EvalSettings, prompts: int):
        self.model, self.prompts = model, prompts
        self.device = next(model.parameters()).device
        self.kwargs = dict(do_sample=s.temperature > 0, pad_token_id=tokenizer.pad_token_id)
        if s.temperature > 0:
            self.kwargs.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or None)
        self.compiled = s.compile and self.device.type == "cuda"
        self.eos = eos_ids(tokenizer)
        self._forward = None

    def __enter__(self) -> "HFGenerate":
        self._forward = self.model.forward
        if self.compiled:  # HF's fast path: static cache + compiled forward
            self.kwargs["cache_implementation"] = "static"
            self.model.forward = torch.compile(self.model.forward, mode="reduce-overhead", fullgraph=True)
        return self

    def __exit__(self, *exc) -> None:
        self.model.forward = self._forward  # the caller's model is left as it was given

    def decode(self, ids: list[int], max_new_tokens: int) -> dict:
        """One turn: its tokens and times as :func:`turn_record` keeps ours (prefill: up to the first new token)."""
        x = torch.tensor([ids], device=self.device)
        for _ in range(2 if self.compiled else 0):  # compilation and warm-up of this prefill shape, untimed
            self.model.generate(x, max_new_tokens=max_new_tokens, **self.kwargs)
        clock = _FirstToken()
        _sync(self.device)
        t0 = time.perf_counter()
        out = self.model.generate(x, max_new_tokens=max_new_tokens, streamer=clock, **self.kwargs)
        _sync(self.device)
        t1 = time.perf_counter()
        tokens = out[0, len(ids):].tolist()
        first = clock.first or t1
        return {"prompt_tokens": len(ids), "new_tokens": len(tokens), "prefill_seconds": first - t0,
                "decode_seconds": t1 - first, "stop": "eos" if tokens and tokens[-1] in self.eos else "length",
                "tokens": tokens, "sequence": ids + tokens}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def speed_on(records: list[dict], prompts: int) -> dict:
    """Tokens/s (prefill included) and decode ms per token (the tokens after each turn's first, which the prefill
    makes) over every turn of the first ``prompts`` prompts: what HF ``generate()`` ran, for any decoder."""
    turns = [t for r in records[:prompts] for t in r["turns"]]
    new = sum(t["new_tokens"] for t in turns)
    decode = sum(t["decode_seconds"] for t in turns)
    total = decode + sum(t["prefill_seconds"] for t in turns)
    return {"prompts": min(prompts, len(records)), "turns": len(turns), "new_tokens": new,
            "tokens_per_second": new / max(total, 1e-9),
            "decode_ms_per_token": 1000 * decode / max(sum(t["new_tokens"] - 1 for t in turns), 1)}


def speedup_over(baseline: dict, records: list[dict]) -> float:
    """A decoder's decode speed over ``baseline``'s (:func:`speed_on`), on the turns the baseline ran."""
    return baseline["decode_ms_per_token"] / max(speed_on(records, baseline["prompts"])["decode_ms_per_token"], 1e-9)
