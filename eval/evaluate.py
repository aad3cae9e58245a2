"""The evaluation API: one typed function that decodes prompts with a drafter through our lossless speculative
loop, beside plain autoregressive decoding of the same prompts, and returns what it measured.

``spectrain-eval`` and ``spectrain-results`` are thin command lines around :func:`evaluate_drafter`; the checks in
``benchmarks/`` call it directly::

    verifier = load_verifier("bundled:tinyshakespeare", dtype=torch.float32)
    drafter = load_drafter("runs/medusa", verifier)
    result = evaluate_drafter(verifier, [["To be, or not"]], method="medusa", drafter=drafter, k=4)
    result.results["chain-4"]["tau"]

Imports only torch and transformers (and safetensors through the drafter loaders).
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import asdict, dataclass, field

import torch

from spectrain.heads.errors import SpectrainError
from spectrain.heads.families import families, family_named, family_of
from spectrain.heads.formats import import_drafter, recorded_verifier
from spectrain.heads.verifier import Verifier, match_verifier, max_context
from spectrain.heads.vocab import load_ranking

from . import metrics
from .accept import Sampling
from .calibrate import medusa_diagnostics
from .costs import draft_cost, plan, probe_state, verify_cost
from .decode import Trace, generate
from .drafters import (Autoregressive, Drafter, DynamicTreeDrafter, HybridDrafter, MedusaDrafter, ModelDrafter,
                       NgramDrafter, check_min_match, truncated_verifier)
from .families import (check_confidence, check_min_confidence_value, evaluator_of, learned_drafter,
                       learned_methods)
from .static_model import StaticCausalLM
from .tree import Tree, build_tree, expected_accept_length

OTHER_METHODS = ("ngram", "hybrid", "draft-model", "truncated", "none")  # besides one per drafter family


def methods() -> tuple[str, ...]:
    """Every ``method``: each registered drafter family's (``medusa``, ``eagle``, ...), then the others."""
    return learned_methods() + OTHER_METHODS


PLANNER_TREES = (4, 8, 16, 32, 64)  # the Medusa planner's tree sizes


@dataclass(frozen=True)
class Settings:
    """How to draft and decode (:func:`evaluate_drafter`'s keyword arguments, checked)."""

    method: str = "medusa"
    k: int = 4
    tree: str | None = None
    dynamic_tree: tuple[int, int, int] | None = None
    lookup: int = 0
    min_confidence: float = 0.0
    draft_layers: int = 1
    min_match: int = 2
    min_match_sampled: int = 4
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    compile: bool = False
    seed: int = 0

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_p, self.top_k)

    @property
    def auto_nodes(self) -> int | None:
        """N of ``tree="auto:N"`` (the best N-node tree from measured rank accuracies); None for other trees."""
        return int(self.tree[5:]) if self.tree and self.tree.startswith("auto:") else None

    def check(self) -> None:
        if self.method not in methods():
            raise SpectrainError(f"method must be one of {', '.join(methods())}, got {self.method!r}")
        if self.k < 0:
            raise SpectrainError(f"k must be >= 0, got {self.k}")
        if self.max_new_tokens < 1:
            raise SpectrainError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.method == "hybrid":
            check_min_match(self.min_match, self.min_match_sampled)
        if not isinstance(self.lookup, int) or self.lookup < 0:
            raise SpectrainError(f"--lookup must be an integer >= 0 (0: k), got {self.lookup!r}")
        if self.lookup and self.method != "hybrid":
            raise SpectrainError(f"--lookup is the hybrid's lookup length; --method {self.method} has no lookup")
        check_min_confidence_value(self.min_confidence)
        if self.min_confidence and self.method not in learned_methods() + ("hybrid",):
            raise SpectrainError(f"--min_confidence cuts a learned drafter's chain; --method {self.method} has none")
        if self.min_confidence and (not self.k or self.tree or self.dynamic_tree):
            raise SpectrainError("--min_confidence cuts chains: give --k > 0 and no --tree / --dynamic_tree (evaluate "
                                 "trees in a run of their own)")
        if self.tree and self.tree.startswith("auto:") and not (self.tree[5:].isdigit() and int(self.tree[5:]) > 0):
            raise SpectrainError(f"--tree auto:N takes a node count N >= 1, got {self.tree!r}")


