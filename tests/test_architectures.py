"""Any verifier family the trainer takes, the evaluator decodes: the model's own decoder layers over our cache
(``StaticCausalLM(path="layers")``, eval/native.py), checked against the model's own forward on tiny random configs
of Gemma 2 / 3, Phi-3, Qwen3-MoE, OLMo 2, Granite, Mistral with a sliding window and GPT-OSS."""

from __future__ import annotations

import collections

import pytest
import torch

from spectrain.eval.accept import Sampling, target_probs
from spectrain.eval.decode import generate
from spectrain.eval.drafters import Autoregressive, DynamicTreeDrafter, ModelDrafter
from spectrain.eval.static_model import StaticCausalLM, binding_window, choose_path
from spectrain.eval.tree import Tree
from spectrain.heads.errors import SpectrainError
from spectrain.heads.verifier import LogitTransform
from tests.architectures import FAMILIES, SLIDING, WINDOW, tiny_model
from tests.eval_helpers import noised_copy
from tests.test_generate_distribution import RankOracle, chi_square_p

PREFILL = 12  # > WINDOW: every later query's window cuts into the cache
TREE = Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]])


def ids(n: int, seed: int = 0, vocab: int = 300) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def own_logits(model, tokens: list[int]) -> torch.Tensor:
    """(T, V) logits of the model's own forward (HF's cache, masks and attention)."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    return request.param, tiny_model(request.param)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic-span", "static-span"])
def test_logits_of_a_chain_and_a_tree_equal_the_models_own_forward(family, static):
    name, model = family
    tokens = ids(PREFILL + 8)
    runner = StaticCausalLM(model, max_len=48, static=static)
    assert runner.path == "layers"
    assert binding_window(model.config, 48) == (WINDOW if name in SLIDING else None)  # windows are exercised
    hidden = [runner.forward(torch.tensor(tokens[:PREFILL]))]
    runner.commit(PREFILL)
    for t in tokens[PREFILL:]:  # AR steps past the window
        hidden.append(runner.forward(torch.tensor([t])))
        runner.commit(1)
    ours = runner.logits(torch.cat(hidden))
    diff = float((ours - own_logits(model, tokens)).abs().max())
    assert diff < 1e-4, f"{name}: chain logits differ from the model's own by {diff}"

    # A tree round on top: root + nodes at positions length + depth, each node's logits against the model's own
    # forward over its path (siblings and cousins masked out; the window counted along the path).
    nodes = ids(TREE.size, seed=1)
    root = tokens[-1]
    runner.length -= 1  # the last token becomes the round's root, as decode does
    n = TREE.size + 1
    ancestors = torch.zeros(n, n, dtype=torch.bool)
    ancestors[:, 0] = True
    ancestors[1:, 1:] = TREE.ancestors
    depth = torch.cat([torch.zeros(1, dtype=torch.long), TREE.depth])
    out = runner.forward(torch.tensor([root] + nodes), positions=runner.length + depth,
                         mask=runner.tree_mask(ancestors))
    logits = runner.logits(out)
    for i, path in enumerate(TREE.paths):
        prefix = tokens + [nodes[j] for j in range(TREE.size) if TREE.ancestors[i, j]]
        diff = float((logits[i + 1] - own_logits(model, prefix)[-1]).abs().max())
        assert diff < 1e-4, f"{name}: tree node {path} differs by {diff}"


def test_greedy_chain_and_tree_equal_ar_and_hf_generate(family):
    name, model = family
    runner = StaticCausalLM(model, max_len=96)
    chain = ModelDrafter(noised_copy(model, 0.1), 4, max_len=96)
    tree = DynamicTreeDrafter(noised_copy(model, 0.1), depth=3, topk=2, budget=6, max_len=96)
    accepted = collections.Counter()
    for seed in range(2):
        prompt = ids(PREFILL, seed=seed + 5)
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0, PREFILL:].tolist()
        assert generate(runner, Autoregressive(), prompt, 40).tokens == expected, f"{name}: AR differs from HF"
        for drafter in (chain, tree):
            out = generate(runner, drafter, prompt, 40)
            assert out.tokens == expected, f"{name}: {type(drafter).__name__} differs from AR"
            accepted.update(out.accept_lengths)
    assert len(accepted) >= 2 and max(accepted) > 0, f"{name}: rounds must accept and reject drafts: {accepted}"


SAMPLED = Sampling(temperature=1.0, top_k=5)
PROMPT = [3, 17, 42, 7]
DRAWS = 1500


def _first_tokens(runner, drafter) -> collections.Counter:
    g = torch.Generator().manual_seed(1)
    return collections.Counter(tuple(generate(runner, drafter, PROMPT, 2, SAMPLED, generator=g).tokens[:2])
                               for _ in range(DRAWS))


def test_sampled_tokens_follow_the_soft_capped_distribution_and_a_missing_cap_is_detected():
    """Gemma 2 at T = 1 through a tree round (the model's own soft-capped logits are q): χ² on the round's first
    token given the prefill's most frequent one; the negative control decodes with the cap left out and fails."""
    from tests.test_generate_distribution import TREE as SIBLING_TREE

    model = tiny_model("gemma2", logit_gain=40.0)  # logits far past the cap of 4: capping moves q
    drafter = RankOracle(model)
    assert drafter.tree is SIBLING_TREE
    p_values = {}
    for label, transform in (("capped", None), ("cap missing", LogitTransform())):
        runner = StaticCausalLM(model, max_len=32)
        if transform is not None:
            runner.logit_transform = transform
        draws = _first_tokens(runner, drafter)  # (prefill's token, the round's first) -> count
        firsts = collections.Counter()
        for (a, _), count in draws.items():
            firsts[a] += count
        first = firsts.most_common(1)[0][0]
        second = collections.Counter({b: count for (a, b), count in draws.items() if a == first})
        p_values[label] = chi_square_p(second, target_probs(own_logits(model, PROMPT + [first])[-1], SAMPLED))
    assert p_values["capped"] > 0.01 and p_values["cap missing"] < 1e-6, p_values


def test_the_hand_written_path_and_the_layers_path_agree_on_llama_and_qwen3():
    from tests.conftest import make_verifier

    for arch in ("llama", "qwen3"):
        model = make_verifier(arch, False, 300, hidden=64, layers=2)
        tokens = ids(PREFILL + 6)
        logits = {}
        for path in ("llama", "layers"):
            runner = StaticCausalLM(model, max_len=48, path=path)
            assert runner.path == path
            hidden = runner.forward(torch.tensor(tokens))
            logits[path] = runner.logits(hidden)
        torch.testing.assert_close(logits["layers"], logits["llama"], rtol=1e-5, atol=1e-5)
        outs = {path: generate(StaticCausalLM(model, max_len=80, path=path), ModelDrafter(noised_copy(model, 0.1), 3,
                                                                                        max_len=80), tokens, 30).tokens
                for path in ("llama", "layers")}
        assert outs["llama"] == outs["layers"]


def test_the_path_each_family_takes_and_what_the_hand_written_one_refuses():
    llama_like = tiny_model("mistral").config
    assert choose_path(llama_like, 48) == "layers"  # its window (8) binds within 48 tokens
    assert choose_path(llama_like, WINDOW) == "llama"  # ... and not within 8
    with pytest.raises(SpectrainError, match="sliding window of 8 tokens is shorter than the 48"):
        choose_path(llama_like, 48, "llama")
    with pytest.raises(SpectrainError, match="'gemma2' is not one of llama, mistral, qwen2, qwen3"):
        choose_path(tiny_model("gemma2").config, 48, "llama")
    with pytest.raises(SpectrainError, match="decoder path must be one of auto, llama, layers"):
        choose_path(llama_like, 48, "hf")


def test_a_family_with_recurrent_layers_is_refused_with_the_reason():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3_next", vocab_size=100, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                                  linear_value_head_dim=16, moe_intermediate_size=32, num_experts=4,
                                  num_experts_per_tok=2)
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(SpectrainError, match="cannot decode 'qwen3_next': its layers of type linear_attention keep a "
                                             "state other than keys and values"):
        StaticCausalLM(model, max_len=32)


