"""The speculative decoding loop (batch 1): prefill, then draft -> verify -> accept -> commit.

One verifier forward per round checks every candidate of the drafter's tree;
the round's single host sync reads the accepted path and the bonus token.
Plain autoregressive decoding is the same loop with the empty drafter, so the
baseline and the speculative runs share every line of the verifier path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from spectrain.heads.errors import SpectrainError

from .accept import Sampling, accept, accept_greedy, sample, target_probs
from .drafters import Drafter, DraftState, Probe
from .static_model import StaticCausalLM


@dataclass
class Generation:
    """One prompt's result. ``accept_lengths`` has one entry per verify round (prefill excluded)."""

    tokens: list[int]
    accept_lengths: list[int] = field(default_factory=list)
    emitted_per_round: list[int] = field(default_factory=list)
    #: each round's deepest draft (the verified tree's depth): a round of another depth than the drafter's own
    #: (a hybrid's lookup round, a chain cut by confidence) reaches only its own depths, which α must know
    drafted_depths: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    stop: str = "length"
    #: seconds of the rounds spent drafting (``propose``), in the verifier's pass (forward + logits) and on the
    #: rest (acceptance, the one host read, commit, bookkeeping, ``advance``), summed over rounds.
    round_seconds: dict = field(default_factory=lambda: {"draft": 0.0, "verify": 0.0, "other": 0.0})

    trace: "Trace | None" = None

    @property
    def verifier_forwards(self) -> int:
        return len(self.accept_lengths)


@dataclass
class Trace:
    """What the loop's own verifier passes decided each emitted token with (diagnostics, never in a timed run).

    ``top_values`` / ``top_ids``: (tokens, 2) fp32 logits and ids of the top 2 of the logits row that chose each
    emitted token (the prefill's row for token 0, then each round's root and accepted-path rows); ``row``: the
    whole (V,) fp32 row that chose token ``keep`` (None when ``keep`` is not reached).
    """

    keep: int | None = None
    top_values: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    row: torch.Tensor | None = None
    _rounds: list = field(default_factory=list)

    def record(self, rows: torch.Tensor, first: int) -> None:
        """``rows`` (m, V): the logits rows of emitted tokens ``first .. first + m - 1`` (kept on the device)."""
        self._rounds.append(rows.topk(2, dim=-1))
        if self.keep is not None and first <= self.keep < first + rows.shape[0]:
            self.row = rows[self.keep - first].clone()

    def close(self, tokens: int) -> None:
        if self._rounds:
            self.top_values = torch.cat([r.values for r in self._rounds])[:tokens].cpu()
            self.top_ids = torch.cat([r.indices for r in self._rounds])[:tokens].cpu()
        self.row = None if self.row is None else self.row.cpu()
        self._rounds = []


