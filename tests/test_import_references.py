"""The references' checkpoints imported as they ship, and the SGLang token map.

* vLLM speculators' EAGLE-3 with its training defaults (``norm_before_residual``, ``norm_before_fc`` and
  ``norm_output`` all on; ``src/speculators/train/config/schema.py`` there), the frozen ``embed_tokens.weight`` in
  the file and the verifier recorded as a local path, written the way speculators writes it;
* SpecForge's ``LlamaForCausalLMEagle3`` layout (``midlayer.*``, ``embed_tokens.weight``, only SGLang's or no layer
  ids);

each loaded by ``import_drafter`` / ``load_drafter`` unchanged and drafting what an independent reference forward
written here from speculators' equations (``src/speculators/models/eagle3/{core,model_definitions}.py``) drafts.
Then: the verifier matched by signature, not by name; a norms-on EAGLE-3 through export and import; the SGLang
token map of an EAGLE-1 drafter with a ranked vocabulary.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from spectrain.eval.accept import Sampling
from spectrain.eval.drafters import DraftState
from spectrain.eval.eagle import EagleChainDrafter
from spectrain.eval.evaluate import load_drafter
from spectrain.heads.eagle import EagleDrafter, build_vocab_map
from spectrain.heads.errors import SpectrainError
from spectrain.heads.serving.formats import export_drafter, import_drafter, recorded_verifier, validate_export
from spectrain.heads.medusa import MedusaHeads
from spectrain.heads.serving.token_map import TOKEN_MAP_FILE, check_token_map
from spectrain.heads.verifier import (Verifier, match_verifier, save_verifier_signature, tokenizer_fingerprint,
                                      verifier_identity)
from spectrain.heads.vocab import Ranking, load_ranking
from tests.conftest import make_verifier

V, H, LAYERS, D = 200, 32, 8, 64  # verifier vocabulary, width, depth; draft vocabulary
AUX = [2, 4, 5]  # speculators' default [2, N//2, N-3] for N = 8
LOCAL_NAME = "/home/u/models/SmolLM2-135M-Instruct"  # how speculators records a verifier given as a local path
ALL_ON = {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True}


@pytest.fixture(scope="module")
def verifier():
    model = make_verifier("llama", False, V, hidden=H, layers=LAYERS)
    model.config.architectures = ["LlamaForCausalLM"]  # as a verifier loaded from its config.json records it
    return model


# -- checkpoints as the references write them ---------------------------------------------------------------------
def reference_weights(verifier, flags: dict, seed: int = 0, full_vocab: bool = False) -> dict[str, torch.Tensor]:
    """Random EAGLE-3 weights under speculators' parameter names (``Eagle3DraftModel.state_dict()`` minus what it
    does not save), stored in bf16 as speculators trains, plus the frozen verifier embedding."""
    g = torch.Generator().manual_seed(seed)
    c = verifier.config
    vocab = c.vocab_size
    heads, kv, d, inter = c.num_attention_heads, c.num_key_value_heads, H // c.num_attention_heads, c.intermediate_size

    def lin(out_f, in_f, scale=1.0):
        return (torch.randn(out_f, in_f, generator=g) * scale / math.sqrt(in_f)).to(torch.bfloat16)

    def norm(n):
        return (1.0 + 0.3 * torch.randn(n, generator=g)).to(torch.bfloat16)

    draft = vocab if full_vocab else D
    w = {"fc.weight": lin(H, len(AUX) * H), "layers.0.input_layernorm.weight": norm(H),
         "layers.0.hidden_norm.weight": norm(H), "layers.0.post_attention_layernorm.weight": norm(H),
         "layers.0.self_attn.q_proj.weight": lin(heads * d, 2 * H), "layers.0.self_attn.k_proj.weight": lin(kv * d, 2 * H),
         "layers.0.self_attn.v_proj.weight": lin(kv * d, 2 * H), "layers.0.self_attn.o_proj.weight": lin(H, heads * d),
         "layers.0.mlp.gate_proj.weight": lin(inter, H), "layers.0.mlp.up_proj.weight": lin(inter, H),
         "layers.0.mlp.down_proj.weight": lin(H, inter), "norm.weight": norm(H), "lm_head.weight": lin(draft, H, 8.0),
         "embed_tokens.weight": verifier.get_input_embeddings().weight.detach().to(torch.bfloat16).clone()}
    if flags.get("norm_before_fc"):
        w["input_norm.weight"] = norm(len(AUX) * H)
    if not full_vocab:  # speculators writes no map for a full draft vocabulary
        counts = torch.randint(0, 1000, (vocab,), generator=g)
        w["d2t"], w["t2d"] = build_vocab_map(counts, D)
    return w


def write_speculators(path, verifier, weights: dict, flags: dict, name: str = LOCAL_NAME,
                      verifier_arch: str = "LlamaForCausalLM"):
    """A speculators EAGLE-3 directory: ``Eagle3SpeculatorConfig`` serialized (every field, as pydantic dumps it;
    ``transformer_layer_config`` the draft Llama config, sliding window and all, as ``scripts/train.py`` builds it)."""
    c = verifier.config
    path.mkdir(parents=True)
    layer = {"model_type": "llama", "vocab_size": c.vocab_size, "hidden_size": H, "intermediate_size": c.intermediate_size,
             "num_hidden_layers": 1, "num_attention_heads": c.num_attention_heads,
             "num_key_value_heads": c.num_key_value_heads, "head_dim": H // c.num_attention_heads, "hidden_act": "silu",
             "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
             "rope_theta": 10000.0, "rope_scaling": None, "tie_word_embeddings": False, "attention_bias": False,
             "mlp_bias": False, "sliding_window": 2048, "use_sliding_window": True, "layer_types": ["sliding_attention"]}
    draft = weights["lm_head.weight"].shape[0]
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
              "transformer_layer_config": layer, "draft_vocab_size": draft, "target_hidden_size": None,
              "eagle_aux_hidden_state_layer_ids": AUX, "norm_before_residual": False, "norm_before_fc": False,
              "fc_norm": False, "norm_output": False, "embed_requires_grad": False, "torch_dtype": "bfloat16",
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                                           "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                     "verifier": {"name_or_path": name, "architectures": [verifier_arch]}}}
    config.update(flags)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(weights, str(path / "model.safetensors"))
    return path


def write_specforge(path, verifier, weights: dict):
    """SpecForge's ``LlamaForCausalLMEagle3`` export (configs/llama3-8B-eagle3.json's keys; ``to_hf`` keeps
    ``embed_tokens.weight``): ``midlayer.*``, no layer ids (the engines then fuse [2, N//2, N-3])."""
    c = verifier.config
    path.mkdir(parents=True)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
              "hidden_size": H, "intermediate_size": c.intermediate_size, "max_position_embeddings": 2048,
              "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
              "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps, "tie_word_embeddings": False,
              "vocab_size": c.vocab_size, "draft_vocab_size": weights["lm_head.weight"].shape[0],
              "torch_dtype": "bfloat16",
              "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "use_cache": True}
    save_file({k.replace("layers.0.", "midlayer."): v for k, v in weights.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


# -- an independent reference forward, from speculators' equations (float64) -------------------------------------
class Reference:
    """speculators' ``Eagle3DraftModel`` with ``LlamaDecoderEagle3FirstLayer``, one query at a time.

    One step at position t: ``e = input_layernorm(embed(x))``, ``n = hidden_norm(g)``, residual ``n`` if
    ``norm_before_residual`` else ``g``; attention of ``cat(e, n)`` (RoPE at speculators' position ids, 1 + t + step)
    over step 0's keys at positions <= t and the keys of this chain's later steps (speculators' TTT mask:
    causal, then one diagonal block per step); ``x = residual + o``; ``out = x + mlp(post_norm(x))``. ``g`` is
    ``fc(input_norm(aux))`` (``norm_before_fc``) at step 0 and the previous step's output after it, normed first
    with ``norm_output``; the logits are ``lm_head(norm(out))`` either way.
    """

    def __init__(self, weights: dict, flags: dict, verifier):
        self.w = {k: v.double() if v.is_floating_point() else v for k, v in weights.items()}
        self.flags = {k: bool(flags.get(k)) for k in ALL_ON}
        c = verifier.config
        self.heads, self.kv, self.d = c.num_attention_heads, c.num_key_value_heads, H // c.num_attention_heads
        self.eps = c.rms_norm_eps
        self.embed = verifier.get_input_embeddings().weight.detach().double()
        self.d2t = weights.get("d2t", torch.zeros(weights["lm_head.weight"].shape[0], dtype=torch.int64))

    def rms(self, x, name):
        return self.w[name] * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def rope(self, x, pos):  # x (n_heads, d), Llama's rotate_half layout
        inv = 10000.0 ** (-torch.arange(0, self.d, 2, dtype=torch.float64) / self.d)
        ang = torch.cat([pos * inv, pos * inv])
        half = self.d // 2
        return x * ang.cos() + torch.cat([-x[:, half:], x[:, :half]], -1) * ang.sin()

    def qkv(self, token, g, pos):
        p = "layers.0."
        n = self.rms(g, p + "hidden_norm.weight")
        a = torch.cat([self.rms(self.embed[token], p + "input_layernorm.weight"), n])
        q = (self.w[p + "self_attn.q_proj.weight"] @ a).view(self.heads, self.d)
        k = (self.w[p + "self_attn.k_proj.weight"] @ a).view(self.kv, self.d)
        v = (self.w[p + "self_attn.v_proj.weight"] @ a).view(self.kv, self.d)
        return self.rope(q, pos), self.rope(k, pos), v, (n if self.flags["norm_before_residual"] else g)

    def finish(self, q, keys, values, residual):
        """keys/values: (n, kv, d) every key this query may see."""
        p = "layers.0."
        group = self.heads // self.kv
        out = []
        for h in range(self.heads):
            scores = keys[:, h // group] @ q[h] / math.sqrt(self.d)
            out.append(torch.softmax(scores, 0) @ values[:, h // group])
        x = residual + self.w[p + "self_attn.o_proj.weight"] @ torch.cat(out)
        m = self.rms(x, p + "post_attention_layernorm.weight")
        act = torch.nn.functional.silu(self.w[p + "mlp.gate_proj.weight"] @ m) * (self.w[p + "mlp.up_proj.weight"] @ m)
        return x + self.w[p + "mlp.down_proj.weight"] @ act

    def target(self, out) -> int:
        logits = self.w["lm_head.weight"] @ self.rms(out, "norm.weight")
        i = int(logits.argmax())
        return i + int(self.d2t[i])

    def fused(self, aux):
        aux = aux.double()
        if self.flags["norm_before_fc"]:
            aux = self.rms(aux, "input_norm.weight")
        return aux @ self.w["fc.weight"].T

    def step0(self, ids, aux):
        """Step 0 over a whole row: (outputs (T, h), keys (T, kv, d), values)."""
        g = self.fused(aux)
        parts = [self.qkv(int(ids[t]), g[t], 1 + t) for t in range(len(ids))]
        keys, values = torch.stack([p[1] for p in parts]), torch.stack([p[2] for p in parts])
        outs = torch.stack([self.finish(q, keys[:t + 1], values[:t + 1], r) for t, (q, _, _, r) in enumerate(parts)])
        return outs, keys, values

    def chain(self, t, first, keys, values, tokens):
        """The draft chain at position t after step 0 (output ``first``): step i >= 1 reads ``tokens[i]`` (a
        callable of the chain so far: teacher forcing or the chain's own drafts). Returns each step's target id."""
        out, ks, vs, drafted = first, [keys[:t + 1]], [values[:t + 1]], [self.target(first)]
        for i in range(1, len(tokens)):
            g = self.rms(out, "norm.weight") if self.flags["norm_output"] else out
            q, k, v, r = self.qkv(tokens[i](drafted), g, 1 + t + i)
            ks.append(k[None])
            vs.append(v[None])
            out = self.finish(q, torch.cat(ks), torch.cat(vs), r)
            drafted.append(self.target(out))
        return drafted

    def ttt(self, ids, aux, steps):
        """speculators' forward over a row (teacher forcing: step i at t reads ``ids[t + i]``, 0 past the end):
        (steps, T) target ids."""
        outs, keys, values = self.step0(ids, aux)
        T = len(ids)
        teacher = lambda t, i: (lambda _: int(ids[t + i]) if t + i < T else 0)  # noqa: E731
        return torch.tensor([self.chain(t, outs[t], keys, values, [None] + [teacher(t, i) for i in range(1, steps)])
                             for t in range(T)]).T

    def draft(self, ids, aux, k):
        """Decoding: the chain at the last position, each step reading the previous step's draft."""
        outs, keys, values = self.step0(ids, aux)
        return self.chain(len(ids) - 1, outs[-1], keys, values, [None] + [lambda d: d[-1]] * (k - 1))


def row(seed: int = 5, T: int = 12):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (T,), generator=g), torch.randn(T, len(AUX) * H, generator=g)


def ours_ttt(drafter, verifier, ids, aux, steps):
    with torch.no_grad():
        logits = drafter.ttt_forward(ids[None], aux[None], verifier.get_input_embeddings(), steps=steps)
    return torch.stack([drafter.draft_to_target(lg[0].argmax(-1)) for lg in logits])


def ours_draft(drafter, verifier, ids, aux, k):
    """What spectrain-eval's EAGLE chain drafter proposes after a prefill of (ids, aux)."""
    chain = EagleChainDrafter(drafter, verifier, k)
    state = DraftState(tokens=ids, length=len(ids), hidden=aux[-1], sampling=Sampling(), new_features=aux,
                       new_tokens=ids)
    chain.start(state, None)
    return chain.propose(state).tokens.tolist()


def same_drafts(drafter, verifier, reference, ids, aux, k) -> bool:
    """Greedy chains of ``k`` after every prefix of the row: spectrain-eval's drafter against the reference."""
    return all(ours_draft(drafter, verifier, ids[:n], aux[:n], k) == reference.draft(ids[:n], aux[:n], k)
               for n in range(2, len(ids) + 1))


# -- speculators' defaults -------------------------------------------------------------------------------------------
def test_speculators_default_checkpoint_drafts_like_its_forward(tmp_path, verifier):
    weights = reference_weights(verifier, ALL_ON)
    path = write_speculators(tmp_path / "spec", verifier, weights, ALL_ON)
    with pytest.warns(UserWarning, match="2048-token sliding window"):
        drafter = import_drafter(path, verifier_model=verifier)
    assert {f: getattr(drafter.config, f) for f in ALL_ON} == ALL_ON
    assert drafter.config.aux_layer_ids == AUX and drafter.config.verifier == LOCAL_NAME
    assert "embed_tokens.weight" not in drafter.state_dict()  # dropped: the verifier's own embeds
    ref = Reference(weights, ALL_ON, verifier)
    ids, aux = row()
    want = ref.ttt(ids, aux, steps=4)
    assert torch.equal(ours_ttt(drafter, verifier, ids, aux, 4), want)  # every TTT step, every position
    assert same_drafts(drafter, verifier, ref, ids, aux, 5)
    # the variant is what makes them agree: read with the flags off, the same weights draft otherwise
    plain = Reference(weights, {}, verifier)
    assert not torch.equal(plain.ttt(ids, aux, steps=4)[1:], want[1:])


@pytest.mark.parametrize("flags", [{}, {"norm_before_residual": True}, {"norm_before_fc": True},
                                   {"norm_output": True}], ids=["none", "residual", "fc", "output"])
def test_each_norm_flag_has_speculators_meaning(tmp_path, verifier, flags):
    """One flag at a time, so a flag read with another's meaning fails here."""
    weights = reference_weights(verifier, flags, seed=3)
    del weights["embed_tokens.weight"]  # optional: speculators writes it, our exports do not
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the sliding-window note
        drafter = import_drafter(write_speculators(tmp_path / "s", verifier, weights, flags), verifier_model=verifier)
    ids, aux = row(seed=7, T=9)
    ref = Reference(weights, flags, verifier)
    assert torch.equal(ours_ttt(drafter, verifier, ids, aux, 3), ref.ttt(ids, aux, steps=3))
    assert same_drafts(drafter, verifier, ref, ids, aux, 4)


def test_full_draft_vocabulary_without_a_map(tmp_path, verifier):
    """speculators writes no d2t / t2d when the draft vocabulary is the verifier's: the identity map."""
    weights = reference_weights(verifier, {}, seed=4, full_vocab=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        drafter = import_drafter(write_speculators(tmp_path / "s", verifier, weights, {}), verifier_model=verifier)
    assert drafter.config.draft_vocab_size == V and bool(drafter.t2d.all()) and not drafter.d2t.any()
    ids, aux = row(seed=8, T=6)
    assert torch.equal(ours_ttt(drafter, verifier, ids, aux, 2), Reference(weights, {}, verifier).ttt(ids, aux, 2))


def test_speculators_checkpoint_in_spectrain_eval(tmp_path, verifier_factory):
    """``spectrain-eval --drafter`` on the checkpoint as speculators wrote it: a verifier recorded as another local
    path, matched by signature (a note says so), decoding lossless."""
    from spectrain.eval.cli import evaluate, parse_args
    from spectrain.heads.verifier import load_verifier

    verifier_dir = verifier_factory("llama", False, layers=LAYERS)
    loaded = load_verifier(str(verifier_dir)).model
    path = write_speculators(tmp_path / "spec", loaded, reference_weights(loaded, ALL_ON, seed=9), ALL_ON)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [f"the king and the queen {i}"]}) for i in range(2)))
    with pytest.warns(UserWarning, match=rf"records verifier '{LOCAL_NAME}'.*signatures agree on architecture"):
        summary_path = evaluate(parse_args(["--verifier", str(verifier_dir), "--method", "eagle", "--drafter",
                                            str(path), "--prompts", str(prompts), "--max_new_tokens", "10",
                                            "--k", "3", "--out", str(tmp_path / "out")]))
    summary = json.loads(open(summary_path).read())
    assert summary["results"]["chain-3"]["identical_to_ar"] is True


# -- SpecForge / SGLang layout ----------------------------------------------------------------------------------------
def test_specforge_layout_drafts_like_its_forward(tmp_path, verifier):
    """SpecForge's TTT (specforge/algorithms/eagle3/model.py) feeds the pre-norm output back and, with its
    default norm_output true, projects lm_head(norm(out)): speculators' equations with every flag off."""
    weights = reference_weights(verifier, {}, seed=11)
    path = write_specforge(tmp_path / "sf", verifier, weights)
    with pytest.raises(SpectrainError, match="pass the verifier"):
        import_drafter(path)  # a foreign checkpoint names no layers: the verifier's depth decides them
    drafter = import_drafter(path, verifier_model=verifier)
    assert drafter.config.aux_layer_ids == AUX and drafter.config.norm_flags == []
    ids, aux = row(seed=12)
    ref = Reference(weights, {}, verifier)
    assert torch.equal(ours_ttt(drafter, verifier, ids, aux, 4), ref.ttt(ids, aux, steps=4))
    assert same_drafts(drafter, verifier, ref, ids, aux, 4)
    # SGLang's eagle_config ids (one less than vLLM's) are read too
    config = json.loads((path / "config.json").read_text())
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}
    (path / "config.json").write_text(json.dumps(config))
    assert import_drafter(path, verifier_model=verifier).config.aux_layer_ids == [2, 4, 6]


@pytest.mark.parametrize("edit,message", [
    ({"norm_output": True}, "read two ways"),  # SpecForge's meaning and vLLM's differ: never guessed
    ({"norm_output": False}, "read two ways"),
    ({"fc_norm": True}, "fc_norm .* is not supported"),
    ({"num_hidden_layers": 2}, "2 decoder layers"),
])
def test_specforge_configs_spectrain_cannot_compute_are_refused(tmp_path, verifier, edit, message):
    weights = reference_weights(verifier, {}, seed=13)
    if edit.get("fc_norm"):
        weights.update({f"fc_norm.{i}.weight": torch.ones(H, dtype=torch.bfloat16) for i in range(3)})
    path = write_specforge(tmp_path / "sf", verifier, weights)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(SpectrainError, match=message):
        import_drafter(path, verifier_model=verifier)


def test_embed_tokens_is_optional_and_checked(tmp_path, verifier):
    weights = reference_weights(verifier, {}, seed=14)
    path = write_specforge(tmp_path / "sf", verifier, weights)
    validate_export(path, "eagle3")  # present: accepted
    tensors = load_file(str(path / "model.safetensors"))
    tensors["embed_tokens.weight"] = tensors["embed_tokens.weight"][:, :-1].contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(SpectrainError, match=r"wrong shapes \['embed_tokens.weight \(200, 31\)"):
        validate_export(path, "eagle3")
    tensors["embed_tokens.weight"] = torch.randn(V, H).to(torch.bfloat16)  # another verifier's embeddings
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.warns(UserWarning, match="differs from this verifier's embedding"):
        import_drafter(path, verifier_model=verifier)


# -- the verifier by signature ------------------------------------------------------------------------------------------
def as_verifier(model, name="bundled:smollm2", tokenizer=None) -> Verifier:
    return Verifier(model=model, tokenizer=tokenizer, name=name)


def test_verifier_signature_mismatch_is_refused_naming_the_field(tmp_path, verifier):
    weights = reference_weights(verifier, ALL_ON, seed=15)
    path = write_speculators(tmp_path / "q", verifier, weights, ALL_ON, verifier_arch="Qwen2ForCausalLM")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(SpectrainError, match=r"architecture: drafter's verifier 'Qwen2ForCausalLM', this one "
                                                 r"'LlamaForCausalLM'.*--allow_verifier_mismatch"):
            load_drafter(str(path), as_verifier(verifier), "eagle")
    with pytest.warns(UserWarning, match=r"signature differs .*architecture.*loaded anyway"):
        drafter = load_drafter(str(path), as_verifier(verifier), "eagle", allow_mismatch=True)
    assert "architecture" in drafter.verifier_note


def test_name_mismatch_with_an_equal_signature_loads_with_a_note(tmp_path, verifier):
    path = write_speculators(tmp_path / "s", verifier, reference_weights(verifier, ALL_ON, seed=16), ALL_ON)
    assert recorded_verifier(path)["signature"]["architecture"] == "LlamaForCausalLM"
    with pytest.warns(UserWarning) as caught:
        drafter = load_drafter(str(path), as_verifier(verifier), "eagle")
    notes = [str(w.message) for w in caught if "records verifier" in str(w.message)]
    assert len(notes) == 1 and LOCAL_NAME in notes[0] and "'bundled:smollm2'" in notes[0]
    assert "architecture, vocab_size, hidden_size" in notes[0] and drafter.verifier_note == notes[0]
    with pytest.raises(SpectrainError, match="holds a drafter of the EAGLE family: use --method eagle"):
        load_drafter(str(path), as_verifier(verifier), "medusa")


def test_tokenizer_and_depth_from_a_recorded_signature(tmp_path, tiny_tokenizer):
    """Our run dirs / exports record the full signature (verifier_signature.json): tokenizer and depth compared."""
    model = make_verifier("llama", False, len(tiny_tokenizer), hidden=H, layers=2)
    heads = MedusaHeads.for_verifier(model, num_heads=2, verifier_name="org/base")
    heads.save_pretrained(tmp_path / "run")
    with pytest.raises(SpectrainError, match="records only its sizes"):  # sizes alone prove nothing
        load_drafter(str(tmp_path / "run"), as_verifier(model, "org/other", tiny_tokenizer), "medusa")
    save_verifier_signature(tmp_path / "run", verifier_identity(model, tiny_tokenizer), "org/base")
    with pytest.warns(UserWarning, match="agree on model_type, vocab_size, hidden_size, num_hidden_layers, tokenizer"):
        load_drafter(str(tmp_path / "run"), as_verifier(model, "org/other", tiny_tokenizer), "medusa")
    changed = verifier_identity(model, tiny_tokenizer)
    assert changed["tokenizer"] == tokenizer_fingerprint(tiny_tokenizer) and changed["tokenizer"].startswith("sha256:")
    changed["tokenizer"] = "sha256:0000000000000000"  # another tokenizer: same sizes, other ids for the same text
    save_verifier_signature(tmp_path / "run", changed, "org/base")
    with pytest.raises(SpectrainError, match="tokenizer: drafter's verifier 'sha256:0000000000000000'"):
        load_drafter(str(tmp_path / "run"), as_verifier(model, "org/base", tiny_tokenizer), "medusa")
    deeper = make_verifier("llama", False, len(tiny_tokenizer), hidden=H, layers=3)
    differ = match_verifier({"name": "x", "signature": verifier_identity(model)}, as_verifier(deeper, "x"),
                            allow_mismatch=True)
    assert "num_hidden_layers: drafter's verifier 2, this one 3" in differ


# -- our norms-on EAGLE-3 through export and import ----------------------------------------------------------------------
def norms_on_drafter(verifier) -> EagleDrafter:
    drafter = EagleDrafter.for_verifier(verifier, "eagle3", draft_vocab_size=D, verifier_name="v", **ALL_ON)
    g = torch.Generator().manual_seed(21)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.ndim == 1 else 0.0))
    drafter.set_vocab_map(*build_vocab_map(torch.randint(0, 1000, (V,), generator=g), D))
    return drafter


