"""Training entry points ``train_medusa`` and ``train_eagle`` on LightningCLI.

A recipe YAML names its LightningModule (``model.class_path``; ``init_args`` are its ``__init__`` arguments).
Every ``__init__`` argument of the drafter module and the data module is a CLI
flag and a YAML key (``--model.num_heads 3``, ``--data.block_size 128``,
``--trainer.max_steps 100``); ``--print_config`` prints the resolved config.
A run writes to ``--run_dir`` (default ``runs/<method>-<verifier>-<data>``):
``config.yaml`` (resolved config), ``checkpoints/`` (drafter weights + resume
state, never the verifier), the exported best drafter (``model.safetensors`` +
``config.json``), logs, and ``summary.json`` last: a directory without it is an
unfinished run.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import shutil
import socket
import sys
import time
import warnings
from importlib import resources
from pathlib import Path
from typing import Literal, Optional

import torch
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar, RichProgressBar
from lightning.pytorch.cli import LightningCLI

from spectrain.data.datamodule import DrafterDataModule
from spectrain.heads.errors import SpectrainError, run_command
from spectrain.heads.precision import precision_dtype, training_precision
from spectrain.heads.report import finish, format_table

from .base import DrafterModule
from .strategies import mmap_checkpoint_io, register_strategies

register_strategies()


def config_path(name: str) -> str:
    """Path of a bundled recipe YAML in ``spectrain.configs``."""
    path = resources.files("spectrain.configs").joinpath(name)
    if not path.is_file():
        raise SpectrainError(f"no bundled config named {name!r}")
    return str(path)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", Path(text.rstrip("/")).name or text).strip("-").lower() or "run"


def wandb_offline() -> bool:
    """Offline unless an API key is configured and the W&B server answers (or WANDB_MODE says otherwise)."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"] in ("offline", "disabled", "dryrun")
    has_key = bool(os.environ.get("WANDB_API_KEY"))
    if not has_key:
        netrc = Path.home() / ".netrc"
        has_key = netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")
    if not has_key:
        return True
    try:
        socket.create_connection(("api.wandb.ai", 443), timeout=3).close()
        return False
    except OSError:
        return True


class StepProgressBar(RichProgressBar):
    """Lightning's progress bar without "Epoch 0/-2": runs are budgeted in steps (max_epochs is -1)."""

    def _get_train_description(self, current_epoch: int) -> str:
        if (self.trainer.max_epochs or -1) < 0:
            return f"Epoch {current_epoch}".ljust(len(self.validation_description))
        return super()._get_train_description(current_epoch)


def _no_litlogger_tip(record: logging.LogRecord) -> bool:
    return "litlogger" not in record.getMessage()  # one function: added once however often train() runs


def quiet_console() -> None:
    """The console shows the run's result, not third-party chatter: no W&B banner or run-history dump (the run
    directory holds the W&B files; ``WANDB_SILENT=false`` brings them back), no Lightning tip to install another
    logger, no weight-loading bars, no deprecation warning from Lightning's own internals."""
    os.environ.setdefault("WANDB_SILENT", "true")
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_no_litlogger_tip)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars for the verifier
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")


