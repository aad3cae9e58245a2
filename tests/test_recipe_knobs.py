"""Recipe knobs measured in the docs: EAGLE-3's loss without out-of-vocabulary positions, warm starts from the
verifier, and measured tau (the lossless loop) at validation."""

from __future__ import annotations

import copy

import pytest
import torch

from spectrain.eval.decode import generate
from spectrain.eval.eagle import EagleChainDrafter
from spectrain.eval.medusa import MedusaDrafter
from spectrain.eval.static_model import StaticCausalLM
from spectrain.eval.tree import Tree
from spectrain.heads.eagle import EagleDrafter
from spectrain.heads.errors import SpectrainError
from spectrain.train.measure import merge_rank_prompts
from spectrain.train.eagle import EagleModule
from spectrain.train.medusa import MedusaModule
from tests.conftest import make_verifier
from tests.eval_helpers import bigram_verifier, oracle_eagle1, oracle_medusa


def _rows(n=8, vocab=300, length=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": (torch.rand(length, generator=g) ** 3 * vocab).long().tolist(), "loss_mask": [1] * length}
            for _ in range(n)]


def _batch(ids, prompt=0):
    mask = torch.ones_like(ids)
    mask[:, :prompt] = 0
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask}


def test_eagle3_drops_positions_whose_verifier_argmax_is_outside_the_draft_vocabulary(verifier_factory):
    torch.manual_seed(0)
    kwargs = dict(variant="eagle3", verifier=str(verifier_factory("llama", False)), verifier_dtype="float32",
                  draft_vocab_size=40, ttt_steps=2)
    drop, keep = EagleModule(**kwargs), EagleModule(**kwargs, drop_outside_vocab=False)
    keep.drafter.load_state_dict(drop.drafter.state_dict())
    for m in (drop, keep):
        m.set_vocab_from(_rows())
    assert drop.needs_greedy(training=True) and not keep.needs_greedy(training=True)
    ids = torch.tensor([r["input_ids"] for r in _rows(2, seed=5)])
    features = drop.features(_batch(ids))
    inside = drop.drafter.t2d[features["greedy"]]
    loss_drop, parts = drop.drafter_loss(_batch(ids), features)
    loss_keep, _ = keep.drafter_loss(_batch(ids), features)
    T = ids.shape[1]
    outside = sum(int((~inside[:, 1 + i:T - 1]).sum()) for i in range(2))
    assert 0 < float(parts["outside_vocab_frac"]) == pytest.approx(outside / (2 * (T - 2) + 2 * (T - 3)))
    assert not torch.allclose(loss_drop, loss_keep)
    # With every argmax inside the draft vocabulary nothing is dropped: the same loss.
    full = features["greedy"].clamp_max(0) + drop.draft_rows()[0]
    same_drop, _ = drop.drafter_loss(_batch(ids), {**features, "greedy": full})
    torch.testing.assert_close(same_drop, loss_keep)


def test_warm_starts_from_the_verifier():
    verifier = make_verifier("llama", False, 300)
    last = verifier.model.layers[-1]
    torch.manual_seed(0)
    one = EagleDrafter.for_verifier(verifier, "eagle1")
    one.warm_start(verifier, "verifier")
    assert torch.equal(one.layer.self_attn.q_proj.weight, last.self_attn.q_proj.weight)
    assert torch.equal(one.layer.mlp.down_proj.weight, last.mlp.down_proj.weight)
    three = EagleDrafter.for_verifier(verifier, "eagle3", draft_vocab_size=50)
    random_half = three.layer.self_attn.k_proj.weight[:, :32].clone()
    three.warm_start(verifier, "verifier", norm="verifier")
    h = verifier.config.hidden_size
    assert torch.equal(three.layer.self_attn.k_proj.weight[:, h:], last.self_attn.k_proj.weight)
    assert torch.equal(three.layer.self_attn.k_proj.weight[:, :h], random_half)  # the embedding half is untouched
    assert torch.equal(three.layer.hidden_norm.weight, last.input_layernorm.weight)
    assert torch.equal(three.norm.weight, verifier.model.norm.weight)
    # Identity start: the decoder layer passes its residual stream through unchanged.
    ident = EagleDrafter.for_verifier(verifier, "eagle1")
    ident.warm_start(verifier, "identity")
    x = torch.randn(1, 5, h)
    from spectrain.heads.eagle import causal_mask, rotary_cos_sin

    cos, sin = rotary_cos_sin(torch.arange(5)[None], ident.config.head_dim, ident.config.rope_theta)
    out, _, _ = ident.layer(x, cos, sin, causal_mask(5, 5)[None, None])
    torch.testing.assert_close(out, x)
    with pytest.raises(SpectrainError, match="eagle3"):
        ident.warm_start(verifier, "random", norm="verifier")
    with pytest.raises(SpectrainError, match="layer must be"):
        ident.warm_start(verifier, "copy")


