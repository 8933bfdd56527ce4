"""Rename the package everywhere: ``python scripts/rename.py mypkg [--dry-run] [--force]``.

The template's package name is written in ~80 files (imports, ``_target_``s, ``python -m ...``,
pyproject, tests, README, notebooks). This rewrites every code-like occurrence in the files git
knows (tracked, plus untracked ones that are not ignored) and moves ``src/<old>`` to
``src/<new>``; the word in prose ("the project's own requirement") stays. Environment variables
follow the package: ``PROJECT_LOG_DIR`` becomes ``MYPKG_LOG_DIR``.

It refuses (one ``error:`` line, exit 2, nothing changed) a name that is not a lowercase Python
identifier or that would shadow a standard-library or installed module, and a working tree with
uncommitted changes (``--force`` overrides), so that ``git checkout . && git clean -fd`` undoes it.
Standard library only: it runs before the package is installed.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import keyword
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Larger files are data, not code; reading them would only cost memory.
MAX_FILE_BYTES = 10 * 1024 * 1024
# The rename's own files, whose examples name the template's package as it was.
OWN_FILES = {Path("scripts/rename.py"), Path("tests/test_rename.py")}
ACCEPTED = (
    "a lowercase Python identifier (a letter, then letters, digits or _) that no keyword, "
    "standard-library or installed module already uses"
)


class RenameError(Exception):
    """Bad input or state: reported as one ``error:`` line, exit 2."""


def current_name(root: Path) -> str:
    """The package's name now: the one folder with an ``__init__.py`` under ``src/``."""
    packages = sorted(p.parent.name for p in (root / "src").glob("*/__init__.py"))
    if len(packages) != 1:
        raise RenameError(
            f"expected exactly one package under {root / 'src'}, found {packages or 'none'}"
        )
    return packages[0]