class SpectrainCLI(LightningCLI):
    """LightningCLI that adds the run directory, logger choice and the best-drafter checkpoint."""

    def __init__(self, default_config: str, args=None):
        super().__init__(  # the recipe names its module (model.class_path), as torchgeo's configs do
            DrafterModule, DrafterDataModule, subclass_mode_model=True, run=False, save_config_callback=None,
            auto_configure_optimizers=False, seed_everything_default=0, args=args,
            parser_kwargs={"default_config_files": [config_path(default_config)],
                           "description": "Train a drafter (the recipe's model.class_path) on a frozen verifier."},
        )

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("model.init_args.verifier", "data.tokenizer")
        parser.link_arguments("model.init_args.verifier_gguf_file", "data.gguf_file")
        parser.add_argument("--run_dir", type=Optional[str], default=None,
                            help="output directory (default: runs/<method>-<verifier>-<data>)")
        parser.add_argument("--force", type=bool, default=False,
                            help="start over in --run_dir: overwrite a finished run, or discard an unfinished one "
                                 "instead of resuming it")
        parser.add_argument("--extend", type=bool, default=False,
                            help="continue a run in --run_dir (finished or interrupted) from its last checkpoint with "
                                 "a larger --trainer.max_steps or --trainer.max_time (the rest of the config unchanged; "
                                 "max_time counts the whole run when the run had one). The "
                                 "cosine schedule spans max_steps: a run that max_time stopped early continues on "
                                 "the same schedule; a larger max_steps stretches it (the learning rate rises again)")
        parser.add_argument("--checkpoint_every", type=int, default=50,
                            help="save a resume checkpoint every N optimizer steps (checkpoints/resume.ckpt); "
                                 "re-running the same command after a crash continues from it")
        parser.add_argument("--logger", type=Literal["wandb", "csv", "tensorboard", "none"], default="wandb",
                            help="wandb (offline when no API key or network), csv, tensorboard or none")
        parser.add_argument("--wandb_project", type=str, default="spectrain", help="W&B project name")

    def before_instantiate_classes(self) -> None:
        cfg = self.config
        self.method = recipe_method(cfg.model)
        if not cfg.run_dir:
            data = cfg.data.path or "tinyshakespeare"
            cfg.run_dir = str(Path("runs") / f"{self.method}-{_slug(cfg.model.init_args.verifier)}-{_slug(data)}")
        self.run_dir = Path(cfg.run_dir).expanduser()
        if (self.run_dir / "summary.json").exists() and not (cfg.force or cfg.extend):
            raise SpectrainError(f"{self.run_dir} holds a finished run (summary.json); pass --extend with a larger "
                                 "--trainer.max_steps / --trainer.max_time to train it further, --force to overwrite "
                                 "it, or choose another --run_dir")
        if cfg.force and cfg.extend:
            raise SpectrainError("--force starts over and --extend continues: pass one of them")
        strategy = cfg.trainer.get("strategy") if hasattr(cfg.trainer, "get") else getattr(cfg.trainer, "strategy", None)
        if isinstance(strategy, str) and strategy.startswith("fsdp") and not torch.cuda.is_available():
            raise SpectrainError(f"--trainer.strategy {strategy}: Lightning's FSDP needs CUDA devices and none is "
                                 "available; use --trainer.strategy ddp on CPUs")
        if cfg.checkpoint_every < 1:
            raise SpectrainError(f"--checkpoint_every must be >= 1, got {cfg.checkpoint_every}")
        self.resolve_precision(cfg)

    @staticmethod
    def resolve_precision(cfg) -> None:
        """Unset ``trainer.precision`` = bf16-mixed where the device multiplies bf16 natively (CUDA, CPUs with
        AMX / AVX512-BF16), else 32-true; ``model.verifier_dtype: auto`` follows the run's precision, so
        ``--trainer.precision 32-true`` trains in fp32 throughout. Both land resolved in ``config.yaml``."""
        accelerator = str(cfg.trainer.get("accelerator") or "auto")
        device = "cuda" if torch.cuda.is_available() and accelerator in ("auto", "gpu", "cuda") else "cpu"
        cfg.trainer.precision = training_precision(cfg.trainer.get("precision"), device)
        model = cfg.model.init_args
        if model.verifier_dtype == "auto":
            model.verifier_dtype = str(precision_dtype(cfg.trainer.precision)).replace("torch.", "")
        if getattr(model, "verifier_device", "auto") == "auto" and \
                "fsdp" in str(cfg.trainer.get("strategy") or "").lower():
            model.verifier_device = "cpu"  # FSDP shards it from the host: a whole copy per GPU may not fit

    def instantiate_classes(self) -> None:
        """As LightningCLI's, but a module's bad-input error reaches the user as it was raised: jsonargparse takes
        any ValueError from a subclass's ``__init__`` (SpectrainError is one) for "not this type" and rewraps it."""
        try:
            super().instantiate_classes()
        except ValueError as e:
            cause = e
            while cause is not None and not isinstance(cause, SpectrainError):
                cause = cause.__cause__
            if cause is None:
                raise
            raise cause from None

    def instantiate_trainer(self, **kwargs):
        cfg = self.config
        trainer_cfg = self._get(self.config_init, "trainer", default={})
        self.checkpoint = ModelCheckpoint(dirpath=self.run_dir / "checkpoints", filename="best", monitor="val/tau_pred",
                                          mode="max", save_top_k=1, save_last=True, auto_insert_metric_name=False)
        # Written every N steps (atomically: Lightning saves local checkpoints through an fsspec transaction,
        # i.e. a temporary file renamed into place), so a crash loses at most N steps.
        self.resume_checkpoint = ModelCheckpoint(dirpath=self.run_dir / "checkpoints", filename="resume",
                                                 every_n_train_steps=cfg.checkpoint_every, save_top_k=1,
                                                 monitor=None, enable_version_counter=False)
        callbacks = list(trainer_cfg.get("callbacks") or []) + [self.checkpoint, self.resume_checkpoint]
        if trainer_cfg.get("enable_progress_bar", True) is not False and \
                not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks.append(StepProgressBar())
        if trainer_cfg.get("enable_model_summary") is None:  # its FLOPs / size columns are 0 or "not supported"
            kwargs["enable_model_summary"] = False         # for a frozen verifier in bf16: the summary table says more
        kwargs.update(default_root_dir=str(self.run_dir), callbacks=callbacks, logger=self._logger(cfg),
                      use_distributed_sampler=False)  # the training loader shards itself over ranks
        if not trainer_cfg.get("plugins"):  # resume memory-maps the checkpoint (a user's own plugins win)
            kwargs["plugins"] = [mmap_checkpoint_io()]
        return super().instantiate_trainer(**kwargs)

    def _logger(self, cfg):
        if cfg.logger == "none":
            return False
        if cfg.logger == "csv":
            from lightning.pytorch.loggers import CSVLogger

            return CSVLogger(save_dir=str(self.run_dir), name="logs", version="")
        if cfg.logger == "tensorboard":
            from lightning.pytorch.loggers import TensorBoardLogger

            return TensorBoardLogger(save_dir=str(self.run_dir), name="logs", version="")
        from lightning.pytorch.loggers import WandbLogger

        offline = wandb_offline()
        print(f"W&B run {'(offline) ' if offline else ''}in {self.run_dir / 'wandb'}", flush=True)
        logger = WandbLogger(project=cfg.wandb_project, name=self.run_dir.name, save_dir=str(self.run_dir),
                             offline=offline)
        logger._wandb_init.pop("anonymous", None)  # Lightning always passes it; W&B warns that it has no effect
        return logger