@pytest.fixture(scope="module")
def bigram_dir(tmp_path_factory, tiny_tokenizer):
    """A saved verifier whose greedy next token is (mostly) a fixed permutation of the current one, and that
    permutation: drafters with known weights then have some drafts accepted and some rejected."""
    model, perm = bigram_verifier(vocab=len(tiny_tokenizer))
    out = tmp_path_factory.mktemp("bigram")
    model.save_pretrained(out)
    tiny_tokenizer.save_pretrained(out)
    return out, perm


def _eagle3_first_step_oracle(m: EagleModule, perm: torch.Tensor, noise: float) -> None:
    """EAGLE-3 weights whose first draft is the bigram verifier's next greedy token when the draft vocabulary
    holds it (the fused layer 1 carries the current token's embedding; the layer starts as the identity; lm_head
    row j reads off pi^2 of it); later steps repeat that guess, so they are mostly rejected."""
    d, h = m.drafter, m.verifier.config.hidden_size
    emb = m.verifier.get_input_embeddings().weight
    inverse2 = torch.empty_like(perm)
    inverse2[perm[perm]] = torch.arange(perm.numel())
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        d.warm_start(m.verifier, "identity")
        d.fc.weight.copy_(torch.eye(h) + noise * torch.randn(h, h, generator=g) / h ** 0.5)
        d.lm_head.weight.copy_(2.0 * emb[inverse2[d.draft_to_target(torch.arange(d.d2t.numel()))]])


@pytest.mark.parametrize("method", ["eagle1", "eagle3", "medusa"])
def test_measured_tau_is_the_evaluators_tau_on_the_validation_prompts(bigram_dir, method):
    torch.manual_seed(0)
    path, perm = str(bigram_dir[0]), bigram_dir[1]
    m = (MedusaModule(verifier=path, num_heads=3, verifier_dtype="float32", measure_prompts=2, measure_k=3,
                      measure_new_tokens=12) if method == "medusa"
         else EagleModule(variant=method, verifier=path, verifier_dtype="float32",
                          draft_vocab_size=60 if method == "eagle3" else None, measure_prompts=2, measure_k=3, measure_new_tokens=12))
    ids = torch.tensor([r["input_ids"] for r in _rows(3, vocab=200, seed=2)])
    # Drafters that are right often but not always (on random weights every draft is rejected: tau 1, alpha 0)
    oracle = {"medusa": lambda: oracle_medusa(m.verifier, perm, 3, noise=1.5),
              "eagle1": lambda: oracle_eagle1(m.verifier, 1.0)}
    if method == "eagle3":  # a draft vocabulary with two in three tokens of the prompts' greedy continuations
        chains = [[int(t)] for t in ids[:2, 5]]
        for chain in chains * 16:
            chain.append(int(perm[chain[-1]]))
        m.set_vocab_from([{"input_ids": c[1::3] + c[2::3], "loss_mask": [1] * len(c[1::3] + c[2::3])} for c in chains])
        _eagle3_first_step_oracle(m, perm, noise=0.3)
    else:
        m.drafter.load_state_dict(oracle[method]().state_dict())
    meter = m.tau_meter
    meter.from_batches = True  # no datamodule: prompts from the validation batches
    meter.collect(_batch(ids, prompt=6))
    meter.prompts = merge_rank_prompts(meter.own, 1, meter.num_prompts)  # one process: its own prompts
    assert meter.prompts == [row[:6] for row in ids[:2].tolist()]  # the first rows, cut before their targets
    rng = torch.get_rng_state()
    got = meter.measure(m)
    assert torch.equal(torch.get_rng_state(), rng)  # the training RNG streams are untouched
    # The same numbers straight from the evaluator.
    drafter = copy.deepcopy(m.drafter).eval()
    chain = (MedusaDrafter(drafter, m.verifier_lm_head, Tree.chain(3)) if method == "medusa"
             else EagleChainDrafter(drafter, m.verifier, 3))
    runner = StaticCausalLM(m.verifier, max_len=40)
    outs = [generate(runner, chain, p, 12) for p in meter.prompts]
    accepts = [a for o in outs for a in o.accept_lengths]
    assert 0 < accepts.count(0) < len(accepts), "some drafts accepted, some rejected: tau and alpha_1 say something"
    assert got["tau_measured"] == pytest.approx(sum(sum(o.emitted_per_round) for o in outs) / len(accepts))
    assert got["alpha1_measured"] == pytest.approx(sum(a >= 1 for a in accepts) / len(accepts))


def test_warm_start_refuses_a_layer_it_cannot_copy():
    """Qwen3's q/k norms (and Qwen2's q/k/v biases) have no place in the drafter's layer: refused, not dropped."""
    verifier = make_verifier("qwen3", False, 300)
    with pytest.raises(SpectrainError, match="parameters the drafter's layer lacks"):
        EagleDrafter.for_verifier(verifier, "eagle1").warm_start(verifier, "verifier")
