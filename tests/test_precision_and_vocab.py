"""Throughput paths: precision auto-selection, bf16-mixed training with clipping through the CLI, the verifier's
native-dtype load, the training vocabulary (loss, dropped targets, exports), a store's greedy ids / top-k
teacher, and the loss's recompute-or-keep decision."""

from __future__ import annotations

import json
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from spectrain.heads import precision
from spectrain.heads.serving.formats import export_drafter, import_drafter
from spectrain.heads.verifier import load_verifier, verifier_features
from spectrain.train.cli import SpectrainCLI, train
from spectrain.train.eagle import EagleModule
from spectrain.train.losses import projected_cross_entropy
from spectrain.train.medusa import MedusaModule


# -- precision ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("native", [True, False])
def test_auto_precision_follows_the_cpu_capability(monkeypatch, native):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    assert precision.bf16_is_native("cpu") is native
    assert precision.resolve_dtype("auto", "cpu") == (torch.bfloat16 if native else torch.float32)
    assert precision.training_precision(None, "cpu") == ("bf16-mixed" if native else "32-true")
    assert precision.training_precision("32-true", "cpu") == "32-true"  # the user can force either
    assert precision.resolve_dtype("float32", "cpu") == torch.float32
    # The CLI resolves an unset precision and lets the verifier follow it (unless the user set its dtype).
    for forced, verifier_dtype, want_precision, want_dtype in [
            (None, "auto", "bf16-mixed" if native else "32-true", "bfloat16" if native else "float32"),
            ("32-true", "auto", "32-true", "float32"), ("bf16-mixed", "auto", "bf16-mixed", "bfloat16"),
            ("bf16-mixed", "float32", "bf16-mixed", "float32")]:
        cfg = SimpleNamespace(trainer={"accelerator": "cpu", "precision": forced},
                              model=SimpleNamespace(init_args=SimpleNamespace(verifier_dtype=verifier_dtype)))
        cfg.trainer = _Dict(cfg.trainer)
        SpectrainCLI.resolve_precision(cfg)
        assert (cfg.trainer.precision, cfg.model.init_args.verifier_dtype) == (want_precision, want_dtype)


def test_amx_alone_counts_as_native(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert precision.resolve_dtype("auto", "cpu") == torch.bfloat16


class _Dict(dict):
    """A dict with attribute access, like jsonargparse's Namespace."""

    __getattr__ = dict.get

    def __setattr__(self, key, value):
        self[key] = value


def test_native_bf16_load_keeps_rope_tables_fp32(verifier_factory):
    path = str(verifier_factory("llama", False))
    native = load_verifier(path, dtype="bfloat16").model
    cast = precision.cast_module(load_verifier(path, dtype="float32").model, torch.bfloat16)
    for model in (native, cast):
        buffers = {n: b.dtype for n, b in model.named_buffers() if "inv_freq" in n}
        assert buffers and set(buffers.values()) == {torch.float32}
    module = MedusaModule(verifier=path, verifier_dtype="bfloat16")
    ids = torch.randint(0, 300, (2, 40))
    want, _ = verifier_features(native, ids)
    got = module.features({"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)})
    assert got["hidden"].dtype == torch.bfloat16 and torch.equal(got["hidden"], want)
    assert torch.equal(verifier_features(cast, ids)[0], want)
    # A blanket .to(bf16) would round the rotary tables: the features would then differ (what cast_module avoids).
    blanket = load_verifier(path, dtype="float32").model.to(torch.bfloat16)
    assert {b.dtype for n, b in blanket.named_buffers() if "inv_freq" in n} == {torch.bfloat16}


# -- bf16-mixed training with clipping, through the CLI --------------------------------------------------------
class GradNormProbe(L.Callback):
    """Records the drafter's total gradient norm as the optimizer saw it (after clipping, before zero_grad)."""

    norms: list[float] = []

    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if grads:
            GradNormProbe.norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))


@pytest.mark.parametrize("config,extra", [
    ("medusa_tinyshakespeare.yaml", ["--model.num_heads", "2"]),
    ("eagle1_tinyshakespeare.yaml", []),
    ("eagle3_tinyshakespeare.yaml", ["--model.draft_vocab_size", "64", "--model.ttt_steps", "2"]),
])
def test_bf16_mixed_training_with_clipping(config, extra, verifier_factory, text_file, tmp_path):
    """Real bf16-mixed steps with fused AdamW and gradient clipping (Lightning alone refuses this combination)."""
    clip = 1e-3  # far below the raw gradient norm, so clipping must have acted
    GradNormProbe.norms = []
    path = train(config, args=[
        "--model.verifier", str(verifier_factory("llama", False, layers=3)), "--data.path", str(text_file),
        "--data.block_size", "32", "--data.batch_size", "4", "--trainer.max_steps", "3",
        "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "2", "--trainer.precision", "bf16-mixed",
        "--trainer.gradient_clip_val", str(clip), "--trainer.callbacks+=tests.test_precision_and_vocab.GradNormProbe",
        "--run_dir", str(tmp_path / "run"), "--logger", "none", *extra])
    summary = json.loads(path.read_text())
    assert summary["steps"] == 3 and summary["tau_pred"] is not None
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "precision: bf16-mixed" in saved and "verifier_dtype: bfloat16" in saved
    assert len(GradNormProbe.norms) >= 2 and max(GradNormProbe.norms) <= clip * 1.01


def test_probe_sees_unclipped_norms_without_a_binding_threshold(verifier_factory, text_file, tmp_path):
    """The probe can fail: without a binding threshold the recorded norms are far above 1e-3."""
    GradNormProbe.norms = []
    train("medusa_tinyshakespeare.yaml", args=[
        "--model.verifier", str(verifier_factory("llama", False, layers=3)), "--data.path", str(text_file),
        "--data.block_size", "32", "--data.batch_size", "4", "--trainer.max_steps", "3", "--model.num_heads", "2",
        "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "1", "--trainer.precision", "bf16-mixed",
        "--trainer.gradient_clip_val", "1e6", "--trainer.callbacks+=tests.test_precision_and_vocab.GradNormProbe",
        "--run_dir", str(tmp_path / "run"), "--logger", "none"])
    assert max(GradNormProbe.norms) > 1e-2


# -- training vocabulary ----------------------------------------------------------------------------------------
def _batch(ids):
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}


