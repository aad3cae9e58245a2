"""PNG plots of a ``spectrain-eval`` summary (when matplotlib is installed): α by depth, accept-length
histograms, α vs the heads' KL, expected vs measured speedup."""

from __future__ import annotations

from pathlib import Path


def write_plots(summary: dict, out_dir: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    settings = {k: v for k, v in summary["results"].items() if k != "ar"}
    if not settings:
        return paths
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, r in settings.items():
        ax.plot(range(1, len(r["alpha"]) + 1), [a if a is not None else float("nan") for a in r["alpha"]], "o-", label=name)
    ax.set(xlabel="draft depth k", ylabel="alpha_k", ylim=(0, 1), title="acceptance by position")
    ax.set_xticks(range(1, max(len(r["alpha"]) for r in settings.values()) + 1))
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "alpha.png", dpi=120)
    paths.append(str(out_dir / "alpha.png"))
    fig, ax = plt.subplots(figsize=(5, 3.5))
    width = 0.8 / len(settings)
    for i, (name, r) in enumerate(settings.items()):
        hist = r["accept_histogram"]
        total = max(sum(hist), 1)
        ax.bar([a + i * width for a in range(len(hist))], [h / total for h in hist], width=width, label=name)
    ax.set(xlabel="accepted drafts per round", ylabel="fraction of rounds", title="accept-length histogram")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "accept_hist.png", dpi=120)
    paths.append(str(out_dir / "accept_hist.png"))
    cal, chain = summary.get("calibration"), next((r for k, r in settings.items() if k.startswith("chain")), None)
    if cal and chain:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for k, (kl, a) in enumerate(zip(cal["kl"], chain["alpha"])):
            if a is not None:
                ax.scatter(kl, a)
                ax.annotate(f"k={k + 1}", (kl, a))
        ax.set(xlabel="KL(q || p) of head k", ylabel="alpha_k", title="acceptance vs drafter KL")
        fig.tight_layout()
        fig.savefig(out_dir / "alpha_vs_kl.png", dpi=120)
        paths.append(str(out_dir / "alpha_vs_kl.png"))
    planner = summary.get("planner") or {}
    if planner.get("chains"):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot([r["n"] for r in planner["chains"]], [r["expected_speedup"] for r in planner["chains"]], "o-",
                label="expected (planner)")
        measured = planner["measured_chain"]
        ax.scatter([measured["n"]], [measured["speedup"]], color="red", zorder=3, label="measured")
        ax.set(xlabel="chain length N", ylabel="speedup over AR", title="expected vs measured speedup")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "speedup_vs_n.png", dpi=120)
        paths.append(str(out_dir / "speedup_vs_n.png"))
    plt.close("all")
    return paths
