"""Every command in README.md and docs/*.md, in the order given: checked to parse, or run.

    python benchmarks/doc_commands.py                      # every command's flags parse (seconds, no training)
    python benchmarks/doc_commands.py --run README.md --workdir CLONE   # run a page's commands in order, in CLONE

Check mode hands each of our commands its arguments as written and stops right after parsing: ``train_medusa`` /
``train_eagle`` with ``--print_config`` (the recipe, every ``--model.*`` / ``--data.*`` / ``--trainer.*`` key and
its type), the argparse commands and ``benchmarks/*.py`` scripts through their own parsers (every flag and
choice), ``spectrain-eval``'s drafting options through the evaluation API's checks. Shell variables set earlier
on the page (``D=…``) are substituted; placeholders in capitals (``RUN_DIR``) stand for the user's paths. Other
programs (pip, pytest, vllm, git) are listed, not run. Run mode executes a page's commands with bash, in order,
stopping at the first failure. Prints a table, writes JSON (last stdout line: its path); exits 1 when a command
fails.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from spectrain.heads.errors import SpectrainError, run_command
from spectrain.heads.report import finish, format_table

ROOT = Path(__file__).resolve().parents[1]
OURS = {"spectrain-eval": "spectrain.eval.cli", "spectrain-results": "spectrain.eval.results",
        "spectrain-extract": "spectrain.data.extract", "spectrain-export": "spectrain.heads.serving.cli",
        "spectrain-distill": "spectrain.data.distill", "spectrain-build-verifier": "spectrain.data.bundled",
        "spectrain-plan": "spectrain.eval.forecast"}
TRAIN = {"train_medusa": "medusa_tinyshakespeare.yaml", "train_eagle": "eagle3_tinyshakespeare.yaml",
         "train_dflash": "dflash_tinyshakespeare.yaml", "spectrain-train": None}  # None: the --config alone


def pages(root: Path = ROOT) -> list[Path]:
    """README first, then the pages of docs/ in the order README's documentation table links them."""
    readme = root / "README.md"
    linked = re.findall(r"\]\((docs/[\w./-]+\.md)\)", readme.read_text())
    ordered = [readme] + [root / p for p in dict.fromkeys(linked)]
    return ordered + sorted(p for p in (root / "docs").glob("*.md") if p not in ordered)


def commands(text: str) -> list[str]:
    """The commands of a page's ``bash`` / ``sh`` blocks: continuations joined, comments dropped, ``&&`` and
    ``;`` split."""
    out = []
    for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.split("\n"):
            line = strip_comment(line).strip()
            out.extend(part.strip() for part in re.split(r"&&|;", line) if part.strip())
    return out


def strip_comment(line: str) -> str:
    """``line`` without a trailing ``# comment`` (a ``#`` inside quotes stays)."""
    quote = None
    for i, ch in enumerate(line):
        if ch in "'\"" and quote in (None, ch):
            quote = None if quote else ch
        elif ch == "#" and quote is None and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


class Parsed(Exception):
    """Raised by the patched parsers: the command's arguments parsed."""


@contextlib.contextmanager
def stop_after_parsing():
    """argparse's ``parse_args`` parses as usual, then raises :class:`Parsed` instead of returning."""
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        parsed = real(self, args, namespace)
        raise Parsed(parsed)

    argparse.ArgumentParser.parse_args = parse_then_stop
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = real


