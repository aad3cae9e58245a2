"""The training command on LightningCLI: its parser, the run (fit, export, summary) and the console scripts.

A recipe YAML names its LightningModule (``model.class_path``; ``init_args`` are its ``__init__`` arguments).
Every ``__init__`` argument of the drafter module and the data module is a CLI
flag and a YAML key (``--model.num_heads 3``, ``--data.block_size 128``,
``--trainer.max_steps 100``); ``--print_config`` prints the resolved config.
A run writes to ``--run_dir`` (default ``runs/<method>-<verifier>-<data>``):
``config.yaml`` (resolved config), ``checkpoints/`` (drafter weights + resume
state, never the verifier), the exported best drafter (``model.safetensors`` +
``config.json``), logs, and ``summary.json`` last: a directory without it is an
unfinished run (``run_dir.py``: start, resume or extend). Each bundled family has a console script, its
default recipe.
"""

from __future__ import annotations

import logging
import os
import shlex
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
from spectrain.heads.report import finish

from .base import DrafterModule
from .run_dir import prepare_run_dir, resolve_run_dir
from .summary import build_summary, summary_tables
from .strategies import mmap_checkpoint_io, register_strategies

register_strategies()


def config_path(name: str) -> str:
    """Path of a bundled recipe YAML in ``spectrain.configs``."""
    path = resources.files("spectrain.configs").joinpath(name)
    if not path.is_file():
        raise SpectrainError(f"no bundled config named {name!r}")
    return str(path)


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

    def __init__(self, default_config: str | None, args=None):
        self.default_config, self.args = default_config, list(sys.argv[1:] if args is None else args)
        self.fit_path: Optional[Path] = None  # --dry_run: the fit check's JSON (nothing is instantiated)
        super().__init__(  # the recipe names its module (model.class_path), as torchgeo's configs do
            DrafterModule, DrafterDataModule, subclass_mode_model=True, run=False, save_config_callback=None,
            auto_configure_optimizers=False, seed_everything_default=0, args=args,
            parser_kwargs={"default_config_files": [config_path(default_config)] if default_config else [],
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
        parser.add_argument("--dry_run", type=bool, default=False,
                            help="estimate the run's memory per device from the recipe and the verifier's config "
                                 "alone (train/fit.py: docs/training.md 'Will it fit?'); nothing is loaded or trained, "
                                 "no run directory is made")
        parser.add_argument("--device_memory", type=Optional[float], default=None,
                            help="with --dry_run: GiB per device; says whether the run fits and the largest "
                                 "data.block_size that does")
        parser.add_argument("--fit_out", type=Optional[str], default=None,
                            help="with --dry_run: the JSON's path (default runs/fit/<method>-<verifier>.json)")

    def before_instantiate_classes(self) -> None:
        cfg = self.config
        self.method = recipe_method(cfg.model)
        self.run_dir = resolve_run_dir(cfg, self.method)
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
        any ValueError from a subclass's ``__init__`` (SpectrainError is one) for "not this type" and rewraps it.
        ``--dry_run`` instantiates nothing: the fit check runs on the parsed config instead."""
        if self.config.dry_run:
            self.fit_path = self.fit_check()
            return
        try:
            super().instantiate_classes()
        except ValueError as e:
            cause = e
            while cause is not None and not isinstance(cause, SpectrainError):
                cause = cause.__cause__
            if cause is None:
                raise
            raise cause from None

    def fit_check(self) -> Path:
        """``--dry_run``: the recipe's memory per device (:func:`~.fit.fit_check`), from its config alone."""
        from spectrain.heads.families import resolve_class_path

        from .fit import Recipe, fit_check

        cfg = self.config
        if not self.names_block_size():
            raise SpectrainError("the recipe names no data.block_size: the fit check needs the sequence length the "
                                 "run trains at (set it in the recipe or pass --data.block_size N)")
        devices = cfg.trainer.get("devices")
        if isinstance(devices, str) and devices.isdigit():  # jsonargparse parses --trainer.devices 8 as the str '8'
            devices = int(devices)
        devices = devices if isinstance(devices, int) and devices > 0 else len(devices) if isinstance(devices, list) else 1
        model = cfg.model.init_args
        recipe = Recipe(module=resolve_class_path(cfg.model.class_path), init_args=model.as_dict(),
                        verifier_dtype=getattr(torch, model.verifier_dtype), precision=str(cfg.trainer.precision),
                        batch_size=cfg.data.batch_size, block_size=cfg.data.block_size,
                        accumulation=int(cfg.trainer.get("accumulate_grad_batches") or 1),
                        devices=devices * int(cfg.trainer.get("num_nodes") or 1), data_path=cfg.data.path)
        out = cfg.fit_out or str(Path("runs") / "fit" / f"{self.method}-{Path(self.run_dir).name.split('-', 1)[-1]}.json")
        return fit_check(recipe, model.verifier, Path(out), cfg.device_memory, model.trust_remote_code,
                         command=shlex.join([PROGRAMS.get(self.default_config, "spectrain-train"), *self.args]))

    def names_block_size(self) -> bool:
        """Whether the command line or a recipe file (the default one or a ``--config``) sets data.block_size."""
        import yaml

        if any(arg.split("=")[0] == "--data.block_size" for arg in self.args):
            return True
        files = ([config_path(self.default_config)] if self.default_config else []) + \
            [str(p) for p in (self.config.get("config") or [])]
        for file in files:
            recipe = yaml.safe_load(Path(file).read_text()) or {}
            if (recipe.get("data") or {}).get("block_size") is not None:
                return True
        return False

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


# The console script of each default recipe (what a recorded command line names).
PROGRAMS = {"medusa_tinyshakespeare.yaml": "train_medusa", "eagle3_tinyshakespeare.yaml": "train_eagle",
            "dflash_tinyshakespeare.yaml": "train_dflash"}


def recipe_method(model_config) -> str:
    """What a parsed ``model`` section (class_path + init_args) trains: its module's
    :meth:`~.base.DrafterModule.method_for`, a method of a registered drafter family."""
    from spectrain.heads.families import family_for_method, resolve_class_path

    method = resolve_class_path(model_config.class_path).method_for(model_config.init_args)
    family_for_method(method, f"model.class_path {model_config.class_path}")
    return method


def train(default_config: str | None, args=None) -> Path:
    """Parse (``default_config`` under the user's ``--config`` and flags; None: the user's ``--config`` alone),
    train, export the best drafter and write ``summary.json``; returns its path."""
    t0 = time.time()
    quiet_console()
    cli = SpectrainCLI(default_config, args=args)
    if cli.fit_path is not None:  # --dry_run: the fit check, nothing trained
        return cli.fit_path
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


def close_loggers(trainer) -> None:
    """Finish the loggers now, so nothing they print at exit follows the summary path on stdout."""
    for logger in trainer.loggers:
        logger.finalize("success")
    if "wandb" in sys.modules:
        import wandb

        if wandb.run is not None:
            wandb.finish()


def _main(default_config: str | None) -> None:
    run_command(train, default_config)


def spectrain_train() -> None:
    """Console script ``spectrain-train --config RECIPE.yaml``: any registered family's recipe, a bundled one or an
    installed package's (its ``model.class_path`` decides what trains); no default recipe."""
    named = ("-c", "--config", "--model", "-h", "--help", "--print_config")
    if not any(arg.split("=")[0] in named for arg in sys.argv[1:]):
        print("error: spectrain-train has no default recipe: give --config RECIPE.yaml (its model.class_path names "
              "the drafter module; bundled recipes: train_medusa / train_eagle / train_dflash --print_config)",
              file=sys.stderr)
        raise SystemExit(2)
    _main(None)


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