def _rows(n=40, vocab=300, length=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Skewed frequencies: low ids common, so a small training vocabulary leaves some targets outside.
    return [{"input_ids": (torch.rand(length, generator=g) ** 3 * vocab).long().tolist(),
             "loss_mask": [1] * length} for _ in range(n)]


def test_reduced_vocabulary_medusa_loss_is_the_restricted_full_loss(verifier_factory):
    """Hand check: CE over the chosen rows only, targets re-indexed, positions with targets outside dropped."""
    torch.manual_seed(0)
    m = MedusaModule(verifier=str(verifier_factory("llama", False)), num_heads=2, target="greedy",
                     verifier_dtype="float32", train_vocab_size=40)
    with torch.no_grad():
        for p in m.drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    rows = _rows()
    m.set_train_vocab(rows)
    counts = torch.bincount(torch.tensor([t for r in rows for t in r["input_ids"]]), minlength=m.to_train_row.shape[0])
    by_count = sorted(range(len(counts)), key=lambda i: (-int(counts[i]), i))  # ties: the lower id first
    assert m.train_rows.tolist() == sorted(by_count[:40])
    ids = torch.tensor([r["input_ids"] for r in _rows(2, seed=5)])
    batch = _batch(ids)
    features = m.features(batch)
    loss, parts = m.drafter_loss(batch, features)
    T, total, dropped, n_all = ids.shape[1], 0.0, 0, 0
    with torch.no_grad():
        hidden = m.verifier.model(ids).last_hidden_state
        full = m.drafter(hidden, m.verifier_lm_head)  # (K, B, T, V)
    chosen = m.train_rows.tolist()
    for k in range(2):
        logits = full[k][:, :T - k - 2][..., chosen]  # the restricted projection
        target = features["greedy"][:, k + 1:T - 1]
        inside = torch.isin(target, m.train_rows)
        index = torch.tensor([chosen.index(t) if t in chosen else 0 for t in target.reshape(-1).tolist()]).view_as(target)
        per_pos = F.cross_entropy(logits.transpose(1, 2), index, reduction="none")
        expected = per_pos[inside].mean()
        torch.testing.assert_close(parts[f"head{k + 1}_loss"], expected, rtol=1e-5, atol=1e-5)
        total += 0.8 ** k * expected
        dropped, n_all = dropped + int((~inside).sum()), n_all + inside.numel()
    torch.testing.assert_close(loss, total, rtol=1e-5, atol=1e-5)
    assert dropped > 0 and float(parts["dropped_frac"]) == pytest.approx(dropped / n_all)


def test_reduced_vocabulary_eagle1_soft_loss(verifier_factory):
    """EAGLE-1's CE against q restricted to the training rows (teacher renormalised over the same rows)."""
    torch.manual_seed(0)
    m = EagleModule(variant="eagle1", verifier=str(verifier_factory("llama", False)), verifier_dtype="float32",
                    train_vocab_size=50, feature_noise=0.0, feature_loss_weight=0.0, ce_loss_weight=1.0)
    m.set_train_vocab(_rows())
    ids = torch.tensor([r["input_ids"] for r in _rows(2, seed=7)])
    batch = _batch(ids)
    features = m.features(batch)
    loss, parts = m.drafter_loss(batch, features)
    hidden = features["hidden"]
    out, _ = m.drafter(ids[:, 1:], hidden[:, :-1], m.embed)
    weight = m.verifier_lm_head.weight[m.train_rows]
    T = ids.shape[1]
    student = (out[:, :T - 2] @ weight.T).log_softmax(-1)
    teacher = (hidden[:, 1:T - 1] @ weight.T).softmax(-1)
    torch.testing.assert_close(loss, -(teacher * student).sum(-1).mean(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shared", [False, True])
def test_reduced_vocabulary_drafter_exports_with_the_full_vocabulary(verifier_factory, tmp_path, shared):
    """Training over a row subset touches only those rows; every Medusa format loads back with identical outputs."""
    torch.manual_seed(0)
    m = MedusaModule(verifier=str(verifier_factory("llama", False)), num_heads=2, verifier_dtype="float32",
                     shared_lm_head=shared, train_vocab_size=40, target="ground_truth")
    m.set_train_vocab(_rows())
    optimizer = torch.optim.SGD(m.drafter.parameters(), lr=0.5)
    ids = torch.tensor([r["input_ids"] for r in _rows(4, seed=3)])
    for _ in range(2):
        loss, _ = m.drafter_loss(_batch(ids), m.features(_batch(ids), greedy=False))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    head = m.verifier_lm_head.weight
    if not shared:
        outside = torch.ones(head.shape[0], dtype=torch.bool)
        outside[m.train_rows] = False
        own = m.drafter.lm_heads[0].weight.detach()
        assert torch.equal(own[outside], head[outside]) and not torch.equal(own[~outside], head[~outside])
    hidden = torch.randn(2, 5, head.shape[1])
    with torch.no_grad():
        want = m.drafter(hidden, m.verifier_lm_head)
    for fmt in ("vllm-medusa", "medusa"):
        out = export_drafter(m.drafter, fmt, tmp_path / fmt, verifier_lm_head=m.verifier_lm_head)
        back = import_drafter(out, verifier_model=m.verifier)
        with torch.no_grad():
            assert torch.equal(back(hidden, m.verifier_lm_head), want)
    # EAGLE-1 trains through the verifier's frozen lm_head: a reduced vocabulary changes no exported tensor's shape.
    e = EagleModule(variant="eagle1", verifier=str(verifier_factory("llama", False)), verifier_dtype="float32",
                    train_vocab_size=40)
    e.set_train_vocab(_rows())
    for fmt in ("eagle", "eagle-sglang"):
        back = import_drafter(export_drafter(e.drafter, fmt, tmp_path / f"e-{fmt}"), verifier_model=e.verifier)
        assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), e.drafter.state_dict().values()))