@pytest.fixture(scope="module")
def saved_families(tmp_path_factory, tiny_tokenizer):
    """Each family saved as a verifier directory (model + the tests' tokenizer)."""
    dirs = {}
    for name in FAMILIES:
        out = tmp_path_factory.mktemp(f"verifier-{name}")
        tiny_model(name, vocab_size=len(tiny_tokenizer)).save_pretrained(out)
        tiny_tokenizer.save_pretrained(out)
        dirs[name] = out
    return dirs


@pytest.mark.integration
@pytest.mark.parametrize("name", list(FAMILIES))
def test_medusa_eagle1_and_eagle3_train_and_evaluate_on_the_family(name, saved_families, text_file, tmp_path):
    """A few Lightning steps of each drafter (measured τ at validation decodes through the family's own layers),
    then the evaluator (T = 0 output equal to AR, τ measured) and the drafter's serving layouts, read back equal."""
    from spectrain.eval.evaluate import EvalSettings, evaluate_drafter, load_drafter
    from spectrain.heads.serving.formats import export_drafter, import_drafter
    from spectrain.heads.verifier import load_verifier
    from spectrain.train.cli import train
    from tests.test_bad_input_matrix import small

    verifier_dir = saved_families[name]
    verifier = load_verifier(str(verifier_dir), dtype=torch.float32)
    prompts = [["the king sat on the mat and"], ["where is the river under the hill"]]
    formats = {"medusa": ("vllm-medusa",), "eagle1": ("eagle",), "eagle3": ("eagle3", "speculators")}
    for recipe, method in (("medusa_tinyshakespeare.yaml", "medusa"), ("eagle1_tinyshakespeare.yaml", "eagle"),
                           ("eagle3_tinyshakespeare.yaml", "eagle")):
        run = tmp_path / recipe.split("_")[0]
        train(recipe, args=small(verifier_dir, text_file, run, "--trainer.precision", "32-true",
                                 "--model.measure_prompts", "2", "--model.measure_new_tokens", "6"))
        summary = __import__("json").loads((run / "summary.json").read_text())
        assert summary["steps"] == 2 and isinstance(summary["val_metrics"]["tau_measured"], float), (name, recipe)
        drafter = load_drafter(str(run), verifier, method)
        settings = EvalSettings(k=3, max_new_tokens=16, hf_generate=0, costs=False, chat_template=False)
        result = evaluate_drafter(verifier, prompts, method, settings, drafter=drafter)
        chain = result.results["chain-3"]
        assert result.decoder == "layers" and chain["identical_to_ar"], (name, recipe)
        for fmt in formats[recipe.split("_")[0]]:  # the serving layouts: written, validated, read back
            out = export_drafter(drafter, fmt, tmp_path / f"{recipe}-{fmt}",
                                 verifier_lm_head=verifier.model.get_output_embeddings(), verifier_name=name)
            back = import_drafter(out, verifier_model=verifier.model)
            for key, value in drafter.state_dict().items():
                assert torch.equal(back.state_dict()[key].to(value.dtype), value), (name, fmt, key)
            # Read back, it drafts what it drafted: the same acceptance per position in the same loop (a layout
            # read with the wrong aux layers, vocabulary map or norm would part here, not in the tensors).
            again = evaluate_drafter(verifier, prompts, method, settings, drafter=back).results["chain-3"]
            assert (again["tau"], again["alpha"]) == (chain["tau"], chain["alpha"]), (name, fmt)


