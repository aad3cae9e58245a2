"""The decoder's fast path on a CPU: static shapes (what CUDA graphs need) and compiled forwards (Inductor)
decode exactly what the eager path decodes, compile once per bucketed size during warm-up, and never while
decoding."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from spectrain.eval.accept import Sampling
from spectrain.eval.decode import generate
from spectrain.eval.drafters import Autoregressive, NgramDrafter
from spectrain.eval.eagle import EagleChainDrafter, EagleTreeDrafter
from spectrain.eval.medusa import MedusaDrafter
from spectrain.eval.static_model import StaticCausalLM
from spectrain.eval.tree import Tree
from spectrain.heads.eagle import EagleDrafter
from spectrain.heads.errors import SpectrainError
from tests.eval_helpers import bigram_verifier, oracle_eagle1, oracle_medusa

K = 3  # chains verify 4 tokens
TREE = Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]])  # 7 nodes: verifies 8
DYNAMIC = (3, 2, 7)  # depth, top-k, budget: verifies 8
SIZES = (1, K + 1, TREE.size + 1, DYNAMIC[2] + 1)  # AR and every drafter: graphs for 1, 4 and 8 tokens
MAX_LEN = 96


def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 300, (n,), generator=g).tolist() for n in (3, 6, 10, 21)]  # bucketed and eager prefills


@pytest.fixture(scope="module")
def setup():
    model, perm = bigram_verifier("llama")
    torch.manual_seed(0)
    eagle3 = EagleDrafter.for_verifier(model, "eagle3", draft_vocab_size=200)
    eagle1 = oracle_eagle1(model, noise=0.5)
    lm_head = model.get_output_embeddings()
    drafters = {
        "ar": Autoregressive(),
        "ngram": NgramDrafter(K),
        "medusa-chain": MedusaDrafter(oracle_medusa(model, perm, K, noise=1.4), lm_head, Tree.chain(K)),
        "medusa-tree": MedusaDrafter(oracle_medusa(model, perm, TREE.max_depth, noise=1.4), lm_head, TREE),
        "eagle1-chain": EagleChainDrafter(eagle1, model, K),
        "eagle3-chain": EagleChainDrafter(eagle3, model, K),
        "eagle1-dynamic": EagleTreeDrafter(eagle1, model, dynamic=DYNAMIC),
        "eagle3-dynamic": EagleTreeDrafter(eagle3, model, dynamic=DYNAMIC),
    }
    capture = drafters["eagle3-chain"].capture_layers
    eager = StaticCausalLM(model, max_len=MAX_LEN)
    static = StaticCausalLM(model, max_len=MAX_LEN, static=True)
    compiled = StaticCausalLM(model, max_len=MAX_LEN, static=True)
    compiled.capture = capture  # compiled with the EAGLE-3 layers kept: every drafter then runs the same graphs
    counter = CompileCounterWithBackend("inductor")
    warmup_seconds = compiled.compile(SIZES, backend=counter)
    return {"drafters": drafters, "eager": eager, "static": static, "compiled": compiled, "counter": counter,
            "warmup_seconds": warmup_seconds}


def decode(runner, drafter, sampling: Sampling):
    return [generate(runner, drafter, p, 24, sampling, generator=torch.Generator().manual_seed(i)).tokens
            for i, p in enumerate(prompts())]


LEARNED = ["medusa-chain", "medusa-tree", "eagle1-chain", "eagle3-chain", "eagle1-dynamic", "eagle3-dynamic"]


@pytest.mark.parametrize("name,temperature", [(n, 0.0) for n in ["ar", "ngram", *LEARNED]] +
                         [(n, 1.0) for n in ["ar", *LEARNED]])
def test_static_and_compiled_decoding_equal_eager(setup, name, temperature):
    """Token for token, greedy and sampled (same seeds): the static-shape path (attention over the whole buffer,
    forwards padded to a compiled size) and the Inductor-compiled one against the eager CPU path."""
    drafter = setup["drafters"][name]
    sampling = Sampling(temperature=temperature)
    want = decode(setup["eager"], drafter, sampling)
    assert decode(setup["static"], drafter, sampling) == want
    before = setup["counter"].frame_count
    assert decode(setup["compiled"], drafter, sampling) == want
    assert setup["counter"].frame_count == before, "compiled while decoding (inside a timed region)"


def test_one_compile_per_bucket_during_warmup_only(setup):
    """Every bucket compiled exactly once in warm-up (a recompile limit hit would silently leave some eager and
    show as fewer), none of it a graph break (fullgraph), and decoding varied prompt lengths with every drafter
    adds no compile at all."""
    runner, counter = setup["compiled"], setup["counter"]
    assert runner.buckets == (1, 4, 8)
    assert counter.frame_count == len(runner.buckets) and setup["warmup_seconds"] > 0
    for drafter in setup["drafters"].values():
        decode(runner, drafter, Sampling())
    assert counter.frame_count == len(runner.buckets)


def test_a_verify_size_past_the_compiled_ones_is_refused(setup):
    """Rather than run a drafter's verify forwards eagerly beside compiled neighbours, say so."""
    with pytest.raises(SpectrainError, match="compiled for forwards of up to 8 tokens; this drafter verifies 10"):
        generate(setup["compiled"], NgramDrafter(9), prompts()[0], 8)


