"""Write ``template/``, the Copier template, from the project at the top of this repository.

The top of the repository is a working project (its README's commands run here, CI tests it);
Copier needs the same files with the names a user chooses in place of ``project``. This script
derives one from the other, so there is one source of truth:

* a user-owned file (:data:`OWNED`) that names the package becomes ``<path>.jinja`` under
  ``template/``, with ``{{ package_name }}`` (and friends) where the name stood and everything
  else wrapped in ``{% raw %}`` so that no ``{{`` of its own is rendered;
* a user-owned file that does not name it becomes a symbolic link to the file itself (a
  ``.gitignore`` a copy: git does not follow links there);
* ``lib/runkit`` (the library, vendored into every project) links to the library's files, less
  its tests; its README, CHANGELOG and pages (``docs/*.md``) are rendered like a user-owned file
  (the user's package in their commands);
* a line ending in ``# repo-only``, and a block between ``# repo-only: begin`` and
  ``# repo-only: end``, are dropped (the library's tests in pytest's settings, mutation testing);
  a ``# template-only: <line>`` comment becomes ``<line>`` (the project's settings that differ
  from this repository's, such as leaving the vendored library out of lint). In Markdown the
  same markers are HTML comments (``<!-- repo-only: begin -->``).

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
LIBRARY_LEFT_OUT = ("tests", "__pycache__")
"""What of lib/runkit stays in this repository: the library's own test suite."""
"""Under :data:`OWNED` but about this repository (Copier, the template itself)."""

