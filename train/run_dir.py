"""The run directory's policy: where a run writes, and whether a command starts it, resumes it or extends it.

A run writes to ``--run_dir`` (default ``runs/<method>-<verifier>-<data>``): ``config.yaml`` (the resolved
config), ``checkpoints/`` (drafter weights + resume state, never the verifier), the exported best drafter and
``summary.json`` last: a directory without it is an unfinished run. Re-running the same command resumes an
unfinished run from its most advanced checkpoint; ``--extend`` continues a finished one with a larger budget,
nothing else changed; ``--force`` starts over. Configs saved by older versions keep resuming: the keys added
since, and those a family's module declares meaningless (:meth:`~.base.DrafterModule.resume_ignores`), are left
out of the comparison.
"""

from __future__ import annotations

import datetime
import os
import re
import shutil
from pathlib import Path

import torch

from spectrain.heads.errors import SpectrainError

# Top-level keys a resumed run may change: how it is launched and logged, not what it trains.
RESUME_MAY_CHANGE = ("force", "extend", "checkpoint_every", "logger", "wandb_project")
# Trainer keys an extension (--extend) raises: the budget.
EXTEND_MAY_CHANGE = ("max_steps", "max_time")
# Model keys that only choose what is measured, not what is trained: a resumed run may change them.
MEASURE_KEYS = ("measure_prompts", "measure_k", "measure_new_tokens")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", Path(text.rstrip("/")).name or text).strip("-").lower() or "run"


def resolve_run_dir(cfg, method: str) -> Path:
    """The run directory of a parsed config (``cfg.run_dir`` set to the default, ``runs/<method>-<verifier>-<data>``,
    when unset); refuses a finished run unless ``--force`` or ``--extend`` says what to do with it."""
    if not cfg.run_dir:
        data = cfg.data.path or "tinyshakespeare"
        cfg.run_dir = str(Path("runs") / f"{method}-{_slug(cfg.model.init_args.verifier)}-{_slug(data)}")
    run_dir = Path(cfg.run_dir).expanduser()
    if (run_dir / "summary.json").exists() and not (cfg.force or cfg.extend):
        raise SpectrainError(f"{run_dir} holds a finished run (summary.json); pass --extend with a larger "
                             "--trainer.max_steps / --trainer.max_time to train it further, --force to overwrite "
                             "it, or choose another --run_dir")
    if cfg.force and cfg.extend:
        raise SpectrainError("--force starts over and --extend continues: pass one of them")
    return run_dir


def init_args_of(config: dict) -> dict:
    """A config's ``model`` init args (runs saved before recipes named their class had them directly under
    ``model``, with no ``class_path``)."""
    model = config.get("model") or {}
    return dict(model["init_args"] or {}) if "init_args" in model else dict(model)


def _comparable(config_text: str, module: type, saved: dict, unresolved_precision: bool = False,
                extend: bool = False) -> str:
    """A resolved config minus the keys that may differ between a run and its resumption (and, with ``extend``,
    the training budget).

    ``module``: the run's ``DrafterModule`` class (its added keys and :meth:`resume_ignores`); ``saved``: the
    saved config's init args. ``unresolved_precision``: the saved config predates resolved precisions
    (``precision: null``, ``verifier_dtype: auto``), so precision is left out of the comparison rather than
    called a change.
    """
    import yaml

    config = yaml.safe_load(config_text) or {}
    for key in RESUME_MAY_CHANGE:
        config.pop(key, None)
    model = config["model"] = init_args_of(config)  # compared by init args: the class is the method's
    for key in MEASURE_KEYS + module.resume_ignores(model, saved):
        model.pop(key, None)
    for key, old in module.added_init_args.items():
        if model.get(key, old) == old:
            model.pop(key, None)
    if extend:
        for key in EXTEND_MAY_CHANGE:
            (config.get("trainer") or {}).pop(key, None)
    if unresolved_precision:
        (config.get("trainer") or {}).pop("precision", None)
        model.pop("verifier_dtype", None)
    return yaml.safe_dump(config, sort_keys=True)


def prepare_run_dir(cli) -> str | None:
    """Create or reuse the run directory of a parsed and instantiated ``SpectrainCLI``; returns the checkpoint to
    resume from, if any.

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
            if old is not None:
                check_same_config(old, config_text, type(cli.model), extend, run_dir, saved)
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


def check_same_config(old: str, new: str, module: type, extend: bool, run_dir: Path, saved: Path) -> None:
    """Refuse to resume (or extend) the run whose saved config is ``old`` with the config ``new`` unless they
    differ only where a resumption (an extension) may."""
    import yaml

    unresolved = "precision: null" in old  # saved before precisions were resolved
    saved_args = init_args_of(yaml.safe_load(old) or {})
    if _comparable(old, module, saved_args, unresolved, extend) != \
            _comparable(new, module, saved_args, unresolved, extend):
        what = "a run" if extend else "an unfinished run"
        raise SpectrainError(f"{run_dir} holds {what} with another config ({saved}); re-run the same command "
                             "(--extend may change only trainer.max_steps / max_time), or pass --force to "
                             "start over")


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
