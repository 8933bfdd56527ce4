"""Write ``template/``, the Copier template, from the project at the top of this repository.

The top of the repository is a working project (its README's commands run here, CI tests it);
Copier needs the same files with the names a user chooses in place of ``project``. This script
derives one from the other, so there is one source of truth:

* a user-owned file (:data:`OWNED`) that names the package becomes ``<path>.jinja`` under
  ``template/``, with ``{{ package_name }}`` (and friends) where the name stood and everything
  else wrapped in ``{% raw %}`` so that no ``{{`` of its own is rendered;
* a user-owned file that does not name it becomes a symbolic link to the file itself (a
  ``.gitignore`` a copy: git does not follow links there);
* ``lib/`` (the library, vendored into every project) is a link to ``../lib``; copier.yml leaves
  its tests and benchmarks out;
* a line ending in ``# repo-only``, and a block between ``# repo-only: begin`` and
  ``# repo-only: end``, are dropped (the library's tests in pytest's settings, mutation testing).

``python tools/make_template.py`` rewrites ``template/``; ``--check`` exits 1 naming the first
file that differs (``tests/test_template.py`` runs it, so a change to the project that was not
carried into the template fails the suite).

Copier itself has no such step: its templates are written in Jinja and do not run as they are.
A task renaming files after ``copier copy`` would not run when ``copier update`` regenerates the
old version to merge against, so updates would conflict on every renamed line.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = "template"
PACKAGE = "project"

OWNED = (
    ".gitignore",
    ".pre-commit-config.yaml",
    ".github",
    "Makefile",
    "README.md",
    "pyproject.toml",
    "configs",
    "notebooks",
    "scripts/setup.sh",
    "scripts/slurm",
    f"src/{PACKAGE}",
    "tests",
)
"""What a user owns: copied into every generated project (everything else is this repository's)."""

REPO_ONLY = ("tests/test_template.py",)
"""Under :data:`OWNED` but about this repository (Copier, the template itself)."""

# The package's name where code, configs and commands use it: a module path (not pyproject's
# [project.*] tables), a quoted name, an environment variable prefix; prose ("your project")
# stays as it is.
_NAME = re.compile(
    rf"(?<![\w\-]){PACKAGE}(?=[./:]\w)(?!\.(?:optional-dependencies|scripts|gui-scripts|urls|"
    rf"entry-points)\])|(?<=\"){PACKAGE}(?=\")|\b{PACKAGE.upper()}_(?=[A-Z])"
    rf"|(?<=\bfrom ){PACKAGE}\b|(?<=\bimport ){PACKAGE}\b"
)
# What else a user chooses, where pyproject.toml and the CI workflow say it.
_SETTINGS = (
    (re.compile(r'(?<=^description = ").*(?="$)', re.M), "{{ description }}"),
    (re.compile(r'(?<=^requires-python = ">=)[0-9.]+(?="$)', re.M), "{{ python_version }}"),
    (
        re.compile(r'(?<=^target-version = "py)[0-9]+(?="$)', re.M),
        "{{ python_version | replace('.', '') }}",
    ),
    (re.compile(r'(?<=python-version: ")[0-9.]+(?=")'), "{{ python_version }}"),
    (re.compile(r"\A# project(?= — )"), "# {{ project_name }}"),  # README's title
)
_JINJA = re.compile(r"\{[{%#]|[}%#]\}")


def _substitute(match: re.Match[str]) -> str:
    text = match.group(0)
    if text.endswith("_"):
        return "{{ package_name | upper }}_"
    return "{{ package_name }}"


def render(text: str) -> str | None:
    """The Jinja text of a file, or ``None`` when it holds nothing a user chooses."""
    text = without_repo_only(text)
    spans = [(m.start(), m.end(), _substitute(m)) for m in _NAME.finditer(text)]
    for pattern, jinja in _SETTINGS:
        spans += [(m.start(), m.end(), jinja) for m in pattern.finditer(text)]
    pieces, last = [], 0
    for start, end, jinja in sorted(spans):
        if start < last:  # inside a setting already replaced (a description naming it)
            continue
        pieces += [_raw(text[last:start]), jinja]
        last = end
    pieces.append(_raw(text[last:]))
    return "".join(pieces) if spans else None


def without_repo_only(text: str) -> str:
    """``text`` less its lines ending in ``# repo-only`` and its ``# repo-only: begin`` ...
    ``# repo-only: end`` blocks."""
    kept, skipping = [], False
    for line in text.splitlines(keepends=True):
        mark = line.strip()
        if mark == "# repo-only: begin":
            skipping = True
        elif mark == "# repo-only: end":
            skipping = False
        elif not skipping and not mark.endswith("# repo-only"):
            kept.append(line)
    return "".join(kept)


def _raw(text: str) -> str:
    return f"{{% raw %}}{text}{{% endraw %}}" if _JINJA.search(text) else text


def owned_files() -> list[Path]:
    files: list[Path] = []
    for entry in OWNED:
        path = ROOT / entry
        candidates = sorted(path.rglob("*")) if path.is_dir() else [path]
        for file in candidates:
            relative = file.relative_to(ROOT)
            if not file.is_file() or "__pycache__" in relative.parts:
                continue
            if str(relative) in REPO_ONLY or file.suffix == ".pyc":
                continue
            files.append(relative)
    return files


def write(target: Path, home: Path | None = None) -> None:
    """Write the whole template under ``target`` (an empty or missing directory); its links
    point where they must from ``home`` (default ``target``), where it will lie."""
    home = home or target
    target.mkdir(parents=True, exist_ok=True)
    for relative in owned_files():
        source = ROOT / relative
        name = Path(*[("{{ package_name }}" if p == PACKAGE else p) for p in relative.parts])
        if relative.parts[:2] != ("src", PACKAGE):
            name = relative
        destination = target / name
        destination.parent.mkdir(parents=True, exist_ok=True)
        try:
            text = source.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            text = None
        rendered = None if text is None else render(text)
        # git does not follow a linked .gitignore (it warns at every command): a copy, then
        if relative.name == ".gitignore" and rendered is None:
            shutil.copy2(source, destination)
        elif rendered is None and (text is None or without_repo_only(text) == text):
            destination.symlink_to(os.path.relpath(source, (home / name).parent))
        else:
            Path(f"{destination}.jinja").write_text(rendered or _raw(text or ""), encoding="utf-8")
    (target / "lib").symlink_to(os.path.relpath(ROOT / "lib", home))
    answers = target / "{{ _copier_conf.answers_file }}.jinja"
    answers.write_text(
        "# Written by Copier; do not edit: `copier update` reads it.\n"
        "{{ _copier_answers | to_nice_yaml -}}\n",
        encoding="utf-8",
    )


def differences(left: Path, right: Path) -> str | None:
    """The first path that differs between two template trees, or ``None``."""
    compare = filecmp.dircmp(left, right)
    for name in compare.left_only + compare.right_only + compare.funny_files:
        return name
    for name in compare.common_files:
        a, b = left / name, right / name
        if a.is_symlink() != b.is_symlink() or (
            os.readlink(a) if a.is_symlink() else a.read_bytes()
        ) != (os.readlink(b) if b.is_symlink() else b.read_bytes()):
            return str(a.relative_to(left))
    for name in compare.common_dirs:
        if (left / name).is_symlink() or (right / name).is_symlink():
            if os.readlink(left / name) != os.readlink(right / name):
                return name
            continue
        found = differences(left / name, right / name)
        if found is not None:
            return f"{name}/{found}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 on a change")
    args = parser.parse_args(argv)
    if args.check:
        with tempfile.TemporaryDirectory(dir=ROOT) as scratch:
            fresh = Path(scratch) / TEMPLATE
            write(fresh, home=ROOT / TEMPLATE)
            found = differences(ROOT / TEMPLATE, fresh)
        if found is not None:
            print(
                f"error: template/{found} is not what tools/make_template.py writes from the "
                "project; run python tools/make_template.py",
                file=sys.stderr,
            )
            return 1
        return 0
    shutil.rmtree(ROOT / TEMPLATE, ignore_errors=True)
    write(ROOT / TEMPLATE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
