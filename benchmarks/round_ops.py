"""aten ops and host syncs per speculative-decoding round, outside the verifier's forward (benchmark, not a test).

On a GPU every op outside the verifier's (graph-captured) forward is a kernel launch of its own and every host
read of a device value a stall, so these two counts bound how fast a round can be next to a ~0.2 ms graph replay
of a small verifier. For AR, Medusa chain-4, Medusa tree-32, EAGLE chain-4 and an EAGLE-2 dynamic tree (depth
6, top-8, 64 nodes), greedy, the acceptance step both ways in the same run: ``before`` = the general rule on a
one-hot q (what every round ran until the greedy fast path), ``after`` = :func:`accept_greedy`:

    python benchmarks/round_ops.py [--verifier bundled:smollm2] [--rounds 16] [--out runs/bench/round_ops.json]

Counted with ``torch.profiler`` (top-level aten ops: those not called by another aten op) and a torch function
mode (host reads: ``item``, ``tolist``, ``int``/``float``/``bool`` of a tensor, ``nonzero``:
``spectrain.eval.host_reads.HostReads``). Drafter weights are
random: the counts do not depend on them, only on the shapes. Prints a table and writes the JSON (its path is the
last line printed).
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from unittest import mock

import torch

from spectrain.eval import decode as decode_mod
from spectrain.eval.accept import accept
from spectrain.eval.decode import generate
from spectrain.eval.drafters import Autoregressive, Drafter
from spectrain.eval.eagle import EagleChainDrafter, EagleTreeDrafter
from spectrain.eval.host_reads import HostReads
from spectrain.eval.medusa import MedusaDrafter
from spectrain.eval.static_model import StaticCausalLM
from spectrain.eval.tree import Tree
from spectrain.heads.eagle import EagleDrafter
from spectrain.heads.errors import run_command
from spectrain.heads.medusa import MedusaHeads
from spectrain.heads.report import finish, format_table
from spectrain.heads.verifier import load_verifier


def tree_of(size: int, width: int = 4) -> Tree:
    """The first ``size`` nodes, breadth first, of a ``width``-ary rank tree."""
    paths, frontier = [], [()]
    while len(paths) < size:
        frontier = [p + (r,) for p in frontier for r in range(width)]
        paths += frontier[:size - len(paths)]
    return Tree.from_paths([list(p) for p in paths])


@contextmanager
def general_accept(vocab: int):
    """The acceptance step as before the fast path: the general rule on one-hot q."""
    def legacy(target, drafts, tree):
        return accept(torch.nn.functional.one_hot(target, vocab).float(), drafts, tree)
    with mock.patch.object(decode_mod, "accept_greedy", legacy):
        yield


def count(runner: StaticCausalLM, drafter: Drafter, prompt: list[int], rounds: int) -> dict:
    """Ops and host reads per round, the verifier's forwards excluded (marked and skipped)."""
    forward = runner.forward
    reads = HostReads()

    def marked(*args, **kwargs):
        reads.paused = True
        try:
            with torch.profiler.record_function("verifier_forward"):
                return forward(*args, **kwargs)
        finally:
            reads.paused = False

    generate(runner, drafter, prompt, 8)  # warm-up
    with mock.patch.object(runner, "forward", marked), torch.profiler.profile() as prof, reads:
        out = generate(runner, drafter, prompt, rounds)  # AR: one round per token
    n_rounds = max(len(out.accept_lengths), 1)
    ops = 0
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        parent, inside, nested = event.cpu_parent, False, False
        while parent is not None:
            nested |= parent.name.startswith("aten::")
            inside |= parent.name == "verifier_forward"
            parent = parent.cpu_parent
        ops += not nested and not inside
    return {"rounds": n_rounds, "ops_per_round": ops / n_rounds, "host_reads_per_round": reads.count / n_rounds}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--verifier", default="bundled:smollm2")
    p.add_argument("--rounds", type=int, default=16, help="new tokens per setting (AR: rounds)")
    p.add_argument("--out", default="runs/bench/round_ops.json")
    args = p.parse_args(argv)
    run_command(bench, args)


def bench(args):
    torch.manual_seed(0)
    model = load_verifier(args.verifier, dtype="float32").model
    vocab = model.get_output_embeddings().weight.shape[0]
    runner = StaticCausalLM(model, max_len=256)
    lm_head = model.get_output_embeddings()
    eagle = EagleDrafter.for_verifier(model, "eagle1")
    settings = {
        "AR": Autoregressive(),
        "Medusa chain-4": MedusaDrafter(MedusaHeads.for_verifier(model, num_heads=4), lm_head, Tree.chain(4)),
        "Medusa tree-32": MedusaDrafter(MedusaHeads.for_verifier(model, num_heads=4), lm_head, tree_of(32)),
        "EAGLE chain-4": EagleChainDrafter(eagle, model, 4),
        "EAGLE dynamic 6x8-64": EagleTreeDrafter(eagle, model, dynamic=(6, 8, 64)),
    }
    prompt = torch.randint(0, vocab, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    rows, table = [], []
    for name, drafter in settings.items():
        with general_accept(vocab):
            before = count(runner, drafter, prompt, args.rounds)
        after = count(runner, drafter, prompt, args.rounds)
        rows.append({"setting": name, "before": before, "after": after})
        table.append([name, round(before["ops_per_round"], 1), round(after["ops_per_round"], 1),
                      round(before["host_reads_per_round"], 2), round(after["host_reads_per_round"], 2)])
    summary = {"command": "python benchmarks/round_ops.py", "verifier": args.verifier, "rows": rows,
               "note": "before: general acceptance rule on one-hot q; after: greedy fast path (argmax compare)"}
    return finish(summary, args.out, [format_table(
        ["setting", "aten ops/round before", "after", "host reads/round before", "after"], table,
        title=f"per decode round outside the verifier forward ({args.verifier}, greedy, {args.rounds} new tokens)")])


if __name__ == "__main__":
    main()
