"""The evaluation's one settings object (:class:`EvalSettings`, checked when made) and its method registry (each
:class:`EvalMethod` declares the kinds of setting it drafts and refuses the others)."""

from __future__ import annotations

import dataclasses

import pytest

from spectrain.eval.evaluate import EvalSettings, evaluate_drafter
from spectrain.eval.methods import all_methods, make_trees, method_named, methods
from spectrain.eval.families import BoundDrafter, evaluator_of
from spectrain.eval.methods import (EvalMethod, bind_learned, register_method, resolve_method, training_free_methods,
                                    unregister_method)
from spectrain.eval.settings import TreeKind
from spectrain.heads.errors import SpectrainError
from spectrain.heads.families import families, family_named

CHAIN, STATIC, DYNAMIC = TreeKind.CHAIN, TreeKind.STATIC, TreeKind.DYNAMIC
ASKING = {CHAIN: EvalSettings(k=2), STATIC: EvalSettings(k=0, tree="[[0], [1]]"),
          DYNAMIC: EvalSettings(k=0, dynamic_tree=(2, 2, 4))}


# -- the settings ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad,message", [
    (dict(k=-1), "k must be an integer >= 0"),
    (dict(k=1.5), "k must be an integer"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (dict(lookup=-1), "--lookup must be an integer >= 0"),
    (dict(min_confidence=1.0), "--min_confidence is a probability"),
    (dict(k=0, min_confidence=0.5), "--min_confidence cuts chains"),
    (dict(tree="[[0]]", min_confidence=0.5), "--min_confidence cuts chains"),
    (dict(draft_layers=0), "draft_layers must be an integer >= 1"),
    (dict(min_match=9), "--min_match must be between 1 and 3"),
    (dict(min_match_sampled=0), "--min_match_sampled must be between"),
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(temperature="0"), "temperature must be a number"),
    (dict(top_p=0.0), "top_p must be in"),
    (dict(top_k=-1), "top_k must be an integer >= 0"),
    (dict(chat_template="yes"), "chat_template must be True or False or None"),
    (dict(compile=1), "compile must be True or False"),
    (dict(hf_generate=-1), "hf_generate must be an integer >= 0"),
    (dict(costs=None), "costs must be True or False"),
    (dict(max_len=0), "max_len must be an integer >= 1"),
    (dict(seed="0"), "seed must be an integer"),
    (dict(batch_invariant="on"), "batch_invariant must be True or False or None"),
    (dict(draft_vocab=-1), "--draft_vocab must be an integer >= 0"),
    (dict(decoder="fast"), "decoder must be one of auto, llama, layers"),
    (dict(tree="auto:0"), "--tree auto:N takes a node count N >= 1"),
    (dict(tree=""), "tree must be JSON rank paths"),
    (dict(dynamic_tree=(6, 8)), "--dynamic_tree takes DEPTH,TOPK,BUDGET"),
    (dict(dynamic_tree="6,x,64"), "--dynamic_tree takes DEPTH,TOPK,BUDGET"),
    (dict(dynamic_tree="6,0,64"), "--dynamic_tree values must be >= 1"),
])
def test_a_bad_setting_is_refused_naming_it(bad, message):
    with pytest.raises(SpectrainError, match=message):
        EvalSettings(**bad)


def test_settings_are_one_frozen_checked_record():
    s = EvalSettings(dynamic_tree="6,8,64")
    assert s.dynamic_tree == (6, 8, 64) and EvalSettings(dynamic_tree=[6, 8, 64]) == s  # read once, one form
    assert (s.k, s.max_new_tokens, s.hf_generate, s.costs, s.decoder) == (4, 128, None, True, "auto")  # the defaults (HF: every prompt)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.k = 2
    assert dataclasses.replace(s, k=2).k == 2
    with pytest.raises(SpectrainError, match="k must be an integer >= 0"):  # a variant is checked again
        dataclasses.replace(s, k=-2)
    assert s.tree_kinds == (CHAIN, DYNAMIC) and EvalSettings(k=0, tree="auto:8").tree_kinds == (STATIC,)
    assert EvalSettings(tree="auto:8").auto_nodes == 8 and s.sampling.greedy
    shapes = make_trees(EvalSettings(k=3, tree="[[0], [1]]", dynamic_tree=(2, 2, 4)), None, None)
    assert [(x.name, x.kind) for x in shapes] == [("chain-3", CHAIN), ("tree-2", STATIC), ("dynamic-2x2-4", DYNAMIC)]
    assert shapes[2].dynamic == (2, 2, 4) and shapes[2].tree.max_depth == 2


