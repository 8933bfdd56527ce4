"""README sections run as written in one folder: file blocks (``# path`` first, after a Hydra
header) written verbatim, then the bash commands in a real bash; ``<run>`` is the printed run."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml
from test_readme import CHECKS, READMES, SECTION, readme_commands

from conftest import clean_env

ROOT = Path(__file__).resolve().parents[3]
OWN = (ROOT / "lib" / "runkit" / "docs" / "own-model-and-data.md", "# Your own model and data")
SECTIONS = [OWN]  # (file, heading) run as written, each by a test below


class Block(NamedTuple):
    lang: str
    text: str


def blocks(text: str) -> list[Block]:
    return [Block(*found) for found in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)]


def file_path(block: Block) -> str | None:
    """The path a file block names (``# my_project/nets.py``, ``# a.yaml: why``), else None."""
    if block.lang not in ("python", "yaml"):
        return None
    for line in block.text.splitlines():
        if re.match(r"#\s*@", line):
            continue  # a Hydra header: it has to come first
        found = re.match(r"# ((?:[\w.-]+/)*[\w.-]+\.(?:py|yaml))(?::\s|$)", line)
        return found.group(1) if found else None
    return None


def section(readme: Path, heading: str) -> str:
    """The text under ``heading`` up to the next heading of its level or above."""
    lines = readme.read_text().splitlines(keepends=True)
    start = lines.index(f"{heading}\n")
    level = len(heading.split(" ", 1)[0])
    fenced = False
    for end in range(start + 1, len(lines)):
        fenced ^= lines[end].startswith("```")
        if not fenced and re.match(rf"#{{1,{level}}} ", lines[end]):
            break
    else:
        end = len(lines)
    return "".join(lines[start:end])


def shell_env() -> dict[str, str]:  # a user's shell: ``python`` is this one, no PYTHONPATH
    env = clean_env()
    env.pop("PYTHONPATH", None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def run_section(text: str, cwd: Path) -> list[tuple[str, subprocess.CompletedProcess]]:
    done: list[tuple[str, subprocess.CompletedProcess]] = []
    printed: str | None = None
    for block in blocks(text):
        path = file_path(block)
        if path is not None:
            (cwd / path).parent.mkdir(parents=True, exist_ok=True)
            (cwd / path).write_text(block.text)
        if block.lang != "bash":
            continue
        for command in readme_commands(f"```bash\n{block.text}```\n"):
            line = command
            if "logs/train/runs/<run>" in command:
                assert printed, f"{command!r} needs a run directory; no command before printed one"
                line = command.replace("logs/train/runs/<run>", shlex.quote(printed))
            result = subprocess.run(["bash", "-c", line], cwd=cwd, env=shell_env(),
                                    capture_output=True, text=True, timeout=900)  # fmt: skip
            output = result.stdout + result.stderr
            assert result.returncode == 0, f"{line}\n{output[-4000:]}"
            found = re.findall(r"Run directory: (\S.*)", output)
            printed = found[-1].strip() if found else printed
            done.append((command, result))
    return done


def test_file_blocks_name_their_path_keep_hydra_headers_first_and_every_block_runs() -> None:
    covered = {
        file_path(b) for readme, heading in SECTIONS for b in blocks(section(readme, heading))
    }
    for readme in READMES:
        found = blocks(readme.read_text())
        for block in found:  # Hydra reads '# @package' only before any other line
            assert "@package" not in block.text or block.text.startswith("# @package"), block.text
            assert block.lang != "yaml" or file_path(block), f"{readme.name}: no path: {block}"
        named = {file_path(b) for b in found} - {None, "tests/test_mine.py"}  # the suite's example
        assert named <= covered, f"file blocks no test writes: {sorted(named - covered)}"
    for readme, block in python_snippets():  # load_network's run on test_readme.py's trained run
        runs = "load_network" in block.text or file_path(block) in (None, "tests/test_mine.py")
        assert runs, f"{readme.name}: a python block no test runs:\n{block.text}"


@pytest.mark.slow
def test_your_own_model_and_data_runs_as_written(tmp_path: Path) -> None:
    done = run_section(section(*OWN), tmp_path)
    ran = [command for command, _ in done]
    assert ran[0] == "python make_table.py" and len(ran) == 5, ran
    assert set(ran) == {c for c, k in CHECKS.items() if k[0] == SECTION}  # test_readme's list

    runs = sorted((tmp_path / "logs" / "train" / "runs").iterdir())
    assert len(runs) == 3, runs  # tiny + csv, the regression, the regression under DDP
    tiny, regression, ddp = runs
    config = yaml.safe_load((tiny / "config.yaml").read_text())
    assert config["model"]["net"]["_target_"] == "my_project.nets.TinyNet"
    assert config["data"]["_target_"] == "my_project.data.CsvDataModule"
    metrics = json.loads((tiny / "metrics.json").read_text())["metrics"]
    assert metrics["test/acc"] > 0.9, metrics  # it learned the three classes
    assert (tiny / "model.pth").is_file() and (tiny / "curves.png").is_file()

    for run in (regression, ddp):
        config = yaml.safe_load((run / "config.yaml").read_text())
        assert config["model"]["_target_"] == "my_project.regression.RegressionModule"
        assert config["data"]["_target_"] == "my_project.points.PointsDataModule"
        report = json.loads((run / "metrics.json").read_text())
        assert report["monitor"] == "val/loss", report  # the experiment's checkpoint key
    assert yaml.safe_load((ddp / "config.yaml").read_text())["trainer"]["devices"] == 2

    (evaluated,) = (tmp_path / "logs" / "eval" / "runs").iterdir()
    tested = json.loads((evaluated / "metrics.json").read_text())["metrics"]
    trained = json.loads((ddp / "metrics.json").read_text())["metrics"]
    assert tested["test/loss"] == pytest.approx(trained["test/loss"], rel=1e-4)


def python_snippets() -> list[tuple[Path, Block]]:  # that no section test runs
    in_sections = {b.text for readme, heading in SECTIONS for b in blocks(section(readme, heading))}
    return [(readme, b) for readme in READMES for b in blocks(readme.read_text())
            if b.lang == "python" and b.text not in in_sections]  # fmt: skip


@pytest.mark.slow
def test_library_readme_snippets_run(tmp_path: Path) -> None:
    tests = Path(__file__).resolve().parent
    snippets = [b for _, b in python_snippets() if "load_network" not in b.text]
    (trainer,) = [b for b in snippets if file_path(b) is None]
    (test_file,) = [b for b in snippets if file_path(b) == "tests/test_mine.py"]
    done = subprocess.run([sys.executable, "-c", trainer.text], cwd=tmp_path, env=shell_env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_mine.py").write_text(test_file.text)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/test_mine.py", "-p", "conftest", "-q", "-p",
         "no:cacheprovider"],
        cwd=tmp_path, env={**shell_env(), "PYTHONPATH": str(tests)},  # the suite's conftest
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-3000:]
