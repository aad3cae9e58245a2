"""Measure a real training step's memory in a process of its own (run by tests/test_fit_check.py).

``python -m tests.fit_probe OUT.json -- TRAIN_ARGS...`` trains through ``spectrain.train.cli.train`` with
:class:`StepPeak` among the trainer's callbacks and writes what it measured to OUT.json:

* ``step_peak_bytes``: per training step after the first (the optimizer's states exist, the gradients of the step
  before are freed: the steady state), the peak RSS during the step (forward, backward, optimizer step) above the
  RSS at its start. Before each step freed heap memory is handed back (``malloc_trim``) and the kernel's RSS
  high-water mark reset (``/proc/self/clear_refs``), so the peak is this step's own, read as ``VmHWM``.
* ``verifier_weight_bytes``, ``drafter_params`` / ``drafter_trainable``, ``optimizer_state_bytes``: counted from
  the live objects (what the estimate predicts exactly).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

import lightning as L

OUT_ENV = "SPECTRAIN_FIT_PROBE_OUT"


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def current_rss() -> int:
    return status_bytes("VmRSS")


def reset_peak() -> int:
    """Hand freed heap memory back, reset the RSS high-water mark; returns the RSS now."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return current_rss()


def peak_rss() -> int:
    """This address space's RSS high-water mark since the last reset (``VmHWM``). Not ``ru_maxrss``: execve keeps
    the forked parent's high-water mark in it (the pytest process that spawned this one, GBs after a long suite)."""
    return status_bytes("VmHWM")


class StepPeak(L.Callback):
    """Peak RSS of each training step above its start (see the module docstring)."""

    def __init__(self):
        self.steps: list[int] = []
        self._base = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._base = reset_peak()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append(peak_rss() - self._base)

    def on_train_end(self, trainer, pl_module) -> None:
        optimizer = trainer.optimizers[0]
        states = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                     if hasattr(t, "numel") and t.dim() > 0)
        verifier = sum(p.numel() * p.element_size() for p in pl_module.verifier.parameters())
        record = {"step_peak_bytes": self.steps[1:], "first_step_bytes": self.steps[0],
                  "verifier_weight_bytes": verifier, "optimizer_state_bytes": states,
                  "drafter_params": sum(p.numel() for p in pl_module.drafter.parameters()),
                  "drafter_trainable": sum(p.numel() for p in pl_module.drafter.parameters() if p.requires_grad)}
        with open(os.environ[OUT_ENV], "w") as f:
            json.dump(record, f)


def main(argv: list[str]) -> None:
    out, args = argv[0], argv[2:]
    os.environ[OUT_ENV] = out
    from spectrain.train.cli import train

    train(None, args=[*args, "--trainer.callbacks+=tests.fit_probe.StepPeak"])


if __name__ == "__main__":
    main(sys.argv[1:])