# -- the method registry ---------------------------------------------------------------------------------------------
def test_the_methods_are_the_families_then_the_training_free_ones():
    assert methods() == tuple(f.name for f in families()) + ("ngram", "lookahead", "hybrid", "draft-model", "truncated",
                                                             "none")
    assert [m.name for m in training_free_methods()] == ["ngram", "lookahead", "hybrid", "draft-model", "truncated",
                                                         "none"]
    needs = {m.name: (m.needs_drafter, m.needs_draft_model) for m in all_methods()}
    assert needs["hybrid"] == (True, False) and needs["draft-model"] == (False, True)
    assert needs["ngram"] == needs["truncated"] == needs["none"] == (False, False)
    assert all(needs[f.name] == (True, False) for f in families())
    for family in families():
        evaluator, method = evaluator_of(family), method_named(family.name)
        assert method.family == family.name
        assert (STATIC in method.tree_kinds, DYNAMIC in method.tree_kinds) == (evaluator.static_trees,
                                                                                 evaluator.dynamic_trees)
    with pytest.raises(SpectrainError, match="method must be one of"):
        method_named("medusa2")


@pytest.mark.parametrize("name", methods())
def test_each_method_drafts_its_declared_kinds_and_refuses_the_others(name):
    method = method_named(name)
    for kind, settings in ASKING.items():
        if kind in method.tree_kinds:  # as asked (a method may decline the cost probes and planner: lookahead)
            assert method.check(settings) in (settings, dataclasses.replace(settings, costs=False))
        elif not method.tree_kinds and kind is CHAIN:  # AR alone: the chain (k defaults to 4) is dropped
            assert method.check(settings) == dataclasses.replace(settings, k=0, costs=False)
        else:
            with pytest.raises(SpectrainError, match=f"--method {name} ") as refused:
                method.check(settings)
            assert kind.flag in str(refused.value)
            if kind is DYNAMIC and method.tree_kinds:
                assert "needs a drafter that drafts autoregressively" in str(refused.value)
    if method.tree_kinds:
        with pytest.raises(SpectrainError, match="nothing to evaluate"):
            method.check(EvalSettings(k=0))


def test_the_messages_name_what_a_method_drafts():
    with pytest.raises(SpectrainError, match="--method ngram drafts chains only; drop --tree"):
        method_named("ngram").check(ASKING[STATIC])
    with pytest.raises(SpectrainError, match="--method truncated drafts chains and dynamic trees only; drop --tree"):
        method_named("truncated").check(ASKING[STATIC])
    with pytest.raises(SpectrainError, match="--method none decodes AR alone"):
        method_named("none").check(ASKING[DYNAMIC])
    with pytest.raises(SpectrainError, match=r"\(eagle, dflash, draft-model, truncated, or hybrid with a eagle or "
                                             r"dflash drafter\)"):
        method_named("ngram").check(ASKING[DYNAMIC])
    with pytest.raises(SpectrainError, match="--method ngram has no lookup"):
        method_named("ngram").check(EvalSettings(lookup=6))
    with pytest.raises(SpectrainError, match="--method draft-model has none"):
        method_named("draft-model").check(EvalSettings(min_confidence=0.5))
    for taker in ("dflash", "hybrid"):  # a learned drafter's chain (its head is checked once it is bound)
        assert method_named(taker).check(EvalSettings(k=3, min_confidence=0.5)).min_confidence == 0.5


def bound_to(family: str) -> BoundDrafter:
    """A learned drafter of ``family`` as the registry sees it (its family and evaluator; no weights needed)."""
    record = family_named(family)
    return BoundDrafter(learned=None, family=record, evaluator=evaluator_of(record))