@dataclass
class EvalResult:
    """What :func:`evaluate_drafter` measured.

    ``results``: per setting (``"ar"``, ``"chain-4"``, ``"tree-32"``, ``"dynamic-6x8-64"``) τ, α by depth, the
    accept-length histogram, tokens/s, ms per token, speedup over AR (measured and ideal) and whether every T = 0
    output equals AR's; ``per_prompt``: per setting, every turn's tokens and rounds; ``costs``: verify / draft
    milliseconds per round; ``planner``: expected speedups by chain length (and tree size, Medusa);
    ``calibration``: Medusa heads' rank accuracies, KL and TV on AR's outputs."""

    method: str
    device: str
    dtype: str
    batch_invariant: bool
    sampling: dict
    draft_vocab: int | None
    num_prompts: int
    max_new_tokens: int
    chat_template: bool
    results: dict[str, dict]
    per_prompt: dict[str, list[dict]]
    costs: dict | None = None
    planner: dict | None = None
    calibration: dict | None = None
    hf_generate: dict | None = None
    compile: dict | None = None
    eval_seconds: float = 0.0
    decoder: str = "llama"
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


# -------------------------------------------------------------------------------------------- drafters


def load_drafter(path: str, verifier: Verifier, method: str | None = None, allow_mismatch: bool = False):
    """Any drafter (a run dir or an export in any format) on the verifier's device and dtype, in eval mode.

    ``method`` ``"medusa"`` / ``"eagle"`` refuses the other kind. The drafter's recorded verifier is matched by
    signature, not by name (:func:`~spectrain.heads.verifier.match_verifier`: architecture, model type, vocabulary,
    width, depth, tokenizer, whichever both sides record): a differing field is refused unless ``allow_mismatch``;
    another name with an agreeing signature loads, with a warning (also kept as ``drafter.verifier_note``). Sizes
    are always checked."""
    if not path:
        raise SpectrainError(f"--method {method} needs --drafter (a train_medusa / train_eagle run directory or "
                             "an export)")
    drafter = import_drafter(path, verifier_model=verifier.model)
    note = match_verifier(recorded_verifier(path), verifier, allow_mismatch, where=f"drafter {path}")
    if note:
        warnings.warn(note, stacklevel=2)
    drafter.verifier_note = note
    family = family_of(drafter)
    if method in learned_methods() and method != family.name:
        raise SpectrainError(f"{path} holds a drafter of the {family.label} family: use --method {family.name}")
    param = next(verifier.model.parameters())
    drafter.ranking = load_ranking(path)  # its training data's token counts (ranked draft heads), or None
    return drafter.to(param.device, param.dtype).eval()


def resolve_draft_vocab(learned, draft_vocab: int | None, vocab_size: int) -> tuple[torch.Tensor | None, int | None]:
    """The ranked draft vocabulary of ``learned`` (a Medusa / EAGLE module or None): ((N,) target ids or None for
    the drafter's own head, the N it drafts over; None without a learned drafter). ``draft_vocab``: None = the
    size it trained over (its ranking's default), 0 = full, N = the N most frequent of its training tokens."""
    if learned is None:
        if draft_vocab:
            raise SpectrainError("--draft_vocab applies to a learned drafter (medusa, eagle, dflash, hybrid)")
        return None, None
    if getattr(learned, "is_eagle3", False):
        if draft_vocab is not None:
            raise SpectrainError("an EAGLE-3 drafter drafts over the draft vocabulary it was trained with "
                                 f"({learned.config.draft_vocab_size} tokens): --draft_vocab is for Medusa, EAGLE-1 and DFlash")
        return None, learned.config.draft_vocab_size
    ranking = getattr(learned, "ranking", None)
    if ranking is not None and ranking.vocab_size != vocab_size:
        raise SpectrainError(f"the drafter's vocab_ranking.json counts {ranking.vocab_size} tokens, the verifier "
                             f"has {vocab_size}: it belongs to another verifier")
    if draft_vocab is None:
        ids = ranking.ids() if ranking is not None else None
    elif draft_vocab == 0:
        ids = None
    else:
        if not isinstance(draft_vocab, int) or isinstance(draft_vocab, bool) or draft_vocab < 0:
            raise SpectrainError(f"--draft_vocab must be an integer >= 0 (0 = full), got {draft_vocab!r}")
        if draft_vocab > vocab_size:
            raise SpectrainError(f"--draft_vocab {draft_vocab} exceeds the verifier's vocabulary of {vocab_size}")
        if ranking is None:
            raise SpectrainError("--draft_vocab N needs the drafter's token counts (vocab_ranking.json beside its "
                                 "weights, written by training); this drafter has none: use --draft_vocab 0, or "
                                 "write one with spectrain-rank-vocab")
        ids = ranking.ids(draft_vocab)
    return ids, vocab_size if ids is None else ids.numel()