def test_train_vocab_size_is_checked(verifier_factory):
    from spectrain.heads.errors import SpectrainError

    path = str(verifier_factory("llama", False))
    with pytest.raises(SpectrainError, match="train_vocab_size"):
        MedusaModule(verifier=path, train_vocab_size=10**6)
    with pytest.raises(SpectrainError, match="draft_vocab_size"):
        EagleModule(variant="eagle3", verifier=path, train_vocab_size=64)


def test_sparse_teacher_over_a_row_subset_by_hand():
    """Top-3 ids [5, 2, 9] with log-probs log(.5), log(.3), log(.2); rows {2, 5} -> ids [1, 0, -1], probs [.625, .375, 0]."""
    from spectrain.train.losses import sparse_teacher

    to_rows = torch.full((10,), -1)
    to_rows[2], to_rows[5] = 0, 1
    ids, probs = sparse_teacher(torch.tensor([[5, 2, 9], [9, 8, 7]]), torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]]).log(),
                                to_rows)
    assert ids.tolist() == [[1, 0, -1], [-1, -1, -1]]
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0], [0.0, 0.0, 0.0]]))
    # The loss over those rows: -(.625 log softmax(z)[1] + .375 log softmax(z)[0]); a row with no kept teacher counts 0.
    states, weight = torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)
    loss = projected_cross_entropy(states, weight, sparse_ids=ids, sparse_probs=probs.double())
    logp = (states[0] @ weight.T).log_softmax(-1)
    torch.testing.assert_close(loss, -(0.625 * logp[1] + 0.375 * logp[0]))


