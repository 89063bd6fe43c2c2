"""Every code block of every README and of every page under docs/ still parses, and the ones marked
`<!-- runs -->` run as they stand; every link between the pages resolves; the README stays short. (The command
lines of the bash blocks are run by tests/test_lifecycle.py.)"""
import ast
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

# the pages a reader follows from the README: the README, the package READMEs and docs/
PAGES = sorted({ROOT / "README.md", *ROOT.glob("*/README.md"), *ROOT.glob("docs/*.md")})
FENCE = re.compile(r"(<!-- runs -->\n)?```(python|bash|sh)\n(.*?)```", re.S)
README_LINES = 300  # what it is, the commands, the workloads, one example, the layout and links: a few screens


def blocks() -> list[tuple[str, str, bool, str]]:
    """(page, language, marked to run, code) for every fenced python, bash and sh block."""
    return [(page.relative_to(ROOT).as_posix(), language, bool(marked), code) for page in PAGES
            for marked, language, code in FENCE.findall(page.read_text())]


def test_the_readmes_have_blocks_and_one_runnable_example():
    found = blocks()
    assert len(found) > 10 and any(runs for page, language, runs, _ in found
                                   if language == "python" and page == "README.md")
    assert {"docs/install.md", "docs/runs.md", "docs/core.md"} <= {page for page, *_ in found}


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


def test_the_readme_stays_a_few_screens_and_opens_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_LINES, "move the detail to a page under docs/ and link it"
    first = FENCE.search(text)
    assert text[:first.start()].count("\n") <= 3 and first.group(2) == "bash"  # on the first screen
    assert "pip install -e . && python -m gan.train" in first.group(3)
    assert 'pip install -e ".[test]" && python -m pytest -q' in first.group(3)
    assert "python3 -m pytest -q" in (ROOT / ".ci" / "run").read_text()  # CI runs the README's test command


def anchors(page) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    prose = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#{1,6} (.+)$", prose, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=[page.relative_to(ROOT).as_posix() for page in PAGES])
def test_every_link_of_a_page_resolves(page):
    """Each relative link names a file or folder of the repository, and its #anchor a heading there."""
    prose = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    links = re.findall(r"\]\(([^)\s]+)\)", prose)
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue  # a web address
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.exists() and ROOT in (target, *target.parents), f"{page.name}: {link} names no file here"
        if anchor:
            assert target.is_file() and anchor in anchors(target), f"{page.name}: {link}: no such heading"