def test_norms_on_eagle3_round_trips_through_speculators(tmp_path, verifier):
    drafter = norms_on_drafter(verifier)
    assert "input_norm.weight" in drafter.state_dict()
    out = export_drafter(drafter, "speculators", tmp_path / "spec")
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in ALL_ON} == ALL_ON and config["fc_norm"] is False
    assert "input_norm.weight" in load_file(str(out / "model.safetensors"))
    back = import_drafter(out, verifier_model=verifier)
    assert back.config.norm_flags == list(ALL_ON)
    ids, aux = row(seed=22)
    assert torch.equal(ours_ttt(back, verifier, ids, aux, 3), ours_ttt(drafter, verifier, ids, aux, 3))
    # and that is speculators' forward of the exported weights
    weights = {k: v for k, v in load_file(str(out / "model.safetensors")).items()}
    assert torch.equal(ours_ttt(back, verifier, ids, aux, 3), Reference(weights, ALL_ON, verifier).ttt(ids, aux, 3))
    # run dirs keep the flags too
    drafter.save_pretrained(tmp_path / "run")
    assert EagleDrafter.from_pretrained(tmp_path / "run").config.norm_flags == list(ALL_ON)


def test_norms_on_eagle3_is_refused_where_sglang_would_drop_the_norms(tmp_path, verifier):
    for flags in ({"norm_before_residual": True}, {"norm_output": True}, ALL_ON):
        drafter = EagleDrafter.for_verifier(verifier, "eagle3", draft_vocab_size=D, **flags)
        with pytest.raises(SpectrainError, match=rf"has {', '.join(flags)} on .*export --format speculators"):
            export_drafter(drafter, "eagle3", tmp_path / "e3")
    assert list(tmp_path.iterdir()) == []  # nothing half-written
    with pytest.raises(SpectrainError, match="eagle1 drafters have none"):
        EagleDrafter.for_verifier(verifier, "eagle1", norm_output=True)