def recipe_method(model_config) -> str:
    """What a parsed ``model`` section (class_path + init_args) trains (``medusa``, ``eagle1``, ...): its module's
    :meth:`~.base.DrafterModule.method_for`, a method of a registered drafter family."""
    from spectrain.heads.families import family_for_method

    module, _, name = model_config.class_path.rpartition(".")
    import importlib

    method = getattr(importlib.import_module(module), name).method_for(model_config.init_args)
    family_for_method(method, f"model.class_path {model_config.class_path}")
    return method


def train(default_config: str, args=None) -> Path:
    """Parse (``default_config`` under the user's ``--config`` and flags), train, export the best drafter and write
    ``summary.json``; returns its path."""
    t0 = time.time()
    quiet_console()
    cli = SpectrainCLI(default_config, args=args)
    model, data, trainer, run_dir = cli.model, cli.datamodule, cli.trainer, cli.run_dir
    data.setup("fit")  # bad data fails here, before the run directory exists
    if data.block_size > model.verifier_context:
        raise SpectrainError(f"data.block_size={data.block_size} exceeds the verifier's context of "
                             f"{model.verifier_context} tokens")
    resume_from = prepare_run_dir(cli)
    fit_start = time.time()
    trainer.fit(model, datamodule=data, ckpt_path=resume_from)
    fit_seconds = time.time() - fit_start
    best = cli.checkpoint.best_model_path
    if best:
        model.drafter.load_state_dict(model.drafter_state_from_checkpoint(best))
    trainer.validate(model, datamodule=data, verbose=False)
    drafter = model.plain_drafter()  # on every rank: under FSDP gathering the shards is a collective
    if trainer.global_rank != 0:  # data-parallel workers: rank 0 alone writes the export and the summary
        return run_dir / "summary.json"
    model.write_run_records(run_dir)  # before the drafter's config.json, which marks the drafter complete
    model.export(run_dir, drafter, extra={"trained_steps": trainer.global_step})
    close_loggers(trainer)
    summary = build_summary(cli, best, fit_seconds, time.time() - t0)
    return finish(summary, run_dir / "summary.json", tables=summary_tables(summary))