def learned_kind(method: str, learned) -> str:
    """The learned drafter's kind behind ``method`` (hybrid: the family of the drafter it was given)."""
    if method != "hybrid":
        return method
    return family_of(learned).name


def lookup_length(s: Settings, tree: Tree | None = None) -> int:
    """A hybrid's lookup branch (0 for other methods): ``lookup``, else ``k``, else as deep as the setting's tree
    (``tree``, once built; before that a static tree's depth, a dynamic tree's, or for ``auto:N`` the bound N)."""
    if s.method != "hybrid":
        return 0
    if s.lookup or s.k:
        return s.lookup or s.k
    if tree is not None:
        return tree.max_depth
    if s.auto_nodes:
        return s.auto_nodes  # a depth bound: sizes only bucket the compile
    if s.tree:
        return Tree.load(s.tree).max_depth
    return s.dynamic_tree[0] if s.dynamic_tree else 0


def verify_sizes(s: Settings) -> list[int]:
    """Every verifier forward size the job decodes with: AR's 1, and 1 + each chain, tree or dynamic-tree budget
    (a hybrid's static tree gains its lookup branch; a dynamic budget already holds it)."""
    if s.method == "none":
        return [1]
    sizes, lookup = [s.k], lookup_length(s)
    if s.method == "hybrid" and s.k and lookup != s.k:  # a chain's lookup rounds bring their own length
        sizes.append(lookup)
    if s.auto_nodes:
        sizes.append(s.auto_nodes + lookup)
    elif s.tree:
        sizes.append(Tree.load(s.tree).size + lookup)
    if s.dynamic_tree:
        sizes.append(s.dynamic_tree[2])
    if s.min_confidence:  # a cut chain verifies any length up to k
        sizes += list(range(1, s.k))
    return [1] + sorted({1 + n for n in sizes})


def dynamic_name(dynamic_tree: tuple[int, int, int]) -> str:
    depth, topk, budget = dynamic_tree
    return f"dynamic-{depth}x{topk}-{budget}"


def make_trees(s: Settings, learned, calibration: dict | None) -> dict[str, Tree]:
    """The job's settings by name: a chain of k, a static tree, a dynamic tree (its depth sizes the metrics)."""
    kind = learned_kind(s.method, learned)
    trees = {}
    if s.k > 0:
        trees[f"chain-{s.k}"] = Tree.chain(s.k)
    if s.tree:
        if s.auto_nodes:
            if calibration is None:
                raise SpectrainError("--tree auto:N needs measured rank accuracies (Medusa drafters)")
            trees[f"tree-{s.auto_nodes}"] = build_tree(calibration["rank_accuracy"], s.auto_nodes)
        else:
            tree = Tree.load(s.tree)
            trees[f"tree-{tree.size}"] = tree
    evaluator = evaluator_of(family_named(kind)) if kind in learned_methods() else None
    if s.dynamic_tree:
        if kind not in ("draft-model", "truncated") and not (evaluator and evaluator.dynamic_trees):
            growing = [f.name for f in families() if evaluator_of(f).dynamic_trees]
            raise SpectrainError(f"--dynamic_tree needs a drafter that drafts autoregressively "
                                 f"({', '.join(growing)}, draft-model, truncated, or hybrid with a "
                                 f"{' or '.join(growing)} drafter)")
        trees[dynamic_name(s.dynamic_tree)] = Tree.chain(s.dynamic_tree[0])
    if s.method != "none" and not trees:
        raise SpectrainError("nothing to evaluate: give --k > 0 and/or --tree")
    depth = evaluator.max_depth(learned) if evaluator else None
    for name, tree in trees.items():
        if depth is not None and tree.max_depth > depth:
            raise SpectrainError(f"{name} is {tree.max_depth} deep but the drafter drafts at most {depth} deep")
        static = not tree.is_chain and not name.startswith("dynamic")
        if static and (s.method in ("ngram", "draft-model", "truncated") or (evaluator and not evaluator.static_trees)):
            raise SpectrainError(f"--method {s.method} drafts chains only; drop --tree")
    return trees