def check(argv: list[str], redirect: str | None = None) -> str:
    """Parse one command as written; returns what was checked (raises on a flag or value the command refuses).
    ``redirect``: the file the page sends its stdout to (a printed config that a later command reads)."""
    import importlib

    program = argv[0]
    if program in TRAIN:
        from spectrain.train.cli import train

        note = ""
        if TRAIN[program] and "--config" in argv[:-1] and not Path(argv[argv.index("--config") + 1]).is_file():
            i = argv.index("--config") + 1  # the user's own recipe: checked against the default one instead
            note, argv = f" (the user's {argv[i]}: the default recipe in its place)", argv[:i - 1] + argv[i + 1:]
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed), exit_codes() as exits:
            train(TRAIN[program], args=argv[1:] + ["--print_config"])
        if redirect:
            Path(redirect).write_text(printed.getvalue())
        return ("recipe and flags (--print_config)" + note) if exits == [0] else f"exit {exits}"
    if program in OURS or (program == "python" and len(argv) > 1 and argv[1].startswith("benchmarks/")):
        if program in OURS:
            main, rest = importlib.import_module(OURS[program]).main, argv[1:]
        else:  # the script as ``python benchmarks/X.py`` runs it, less its ``__main__`` block: its own main()
            main, rest = runpy.run_path(str(ROOT / argv[1]), run_name="doc_commands_check")["main"], argv[2:]
        with stop_after_parsing(), contextlib.redirect_stderr(io.StringIO()) as err:
            try:
                main(rest)
            except Parsed as parsed:
                if program == "spectrain-eval":  # the drafting options, through the API's own checks
                    from spectrain.eval.cli import checked

                    checked(parsed.args[0])
                return "flags (argparse)"
            except SystemExit as e:
                raise SpectrainError(f"refused its arguments (exit {e.code}): {err.getvalue().strip()[-300:]}") from None
        raise SpectrainError("ran past its parser: no argparse parser to check")
    return "not ours: listed"


@contextlib.contextmanager
def exit_codes():
    """Collect SystemExit codes (``--print_config`` exits 0 after printing; a bad flag exits 2)."""
    codes: list = []
    try:
        yield codes
    except SystemExit as e:
        codes.append(e.code)
        if e.code not in (0, None):
            raise SpectrainError(f"refused its arguments (exit {e.code})") from None


@contextlib.contextmanager
def working_dir(path: str):
    """``contextlib.chdir`` for Python 3.10."""
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def expand(command: str, env: dict[str, str]) -> tuple[list[str], str | None]:
    """``$VAR`` / ``${VAR}`` from assignments earlier on the page (unknown ones stay a placeholder), split into
    words; and the file a ``> FILE`` redirection names."""
    text = re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), m.group(1).upper()), command)
    text, _, redirect = text.partition(">")
    return shlex.split(text), (redirect.strip() or None)


def assignment(command: str) -> tuple[str, str] | None:
    """``NAME=value`` (or ``export NAME=value``; quoted values may hold spaces) -> (name, value)."""
    words = shlex.split(command)
    words = words[1:] if words and words[0] == "export" else words
    if len(words) == 1 and re.fullmatch(r"\w+=.*", words[0]):
        name, _, value = words[0].partition("=")
        return name, value
    return None


def check_page(path: Path) -> list[dict]:
    rows, env = [], {}
    for command in commands(path.read_text()):
        assigned = assignment(command)
        if assigned:
            env[assigned[0]] = assigned[1]
            continue
        argv, redirect = expand(command, env)
        row = {"page": str(path.relative_to(ROOT)), "command": command}
        try:
            row["checked"] = check(argv, redirect)
            row["ok"] = True
        except Exception as e:  # every failure is reported, the next command still checked
            row.update(ok=False, checked=f"{type(e).__name__}: {str(e)[:300]}")
        rows.append(row)
    return rows