RESUME_MAY_CHANGE = ("force", "extend", "checkpoint_every", "logger", "wandb_project")
# Trainer keys an extension (--extend) raises: the budget.
EXTEND_MAY_CHANGE = ("max_steps", "max_time")
# Model keys that only choose what is measured, not what is trained: a resumed run may change them.
MEASURE_KEYS = ("measure_prompts", "measure_k", "measure_new_tokens")
# Model keys added after runs were saved, with the value that reproduces a config without them.
ADDED_MODEL_KEYS = {"layer_init": "random", "norm_init": "default", "drop_outside_vocab": False,
                    "verifier_device": "auto"}


def _comparable(config_text: str, unresolved_precision: bool = False, extend: bool = False,
                ignore_model: tuple[str, ...] = ()) -> str:
    """A resolved config minus the keys that may differ between a run and its resumption (and, with ``extend``,
    the training budget).

    ``unresolved_precision``: the saved config predates resolved precisions (``precision: null``, ``verifier_dtype:
    auto``), so precision is left out of the comparison rather than called a change.
    """
    import yaml

    config = yaml.safe_load(config_text) or {}
    for key in RESUME_MAY_CHANGE:
        config.pop(key, None)
    model = config.get("model") or {}
    if "init_args" in model:  # compared by init args (runs saved before recipes named their class had no class_path)
        model = config["model"] = dict(model["init_args"] or {})
    for key in MEASURE_KEYS + tuple(ignore_model):
        model.pop(key, None)
    if model.get("variant") == "eagle1":
        model.pop("drop_outside_vocab", None)  # an EAGLE-3 option: EAGLE-1 ignores it
    for key, old in ADDED_MODEL_KEYS.items():
        if model.get(key, old) == old:
            model.pop(key, None)
    if extend:
        for key in EXTEND_MAY_CHANGE:
            (config.get("trainer") or {}).pop(key, None)
    if unresolved_precision:
        (config.get("trainer") or {}).pop("precision", None)
        (config.get("model") or {}).pop("verifier_dtype", None)
    return yaml.safe_dump(config, sort_keys=True)