def test_eagle_module_trains_the_variant(tmp_path, verifier_factory):
    from spectrain.train.eagle import EagleModule

    verifier_dir = verifier_factory("llama", False, layers=LAYERS)
    module = EagleModule(variant="eagle3", verifier=str(verifier_dir), draft_vocab_size=32, **ALL_ON)
    assert module.drafter.config.norm_flags == list(ALL_ON)
    module.drafter.save_pretrained(tmp_path / "src")
    with pytest.raises(SpectrainError, match="norm_before_residual=True.*--model.norm_before_residual true"):
        EagleModule(variant="eagle3", verifier=str(verifier_dir), draft_vocab_size=32, norm_before_fc=True,
                    norm_output=True, init_from=str(tmp_path / "src"))
    with pytest.raises(SpectrainError, match="eagle1 has none"):
        EagleModule(variant="eagle1", verifier=str(verifier_dir), norm_output=True)


# -- SGLang's token map ---------------------------------------------------------------------------------------------------
def ranked_eagle1(verifier) -> tuple[EagleDrafter, Ranking]:
    drafter = EagleDrafter.for_verifier(verifier, "eagle1", verifier_name="v")
    counts = torch.randint(0, 50, (V,), generator=torch.Generator().manual_seed(31))
    return drafter, Ranking(counts=counts, default_size=40, source="test corpus")


