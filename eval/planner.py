"""The planner: expected speedups of the chains and trees an evaluation did not decode, priced from the ones it
did (:func:`plan_speedups`)."""

from __future__ import annotations

from .costs import draft_cost, plan, verify_cost
from .methods import DraftInputs, EvalMethod
from .settings import DraftShape, EvalSettings, TreeKind
from .tree import Tree, build_tree, expected_accept_length

PLANNER_TREES = (4, 8, 16, 32, 64)  # the tree sizes the planner prices (rank-tree families)


def plan_speedups(s: EvalSettings, method: EvalMethod, results: dict, shapes: list[DraftShape], inputs: DraftInputs,
                  calibration, state, t_decode: float, t_verify: dict, t_draft: dict, context: int) -> dict | None:
    """Expected speedup of every chain length up to the measured depth (and, for a rank-tree family, of trees of
    every size from the measured rank accuracies), from measured α and per-round costs.

    Where a chain was decoded, its rounds and AR's price the sizes not run (isolated probes at one context read
    high and noisy on a small CPU, so they only give shapes): a verify pass linear in its tokens between AR's
    round (1 token) and the chain's (k + 1), drafting as the chain's scaled by the isolated drafts' ratio
    (sequential drafters grow with n, one-pass ones do not), the rest of a round as the chain's; a rank tree's
    verify pass is its isolated cost scaled by the chain's in-loop / isolated ratio. Speedups are over AR's
    measured ms per token. Without a chain, the isolated costs alone."""
    chain = next((results[shape.name] for shape in shapes if shape.kind is TreeKind.CHAIN), None)
    runner = inputs.runner
    planner = None
    in_loop = (chain is not None and s.k in t_verify and chain.get("round_ms") is not None
               and results["ar"].get("round_ms") is not None)
    if chain is not None:
        # A lookup method's α reaches its lookup rounds' depth; the chains priced are the learned drafter's (up to k).
        depth = min(len(chain["alpha"]), s.k) if method.lookup else len(chain["alpha"])
        for n in range(1, depth + 1):
            if n not in t_verify:
                t_verify[n] = verify_cost(runner, Tree.chain(n), context)
                # Heads that draft every depth in one pass (rank-tree families) cost the same for any chain.
                t_draft[n] = (t_draft.get(depth, 0.0) if calibration is not None else
                              draft_cost(method.drafter(s, DraftShape.chain(n), inputs), state))
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