def prepare_run_dir(cli: SpectrainCLI) -> str | None:
    """Create or reuse the run directory; returns the checkpoint to resume from, if any.

    An unfinished run (no summary.json) with a checkpoint is resumed from its most advanced checkpoint,
    provided the resolved config is the same; ``--force`` starts over instead. ``--extend`` resumes a finished
    run the same way, its budget (``trainer.max_steps`` / ``max_time``) allowed to differ; its old summary.json
    stays until the extension writes the new one.
    """
    run_dir, force, extend = cli.run_dir, cli.config.force, cli.config.extend
    config_text = cli.parser.dump(cli.config, skip_none=False)
    checkpoints = run_dir / "checkpoints"
    resume_from = None
    if force:
        (run_dir / "summary.json").unlink(missing_ok=True)  # the old run is no longer finished
        shutil.rmtree(checkpoints, ignore_errors=True)
    elif checkpoints.is_dir():
        candidates = [p for p in (checkpoints / "resume.ckpt", checkpoints / "last.ckpt") if p.is_file()]
        if candidates:
            saved = run_dir / "config.yaml"
            old = saved.read_text() if saved.is_file() else None
            unresolved = old is not None and "precision: null" in old  # saved before precisions were resolved
            # A run saved with the default fused layers (null) may be resumed with them named explicitly (the
            # default changed for small verifiers); the checkpoint's record of its layers is checked on load.
            ignore = ("aux_layer_ids",) if old is not None and re.search(r"\baux_layer_ids: null", old) else ()
            if old is not None and _comparable(old, unresolved, extend, ignore) != \
                    _comparable(config_text, unresolved, extend, ignore):
                what = "a run" if extend else "an unfinished run"
                raise SpectrainError(f"{run_dir} holds {what} with another config ({saved}); re-run the same command "
                                     "(--extend may change only trainer.max_steps / max_time), or pass --force to "
                                     "start over")
            progress = {path: _checkpoint_progress(path) for path in candidates}  # also proves each is readable
            # On a tie, last.ckpt: it was saved after that step's validation, resume.ckpt before it.
            best = max(progress, key=lambda p: (progress[p][0], p.name == "last.ckpt"))
            step, elapsed = progress[best]
            if extend:
                check_extension(cli.config.trainer, step, elapsed, run_dir)
            resume_from = str(best)
            print(f"resuming {run_dir} from {resume_from} (step {step})", flush=True)
    if extend and resume_from is None:
        raise SpectrainError(f"--extend: {run_dir} holds no run to extend (no checkpoints/last.ckpt or resume.ckpt)")
    if extend and (run_dir / "summary.json").exists():
        # Unfinished again until the extension writes its own summary: a crash mid-extension leaves a run that
        # re-running the command resumes, never a summary that describes other weights.
        os.replace(run_dir / "summary.json", run_dir / "summary.before-extend.json")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_text)
    return resume_from


def check_extension(trainer_cfg, step: int, elapsed: float | None, run_dir: Path) -> None:
    """Refuse an ``--extend`` whose budget would train nothing more (Lightning would stop at once, exit 0)."""
    max_steps, max_time = trainer_cfg.get("max_steps"), trainer_cfg.get("max_time")
    if max_steps not in (None, -1) and max_steps <= step:
        raise SpectrainError(f"--extend: --trainer.max_steps {max_steps} does not go beyond the {step} steps already "
                             f"trained in {run_dir}")
    seconds = _max_time_seconds(max_time)
    if seconds is not None and elapsed is not None and seconds <= elapsed:
        raise SpectrainError(f"--extend: --trainer.max_time {max_time} does not go beyond the {elapsed:.0f} s this "
                             f"run has already fitted (Lightning's max_time counts the whole run); raise it")


def _max_time_seconds(max_time) -> float | None:
    """Lightning's ``max_time`` (``DD:HH:MM:SS`` or a dict of timedelta fields) in seconds; None when unset."""
    if max_time is None:
        return None
    if isinstance(max_time, str):
        days, hours, minutes, seconds = (int(x) for x in max_time.split(":"))
        return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)
    return datetime.timedelta(**dict(max_time)).total_seconds()