def test_compile_needs_static_shapes_and_an_empty_cache():
    model, _ = bigram_verifier("llama")
    with pytest.raises(SpectrainError, match="static shapes"):
        StaticCausalLM(model, max_len=32).compile([1])
    runner = StaticCausalLM(model, max_len=32, static=True)
    runner.length = 3
    with pytest.raises(SpectrainError, match="empty cache"):
        runner.compile([1])


def test_draft_cost_times_decode_rounds_not_a_prefill():
    """T_draft of a draft model: each timed propose feeds one new context token and drafts k (a decode round),
    never the whole prompt again (which made the ideal speedup too low)."""
    from spectrain.eval.costs import draft_cost, probe_state
    from spectrain.eval.drafters import ModelDrafter
    from tests.eval_helpers import noised_copy

    model, _ = bigram_verifier("llama")
    drafter = ModelDrafter(noised_copy(model, 0.5), K, max_len=64)
    prompt = list(range(20))
    state = probe_state(StaticCausalLM(model, max_len=64), prompt, Sampling())
    sizes = []
    forward = drafter.runner.forward
    drafter.runner.forward = lambda ids, *a, **k: sizes.append(ids.numel()) or forward(ids, *a, **k)
    assert draft_cost(drafter, state, repeats=3) > 0
    # Untimed: the prefill round (the prompt, then k - 1 draft steps); then warm-up + 3 timed rounds of k steps.
    assert sizes == [len(prompt)] + [1] * (K - 1) + [1] * (K * 4)


def host_dynamic_tree(drafter, root_logp, root_out, base):
    """The EAGLE-2 tree as the drafter built it on the host before (Python lists, a read per level): the
    reference the device-built tree must match, node for node. Log-probabilities are over the drafter's own
    vocabulary (EAGLE-3's draft vocabulary): columns map to target ids through ``drafter._target``."""
    depth_cap, topk, budget = drafter.dynamic
    top = root_logp.topk(topk)
    tokens, scores = drafter._target(top.indices).tolist(), top.values.tolist()
    paths, parent = [(r,) for r in range(topk)], [-1] * topk
    outs, slot, frontier, scratch = {-1: root_out}, {}, list(range(topk)), drafter.past
    for depth in range(1, depth_cap):
        frontier = sorted(frontier, key=lambda i: -scores[i])[:topk]
        anc = []
        for i in frontier:
            chain, a = [], parent[i]
            while a >= 0:
                chain.append(slot[a])
                a = parent[a]
            anc.append(chain)
        start = scratch[0].shape[2]
        ids = torch.tensor([tokens[i] for i in frontier])
        out, logp, scratch = drafter._run_frontier(ids, torch.stack([outs[parent[i]] for i in frontier]), depth, base,
                                                   drafter._slots_mask(anc, base, start, ids.device), scratch)
        child = logp.topk(topk)
        new = []
        for j, i in enumerate(frontier):
            slot[i], outs[i] = start + j, out[j]
            for r in range(topk):
                tokens.append(int(drafter._target(child.indices[j, r])))
                scores.append(scores[i] + float(child.values[j, r]))
                paths.append(paths[i] + (r,))
                parent.append(i)
                new.append(len(tokens) - 1)
        frontier = new
    keep = sorted(range(len(tokens)), key=lambda i: (-scores[i], len(paths[i])))[:budget]
    return {paths[i]: tokens[i] for i in keep}


