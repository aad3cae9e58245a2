"""The speed targets of ``benchmarks/gpu_check.py`` and which of its checks decide a run: each target recorded
with what it compared, so a reader (and a test) can recompute the verdict from the summary's own timings.

Targets: our AR loop's tokens/s at least ``min_ar_vs_hf`` × HF ``generate()``'s, and each speculative setting's
measured speedup at least ``min_speedup_vs_ideal`` × its ideal one (τ and its rounds' draft + verify time: what
the loop's own overhead costs). Greedy identity in fp32 is required always; the speed targets only where asked
(on CUDA by default: on shared CPU cores timings swing too much to judge).
"""

from __future__ import annotations


def speed_checks(results: dict, hf: dict, min_ar_vs_hf: float, min_speedup_vs_ideal: float) -> dict:
    """Each speed target with what it compared: our AR tokens/s over HF ``generate()``'s, and per speculative
    setting its measured speedup over the ideal one (tau and its rounds' draft + verify time), each against its
    minimum. ``results``: an evaluation's ``results`` (``ar`` and the settings); ``hf``: its ``hf_generate``."""
    ours, theirs = results["ar"]["tokens_per_second"], hf["tokens_per_second"]
    ratio = ours / theirs if theirs > 0 else float("inf")
    per_setting = {}
    for name, res in results.items():
        if name == "ar":
            continue
        value = res["speedup"] / res["ideal_speedup"]
        per_setting[name] = {"speedup": res["speedup"], "ideal_speedup": res["ideal_speedup"], "ratio": value,
                             "min": min_speedup_vs_ideal, "passed": value >= min_speedup_vs_ideal}
    return {"ar_vs_hf_generate": {"ours_tokens_per_second": ours, "hf_tokens_per_second": theirs, "ratio": ratio,
                                  "min": min_ar_vs_hf, "passed": ratio >= min_ar_vs_hf},
            "speedup_vs_ideal": per_setting}


def required_checks(checks: dict, speed: bool) -> dict[str, bool]:
    """The checks that decide ``passed``: fp32 greedy identity always, the speed targets when ``speed``."""
    required = {f"fp32_greedy_identical/{k}": v for k, v in checks["fp32_greedy_identical"].items()}
    if speed:
        required["ar_vs_hf_generate"] = checks["ar_vs_hf_generate"]["passed"]
        required.update({f"speedup_vs_ideal/{k}": v["passed"] for k, v in checks["speedup_vs_ideal"].items()})
    return required


def failed_checks(checks: dict, speed: bool) -> list[str]:
    """The names of the required checks (:func:`required_checks`) that failed, sorted: empty when the run passed."""
    return sorted(k for k, ok in required_checks(checks, speed).items() if not ok)