def build_drafter(s: Settings, tree: Tree, model, learned, draft_model, max_len: int, name: str = "",
                  vocab: torch.Tensor | None = None) -> Drafter:
    """The drafter of one setting (``model``: the verifier's HF model; ``learned``: the learned drafter;
    ``vocab``: its ranked draft vocabulary, (N,) target ids, or None for its own)."""
    if s.method == "hybrid":
        return build_hybrid(s, tree, model, learned, name, vocab)
    if s.method in learned_methods():  # the family's own drafter (eval/families.py); chains may be cut by confidence
        if name.startswith("dynamic"):
            return learned_drafter(learned, model, tree, s.dynamic_tree, vocab)
        return learned_drafter(learned, model, tree, vocab=vocab, min_confidence=s.min_confidence)
    if name.startswith("dynamic"):
        small = truncated_verifier(model, s.draft_layers) if s.method == "truncated" else draft_model
        return DynamicTreeDrafter(small, *s.dynamic_tree, max_len)
    if s.method == "ngram":
        return NgramDrafter(tree.size)
    if s.method == "truncated":
        return ModelDrafter(truncated_verifier(model, s.draft_layers), tree.size, max_len)
    if s.method == "draft-model":
        return ModelDrafter(draft_model, tree.size, max_len)
    return Autoregressive()


def build_hybrid(s: Settings, tree: Tree, model, learned, name: str, vocab: torch.Tensor | None = None) -> HybridDrafter:
    """Prompt lookup + the learned drafter: a chain switches per round; a tree gains the lookup branch (a dynamic
    tree's budget keeps room for it, so the whole tree stays within the dynamic tree's budget)."""
    k = lookup_length(s, tree)
    options = dict(min_match=s.min_match, min_match_sampled=s.min_match_sampled)
    if name.startswith("dynamic"):
        depth, topk, budget = s.dynamic_tree
        if budget <= k:
            raise SpectrainError(f"--dynamic_tree budget {budget} leaves no room beside the lookup branch of {k}")
        inner = learned_drafter(learned, model, tree, (depth, topk, budget - k), vocab)
        return HybridDrafter(inner, k, merge=True, **options)
    inner = learned_drafter(learned, model, tree, vocab=vocab,
                            min_confidence=s.min_confidence if tree.is_chain else 0.0)
    if tree.is_chain:  # lookup rounds draft ``lookup`` tokens (default: the chain's k)
        return HybridDrafter(inner, tree.size, merge=False, lookup=s.lookup or None, **options)
    return HybridDrafter(inner, k, merge=True, **options)


# -------------------------------------------------------------------------------------------- runs


def encode_turn(tokenizer, history: list[dict], use_template: bool) -> list[int]:
    if use_template:
        return tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True, return_dict=False)
    return tokenizer("\n".join(m["content"] for m in history), add_special_tokens=False)["input_ids"]


def eos_ids(tokenizer) -> set[int]:
    return {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()


def run_prompts(runner: StaticCausalLM, drafter: Drafter, prompts: list[list[str]], tokenizer, use_template: bool,
                s: Settings) -> list[dict]:
    """Generate every turn of every prompt (later turns see the earlier answers, as MT-bench does)."""
    generator = torch.Generator(device=runner.device).manual_seed(s.seed)
    eos = eos_ids(tokenizer)
    records = []
    for i, turns in enumerate(prompts):
        history, record = [], {"prompt": i, "turns": []}
        for turn in turns:
            history.append({"role": "user", "content": turn})
            ids = encode_turn(tokenizer, history, use_template)
            if len(ids) + s.max_new_tokens + drafter.max_nodes + 1 > runner.max_len:
                raise SpectrainError(f"prompt {i}: {len(ids)} prompt tokens + max_new_tokens {s.max_new_tokens} "
                                     f"exceed the verifier's context of {runner.max_len}")
            gen = generate(runner, drafter, ids, s.max_new_tokens, s.sampling, eos, generator)
            history.append({"role": "assistant", "content": tokenizer.decode(gen.tokens, skip_special_tokens=True)})
            record["turns"].append(turn_record(ids, gen))
        records.append(record)
    return records


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
                s: Settings, eos: set[int]) -> dict:
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