@pytest.mark.parametrize("variant", ["eagle1", "eagle3"])
def test_device_built_dynamic_tree_is_the_host_built_one(setup, variant):
    """The EAGLE-2 tree built on the device (no host read) keeps the same nodes, with the same tokens, as the
    host-side construction; its tensors describe that tree (parents, depths, ancestors, children by rank)."""
    from spectrain.eval.costs import probe_state

    drafter = setup["drafters"][f"{variant}-dynamic"]
    runner = StaticCausalLM(setup["eager"].model, max_len=MAX_LEN)
    state = probe_state(runner, prompts()[3], Sampling(), drafter.capture_layers)
    drafter.start(state, runner)
    out = drafter._step(state.new_tokens, state.new_features, hidden_input=False)
    committed, base = drafter.past, drafter.past[0].shape[2]
    root_logp = torch.log_softmax(drafter._logits(out[-1:]), -1)[0]
    device_built = drafter._dynamic(root_logp, out[-1], base)
    drafter.past = committed
    want = host_dynamic_tree(drafter, root_logp, out[-1], base)
    tree = device_built.tree
    assert dict(zip(tree.paths, device_built.tokens.tolist())) == want and tree.size == DYNAMIC[2]
    reference = Tree.from_paths([list(p) for p in tree.paths])  # the host Tree of the same paths (its own order)
    order = [reference.paths.index(p) for p in tree.paths]
    assert torch.equal(reference.ancestors[order][:, order], tree.ancestors)
    assert torch.equal(reference.depth[order], tree.depth)
    for i, p in enumerate(tree.paths):  # children rows: each kept child at its rank, -1 elsewhere
        kids = {int(c): r for r, c in enumerate(tree.children[i + 1].tolist()) if c >= 0}
        assert kids == {j: q[-1] for j, q in enumerate(tree.paths) if q[:-1] == p}


def test_draft_model_dynamic_tree_never_reads_the_device():
    """The draft model's EAGLE-2 tree is grown by the same device-side builder: a proposal reads nothing back to
    the host, and a greedy decode with it is still the verifier's own."""
    from spectrain.eval.costs import probe_state
    from spectrain.eval.drafters import DynamicTreeDrafter
    from spectrain.eval.host_reads import HostReads  # benchmarks/round_ops.py's counter of host reads
    from tests.eval_helpers import noised_copy

    model, _ = bigram_verifier("llama")
    drafter = DynamicTreeDrafter(noised_copy(model, 0.5), depth=3, topk=2, budget=5, max_len=MAX_LEN)
    state = probe_state(StaticCausalLM(model, max_len=MAX_LEN), prompts()[2], Sampling())
    drafter.start(state, None)
    with HostReads() as reads:
        proposal = drafter.propose(state)
    assert reads.count == 0 and proposal.tree.size == 5 and proposal.tokens.shape == (5,)
    runner = StaticCausalLM(model, max_len=MAX_LEN)
    for p in prompts():
        assert generate(runner, drafter, p, 20).tokens == generate(runner, Autoregressive(), p, 20).tokens
