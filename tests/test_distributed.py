"""Data-parallel training through Lightning's strategies: DDP on CPU (gloo) matches one process; FSDP units."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spectrain.train.strategies import drafter_wrap_policy, fsdp_units


def run_train_medusa(*args):
    """The real console script: Lightning's DDP launcher re-executes it once per extra rank."""
    script = shutil.which("train_medusa")
    if script is None:
        pytest.skip("train_medusa console script not on PATH (install the package)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    return subprocess.run([sys.executable, script, *args], capture_output=True, text=True, env=env, timeout=900)


@pytest.mark.integration
def test_ddp_two_processes_match_one(tmp_path, verifier_factory, text_file):
    common = ["--model.verifier", str(verifier_factory("llama", False)), "--data.path", str(text_file),
              "--data.block_size", "32", "--trainer.max_steps", "6", "--trainer.val_check_interval", "6",
              "--trainer.limit_val_batches", "2", "--model.num_heads", "2", "--logger", "none",
              "--model.measure_prompts", "3", "--model.measure_new_tokens", "8",
              "--trainer.precision", "32-true"]  # exact equality is an fp32 property (bf16 sums round per rank)
    one = run_train_medusa(*common, "--data.batch_size", "8", "--run_dir", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_train_medusa(*common, "--data.batch_size", "4", "--trainer.devices", "2", "--trainer.accelerator",
                           "cpu", "--trainer.strategy", "ddp", "--run_dir", str(tmp_path / "two"))
    assert two.returncode == 0, two.stderr[-3000:]
    assert "MEMBER: 2/2" in two.stdout + two.stderr and "gloo" in two.stdout + two.stderr
    # Same global batch (rank r reads rows r, r+2, ... of the one-process order), averaged gradients.
    a = load_file(str(tmp_path / "one" / "model.safetensors"))
    b = load_file(str(tmp_path / "two" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)
    s1 = json.loads((tmp_path / "one" / "summary.json").read_text())
    s2 = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert s1["steps"] == s2["steps"] == 6
    # Tokens summed over ranks; validation sharded (rank r: rows r, r + 2, ...) and its counts summed; measured
    # tau pooled over the same prompts, each rank decoding its share: all as one process.
    assert s2["trained_tokens"] == s1["trained_tokens"] > 0
    assert [c["trained_tokens"] for c in s2["curve"]] == [c["trained_tokens"] for c in s1["curve"]]
    assert s1["val_metrics"].keys() == s2["val_metrics"].keys() and "tau_measured" in s1["val_metrics"]
    for key, value in s1["val_metrics"].items():
        assert s2["val_metrics"][key] == pytest.approx(value, rel=1e-6), key
    assert any(float(v.abs().max()) > 0 for k, v in a.items() if "blocks" in k)  # training moved the heads
    # Each rank's own random stream, both saved (rank 0 writes the file).
    ranks = torch.load(tmp_path / "two" / "checkpoints" / "last.ckpt", weights_only=True)["rng"]["ranks"]
    assert len(ranks) == 2 and not torch.equal(ranks[0]["torch"], ranks[1]["torch"])


@pytest.mark.integration
def test_ddp_step_with_a_head_that_has_no_targets(tmp_path, verifier_factory, text_file):
    """A training vocabulary of 2 tokens drops nearly every greedy target, so some heads have no rows in a rank's
    batch: their lm_heads must still take part in the step, or DDP stops at the next one."""
    proc = run_train_medusa("--model.verifier", str(verifier_factory("llama", False)), "--data.path", str(text_file),
                            "--data.block_size", "32", "--data.batch_size", "2", "--trainer.max_steps", "4",
                            "--trainer.val_check_interval", "4", "--trainer.limit_val_batches", "1",
                            "--model.num_heads", "3", "--model.train_vocab_size", "2", "--logger", "none",
                            "--trainer.precision", "32-true", "--trainer.devices", "2", "--trainer.accelerator", "cpu",
                            "--trainer.strategy", "ddp", "--run_dir", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["steps"] == 4


def test_ddp_syncs_the_drafter_only(verifier_factory):
    """DDP broadcasts what it is not told to ignore, at the start and (buffers) before every forward: never the
    frozen verifier, loaded alike on every rank."""
    from spectrain.train.ranks import ddp_ignored_names
    from spectrain.train.eagle import EagleModule

    module = EagleModule(variant="eagle3", verifier=str(verifier_factory("llama", False)))
    ignored = set(ddp_ignored_names(module))
    params = dict(module.named_parameters())
    assert {n for n in params if n.startswith("verifier.")} <= ignored
    assert not {n for n in params if n.startswith("drafter.")} & ignored
    assert {n for n, _ in module.named_buffers()} <= ignored and any("d2t" in n for n in ignored)


def test_resume_restores_each_ranks_own_random_stream(verifier_factory):
    from types import SimpleNamespace

    from spectrain.train.medusa import MedusaModule

    module = MedusaModule(verifier=str(verifier_factory("llama", False)), num_heads=1)
    streams = [torch.Generator().manual_seed(r).get_state() for r in range(2)]
    module._trainer = SimpleNamespace(world_size=2, global_rank=1, strategy=SimpleNamespace(root_device=torch.device("cpu")))
    module.restore_rng({"ranks": [{"torch": streams[0]}, {"torch": streams[1]}]})
    assert torch.equal(torch.get_rng_state(), streams[1])
    before = torch.get_rng_state()
    module.restore_rng({"ranks": [{"torch": streams[0]}]})  # saved by another number of ranks: left as seeded
    assert torch.equal(torch.get_rng_state(), before)


def test_resume_restores_the_cuda_stream_of_the_device_the_rank_trains_on(verifier_factory, monkeypatch):
    """Lightning restores a checkpoint before the strategy moves the module to its GPU: the CUDA stream must go to
    the strategy's device, not to ``module.device`` (still the CPU then, so the stream was silently not restored)."""
    from types import SimpleNamespace

    from spectrain.train.medusa import MedusaModule

    module = MedusaModule(verifier=str(verifier_factory("llama", False)), num_heads=1)
    assert module.device.type == "cpu"
    restored = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((state, device)))
    gpu = torch.device("cuda", 1)
    module._trainer = SimpleNamespace(world_size=2, global_rank=1, strategy=SimpleNamespace(root_device=gpu))
    cuda_states = [torch.tensor([0], dtype=torch.uint8), torch.tensor([1], dtype=torch.uint8)]
    module.restore_rng({"ranks": [{"torch": torch.get_rng_state(), "cuda": cuda_states[0]},
                                  {"torch": torch.get_rng_state(), "cuda": cuda_states[1]}]})
    assert len(restored) == 1 and restored[0][1] == gpu and torch.equal(restored[0][0], cuda_states[1])


def test_each_rank_loads_the_verifier_straight_onto_its_own_gpu(verifier_factory, monkeypatch):
    """Loaded on the host and moved by the strategy, a large verifier would sit whole in host memory once per
    rank; the weights go straight to the local rank's GPU instead (what ``from_pretrained`` is asked for: CUDA
    itself is not needed to check it)."""
    from transformers import AutoModelForCausalLM

    from spectrain.train.medusa import MedusaModule

    class Stop(Exception):
        pass

    asked = {}

    def from_pretrained(path, **kwargs):
        asked.update(kwargs)
        raise Stop

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    with pytest.raises(Stop):
        MedusaModule(verifier=str(verifier_factory("llama", False)), verifier_dtype="bfloat16")
    assert asked["device_map"] == {"": torch.device("cuda", 1)} and asked["dtype"] == torch.bfloat16


def test_under_fsdp_the_verifier_is_loaded_on_the_host_and_not_decoded(verifier_factory, monkeypatch):
    """FSDP shards the verifier from the host (a whole copy per GPU may not fit): the CLIs resolve
    ``verifier_device`` to cpu for it. And measured tau, which runs the verifier's layers directly, is skipped with
    a warning while they are sharded, on every rank alike."""
    from types import SimpleNamespace

    from jsonargparse import Namespace

    from spectrain.train.cli import SpectrainCLI
    from spectrain.train.medusa import MedusaModule

    for strategy, want in (("fsdp_drafter", "cpu"), ("ddp", "auto"), (None, "auto")):
        cfg = Namespace(trainer=Namespace(strategy=strategy, accelerator="cpu", precision=None),
                        model=Namespace(init_args=Namespace(verifier_dtype="auto", verifier_device="auto")))
        SpectrainCLI.resolve_precision(cfg)
        assert cfg.model.init_args.verifier_device == want, strategy
    module = MedusaModule(verifier=str(verifier_factory("llama", False)), num_heads=1, verifier_dtype="float32",
                          measure_prompts=1, measure_new_tokens=4)
    module._trainer = SimpleNamespace(world_size=1, global_rank=0, strategy=_GlooStrategy(),
                                      state=SimpleNamespace(fn="validate"), sanity_checking=False)
    module.log_dict = lambda *a, **k: None
    module.tau_meter.from_batches, module._val_sums = True, {}
    module.validation_step(_validation_batch(), 0)
    monkeypatch.setattr(module, "verifier_is_sharded", lambda: True)
    with pytest.warns(UserWarning, match="measured tau is skipped while the verifier is sharded"):
        module.on_validation_epoch_end()
    assert "tau_measured" not in module.last_val_metrics and "tau_pred" in module.last_val_metrics


def test_fsdp_units_never_mix_frozen_and_trainable(verifier_factory):
    from spectrain.train.eagle import EagleModule
    from spectrain.train.medusa import MedusaModule

    verifier = str(verifier_factory("llama", False, layers=3))
    for module in (MedusaModule(verifier=verifier), EagleModule(variant="eagle3", verifier=verifier)):
        units = fsdp_units(module)
        names = [type(u).__name__ for u in units]
        assert names.count("LlamaDecoderLayer") == 3 and sum(n in ("MedusaHeads", "EagleDrafter") for n in names) == 1
        # Each parameter belongs to the innermost unit containing it; no unit may hold both kinds.
        owner = {}
        for unit in units:  # outer first, so inner units overwrite
            for p in unit.parameters():
                owner[id(p)] = id(unit)
        for unit in units:
            flags = {p.requires_grad for p in unit.parameters() if owner[id(p)] == id(unit)}
            assert len(flags) <= 1, f"unit {type(unit).__name__} mixes frozen and trainable parameters"
        # torch wraps a module only if it answers True to recurse=True too; its submodules then stay in its unit.
        assert drafter_wrap_policy(module.drafter, recurse=True) and drafter_wrap_policy(module.drafter, recurse=False)
        inside = {id(m) for m in module.drafter.modules() if m is not module.drafter}
        assert not any(id(u) in inside for u in units)


@pytest.mark.integration
@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="runs the real FSDP check instead (see below)")
def test_fsdp_needs_cuda_in_lightning(tmp_path, verifier_factory, text_file):
    """Lightning's FSDP strategy refuses the CPU accelerator; say so clearly rather than pretend."""
    proc = run_train_medusa("--model.verifier", str(verifier_factory("llama", False)), "--data.path", str(text_file),
                            "--data.block_size", "32", "--trainer.max_steps", "2", "--trainer.devices", "2",
                            "--trainer.accelerator", "cpu", "--trainer.strategy", "fsdp_drafter", "--logger", "none",
                            "--run_dir", str(tmp_path / "fsdp"))
    assert proc.returncode == 2 and "Lightning's FSDP needs CUDA devices" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "fsdp").exists()


@pytest.mark.integration
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="Lightning's FSDP needs at least 2 CUDA devices here")
def test_fsdp_drafter_strategy_trains_on_gpus(tmp_path, verifier_factory, text_file):
    proc = run_train_medusa("--model.verifier", str(verifier_factory("llama", False)), "--data.path", str(text_file),
                            "--data.block_size", "32", "--trainer.max_steps", "4", "--trainer.devices", "2",
                            "--trainer.strategy", "fsdp_drafter", "--logger", "none", "--run_dir", str(tmp_path / "f"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "f" / "summary.json").is_file()


def _gather_to_file(rank: int, world: int, result, out: str) -> None:
    """Every rank's ``result`` into ``out`` (written by rank 0), then the process group torn down."""
    import torch.distributed as dist

    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.barrier()  # neither rank tears the group down while the other may still be in its last collective
    dist.destroy_process_group()


def _fsdp_worker(rank: int, world: int, store: str, verifier: str, out: str) -> None:
    """One rank: the drafter sharded by torch's FSDP (``fully_shard``, gloo on CPU), a training step through
    the module's own ``step_loss``, then the gathered drafter."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from spectrain.train.optim import build_optimizer
    from spectrain.train.eagle import EagleModule
    from spectrain.train.medusa import MedusaModule

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    results = {}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 24), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    for name, module in (("medusa", MedusaModule(verifier=verifier, num_heads=2, verifier_dtype="float32")),
                         ("eagle1", EagleModule(variant="eagle1", verifier=verifier, verifier_dtype="float32")),
                         ("eagle3", EagleModule(variant="eagle3", verifier=verifier, verifier_dtype="float32",
                                                draft_vocab_size=32))):
        if name == "eagle3":
            module.set_vocab_from([batch])
        whole = {k: v.clone() for k, v in module.drafter.state_dict().items()}
        fully_shard(module.drafter, mesh=init_device_mesh("cpu", (world,)))
        try:  # the failure the issue found: drafter methods called outside forward see shards
            module.drafter_loss(batch, module.features(batch, greedy=True))
            outside = "ran"
        except RuntimeError:
            outside = "failed"
        calls = []
        module.drafter.register_forward_pre_hook(lambda *a: calls.append(1))
        loss, _ = module.step_loss(batch)
        loss.backward()
        grads = [p.grad is not None for p in module.drafter.parameters()]
        plain = module.plain_drafter()
        same = all(torch.equal(v, whole[k]) for k, v in plain.state_dict().items())
        optimizer = build_optimizer(module.drafter, 1e-3, 0.1, decaying=module._decaying)
        decayed = sum(p.numel() for p in optimizer.param_groups[0]["params"])
        results[name] = {"outside": outside, "forward_calls": len(calls), "all_grads": all(grads),
                         "loss": float(loss), "gathered_equals_whole": same,
                         "decayed_local": decayed, "plain_type": type(plain).__name__}
    _gather_to_file(rank, world, results, out)


@pytest.mark.integration
def test_fsdp_sharded_drafter_trains_through_forward(tmp_path, verifier_factory):
    """Lightning's FSDP needs CUDA; torch's own FSDP2 shards on CPU with gloo. Each rank holds half of the
    drafter: a training step must run as the drafter's forward (one gather per step), give every parameter a
    gradient, keep weight decay on the matrices, and the gathered drafter must be the whole one."""
    import torch.multiprocessing as mp

    verifier = str(verifier_factory("llama", False, layers=2))
    out = tmp_path / "fsdp.json"
    mp.spawn(_fsdp_worker, args=(2, str(tmp_path / "store"), verifier, str(out)), nprocs=2)
    ranks = json.loads(out.read_text())
    for name in ("medusa", "eagle1", "eagle3"):
        r0, r1 = ranks[0][name], ranks[1][name]
        for r in (r0, r1):
            assert r["outside"] == "failed" and r["forward_calls"] == 1 and r["all_grads"]
            assert r["gathered_equals_whole"] and r["plain_type"] in ("MedusaHeads", "EagleDrafter")
        assert r0["loss"] == pytest.approx(r1["loss"])  # the same batch on both ranks: the same loss
        assert r0["decayed_local"] > 0 and r1["decayed_local"] > 0  # matrices still decay when sharded


class _GlooStrategy:
    root_device = torch.device("cpu")

    def reduce(self, tensor, reduce_op="sum"):
        import torch.distributed as dist

        if not dist.is_initialized():  # one process
            return tensor
        tensor = tensor.clone()
        dist.all_reduce(tensor)
        return tensor


def _validation_end(rank: int, world: int, verifier: str, batch: dict | None) -> dict:
    """One rank's validation: ``batch`` (or none at all) through the module's own hooks, then its metrics."""
    from types import SimpleNamespace

    from spectrain.train.medusa import MedusaModule

    torch.manual_seed(0)
    module = MedusaModule(verifier=verifier, num_heads=2, verifier_dtype="float32", measure_prompts=2,
                          measure_new_tokens=4)
    module._trainer = SimpleNamespace(world_size=world, global_rank=rank, strategy=_GlooStrategy(),
                                      state=SimpleNamespace(fn="validate"), sanity_checking=False)
    module.log_dict = lambda *a, **k: None
    module.tau_meter.from_batches, module._val_sums = True, {}  # bare dataloaders: prompts from the batches
    if batch is not None:
        module.validation_step(batch, 0)
    module.on_validation_epoch_end()
    return module.last_val_metrics


def _validation_batch() -> dict:
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}


def _validation_worker(rank: int, world: int, store: str, verifier: str, out: str) -> None:
    import datetime

    import torch.distributed as dist

    # Imported before the group exists, as a real program does: torch.distributed.fsdp imported after
    # init_process_group keeps the default group alive past destroy_process_group (torch 2.13), and its gloo
    # threads, still joinable at exit, abort the process ("terminate called without an active exception").
    import spectrain.train.medusa  # noqa: F401

    # A rank left out of a collective would hang the others: the timeout turns that into a failure.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    metrics = _validation_end(rank, world, verifier, _validation_batch() if rank == 0 else None)
    _gather_to_file(rank, world, metrics, out)


@pytest.mark.integration
def test_validation_end_takes_the_same_collectives_on_every_rank(tmp_path, verifier_factory):
    """Rank 1 saw no validation batch (so has no sums and no prompts of its own): it must still enter every
    reduction rank 0 enters, and both must report what one process reports for rank 0's batch, measured tau
    included (the prompts rank 0 collected, shared, each rank decoding its share)."""
    import torch.multiprocessing as mp

    verifier = str(verifier_factory("llama", False, layers=2))
    out = tmp_path / "val.json"
    mp.spawn(_validation_worker, args=(2, str(tmp_path / "store"), verifier, str(out)), nprocs=2)
    ranks = json.loads(out.read_text())
    one = _validation_end(0, 1, verifier, _validation_batch())
    assert "tau_measured" in one and ranks[0] == ranks[1]
    for key, value in one.items():
        assert ranks[0][key] == pytest.approx(value, rel=1e-6), key


def test_fsdp_drafter_keeps_buffers_and_reductions_in_fp32():
    """Lightning's bf16-mixed FSDP config casts buffers (the verifier's RoPE tables) and gradient reductions to
    bf16; ``fsdp_drafter`` keeps both fp32 and computes in bf16."""
    from lightning.pytorch.plugins.precision import FSDPPrecision
    from lightning.pytorch.strategies import StrategyRegistry

    from spectrain.train.strategies import register_strategies

    register_strategies()
    strategy = StrategyRegistry.get("fsdp_drafter")
    strategy.precision_plugin = FSDPPrecision("bf16-mixed")
    config = strategy.mixed_precision_config
    assert config.param_dtype == torch.bfloat16 and config.reduce_dtype == torch.float32
    assert config.buffer_dtype is None
    assert FSDPPrecision("bf16-mixed").mixed_precision_config.buffer_dtype == torch.bfloat16  # what it replaces


def test_fsdp_drafter_checkpoints_gather_the_drafter_only(verifier_factory):
    """Lightning's FSDP checkpoint gathers the whole model, frozen verifier included, onto rank 0 before the
    module drops it again; ``fsdp_drafter`` gathers the drafter alone, under the names the module restores."""
    from lightning.pytorch.strategies import StrategyRegistry

    from spectrain.heads.errors import SpectrainError
    from spectrain.train.medusa import MedusaModule
    from spectrain.train.strategies import register_strategies

    register_strategies()
    strategy = StrategyRegistry.get("fsdp_drafter")
    module = MedusaModule(verifier=str(verifier_factory("llama", False)), num_heads=2)
    strategy._lightning_module, strategy.model = module, module
    state = strategy.lightning_module_state_dict()
    assert set(state) == {f"drafter.{k}" for k in module.drafter.state_dict()}
    for k, v in module.drafter.state_dict().items():
        assert torch.equal(state[f"drafter.{k}"], v)
    with pytest.raises(SpectrainError, match="no activation checkpointing"):
        StrategyRegistry["fsdp_drafter"]["strategy"](activation_checkpointing_policy={torch.nn.Linear})


class _HostSyncs(torch.overrides.TorchFunctionMode):
    """Counts the tensor calls that wait for the device: reading values to the host, data-dependent shapes."""

    SYNCS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__, torch.Tensor.__float__,
             torch.Tensor.__bool__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero}

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.SYNCS:
            import traceback

            caller = traceback.extract_stack()[-2]  # ours only: transformers' own mask checks are not counted
            if any(f"/{part}/" in caller.filename for part in ("train", "heads", "data", "eval")):
                self.calls.append(f"{getattr(func, '__name__', func)} at {caller.filename.split('/')[-1]}:"
                                  f"{caller.lineno}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("method", ["medusa", "eagle1", "eagle3"])
def test_a_training_step_waits_on_the_device_once(method, verifier_factory):
    """On a GPU every host read stalls the step: one row count per step (all heads / TTT steps at once), no
    per-head ``nonzero``, no token count read back (it stays on the device until validation). Checks inside
    the verifier's own transformers forward (its attention-mask shortcuts) are not ours and not counted."""
    from spectrain.train.eagle import EagleModule
    from spectrain.train.medusa import MedusaModule

    verifier = str(verifier_factory("llama", False))
    module = (MedusaModule(verifier=verifier, num_heads=3, verifier_dtype="float32") if method == "medusa" else
              EagleModule(variant="eagle1", verifier=verifier, verifier_dtype="float32") if method == "eagle1" else
              EagleModule(variant="eagle3", verifier=verifier, verifier_dtype="float32", draft_vocab_size=32))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 24), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    if method == "eagle3":
        module.set_vocab_from([batch])
    module.step_loss(batch)  # warm: one-time sizing (the loss memory budget) is not per step
    with _HostSyncs() as syncs:
        loss, _ = module.step_loss(batch)
        loss.backward()
    assert len(syncs.calls) <= 1, syncs.calls


@pytest.mark.integration
def test_gpu_train_check_cpu_path(tmp_path):
    """The prepared GPU training check runs its whole path on the CPU with tiny sizes: every method trains its
    steps in bf16-mixed with clipping, counts its tokens and FLOPs, and the JSON says it passed. The runs are the
    bundled recipes' modules, built from each recipe's class_path (no family named in the script)."""
    from importlib.resources import files

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_train_check.py"), "--small", "--device",
                           "cpu", "--steps", "4", "--out", str(tmp_path)], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(Path(done.stdout.strip().splitlines()[-1]).read_text())
    recipes = sorted(p.name for p in files("spectrain.configs").iterdir() if p.name.endswith("_tinyshakespeare.yaml"))
    assert summary["passed"] and [r["method"] for r in summary["runs"]] == ["dflash", "eagle1", "eagle3", "medusa"]
    assert [r["recipe"] for r in summary["runs"]] == recipes  # every bundled recipe, from configs/
    for run in summary["runs"]:
        assert run["steps"] == 4 and run["trained_tokens"] == 4 * 4 * 32 and run["flops_per_token"] > 0
        assert run["tau_measured"] is not None