def hf_generate_speed(model, tokenizer, prompts: list[list[str]], use_template: bool, s: Settings,
                      n: int) -> dict | None:
    """HF ``generate()`` tokens/s on the first n prompts (greedy or sampled as configured, warm-up excluded)."""
    if n <= 0:
        return None
    ids = [encode_turn(tokenizer, [{"role": "user", "content": p[0]}], use_template) for p in prompts[:n]]
    kwargs = dict(max_new_tokens=s.max_new_tokens, do_sample=s.temperature > 0, pad_token_id=tokenizer.pad_token_id)
    if s.temperature > 0:
        kwargs.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or None)
    device = next(model.parameters()).device
    compiled = s.compile and device.type == "cuda"
    forward = model.forward
    if compiled:  # HF's fast path: static cache + compiled forward
        kwargs["cache_implementation"] = "static"
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    try:
        # Warm-up (and compilation) excluded: compiled, every prompt length is a prefill shape of its own.
        for x in (ids if compiled else ids[:1]):
            for _ in range(2 if compiled else 1):
                model.generate(torch.tensor([x], device=device), **kwargs)
        tokens, seconds = 0, 0.0
        for x in ids:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model.generate(torch.tensor([x], device=device), **kwargs)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds += time.perf_counter() - t0
            tokens += out.shape[1] - len(x)
    finally:
        model.forward = forward  # the caller's model is left as it was given
    return {"prompts": len(ids), "new_tokens": tokens, "tokens_per_second": tokens / max(seconds, 1e-9)}


# -------------------------------------------------------------------------------------------- the API


