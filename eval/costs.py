"""Measured costs and the planner: which N (or tree size) is worth it on this hardware.

Costs are timed in isolation (CUDA events on GPU, perf_counter on CPU) at a
fixed context length: T_decode = one verifier token, T_verify(n) = the verifier
on 1 + n tokens with a tree mask, T_draft = one ``propose`` of the drafter.
They shape the planner's prices for sizes that were not decoded; a decoded
setting's own costs (and its ideal speedup) come from its rounds
(``Generation.round_seconds``, ``evaluate.in_loop_costs``).
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from spectrain.heads.errors import SpectrainError

from .accept import Sampling
from .decode import verify_mask_rows
from .drafters import Drafter, DraftState
from .metrics import expected_tau
from .static_model import StaticCausalLM
from .tree import Tree


def _timer(device: torch.device, fn, repeats: int) -> float:
    """Median seconds of ``fn()`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def verify_cost(runner: StaticCausalLM, tree: Tree, context: int, repeats: int = 10) -> float:
    """Seconds of one verifier forward over [root] + tree at ``context`` committed tokens."""
    tree = tree.to(runner.device)
    rows = verify_mask_rows(tree)
    positions = torch.cat([tree.depth.new_zeros(1), tree.depth])
    ids = torch.zeros(tree.size + 1, dtype=torch.long, device=runner.device)

    def run():
        runner.length = context
        runner.forward(ids, positions=context + positions, mask=runner.tree_mask(rows))

    cost = _timer(runner.device, run, repeats)
    runner.reset()
    return cost


@torch.no_grad()
def draft_cost(drafter: Drafter, state: DraftState, repeats: int = 10) -> float:
    """Seconds per ``propose`` of ``drafter`` after ``state``. A hybrid is timed by its learned drafter: a lookup
    round costs next to nothing, so this is the cost of the rounds that cost anything (an upper bound)."""
    drafter = getattr(drafter, "learned", drafter)
    if drafter.tree.size == 0:
        return 0.0
    drafter.start(state, None)
    if drafter.wants_features:  # feed the prompt once; a round then feeds one new position (again) and drafts
        drafter.propose(state)
        state = replace(state, new_features=state.new_features[-1:], new_tokens=state.new_tokens[-1:])
        if hasattr(drafter, "rewind"):  # a drafter that checks its context positions: forget the re-fed one
            def run():
                drafter.rewind(1)
                drafter.propose(state)
            return _timer(state.tokens.device, run, repeats)
    if hasattr(drafter, "runner"):  # a model drafter: its prefill untimed, then rounds that feed one new token
        drafter.propose(state)
        keep, last = state.length - 1, state.tokens[state.length - 1:state.length]

        def run():  # its cache rolled back to before the last context token, which it feeds again
            drafter.runner.length, drafter.pending = keep, last
            drafter.propose(state)
    else:
        def run():
            drafter.propose(state)
    return _timer(state.tokens.device, run, repeats)


def plan(alpha: list[float | None], t_decode: float, t_verify: dict[int, float], t_draft: dict[int, float]) -> list[dict]:
    """Expected tau and speedup for every chain length with a measured cost (product form of alpha)."""
    measured = [a for a in alpha if a is not None]
    rows = []
    for n in sorted(t_verify):
        if n > len(measured):
            continue
        tau_n = expected_tau(measured, n)
        rows.append({"n": n, "expected_tau": tau_n,
                     "expected_speedup": tau_n * t_decode / (t_verify[n] + t_draft.get(n, 0.0))})
    return rows


def probe_state(runner: StaticCausalLM, prompt: list[int], sampling: Sampling,
                capture_layers: tuple[int, ...] = ()) -> DraftState:
    """A drafter state as the decoder hands it over after prefilling ``prompt[:-1]`` (for timing drafters in
    isolation): the root is ``prompt[-1]``, the features those of the positions before it, each paired with the
    token after it."""
    if len(prompt) < 2:
        raise SpectrainError("timing a drafter needs a prompt of at least 2 tokens (its first prompt has 1)")
    tokens = torch.zeros(runner.max_len, dtype=torch.long, device=runner.device)
    tokens[:len(prompt)] = torch.tensor(prompt, device=runner.device)
    runner.reset()
    runner.capture = capture_layers
    hidden = runner.forward(tokens[:len(prompt) - 1])
    runner.reset()
    return DraftState(tokens=tokens, length=len(prompt), hidden=hidden[-1], sampling=sampling, history=list(prompt),
                      new_features=runner.aux if capture_layers else hidden, new_tokens=tokens[1:len(prompt)])