def run_page(path: Path, workdir: Path, timeout: int, values: dict[str, str], skip: list[str]) -> list[dict]:
    """Run the page's commands in ``workdir`` (a fresh clone), in order, in one shell environment; ``values``
    name the user's files for the page's placeholders; commands matching a ``skip`` pattern are reported, not run."""
    rows, env = [], dict(os.environ)
    for command in commands(path.read_text()):
        if any(re.search(pattern, command) for pattern in skip):
            rows.append({"page": path.name, "command": command, "ok": True, "rc": None, "seconds": 0.0,
                         "last_line": "skipped (--skip)", "stderr_tail": ""})
            continue
        for placeholder, value in values.items():
            command = command.replace(placeholder, value)
        t0 = time.time()
        # set -a: assignments are exported, so env -0 carries them to the next command; the command's status is
        # the script's.
        script = f"set -a\n{command}\n__rc=$?\nenv -0 > {shlex.quote(str(workdir))}/.doc_env\nexit $__rc"
        try:
            proc = subprocess.run(["bash", "-c", script], cwd=workdir, env=env, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            rows.append({"page": path.name, "command": command, "ok": False, "rc": "timeout",
                         "seconds": round(time.time() - t0, 1), "last_line": f"killed after {timeout} s",
                         "stderr_tail": ""})
            break
        env_file = workdir / ".doc_env"
        if env_file.is_file():
            env = dict(item.split("=", 1) for item in env_file.read_text().split("\0") if "=" in item)
        last = (proc.stdout.strip().splitlines() or [""])[-1]
        rows.append({"page": path.name, "command": command, "ok": proc.returncode == 0, "rc": proc.returncode,
                     "seconds": round(time.time() - t0, 1), "last_line": last, "stderr_tail": proc.stderr[-600:]})
        print(f"[{rows[-1]['seconds']:7.1f} s] rc {proc.returncode}  {command}", flush=True)
        if proc.returncode:
            break
    return rows


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(prog="python benchmarks/doc_commands.py", description=__doc__.split("\n")[0])
    p.add_argument("--run", default=None, help="run this page's commands (e.g. README.md) instead of checking all")
    p.add_argument("--workdir", default=None, help="--run: the fresh clone to run them in")
    p.add_argument("--timeout", type=int, default=3600, help="--run: seconds per command")
    p.add_argument("--set", action="append", default=[], metavar="PLACEHOLDER=VALUE",
                   help="--run: the user's file for a placeholder of the page (e.g. PROMPTS.jsonl=mt_bench.jsonl)")
    p.add_argument("--skip", action="append", default=[], metavar="REGEX",
                   help="--run: leave out commands matching this (reported as skipped), e.g. ones needing the hub")
    p.add_argument("--out", default="runs/doc_commands")
    args = p.parse_args(argv)
    return run_command(measure, args)


def measure(args) -> Path:
    if args.run:
        if not args.workdir or not Path(args.workdir).is_dir():
            raise SpectrainError("--run needs --workdir, an existing directory (a fresh clone)")
        values = dict(item.split("=", 1) for item in args.set if "=" in item)
        if len(values) != len(args.set):
            raise SpectrainError(f"--set takes PLACEHOLDER=VALUE, got {args.set}")
        workdir = Path(args.workdir).resolve()
        rows = run_page(workdir / args.run, workdir, args.timeout, values, args.skip)  # the clone's own page
        table = format_table(["seconds", "rc", "command", "last stdout line"],
                             [[r["seconds"], "-" if r["rc"] is None else r["rc"], r["command"][:70],
                               r["last_line"][-60:]] for r in rows],
                             title=f"{args.run}, run in {args.workdir}")
    else:
        with tempfile.TemporaryDirectory() as scratch, working_dir(scratch):  # what the pages write lands here
            for name in ("configs", "pretrained", "benchmarks", "docs", "runs"):  # relative paths as in a clone
                if (ROOT / name).exists():
                    os.symlink(ROOT / name, Path(scratch) / name)
            rows = [row for page in pages() for row in check_page(page)]
        table = format_table(["page", "ok", "command", "checked"],
                             [[r["page"], "yes" if r["ok"] else "NO", r["command"][:80], r["checked"][:60]]
                              for r in rows], title="every command in README.md and docs/, parsed as written")
    failed = [r for r in rows if not r["ok"]]
    summary = {"mode": "run" if args.run else "check", "page": args.run, "commands": len(rows),
               "failed": len(failed), "rows": rows}
    path = finish(summary, Path(args.out) / ("run.json" if args.run else "check.json"), tables=[table])
    if failed:
        print(f"doc commands: {len(failed)} failed", file=sys.stderr)
        raise SystemExit(1)
    return path


if __name__ == "__main__":
    main()