# The package's name wherever code, configs, commands and paths use it; the word in prose ("your
# project", "the project's configs") and pyproject's own [project] tables stay as they are:
# - a module path or attribute (project.train), a package's extras (project[optuna]), a path
#   (src/project, project/configs), quoted ("project", 'project', `project`);
# - after -m / from / import; an environment variable prefix (PROJECT_LOG_DIR);
# - a YAML or TOML value of its own (wandb's `project: project`).
_NAME = re.compile(
    rf"(?<![\w\-])(?<!^\[){PACKAGE}(?=\.[\w\"'`\\]|\[\w|/)"
    rf"|(?<=/){PACKAGE}\b(?![\-])"
    rf"|(?<=[\"'`]){PACKAGE}(?=[\"'`])"
    rf"|(?<=-m ){PACKAGE}\b|(?<=\bfrom ){PACKAGE}\b|(?<=\bimport ){PACKAGE}\b"
    rf"|\b{PACKAGE.upper()}_(?=[A-Z])"
    rf"|(?<=: ){PACKAGE}$",
    re.M,
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
    (re.compile(r"(?<=Python )[0-9.]+(?= or newer)"), "{{ python_version }}"),  # README
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


_MARK = re.compile(r"^\s*(?:#|<!--)\s*(repo-only|template-only)(?:: (.*?))?\s*(?:-->)?\s*$")


_NOT_RUN = "<!-- not run by the README test:"


def without_repo_only(text: str) -> str:
    """``text`` as a generated project has it: less its lines ending in ``repo-only`` and its
    ``repo-only: begin`` ... ``repo-only: end`` blocks, with each ``template-only: <line>``
    comment replaced by ``<line>``.

    Markers are comments of the file's kind: ``# ...`` (Python, YAML, TOML, Makefile, shell) or
    ``<!-- ... -->`` (Markdown, where a comment does not show). A line that ends in
    ``# repo-only`` or ``<!-- repo-only -->`` is dropped whole, and so is a README's
    ``<!-- not run by the README test: ... -->``, which speaks to this repository's own test.
    """
    kept, skipping = [], False
    for line in text.splitlines(keepends=True):
        mark = _MARK.match(line)
        kind, rest = (mark.group(1), mark.group(2)) if mark else (None, None)
        if kind == "repo-only" and rest == "begin":
            skipping = True
        elif kind == "repo-only" and rest == "end":
            skipping = False
        elif skipping:
            continue
        elif kind == "template-only" and rest is not None:
            kept.append(line[: len(line) - len(line.lstrip())] + rest + "\n")
        elif line.startswith(_NOT_RUN):  # what this repository's README test leaves out
            continue
        elif not line.rstrip().endswith(("# repo-only", "<!-- repo-only -->")):
            kept.append(line)
    return "".join(kept)


def without_test_column(text: str) -> str:
    """``text`` less the first and last columns of each Markdown table headed
    ``| Case | ... | Test |``: the library's README names the test behind each row (its case and
    file), which its vendored copy does not have."""
    kept, in_table = [], False
    for line in text.splitlines(keepends=True):
        row = line.rstrip("\n")
        if row.startswith("| Case |") and row.rstrip().endswith("| Test |"):
            in_table = True
        elif not row.startswith("|"):
            in_table = False
        if in_table:
            line = "|" + row.rstrip()[1:-1].split("|", 1)[1].rsplit("|", 1)[0] + "|\n"
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
        if rendered is None and text is not None and without_repo_only(text) != text:
            rendered = _raw(without_repo_only(text))
        if rendered is not None:
            Path(f"{destination}.jinja").write_text(rendered, encoding="utf-8")
        elif relative.name == ".gitignore":  # git does not follow a linked .gitignore
            shutil.copy2(source, destination)
        else:
            destination.symlink_to(os.path.relpath(source, (home / name).parent))
    # The library, vendored: its files as they are, but its README as the project reads it (the
    # project's own package name in its commands, this repository's tools and tests left out).
    library = Path("lib", "runkit")
    (target / library).mkdir(parents=True)
    for source in sorted((ROOT / library).iterdir()):
        relative = library / source.name
        if source.name in LIBRARY_LEFT_OUT or source.name.startswith("."):
            continue
        if source.name in ("README.md", "CHANGELOG.md", "docs"):  # read like the README
            for page in sorted(source.glob("*.md")) if source.is_dir() else [source]:
                (target / page.relative_to(ROOT)).parent.mkdir(exist_ok=True)
                text = without_test_column(page.read_text(encoding="utf-8"))
                jinja = render(text) or _raw(without_repo_only(text))
                Path(f"{target / page.relative_to(ROOT)}.jinja").write_text(jinja, encoding="utf-8")
        else:
            (target / relative).symlink_to(os.path.relpath(source, (home / relative).parent))
    answers = target / "{{ _copier_conf.answers_file }}.jinja"
    answers.write_text(
        "# Written by Copier; do not edit: `copier update` reads it.\n"
        "{{ _copier_answers | to_nice_yaml -}}\n",
        encoding="utf-8",
    )


NAMES_FILE = ROOT / "tools" / "package_name.jinja"
"""copier.yml's checks of the package name (its default from the project name, the names it may
not take), with the lists :func:`write_names` writes into it."""
_NAMES = re.compile(
    r"(?<=\{%- set reserved = ).*?(?= -%\})|(?<=\{%- set base_letters = ).*?(?= -%\})", re.S
)
_NO_DECOMPOSITION = {
    "ß": "ss",
    "æ": "ae",
    "œ": "oe",
    "ø": "o",
    "ł": "l",
    "đ": "d",
    "ð": "d",
    "þ": "th",
    "ı": "i",
}


def reserved_names() -> list[str]:
    """The names a project's package may not take: the top-level import names and distribution
    names of everything the project installs (its dependencies and dev extras, recursively, as
    installed here), the optional integrations' own, Python's standard library and keywords.
    A package of such a name shadows the real one (``numpy``: ``import torch`` fails) or, as a
    distribution, replaces it on install (``lightning_runkit`` uninstalls the vendored library)."""
    import importlib.metadata as metadata
    import keyword

    from packaging.requirements import Requirement

    def normal(name: str) -> str:
        return re.sub(r"[-_.]+", "_", name).lower()

    names = {"wandb", "mlflow", "hydra_plugins", "runkit", "lightning_runkit", "test", "tests"}
    names |= set(sys.stdlib_module_names) | set(keyword.kwlist) | set(keyword.softkwlist)
    seen: dict[str, set[str]] = {}
    todo = [(PACKAGE, {"dev"}), ("lightning-runkit", set())]
    while todo:
        name, extras = todo.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional integration not installed here (its name is listed above)
        key = normal(dist.metadata["Name"])
        if key in seen and extras <= seen[key]:
            continue
        seen[key] = seen.get(key, set()) | extras
        names.add(key)
        for line in (dist.read_text("top_level.txt") or "").split():
            names.add(line)
        for file in dist.files or []:
            top = file.parts[0] if file.parts else ""
            if top.endswith((".dist-info", ".egg-info", ".data")) or top in ("..", "__pycache__"):
                continue
            names.add(top.split(".")[0] if len(file.parts) == 1 else top)
        for text in dist.requires or []:
            requirement = Requirement(text)
            marker = requirement.marker
            if marker is None or any(marker.evaluate({"extra": e}) for e in extras | {""}):
                todo.append((requirement.name, set(requirement.extras)))
    names.discard(PACKAGE)  # the template's own name
    return sorted({n.lower() for n in names if re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", n)})


def base_letters() -> dict[str, str]:
    """Each lowercase Latin letter with a diacritic and the ASCII letters it is written with
    (é: e, ß: ss): the package name's default keeps them from a project name like "Élan"."""
    import unicodedata

    table = dict(_NO_DECOMPOSITION)
    for code in range(0xC0, 0x250):
        char = chr(code)
        if not char.isalpha() or char != char.lower():
            continue
        base = "".join(c for c in unicodedata.normalize("NFKD", char) if c.isascii())
        if base.isalpha() and base != char:
            table.setdefault(char, base.lower())
    return dict(sorted(table.items()))


def write_names() -> None:
    """Rewrite the two lists in :data:`NAMES_FILE` from this environment."""
    import json

    values = iter([json.dumps(reserved_names()), json.dumps(base_letters(), ensure_ascii=False)])
    text = NAMES_FILE.read_text(encoding="utf-8")
    NAMES_FILE.write_text(_NAMES.sub(lambda _: next(values), text), encoding="utf-8")


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
    parser.add_argument(
        "--names",
        action="store_true",
        help=f"rewrite the reserved names in {NAMES_FILE.relative_to(ROOT)} from this environment",
    )
    args = parser.parse_args(argv)
    if args.names:
        write_names()
        return 0
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