def test_own_heads_outside_the_training_vocabulary_do_not_decay(verifier_factory):
    m = MedusaModule(verifier=str(verifier_factory("llama", False)), train_vocab_size=40, weight_decay=0.1)
    from spectrain.train.optim import build_optimizer

    groups = build_optimizer(m.drafter, 1e-3, 0.1, no_decay=m.no_decay_params()).param_groups
    decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decayed and not any(id(p) in decayed for head in m.drafter.lm_heads for p in head.parameters())
    assert all(id(b.linear.weight) in decayed for blocks in m.drafter.blocks for b in blocks)


# -- recompute or keep --------------------------------------------------------------------------------------------
def test_recompute_decision_and_equal_gradients(verifier_factory):
    m = MedusaModule(verifier=str(verifier_factory("llama", False)), loss_memory_budget_gb=1e-6)
    assert m.recompute_loss(rows=1000, vocab=5000)  # 50 MB of logits > 1 KB budget: recompute
    m = MedusaModule(verifier=str(verifier_factory("llama", False)), loss_memory_budget_gb=1.0)
    assert not m.recompute_loss(rows=1000, vocab=5000)
    assert MedusaModule(verifier=str(verifier_factory("llama", False)), loss_recompute="always").recompute_loss(1, 1)
    states = torch.randn(300, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (300,))
    grads = []
    for recompute in (True, False):
        loss = projected_cross_entropy(states, weight, target_ids=targets, chunk_size=64, recompute=recompute)
        grads.append((loss.detach(), *torch.autograd.grad(loss, (states, weight))))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


# -- a store's greedy ids and top-k teacher -------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["medusa-greedy", "medusa-soft", "eagle1", "eagle3"])
def test_store_greedy_and_topk_give_the_online_loss(verifier_factory, text_file, tmp_path, variant):
    """Stored greedy ids are the online argmax; a full-width stored top-k teacher is the online soft teacher."""
    from spectrain.data.datamodule import DrafterDataModule
    from spectrain.data.store import extract

    verifier_dir = verifier_factory("llama", False, layers=3)
    data = DrafterDataModule(path=str(text_file), tokenizer=str(verifier_dir), block_size=32)
    data.setup()
    verifier = load_verifier(str(verifier_dir), dtype="float32")
    vocab = verifier.model.get_output_embeddings().weight.shape[0]
    rows = data.train_set.select(range(8))
    for split in ("train", "validation"):
        extract(verifier, rows, tmp_path / "store" / split, (1, 2, 3), "corpus", dtype="float32", rows_per_shard=4,
                log=lambda *_: None, topk=vocab)
    if variant.startswith("medusa"):
        module = MedusaModule(verifier=str(verifier_dir), verifier_dtype="float32", num_heads=2,
                              target=variant.split("-")[1])
    else:
        module = EagleModule(variant=variant, verifier=str(verifier_dir), verifier_dtype="float32", feature_noise=0.0,
                             aux_layer_ids=[1, 2, 3] if variant == "eagle3" else None, ttt_steps=2,
                             draft_vocab_size=64 if variant == "eagle3" else None)
        if variant == "eagle3":
            module.set_vocab_from(rows)
    store = DrafterDataModule(path=str(tmp_path / "store"), tokenizer=str(verifier_dir), block_size=32, batch_size=4)
    store.setup()
    module.use_store(store.store_meta)
    stored = store.collate([store.train_set[i] for i in range(4)])
    online = data.collate([rows[i] for i in range(4)])
    assert torch.equal(stored["input_ids"], online["input_ids"])
    offline_features = module.features(stored, greedy=False)
    online_features = module.features(online)
    assert "topk_ids" in offline_features and torch.equal(offline_features["greedy"], online_features["greedy"])
    loss_offline, _ = module.drafter_loss(stored, offline_features)
    loss_online, _ = module.drafter_loss(online, online_features)
    torch.testing.assert_close(loss_offline, loss_online, rtol=1e-4, atol=1e-5)