def test_sglang_token_map_written_and_validated(tmp_path, verifier):
    drafter, ranking = ranked_eagle1(verifier)
    notes: list[str] = []
    out = export_drafter(drafter, "eagle-sglang", tmp_path / "sg", ranking=ranking, notes=notes)
    ids = torch.load(out / TOKEN_MAP_FILE, weights_only=True)  # exactly how SGLang's load_token_map reads it
    assert ids.dtype == torch.int64 and torch.equal(ids, ranking.ids())
    assert torch.equal(torch.tensor(ids, dtype=torch.int64), ranking.ids())  # ... then torch.tensor(..., int64)
    config = json.loads((out / "config.json").read_text())
    assert config["spectrain"]["token_map"] == {"file": TOKEN_MAP_FILE, "tokens": 40, "source": "test corpus"}
    assert any("--speculative-token-map" in n for n in notes)
    copied = load_ranking(out)  # our evaluator's ranked head works on the export too
    assert torch.equal(copied.counts, ranking.counts) and copied.default_size == 40
    validate_export(out, "eagle-sglang")
    assert torch.equal(check_token_map(out, config, config["spectrain"]["token_map"]), ids)
    # the vLLM layout of the same drafter: no token map, the full head said, and the engine check's export validates
    from spectrain.eval.vllm_engine import ENGINE_FORMAT

    vllm_notes: list[str] = []
    fmt = ENGINE_FORMAT["eagle1"]
    vllm = export_drafter(drafter, fmt, tmp_path / "vllm", ranking=ranking, notes=vllm_notes)
    validate_export(vllm, fmt)
    assert not (vllm / TOKEN_MAP_FILE).exists() and any("vLLM serves this export's full head" in n for n in vllm_notes)
    plain = export_drafter(drafter, fmt, tmp_path / "engine", verifier_lm_head=verifier.get_output_embeddings(),
                           verifier_name="/models/v", force=True)  # as engine_check.py calls it
    validate_export(plain, fmt)