def check_name(new: str, old: str, root: Path) -> None:
    """Refuse ``new`` unless it can be imported as itself from a clone of this repository."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", new):
        raise RenameError(f"{new!r} is not a valid package name; expected {ACCEPTED}")
    if keyword.iskeyword(new):
        raise RenameError(f"{new!r} is a Python keyword; expected {ACCEPTED}")
    if new == old:
        return
    if new in sys.stdlib_module_names:
        raise RenameError(f"{new!r} would shadow the standard-library module; expected {ACCEPTED}")
    top_level = {p.name.partition(".")[0] for p in root.iterdir()}
    if new in top_level:
        raise RenameError(f"{new!r} is already a name at the top of {root}; expected {ACCEPTED}")
    # This script's folder and the repository itself are on sys.path only because of how the
    # script was started; what matters is what the environment would import instead.
    own = {Path(__file__).resolve().parent, root, root / "src"}
    search = [p for p in sys.path if Path(p or ".").resolve() not in own]
    spec = importlib.machinery.PathFinder.find_spec(new, search)
    if spec is not None:
        where = spec.origin or next(iter(spec.submodule_search_locations or []), "?")
        raise RenameError(
            f"{new!r} would shadow the installed module at {where}; expected {ACCEPTED}"
        )


def rewriter(old: str, new: str, suffix: str) -> Callable[[str], tuple[str, int]]:
    """Replace the code-like occurrences of ``old`` in a file whose name ends in ``suffix``.

    Code-like: a dotted path (``import project.x``, ``"project.x:create"``, ``project.{task}``),
    a path into the package (``src/project``, ``project/configs``), ``import``/``from``/``-m``,
    the name quoted (``"project"``, ```project```), pip extras and wheels (``project[plot]``,
    ``project-*.whl``), a YAML value (``project: project``), the README's title, and
    ``PROJECT_`` environment variables. Not TOML table headers (``[project.optional-dependencies]``
    is pyproject's own table), and not the word in a longer name (``pyproject``, ``my-project``).
    """
    o = re.escape(old)
    free = r"(?![\w-])"  # not the start of a longer name
    forms = [
        rf"(?<![\w./:-]){o}(?=\.[A-Za-z_{{<])",  # dotted: module paths, f"project.{task}"
        rf"(?<![\w.-]){o}(?=/)",  # a path inside the package
        rf"(?<=src/){o}{free}",
        rf"(?<=site-packages/){o}{free}",
        rf"(?<=\bimport ){o}{free}",
        rf"(?<=\bfrom ){o}(?=\s+import\b)",
        rf"(?<=-m ){o}{free}",
        rf'(?<="){o}(?=")',
        rf"(?<='){o}(?=')",
        rf"(?<=`){o}(?=`)",
        rf"(?<![\w.-]){o}(?=\[[\w,\s-]*\])",  # pip extras: 'project[plot]'
        rf"(?<![\w.-]){o}(?=-(?:\*|\d))",  # distributions: project-*.whl, project-0.1.0
    ]
    if suffix in (".yaml", ".yml"):
        forms.append(rf"(?<=: ){o}(?=[ \t]*(?:#.*)?$)")  # a value: `project: project`
    if suffix == ".md":
        forms.append(rf"(?<=\A# ){o}(?![\w'’-])")  # the title, on the first line
    package = re.compile("|".join(forms), re.MULTILINE)
    env_prefix = re.compile(rf"(?<!\w){re.escape(old.upper())}_")

    def rewrite(text: str) -> tuple[str, int]:
        replaced = 0

        def replace(match: re.Match[str]) -> str:
            nonlocal replaced
            if suffix == ".toml":  # a table header: [project], [project.optional-dependencies]
                line_start = text.rfind("\n", 0, match.start()) + 1
                if text[line_start : match.start()].strip() in ("[", "[["):
                    return match.group()
            replaced += 1
            return new

        renamed, env_count = env_prefix.subn(f"{new.upper()}_", package.sub(replace, text))
        return renamed, replaced + env_count

    return rewrite


def git(root: Path, *args: str) -> str:
    try:
        result = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=False
        )
    except FileNotFoundError:
        raise RenameError("git is not installed; the rename works on the files git knows") from None
    if result.returncode != 0:
        message = result.stderr.strip().splitlines()[-1:] or ["no message"]
        raise RenameError(f"git {' '.join(args)} failed in {root}: {message[0]}")
    return result.stdout


def candidate_files(root: Path) -> list[Path]:
    """The files git knows (tracked, or untracked and not ignored), as paths relative to ``root``."""
    listed = git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    return sorted({Path(p) for p in listed.split("\0") if p})


def read_text(path: Path) -> str | None:
    """The file's text, or None where it is not a regular, reasonably small UTF-8 text file."""
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
            return None
        data = path.read_bytes()
    except OSError as error:
        raise RenameError(f"cannot read {path}: {error.strerror}") from None
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def write_text(path: Path, text: str) -> None:
    """Replace the file in one step (a crash leaves the old or the new file, never half of one)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".rename")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8"))
        os.chmod(tmp, path.stat().st_mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def plan(root: Path, old: str, new: str) -> dict[Path, tuple[str, str, int]]:
    """Every file that changes: relative path -> (old text, new text, number of replacements)."""
    changes = {}
    for relative in candidate_files(root):
        if relative in OWN_FILES:
            continue
        text = read_text(root / relative)
        if text is None:
            continue
        in_use = rewriter(new, new, relative.suffix)
        for number, line in enumerate(text.splitlines() if in_use(text)[1] else [], start=1):
            if in_use(line)[1]:
                raise RenameError(
                    f"{new!r} is already used in the code ({relative.as_posix()}:{number}: "
                    f"{line.strip()[:80]}), so a later rename could not tell the two apart; "
                    "pick a name the repository does not use yet"
                )
        rewritten, count = rewriter(old, new, relative.suffix)(text)
        if count:
            changes[relative] = (text, rewritten, count)
    return changes


def show(changes: dict[Path, tuple[str, str, int]]) -> None:
    """Each changed line as ``path:line: new text``, for review before a real run."""
    for relative, (before, after, _) in changes.items():
        for number, (line_before, line_after) in enumerate(
            zip(before.splitlines(), after.splitlines(), strict=True), start=1
        ):
            if line_before != line_after:
                print(f"{relative.as_posix()}:{number}: {line_after.strip()}")


def tidy(root: Path, files: list[Path]) -> None:
    """Re-sort the imports and re-wrap the lines that the new name made shorter or longer."""
    python_files = [str(root / f) for f in files if f.suffix == ".py"]
    if importlib.util.find_spec("ruff") is None:
        print("ruff is not installed here; run `make format` to keep `make lint` clean")
        return
    for command in (("check", "--fix", "--select", "I"), ("format",)):
        subprocess.run(
            [sys.executable, "-m", "ruff", *command, "--quiet", *python_files],
            cwd=root,
            check=False,
        )


def rename(root: Path, new: str, *, dry_run: bool = False, force: bool = False) -> int:
    old = current_name(root)
    check_name(new, old, root)
    if new == old:
        print(f"the package is already named {new}; nothing to do")
        return 0
    target = root / "src" / new
    if target.exists() or target.is_symlink():
        raise RenameError(f"{target} already exists; move it away or pick another name")
    toplevel = Path(git(root, "rev-parse", "--show-toplevel").strip()).resolve()
    if toplevel != root.resolve():
        raise RenameError(f"{root} is not the top of its git repository ({toplevel} is)")
    dirty = git(root, "status", "--porcelain").splitlines()
    if dirty and not force and not dry_run:
        raise RenameError(
            f"the working tree has {len(dirty)} uncommitted change(s) (e.g. {dirty[0][3:]}); "
            "commit them first so that git can undo the rename, or pass --force"
        )
    changes = plan(root, old, new)
    total = sum(count for *_, count in changes.values())
    summary = (
        f"{old} -> {new}: {total} replacements in {len(changes)} files; src/{old} -> src/{new}"
    )
    if dry_run:
        show(changes)
        print(f"dry run, nothing changed: {summary}")
        return 0
    try:
        for relative, (_, rewritten, _) in changes.items():
            write_text(root / relative, rewritten)
        (root / "src" / old).rename(target)
    except OSError as error:
        raise RenameError(
            f"stopped half-way, at {error.filename}: {error.strerror}; "
            "`git checkout . && git clean -fd` undoes what was done"
        ) from None
    print(f"renamed {summary}")
    package = Path("src", old)
    tidy(
        root, [Path("src", new, *p.parts[2:]) if p.is_relative_to(package) else p for p in changes]
    )
    print(
        f"now reinstall, so that the environment imports {new}: "
        f"pip uninstall -y {old} && pip install -e '.[dev]'"
    )
    return 0


def main(argv: Sequence[str] | None = None, root: Path = ROOT) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("name", help="the new package name, e.g. mypkg")
    parser.add_argument("--dry-run", action="store_true", help="list the changes; change nothing")
    parser.add_argument("--force", action="store_true", help="rename despite uncommitted changes")
    args = parser.parse_args(argv)
    try:
        return rename(root, args.name, dry_run=args.dry_run, force=args.force)
    except RenameError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