# -- host memory --------------------------------------------------------------------------------------------------
@pytest.mark.integration
def test_freed_host_memory_is_reused_without_page_faults():
    """A loop of steps that allocate and free the same large tensors: with keep_freed_memory() the later steps reuse
    the pages (no faults); glibc's default unmaps and re-faults them every step (24K faults for 96 MiB)."""
    import subprocess
    import sys

    code = ("import resource, sys, torch\n"
            "from spectrain.heads.host_memory import keep_freed_memory\n"
            "if sys.argv[1] == 'keep': assert keep_freed_memory()\n"
            "faults = []\n"
            "for _ in range(10):\n"
            "    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
            "    a = torch.ones(8 * 2**20); b = a * 2; c = (a + b).sum(); del a, b, c\n"
            "    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n"
            "print(sum(faults[5:]))\n")
    late = {mode: int(subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True,
                                     check=True).stdout) for mode in ("default", "keep")}
    assert late["default"] > 5 * 16000 and late["keep"] < late["default"] / 4, late


# -- decoding dtype -------------------------------------------------------------------------------------------------
def test_decode_dtype_is_a_rule_no_timer_can_flip(monkeypatch):
    """``--dtype auto`` follows capability alone: nothing is timed, so a noisy timer cannot change the choice
    (the old rule raced fp32 against bf16 once per job and flipped between runs of the same command)."""
    from spectrain.eval import costs
    from spectrain.eval import decode_dtype as dd
    from spectrain.eval.evaluate import EvalSettings
    from spectrain.eval.methods import method_named

    def noisy_timer(*args, **kwargs):
        raise AssertionError("decode_dtype timed a forward")

    monkeypatch.setattr(costs, "verify_cost", noisy_timer)
    monkeypatch.setattr(costs, "_timer", noisy_timer)
    monkeypatch.setattr(dd, "bf16_is_native", lambda device: False)
    assert dd.decode_dtype("cpu") == (torch.float32, {"rule": "fp32: no native bf16 on this cpu"})
    monkeypatch.setattr(dd, "bf16_is_native", lambda device: True)
    choices = {dd.decode_dtype("cpu")[0] for _ in range(5)}
    assert choices == {torch.bfloat16} and "AMX" in dd.decode_dtype("cpu")[1]["rule"]
    assert method_named("none").verify_sizes(EvalSettings()) == [1]
    assert max(method_named("ngram").verify_sizes(EvalSettings(k=5))) == 6
    assert method_named("medusa").verify_sizes(EvalSettings(k=4, tree="auto:32")) == [1, 5, 33]
    assert method_named("eagle").verify_sizes(EvalSettings(k=4, dynamic_tree=(6, 8, 64))) == [1, 5, 65]
    assert method_named("hybrid").verify_sizes(EvalSettings(k=4, tree="auto:32")) == [1, 5, 37]  # + the lookup branch


def test_the_cpu_record_names_the_class_a_speed_was_measured_on(monkeypatch):
    """lscpu's fields and flags -> the record every speed JSON carries, and its one-line name; without lscpu the
    record still says what it knows (the architecture, torch's threads, whether bf16 is native)."""
    import subprocess
    import types

    from spectrain.eval import decode_dtype as dd

    amx = ("Model name:   Intel(R) Xeon(R) Platinum 8488C\nCPU(s):  2\nCPU family:  6\nModel:  143\n"
           "Flags:   fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n")
    monkeypatch.setattr(dd.subprocess, "run", lambda *a, **k: types.SimpleNamespace(stdout=amx))
    record = dd.cpu_record()
    assert {k: record[k] for k in ("model", "cpus", "family", "model_id", "avx2", "avx512_bf16", "amx_bf16")} == {
        "model": "Intel(R) Xeon(R) Platinum 8488C", "cpus": 2, "family": "6", "model_id": "143", "avx2": True,
        "avx512_bf16": True, "amx_bf16": True}
    record["bf16_native"], record["threads"] = True, 2
    assert dd.cpu_line(record) == ("Intel(R) Xeon(R) Platinum 8488C (family 6, model 143), 2 CPUs "
                                   "(AMX-BF16, AVX512-BF16, AVX-512, AVX2, bf16 native), 2 threads")
    avx2 = amx.replace("Intel(R) Xeon(R) Platinum 8488C", "AMD EPYC").replace(" avx512f avx512_bf16 amx_bf16 amx_tile", "")
    monkeypatch.setattr(dd.subprocess, "run", lambda *a, **k: types.SimpleNamespace(stdout=avx2))
    record = {**dd.cpu_record(), "bf16_native": False, "threads": 2}
    assert dd.cpu_line(record) == "AMD EPYC (family 6, model 143), 2 CPUs (AVX2, bf16 emulated), 2 threads"

    def missing(*a, **k):
        raise FileNotFoundError("lscpu")

    monkeypatch.setattr(dd.subprocess, "run", missing)
    record = dd.cpu_record()
    assert record["cpus"] is None and "avx2" not in record and isinstance(record["bf16_native"], bool)