def evaluate_drafter(verifier: Verifier, prompts: list[list[str]], *, method: str = "medusa", drafter=None,
                     draft_model: torch.nn.Module | None = None, k: int = 4, tree: str | None = None,
                     dynamic_tree: tuple[int, int, int] | None = None, lookup: int = 0, min_confidence: float = 0.0,
                     draft_layers: int = 1,
                     min_match: int = 2, min_match_sampled: int = 4, max_new_tokens: int = 128,
                     temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, chat_template: bool | None = None,
                     compile: bool = False, hf_generate: int = 3, costs: bool = True,
                     reference: list[dict] | None = None, max_len: int | None = None, seed: int = 0,
                     batch_invariant: bool | None = None, draft_vocab: int | None = None,
                     decoder: str = "auto") -> EvalResult:
    """Decode ``prompts`` with AR and with every drafting setting the arguments name; measure τ, α, speed.

    Args:
        verifier: the loaded verifier (:func:`spectrain.heads.verifier.load_verifier`); its device and dtype are
            the run's.
        prompts: per prompt its user turns (later turns see the earlier answers, as MT-bench does).
        method: ``medusa`` | ``eagle`` | ``ngram`` | ``hybrid`` (prompt lookup + ``drafter``) | ``draft-model``
            | ``truncated`` (the verifier's first ``draft_layers`` layers) | ``none`` (AR only).
        drafter: the learned drafter (:func:`load_drafter`) for medusa / eagle / hybrid.
        draft_model: a causal LM with the verifier's vocabulary, for ``draft-model``.
        k: chain length (drafts per round); 0 skips the chain.
        tree: a static tree as JSON rank paths (inline or a file), or ``auto:N`` for the best N-node tree from
            the Medusa heads' rank accuracies measured on AR's outputs.
        dynamic_tree: ``(depth, topk, budget)`` of an EAGLE-2 dynamic tree (eagle, draft-model, truncated, hybrid).
        lookup: the tokens a hybrid's lookup round drafts: a chain's lookup rounds (default ``k``) and a tree's
            lookup branch (default ``k``, else the tree's depth).
        min_confidence: a chain (alone or a hybrid's learned rounds) verifies only the drafts its confidence head
            expects to survive, the longest prefix with predicted whole-prefix acceptance >= this (DSpark drafters
            with a confidence head; 0: every draft).
        min_match, min_match_sampled: a hybrid's lookup threshold at T = 0 and at T > 0.
        temperature, top_p, top_k: decoding (T = 0: greedy, where every output must equal AR's).
        chat_template: render turns with the tokenizer's chat template (None: when it has one).
        compile: compile one graph per verify size, warmed up before anything is timed.
        hf_generate: prompts also timed with HF ``generate()`` (0: skip).
        costs: probe verify / draft costs in isolation (``EvalResult.costs``) and run the planner (without them
            a Medusa drafter is calibrated only when ``tree`` is ``auto:N``); every setting's own costs and ideal
            speedup come from its rounds either way.
        reference: AR records of these prompts from an earlier call (``result.per_prompt["ar"]``): reused
            instead of decoding AR again.
        max_len: KV-cache positions (default: what the longest prompt's turns need).
        seed: the sampling generator's seed, the same for every setting.
        batch_invariant: decode so that each token's numbers do not depend on the forward's width
            (:class:`~.static_model.StaticCausalLM`); then low-precision chains equal AR token for token.
            None: on in bf16 / fp16 on a CPU, off on CUDA and in fp32.
        draft_vocab: Medusa / EAGLE-1 / DFlash: draft over the N most frequent tokens of the drafter's training data
            (its ``vocab_ranking.json``); 0 = the full vocabulary; None = the vocabulary it trained over (full
            when it records none). Verification is always over the full vocabulary.
        decoder: the verifier's forward — ``llama`` (our hand-written Llama-family layer), ``layers`` (the
            model's own decoder layers over our cache: any family) or ``auto`` (``llama`` where it applies).
    """
    if method == "none":  # AR only: no chain, no costs to probe, nothing to plan
        k, costs = 0, False
    s = Settings(method=method, k=k, tree=tree, dynamic_tree=tuple(dynamic_tree) if dynamic_tree else None,
                 lookup=lookup, min_confidence=min_confidence, draft_layers=draft_layers, min_match=min_match,
                 min_match_sampled=min_match_sampled,
                 max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, compile=compile,
                 seed=seed)
    s.check()
    if (method in learned_methods() or method == "hybrid") and drafter is None:
        raise SpectrainError(f"method {method} needs a drafter")
    if method == "draft-model" and draft_model is None:
        raise SpectrainError("method draft-model needs a draft_model")
    if not prompts or not all(isinstance(p, (list, tuple)) and p and all(isinstance(t, str) for t in p)
                              for p in prompts):
        raise SpectrainError("prompts must be a non-empty list of prompts, each a non-empty list of user turns (str)")
    if method in learned_methods() and family_of(drafter).name != method:  # an unregistered drafter: refused
        raise SpectrainError(f"method {method} got a {type(drafter).__name__}: use method {family_of(drafter).name}")
    if s.min_confidence:  # before anything is decoded
        check_confidence(drafter)
    if reference is not None and [len(r["turns"]) for r in reference] != [len(p) for p in prompts]:
        raise SpectrainError("reference holds AR records of other prompts (turn counts differ)")
    model, tokenizer = verifier.model, verifier.tokenizer
    param = next(model.parameters())
    device, sampling = param.device, s.sampling
    torch.manual_seed(seed)
    context = max_context(verifier.config)
    if max_new_tokens >= context:
        raise SpectrainError(f"--max_new_tokens {max_new_tokens} is beyond the verifier's context of {context}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    use_template = has_template if chat_template is None else chat_template
    if use_template and not has_template:
        raise SpectrainError("chat template on, but the verifier's tokenizer has no chat template")
    vocab, vocab_size = resolve_draft_vocab(drafter if method in learned_methods() + ("hybrid",) else None,
                                            draft_vocab, model.get_output_embeddings().weight.shape[0])
    if max_len is None:
        longest = max(len(encode_turn(tokenizer, [{"role": "user", "content": t}], use_template))
                      for p in prompts for t in p)
        widest = max(verify_sizes(s))  # the widest verify pass (a hybrid's lookup rounds included)
        max_len = min(context, max(len(p) for p in prompts) * (longest + max_new_tokens + 16) + max(80, widest))
    # Verifier layers the drafter reads besides the last hidden state (EAGLE-3's fused layers, DFlash's targets).
    evaluator = (evaluator_of(family_of(drafter)) if drafter is not None and method in learned_methods() + ("hybrid",)
                 else None)
    captured = evaluator.capture(drafter) if evaluator else ()
    rank_trees = bool(evaluator and evaluator.rank_trees)
    runner = StaticCausalLM(model, max_len=max_len, device=device, static=True if compile else None,
                            batch_invariant=batch_invariant, path=decoder)
    compile_seconds = None
    if compile:  # every size compiled and warmed up here, before anything is timed
        runner.capture = captured  # kept by every drafter's run: one set of graphs
        planner_sizes = list(range(2, k + 2)) + ([1 + n for n in PLANNER_TREES] if rank_trees else [])
        compile_seconds = runner.compile(verify_sizes(s) + (planner_sizes if costs else []))

    t0 = time.time()
    ar_records = reference if reference is not None else run_prompts(runner, Autoregressive(), prompts, tokenizer,
                                                                     use_template, s)
    results = {"ar": summarize(ar_records, 0)}
    per_prompt = {"ar": ar_records}
    calibration = None
    if rank_trees and (costs or s.auto_nodes):  # rank accuracies measured on AR's outputs (Medusa heads)
        probe = MedusaDrafter(drafter, model.get_output_embeddings(), Tree.chain(drafter.config.num_heads))
        seqs = [t["sequence"] for r in ar_records for t in r["turns"]]
        starts = [t["prompt_tokens"] for r in ar_records for t in r["turns"]]
        calibration = medusa_diagnostics(runner, probe, seqs, starts, temperature=max(temperature, 1.0),
                                         decoding=sampling)
    trees = make_trees(s, drafter, calibration)

    if costs:
        probe_prompt = encode_turn(tokenizer, [{"role": "user", "content": prompts[0][0]}], use_template)
        state = probe_state(runner, probe_prompt, sampling, captured)
        t_decode = verify_cost(runner, Tree.chain(0), len(probe_prompt))
        cost_table = {"context_tokens": len(probe_prompt), "t_decode_ms": 1000 * t_decode, "settings": {}}
    t_verify, t_draft = {}, {}
    for name, shape_tree in trees.items():
        spec = build_drafter(s, shape_tree, model, drafter, draft_model, max_len, name, vocab)
        records = run_prompts(runner, spec, prompts, tokenizer, use_template, s)
        # A hybrid's lookup branch reaches its own depth whatever the learned tree's depth.
        summary = summarize(records, max(shape_tree.max_depth, lookup_length(s, shape_tree)))
        same = identical_turns(ar_records, records)
        summary.update(tree_size=spec.max_nodes, tree_paths=[list(p) for p in shape_tree.paths], draft_vocab=vocab_size,
                       speedup=results["ar"]["decode_ms_per_token"] / max(summary["decode_ms_per_token"], 1e-9),
                       identical_turns=same,
                       identical_to_ar=sampling.greedy and same == sum(len(r["turns"]) for r in records))
        if s.min_confidence:  # chains only (checked): a cut chain's rounds verify fewer than k drafts
            summary["min_confidence"] = s.min_confidence
        if isinstance(spec, HybridDrafter):
            summary["lookup_round_fraction"] = round(spec.lookup_rounds / max(spec.rounds, 1), 4)
        if sampling.greedy:
            summary["divergences"] = divergences(runner, spec, ar_records, records, s, eos_ids(tokenizer))
        if calibration is not None and not shape_tree.is_chain:
            summary["expected_accept_length"] = expected_accept_length(shape_tree.paths, calibration["rank_accuracy"])
        summary.update(in_loop_costs(summary, results["ar"]))
        if costs and not s.min_confidence:  # isolated probes at one context length: what the planner prices
            # settings not run with (not for a cut chain: its verify width changes every round)
            # A hybrid chain's own rounds verify k + 1 (its lookup rounds bring their own length); a merged or
            # dynamic tree verifies its whole budget.
            own_chain = isinstance(spec, HybridDrafter) and not spec.merge
            verified = shape_tree if spec.max_nodes == shape_tree.size or own_chain else Tree.chain(spec.max_nodes)
            tv, td = verify_cost(runner, verified, len(probe_prompt)), draft_cost(spec, state)
            cost_table["settings"][name] = {"t_verify_ms": 1000 * tv, "t_draft_ms": 1000 * td,
                                            "draft_over_verify": td / max(tv, 1e-12),
                                            "ideal_speedup": summary["tau"] * t_decode / max(tv + td, 1e-12)}
            if shape_tree.is_chain and not name.startswith("dynamic"):
                t_verify[shape_tree.size], t_draft[shape_tree.size] = tv, td
        results[name] = summary
        per_prompt[name] = records
    planner = None
    if costs and not s.min_confidence:  # a cut chain's α counts only the rounds its head extended: not a chain's
        planner = plan_speedups(s, results, trees, runner, model, drafter, draft_model, max_len, calibration, state,
                                t_decode, t_verify, t_draft, len(probe_prompt), vocab)
    hf = hf_generate_speed(model, tokenizer, prompts, use_template, s, hf_generate)
    return EvalResult(
        method=method, device=str(device), dtype=str(param.dtype).replace("torch.", ""), sampling=asdict(sampling),
        batch_invariant=runner.batch_invariant, draft_vocab=vocab_size,
        num_prompts=len(prompts), max_new_tokens=max_new_tokens, chat_template=use_template, results=results,
        per_prompt=per_prompt, costs=cost_table if costs else None, planner=planner, calibration=calibration,
        hf_generate=hf, compile=None if compile_seconds is None else {"seconds": compile_seconds,
                                                                       "buckets": list(runner.buckets)},
        eval_seconds=time.time() - t0, decoder=runner.path)


def plan_speedups(s: Settings, results: dict, trees: dict, runner, model, learned, draft_model, max_len: int,
                  calibration, state, t_decode: float, t_verify: dict, t_draft: dict, context: int,
                  vocab: torch.Tensor | None = None) -> dict | None:
    """Expected speedup of every chain length up to the measured depth (and, for Medusa, of trees of every size
    from the measured rank accuracies), from measured α and per-round costs.

    Where a chain was decoded, its rounds and AR's price the sizes not run (isolated probes at one context read
    high and noisy on a small CPU, so they only give shapes): a verify pass linear in its tokens between AR's
    round (1 token) and the chain's (k + 1), drafting as the chain's scaled by the isolated drafts' ratio
    (sequential drafters grow with n, one-pass ones do not), the rest of a round as the chain's; a Medusa tree's
    verify pass is its isolated cost scaled by the chain's in-loop / isolated ratio. Speedups are over AR's
    measured ms per token. Without a chain, the isolated costs alone."""
    chain = next((results[n] for n in trees if n.startswith("chain")), None)
    planner = None
    in_loop = (chain is not None and s.k in t_verify and chain.get("round_ms") is not None
               and results["ar"].get("round_ms") is not None)
    if chain is not None:
        # A hybrid's α reaches its lookup rounds' depth; the chains priced are the learned drafter's (up to k).
        depth = min(len(chain["alpha"]), s.k) if s.method == "hybrid" else len(chain["alpha"])
        for n in range(1, depth + 1):
            if n not in t_verify:
                t_verify[n] = verify_cost(runner, Tree.chain(n), context)
                # Heads that draft every depth in one pass (rank-tree families) cost the same for any chain.
                t_draft[n] = (t_draft.get(depth, 0.0) if calibration is not None else
                              draft_cost(build_drafter(s, Tree.chain(n), model, learned, draft_model, max_len,
                                                       vocab=vocab), state))
        priced_verify, priced_draft = dict(t_verify), dict(t_draft)
        if in_loop:
            loop, ar = {p: v / 1000 for p, v in chain["round_ms"].items()}, results["ar"]["round_ms"]["verify"] / 1000
            t_decode = results["ar"]["decode_ms_per_token"] / 1000
            # AR's round may come from another call (a reused reference): a chain never priced below it.
            slope = max(loop["verify"] - ar, 0.0) / s.k
            priced_verify = {n: ar + slope * n + loop["other"] for n in t_verify}
            probe_k = t_draft.get(s.k, 0.0)
            priced_draft = {n: loop["draft"] * (t_draft.get(n, 0.0) / probe_k if probe_k > 0 else 1.0)
                            for n in t_verify}
        planner = {"chains": plan(chain["alpha"], t_decode, priced_verify, priced_draft),
                   "priced_by": "in-loop rounds" if in_loop else "isolated probes",
                   "priced_ms": {n: {"verify": 1000 * priced_verify[n], "draft": 1000 * priced_draft.get(n, 0.0)}
                                 for n in sorted(priced_verify)}}
        planner["best_chain"] = max(planner["chains"], key=lambda r: r["expected_speedup"], default=None)
        planner["measured_chain"] = {"n": s.k, "speedup": chain["speedup"]}
    if calibration is not None:  # trees of every size from the measured rank accuracies
        planner = planner or {"priced_by": "isolated probes"}
        planner["trees"] = []
        verify_scale, rest, draft = 1.0, 0.0, t_draft.get(s.k, 0.0)
        if in_loop:
            verify_scale = chain["round_ms"]["verify"] / 1000 / max(t_verify[s.k], 1e-12)
            rest, draft = chain["round_ms"]["other"] / 1000, chain["round_ms"]["draft"] / 1000
        for size in PLANNER_TREES:
            tree = build_tree(calibration["rank_accuracy"], size)
            cost = max(verify_cost(runner, tree, context) * verify_scale + draft + rest, 1e-12)
            tau_n = 1 + expected_accept_length(tree.paths, calibration["rank_accuracy"])
            planner["trees"].append({"n": size, "expected_tau": tau_n, "expected_speedup": tau_n * t_decode / cost})
        planner["best_tree"] = max(planner["trees"], key=lambda r: r["expected_speedup"])
    return planner