@pytest.mark.parametrize("corrupt,message", [
    (lambda ids: torch.cat([ids, ids[:1]]), "repeats 1 token ids"),
    (lambda ids: torch.cat([ids[:-1], torch.tensor([V])]), r"outside the verifier's vocabulary \[0, 200\)"),
    (lambda ids: ids.to(torch.int32), "int64"),
    (lambda ids: ids[:-1], "holds 39 ids, config.json declares 40"),
    (lambda ids: b"not a torch file", "not readable with torch.load"),
])
def test_a_corrupted_token_map_is_refused(tmp_path, verifier, corrupt, message):
    drafter, ranking = ranked_eagle1(verifier)
    out = export_drafter(drafter, "eagle-sglang", tmp_path / "sg", ranking=ranking)
    bad = corrupt(torch.load(out / TOKEN_MAP_FILE, weights_only=True))
    if isinstance(bad, bytes):
        (out / TOKEN_MAP_FILE).write_bytes(bad)
    else:
        torch.save(bad, out / TOKEN_MAP_FILE)
    with pytest.raises(SpectrainError, match=message):
        validate_export(out, "eagle-sglang")
    with pytest.raises(SpectrainError, match=message):
        import_drafter(out, verifier_model=verifier)


def test_full_vocabulary_drafters_get_no_token_map_and_medusa_says_full_head(tmp_path, verifier):
    drafter, ranking = ranked_eagle1(verifier)
    full = Ranking(counts=ranking.counts, default_size=0)
    notes: list[str] = []
    out = export_drafter(drafter, "eagle-sglang", tmp_path / "sg", ranking=full, notes=notes)
    assert not (out / TOKEN_MAP_FILE).exists() and any("no token map" in n for n in notes)
    (out / TOKEN_MAP_FILE).write_bytes(b"")  # a stray file is checked all the same
    with pytest.raises(SpectrainError, match="token map"):
        validate_export(out, "eagle-sglang")
    heads = MedusaHeads.for_verifier(verifier, num_heads=2)
    for fmt, engines in (("vllm-medusa", "vLLM serves"), ("medusa", "TensorRT-LLM and vLLM serve")):
        notes = []
        export_drafter(heads, fmt, tmp_path / fmt, ranking=ranking, notes=notes)
        assert any(f"{engines} this export's full head over all {V} tokens" in n for n in notes), notes
        assert load_ranking(tmp_path / fmt).default_size == 40