class RoundClock:
    """Stamps at a round's phase boundaries — start, drafted, verifier pass starts, verified — and one after the
    last round; summed per phase once the loop is over (the verify pass's preparation — a dynamic tree's mask,
    the ids — counts as "other", with acceptance and bookkeeping). A CPU runs ops as they are called, so ``perf_counter`` stamps time them; on
    CUDA the stamps are events recorded in the stream and read after the loop's final sync (no host sync inside
    a round)."""

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"
        self.stamps: list = []

    def stamp(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            self.stamps.append(event)
        else:
            self.stamps.append(time.perf_counter())

    def totals(self) -> dict:
        """``{"draft", "verify", "other"}`` seconds over every round (call after the device is synced)."""
        if self.cuda:
            gaps = [a.elapsed_time(b) / 1000 for a, b in zip(self.stamps, self.stamps[1:])]
        else:
            gaps = [b - a for a, b in zip(self.stamps, self.stamps[1:])]
        return {"draft": sum(gaps[0::4]), "verify": sum(gaps[2::4]), "other": sum(gaps[1::4]) + sum(gaps[3::4])}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def verify_mask_rows(tree) -> torch.Tensor:
    """(n+1, n+1) ancestor-or-self matrix over [root, nodes...]: every node also sees the root."""
    n = tree.size
    rows = torch.zeros(n + 1, n + 1, dtype=torch.bool, device=tree.ancestors.device)
    rows[:, 0] = True
    rows[1:, 1:] = tree.ancestors
    return rows


def with_probe_rows(rows: torch.Tensor, probe: Probe) -> torch.Tensor:
    """(n+1, n+1) tree rows -> (n+1+m, n+1+m) over [root, nodes..., probe nodes...]: a probe node sees the root
    and the probe nodes its mask names; tree nodes and probe nodes never see each other."""
    n1, m = rows.shape[0], probe.tokens.numel()
    out = torch.zeros(n1 + m, n1 + m, dtype=torch.bool, device=rows.device)
    out[:n1, :n1] = rows
    out[n1:, 0] = True
    out[n1:, n1:] = probe.mask
    return out


@torch.no_grad()
def generate(verifier: StaticCausalLM, drafter: Drafter, prompt: list[int], max_new_tokens: int,
             sampling: Sampling = Sampling(), eos_ids: set[int] | frozenset = frozenset(),
             generator: torch.Generator | None = None, trace: Trace | None = None) -> Generation:
    """Decode up to ``max_new_tokens`` after ``prompt`` (stopping at an EOS id, which is kept).

    ``trace``: also keep, for every emitted token, the top 2 of the verifier logits row that chose it (and one
    whole row), in ``Generation.trace`` — what the lossless check reads at a divergence."""
    device = verifier.device
    tree = drafter.tree.to(device)
    n = tree.size
    need = len(prompt) + max_new_tokens + drafter.max_nodes + 1
    if need > verifier.max_len:
        raise SpectrainError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) + draft ({drafter.max_nodes + 1}) = {need} "
                             f"tokens exceed the decoder's buffers ({verifier.max_len})")
    if not prompt:
        raise SpectrainError("empty prompt")
    if verifier.buckets and verifier.bucket(drafter.max_nodes + 1) is None:  # would run eagerly: say so instead
        raise SpectrainError(f"the decoder was compiled for forwards of up to {verifier.buckets[-1]} tokens; this "
                             f"drafter verifies {drafter.max_nodes + 1}: include that size in compile()")
    mask_rows = verify_mask_rows(tree)
    depth_positions = torch.cat([tree.depth.new_zeros(1), tree.depth])
    static_tree, static_mask_rows, static_depth_positions = tree, mask_rows, depth_positions
    static_depth = depth = tree.max_depth
    # the last tree a proposal brought, prepared (its mask rows, positions and depth: host work once per tree)
    brought_from = brought = brought_rows = brought_depths = brought_depth = None
    tokens = torch.zeros(verifier.max_len, dtype=torch.long, device=device)
    tokens[:len(prompt)] = torch.tensor(prompt, dtype=torch.long, device=device)

    _sync(device)
    t0 = time.perf_counter()
    verifier.reset()
    if drafter.capture_layers:  # else leave it: a compiled runner keeps the capture it was compiled with
        verifier.capture = drafter.capture_layers
    hidden = verifier.forward(tokens[:len(prompt)])
    verifier.commit(len(prompt))
    first_logits = verifier.logits(hidden[-1:])
    root = sample(target_probs(first_logits, sampling), generator)
    if trace is not None:
        trace.record(first_logits, 0)
    tokens[len(prompt)] = root[0]
    out = Generation(tokens=[int(root)])  # host sync: the prefill's token
    state = DraftState(tokens=tokens, length=len(prompt) + 1, hidden=hidden[-1], sampling=sampling, generator=generator,
                       history=list(prompt) + out.tokens)
    if drafter.wants_features:  # every prompt position's features, paired with the token after it
        state.new_features = verifier.aux if drafter.capture_layers else hidden
        state.new_tokens = tokens[1:len(prompt) + 1]
    drafter.start(state, verifier)
    _sync(device)
    out.prefill_seconds = time.perf_counter() - t0
    if out.tokens[0] in eos_ids:
        out.stop = "eos"
        if trace is not None:
            trace.close(1)
            out.trace = trace
        return out

    clock = RoundClock(device)
    t1 = time.perf_counter()
    while len(out.tokens) < max_new_tokens:
        clock.stamp()
        proposal = drafter.propose(state)
        clock.stamp()
        if proposal.tree is not None:  # this round's structure (a dynamic tree; a hybrid's lookup chain)
            if proposal.tree is not brought_from:  # a new tree (a dynamic one every round; a lookup chain once)
                brought_from, brought = proposal.tree, proposal.tree.to(device)
                brought_rows = verify_mask_rows(brought)
                brought_depths = torch.cat([brought.depth.new_zeros(1), brought.depth])
                brought_depth = brought.max_depth
            tree, mask_rows, depth_positions, depth = brought, brought_rows, brought_depths, brought_depth
        elif tree is not static_tree:  # back to the drafter's own tree after a round that brought its own
            tree, mask_rows, depth_positions, depth = (static_tree, static_mask_rows, static_depth_positions,
                                                       static_depth)
        n = tree.size
        ids = torch.cat([state.tokens[state.length - 1:state.length], proposal.tokens])
        base = verifier.length
        positions, mask = base + depth_positions, verifier.tree_mask(mask_rows)
        probe = proposal.probe  # nodes run for the drafter beside the tree (lookahead's window): never accepted
        if probe is not None:
            ids = torch.cat([ids, probe.tokens])
            positions = torch.cat([positions, base + probe.depth])
            mask = verifier.tree_mask(with_probe_rows(mask_rows, probe))
        clock.stamp()
        hidden = verifier.forward(ids, positions=positions, mask=mask)
        logits = verifier.logits(hidden[:n + 1])  # the tree's rows: all that acceptance reads
        if probe is not None:  # only the rows the drafter reads through the vocabulary projection
            probed = verifier.logits(torch.cat([hidden[:1], hidden[n + 1:]])[probe.read]).argmax(-1)
        clock.stamp()
        if sampling.greedy:  # compare argmaxes: no vocabulary-sized one-hot q, no random draws
            verdict = accept_greedy(logits.argmax(-1)[None], proposal.tokens[None], tree)
        else:
            probs = None if proposal.probs is None else proposal.probs[None]
            verdict = accept(target_probs(logits, sampling)[None], proposal.tokens[None], tree, probs, generator)
        path_tokens = proposal.tokens.gather(0, verdict.path[0].clamp_min(0)) if n else verdict.bonus[:0]
        # The round's one host sync: accept length, path, its tokens, the bonus (and a probe's tokens) together.
        read = [verdict.accept_length, verdict.path[0], path_tokens, verdict.bonus]
        a, *rest = torch.cat(read + ([probed] if probe is not None else [])).tolist()
        state.probed = None
        if probe is not None:
            rest, state.probed = rest[:-probed.numel()], rest[-probed.numel():]
        path_len = verdict.path.shape[1]
        new = rest[path_len:path_len + a] + [rest[-1]]
        last_slot = 1 + rest[a - 1] if a else 0
        kept_slots = torch.cat([verdict.path.new_zeros(1), verdict.path[0, :a] + 1])  # root + path, on device
        verifier.commit(1 + a, None if tree.is_chain else kept_slots + base)  # a chain's path is already in place
        if trace is not None:  # rows of root + path chose path[0..a-1] + bonus
            trace.record(logits[kept_slots], len(out.tokens))
        room = max_new_tokens - len(out.tokens)
        kept = new[:room]
        for i, t in enumerate(kept):
            if t in eos_ids:
                kept = kept[:i + 1]
                out.stop = "eos"
                break
        out.tokens.extend(kept)
        out.accept_lengths.append(a)
        out.drafted_depths.append(depth)
        out.emitted_per_round.append(len(kept))
        tokens[state.length:state.length + a + 1] = torch.cat([path_tokens[:a], verdict.bonus])
        state.length += len(new)
        state.history.extend(new)
        state.hidden = hidden[last_slot]
        if drafter.wants_features:  # features of root + path, paired with the tokens that follow them
            state.new_features = (verifier.aux if drafter.capture_layers else hidden)[kept_slots]
            state.new_tokens = torch.cat([path_tokens[:a], verdict.bonus])
        drafter.advance(a, state)
        if out.stop == "eos":
            break
    clock.stamp()
    _sync(device)
    out.decode_seconds = time.perf_counter() - t1
    out.round_seconds = clock.totals()
    if trace is not None:
        trace.close(len(out.tokens))
        out.trace = trace
    return out