def _checkpoint_progress(path: Path) -> tuple[int, float | None]:
    """(global step, training seconds Lightning's Timer had counted, or None without one) of a Lightning
    checkpoint; a clear error if the file is damaged."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # truncated zip, pickle of foreign classes, ...
        raise SpectrainError(f"checkpoint {path} cannot be read ({type(e).__name__}: {e}); delete it or pass "
                             "--force to start over") from None
    if not isinstance(checkpoint, dict) or "global_step" not in checkpoint or "spectrain" not in checkpoint:
        raise SpectrainError(f"{path} is not a spectrain training checkpoint")
    timer = next((v for k, v in (checkpoint.get("callbacks") or {}).items() if str(k).startswith("Timer")), None)
    return int(checkpoint["global_step"]), ((timer or {}).get("time_elapsed") or {}).get("train")


def close_loggers(trainer) -> None:
    """Finish the loggers now, so nothing they print at exit follows the summary path on stdout."""
    for logger in trainer.loggers:
        logger.finalize("success")
    if "wandb" in sys.modules:
        import wandb

        if wandb.run is not None:
            wandb.finish()


def build_summary(cli: SpectrainCLI, best: str, fit_seconds: float, wall_seconds: float) -> dict:
    model, data, trainer = cli.model, cli.datamodule, cli.trainer
    metrics = model.last_val_metrics
    headers, rows = model.summary_rows(metrics)
    verifier_report = None
    if model.verifier_name.startswith("bundled:"):
        from spectrain.data.bundled import bundled_verifier_dir

        report_path = bundled_verifier_dir(model.verifier_name.split(":", 1)[1]) / "build_report.json"
        if report_path.is_file():
            import json

            verifier_report = json.loads(report_path.read_text())
    return {
        "method": model.method_name,
        "verifier": model.verifier_name,
        "verifier_report": verifier_report,
        "data": data.data_name,
        "data_format": data.resolved_format(),
        "skipped_rows": data.skipped,
        "target": getattr(model, "target", None),
        "steps": trainer.global_step,
        "fit_seconds": round(fit_seconds, 1),
        "wall_seconds": round(wall_seconds, 1),
        "trained_tokens": model.trained_tokens,
        "train_seconds": round(model.train_seconds, 3),
        # Over the whole run (resumes and extensions included); fit_seconds / wall_seconds are this invocation's.
        "train_tokens_per_second": round(model.trained_tokens / max(model.train_seconds or fit_seconds, 1e-9), 1),
        "best_checkpoint": best or None,
        "drafter_dir": str(cli.run_dir.resolve()),
        "tau_pred": metrics.get("tau_pred"),
        "tau_measured": metrics.get("tau_measured"),
        "curve": model.curve,
        "per_position": {"columns": headers, "rows": rows},
        "val_metrics": metrics,
    }


def summary_tables(summary: dict) -> list[str]:
    table = summary["per_position"]
    per_head = format_table(table["columns"], table["rows"],
                            title=f"{summary['method']} on {summary['verifier']} ({summary['data']}), held-out")
    tau = summary["tau_pred"]
    facts = format_table(["", "value"], [
        ["predicted tau (joint chain)", "n/a" if tau is None else f"{tau:.3f}"],
        *([["measured tau (lossless loop, chain, T=0)", f"{summary['tau_measured']:.3f}"]]
          if summary.get("tau_measured") is not None else []),
        *([["target", summary["target"]]] if summary["target"] else []), ["steps", summary["steps"]],
        ["train tokens/s", summary["train_tokens_per_second"]], ["wall seconds", summary["wall_seconds"]],
    ])
    return [per_head, facts]


def _main(default_config: str) -> None:
    run_command(train, default_config)


def train_medusa() -> None:
    """Console script ``train_medusa``: the Medusa recipe by default (``--config`` another recipe)."""
    _main("medusa_tinyshakespeare.yaml")


def train_eagle() -> None:
    """Console script ``train_eagle`` (EAGLE-3 by default; ``--model.variant eagle1`` or ``--config`` another recipe)."""
    _main("eagle3_tinyshakespeare.yaml")


def train_dflash() -> None:
    """Console script ``train_dflash``: a DFlash block drafter on the bundled default (``--config`` another recipe:
    ``configs/dflash_smollm2.yaml``; ``--model.markov_rank`` / ``--model.confidence_head`` make it DSpark)."""
    _main("dflash_tinyshakespeare.yaml")