def test_export_cli_carries_ranking_token_map_and_signature(tmp_path, verifier, tiny_tokenizer):
    """``spectrain-export RUN --format eagle-sglang --format eagle``: the run's vocab_ranking.json and
    verifier_signature.json travel into each export, the SGLang one gets its token map, the summary says where."""
    from spectrain.heads.serving.cli import parse_args, run
    from spectrain.heads.vocab import save_ranking

    drafter, ranking = ranked_eagle1(verifier)
    drafter.save_pretrained(tmp_path / "run")
    save_ranking(tmp_path / "run", ranking.counts, ranking.default_size, ranking.source)
    save_verifier_signature(tmp_path / "run", verifier_identity(verifier, tiny_tokenizer), "v")
    summary = json.loads(open(run(parse_args([str(tmp_path / "run"), "--format", "eagle-sglang", "--format",
                                              "eagle"]))).read())
    sglang, vllm = summary["exports"]
    assert sglang["token_map"]["tokens"] == 40 and sglang["token_map"]["path"].endswith(TOKEN_MAP_FILE)
    assert vllm["token_map"] is None and any("full head" in n for n in vllm["notes"])
    for fmt in ("eagle-sglang", "eagle"):
        out = tmp_path / "run" / "export" / fmt
        assert load_ranking(out).default_size == 40
        assert recorded_verifier(out)["signature"] == verifier_identity(verifier, tiny_tokenizer)
        validate_export(out, fmt)
