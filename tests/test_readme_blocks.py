"""Every code block of every README still parses, and the ones marked `<!-- runs -->` run as they stand. (The
command lines of the bash blocks are run by tests/test_lifecycle.py.)"""
import ast
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

READMES = sorted([ROOT / "README.md", *ROOT.glob("*/README.md")])
FENCE = re.compile(r"(<!-- runs -->\n)?```(python|bash|sh)\n(.*?)```", re.S)


def blocks() -> list[tuple[str, str, bool, str]]:
    """(readme, language, marked to run, code) for every fenced python, bash and sh block."""
    return [(readme.relative_to(ROOT).as_posix(), language, bool(marked), code) for readme in READMES
            for marked, language, code in FENCE.findall(readme.read_text())]


def test_the_readmes_have_blocks_and_one_runnable_example():
    found = blocks()
    assert len(found) > 10 and any(runs for _, language, runs, _ in found if language == "python")


@pytest.mark.parametrize("readme, language, runs, code", blocks(),
                         ids=[f"{readme}-{language}-{i}" for i, (readme, language, _, _) in enumerate(blocks())])
def test_every_readme_block_parses(readme, language, runs, code):
    if language == "python":
        ast.parse(code)
    else:
        result = subprocess.run(["bash", "-n"], input=code, capture_output=True, text=True)
        assert result.returncode == 0, f"{readme}: {result.stderr}"


@pytest.mark.parametrize("readme, code", [(readme, code) for readme, language, runs, code in blocks() if runs])
def test_the_marked_readme_examples_run(tmp_path, readme, code):
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, f"{readme}:\n{result.stderr[-3000:]}"
    assert (tmp_path / "regression.ckpt").exists() or "save(" not in code