def test_the_hybrid_drafts_what_its_learned_drafter_drafts():
    hybrid = method_named("hybrid")
    assert hybrid.kinds(bound_to("medusa")) == (CHAIN, STATIC)
    assert hybrid.kinds(bound_to("dflash")) == (CHAIN, DYNAMIC)
    assert hybrid.kinds(bound_to("eagle")) == (CHAIN, STATIC, DYNAMIC)
    with pytest.raises(SpectrainError, match="--method hybrid with a Medusa drafter grows no dynamic trees"):
        hybrid.check(ASKING[DYNAMIC], bound_to("medusa"))
    with pytest.raises(SpectrainError, match="--method hybrid with a .* drafter drafts chains and dynamic trees only"):
        hybrid.check(ASKING[STATIC], bound_to("dflash"))
    assert hybrid.check(ASKING[DYNAMIC], bound_to("eagle")) == ASKING[DYNAMIC]


def test_methods_resolve_from_a_name_a_record_or_a_drafter(tiny_tokenizer):
    from tests.eval_helpers import bigram_verifier, oracle_medusa

    model, perm = bigram_verifier(vocab=320)
    heads = oracle_medusa(model, perm, 2, noise=0.5)
    ngram = method_named("ngram")
    assert resolve_method("ngram") == (ngram, None) and resolve_method(ngram) == (ngram, None)
    method, learned = resolve_method(heads)
    assert method.name == "medusa" and learned is heads
    assert resolve_method("hybrid", heads) == (method_named("hybrid"), heads)
    with pytest.raises(SpectrainError, match="given twice"):
        resolve_method(heads, heads)
    with pytest.raises(SpectrainError, match="needs a learned drafter or a method"):
        resolve_method(None)
    assert bind_learned(method_named("hybrid"), heads).family.name == "medusa"
    assert bind_learned("ngram", None) is None
    with pytest.raises(SpectrainError, match="method hybrid needs a drafter"):
        bind_learned("hybrid", None)
    with pytest.raises(SpectrainError, match="method truncated takes no learned drafter"):
        bind_learned("truncated", heads)
    with pytest.raises(SpectrainError, match="method eagle got a MedusaHeads: use method medusa"):
        bind_learned("eagle", heads)


def test_a_registered_method_decodes_through_the_api(tiny_tokenizer):
    """A training-free method registered from outside (here a prompt lookup under another name) is offered,
    checked and decoded like the bundled ones; names already taken and inconsistent records are refused."""
    from spectrain.eval.drafters import NgramDrafter
    from spectrain.heads.verifier import Verifier
    from tests.eval_helpers import bigram_verifier

    def build(settings, shape, inputs):
        return NgramDrafter(shape.tree.size)

    echo = EvalMethod(name="echo", build=build, description="prompt lookup, again")
    with pytest.raises(SpectrainError, match="a method or drafter family of that name"):
        register_method(dataclasses.replace(echo, name="ngram"))
    with pytest.raises(SpectrainError, match="a method or drafter family of that name"):
        register_method(dataclasses.replace(echo, name="medusa"))
    with pytest.raises(SpectrainError, match="comes from its family record"):
        register_method(dataclasses.replace(echo, family="medusa"))
    with pytest.raises(SpectrainError, match="gives grow"):
        EvalMethod(name="bad", build=build, tree_kinds=(CHAIN, DYNAMIC))
    register_method(echo)
    try:
        assert "echo" in methods() and method_named("echo") is echo
        model, _ = bigram_verifier(vocab=320)
        verifier = Verifier(model, tiny_tokenizer, "bigram")
        settings = EvalSettings(k=2, max_new_tokens=8, hf_generate=0, costs=False, chat_template=False)
        result = evaluate_drafter(verifier, [["the king and the king and"]], "echo", settings)
        assert result.method == "echo" and result.results["chain-2"]["identical_to_ar"]
        with pytest.raises(SpectrainError, match="--method echo drafts chains only"):
            evaluate_drafter(verifier, [["the king"]], echo, dataclasses.replace(settings, tree="[[0], [1]]"))
    finally:
        unregister_method("echo")
    assert "echo" not in methods()