@pytest.mark.integration
def test_the_gpu_check_takes_another_family(tmp_path):
    """``python benchmarks/gpu_check.py --family gemma2`` (CPU sizes): its verifier decodes through its own layers,
    greedy identical."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
    proc = subprocess.run([sys.executable, str(script), "--small", "--device", "cpu", "--out", str(tmp_path),
                           "--num_prompts", "2", "--max_new_tokens", "16", "--family", "gemma2", "--speed_checks",
                           "off"], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    path = Path(proc.stdout.strip().splitlines()[-1])
    summary = json.loads(path.read_text())
    assert summary["verifier"]["family"] == "gemma2" and summary["decoder"] == "layers"
    assert summary["checks"]["fp32_greedy_identical"] == {"chain-4": True, "tree-32": True} and summary["passed"]


def test_the_layers_path_compiles_whole_with_captured_layers_and_decodes_as_eager():
    """``compile()`` on the model's own layers (one graph per size, ``fullgraph=True``; the eager backend, so only
    Dynamo's tracing is timed) with EAGLE-3-style captured layers: the same tokens and captured states as eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    model = tiny_model("gemma2")
    prompt = ids(PREFILL, seed=3)
    outs = {}
    for label in ("eager", "compiled"):
        runner = StaticCausalLM(model, max_len=64, static=True)
        runner.capture = (1, 3)
        if label == "compiled":
            counter = CompileCounterWithBackend("eager")
            runner.compile([1, 4], backend=counter)
            assert counter.frame_count == 2  # one graph per size, no graph breaks (fullgraph)
        tokens = generate(runner, ModelDrafter(noised_copy(model, 0.1), 3, max_len=64), prompt, 20).tokens
        runner.reset()
        runner.forward(torch.tensor(prompt[:4]))
        outs[label] = (tokens, runner.aux.clone())
    assert outs["eager"][0] == outs["compiled"][0]
    torch.testing.assert_close(outs["compiled"][1], outs["eager"][1])


def test_an_attention_argument_the_decoder_does_not_implement_is_refused():
    from spectrain.eval.native import FAR, attention

    module = tiny_model("olmo2").model.layers[0].self_attn
    q, kv = torch.randn(1, 4, 2, 16), torch.randn(1, 2, 5, 16)
    mask = torch.zeros(1, 1, 2, 5, dtype=torch.int32)
    out, _ = attention(module, q, kv, kv, mask, scaling=0.25, position_ids=torch.arange(2))  # passed through
    assert out.shape == (1, 2, 4, 16)
    with pytest.raises(SpectrainError, match=r"its attention layers pass \['position_bias'\], which spectrain's "
                                             "attention function does not implement"):
        attention(module, q, kv, kv, mask.masked_fill(mask == 0, FAR), position_bias=torch.zeros(1))


def test_a_logit_transform_spectrain_does_not_know_is_caught_when_the_verifier_loads(saved_families, monkeypatch):
    from spectrain.heads import verifier as verifier_module

    verifier_module.load_verifier(str(saved_families["granite"]), dtype=torch.float32)  # logits_scaling 2: known
    monkeypatch.setattr(verifier_module.LogitTransform, "of", classmethod(lambda cls, config: cls()))
    with pytest.raises(SpectrainError, match="granite: the model's logits differ from its lm_head over its final "
                                             "hidden state"):
        verifier_module.load_verifier(str(saved_families["granite"]), dtype=torch.float32)


def test_a_multimodal_wrapper_is_refused_by_name():
    from transformers import AutoConfig

    with pytest.raises(SpectrainError, match="'gemma3': a multimodal wrapper .* load the text model alone"):
        choose_path(AutoConfig.for_model("gemma3"), 48)
