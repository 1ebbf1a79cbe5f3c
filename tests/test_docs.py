"""The documentation, executed: every ```python block of README.md and docs/*.md runs, and every relative
link of the Markdown files points at a file (and heading) that exists, so the pages cannot drift from the code.

A page's blocks run in order in one namespace, as a reader pastes them into one session (a later block
may use what an earlier one made). A block that cannot run here (it needs a GPU or several processes)
is preceded by `<!-- not run: the reason -->` and is only compiled. Examples use tiny data: the whole
file takes a few seconds.
"""
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKED = [*PAGES, ROOT / "benchmarks" / "README.md", ROOT / "ARCHITECTURE.md"]
README_MOST_LINES = 250

BLOCK = re.compile(r"(?:<!--\s*not run:(?P<why>[^>]*)-->\s*\n)?^```python\n(?P<code>.*?)^```", re.S | re.M)
FENCED = re.compile(r"^```.*?^```", re.S | re.M)     # code blocks: their '# comments' and [x](y) are no markdown
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(line, code, reason it is not run or None) of every ```python block."""
    return [(text.count("\n", 0, m.start("code")) + 1, m.group("code"),
             None if m.group("why") is None else m.group("why").strip()) for m in BLOCK.finditer(text)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCED.sub("", path.read_text())
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(page, tmp_path, monkeypatch):
    blocks = python_blocks(page.read_text())
    if page.parent.name == "docs":
        assert blocks, f"{page.name} has no ```python example; every reference page shows one"
    monkeypatch.chdir(tmp_path)                      # a block that writes a file writes it here
    torch.manual_seed(0)
    namespace: dict = {"__name__": "__docs__"}
    for line, code, why in blocks:
        compiled = compile(code, f"{page.name}:{line}", "exec")
        if why is not None:
            assert why, f"{page.name}:{line}: '<!-- not run: -->' needs a reason"
            continue
        exec(compiled, namespace)


def test_a_block_that_breaks_fails_and_a_marked_one_is_skipped():
    text = ("```python\nx = 1\n```\n<!-- not run: needs a GPU -->\n```python\ntorch.ones(1, device='cuda')\n```\n"
            "```bash\nmake demo\n```\n")
    assert [(code, why) for _, code, why in python_blocks(text)] == [("x = 1\n", None),
                                                                      ("torch.ones(1, device='cuda')\n", "needs a GPU")]
    assert python_blocks(text)[1][0] == 6


@pytest.mark.parametrize("page", LINKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files_that_exist(page):
    missing = []
    for target in LINK.findall(FENCED.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):             # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            missing.append(f"{target} (no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            missing.append(f"{target} (no heading '#{anchor}' in {dest.name})")
    assert not missing, f"{page.relative_to(ROOT)} links to what does not exist: {missing}"


def test_slug_matches_github():
    assert slug("Activation planning, memfit's zoo") == "activation-planning-memfits-zoo"
    assert slug("What fits: memory models") == "what-fits-memory-models"


def test_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MOST_LINES, "README.md grew past a front door: move reference to docs/"
    head = text[:2500]
    assert "make demo" in head and "make test" in head and ".venv" in head
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"docs/{page.name}" in text, f"README.md does not link docs/{page.name}"
    assert "benchmarks/README.md" in text


@pytest.mark.parametrize("target", ["demo", "test-torch-next"])
def test_make_says_it_creates_the_venv(tmp_path, target):
    """The first `make demo` spends minutes in a quiet pip install: it says so before it starts."""
    import shutil
    import subprocess
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    for name in ("Makefile", "pyproject.toml", "constraints-cpu.txt"):
        shutil.copy(ROOT / name, tmp_path / name)
    out = subprocess.run(["make", "-n", target], cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    venv = next(i for i, line in enumerate(lines) if "-m venv" in line)
    assert any(line.startswith("echo ") and "a few minutes" in line for line in lines[:venv]), out.stdout


def test_the_range_of_torch_versions_stated_is_the_range_the_suite_ran_on():
    """`make test` runs the suite on torch from constraints-cpu.txt, `make test-torch-next` on the Makefile's
    TORCH_NEXT: pyproject.toml's range holds both and reaches no minor release below the one or above the other."""
    from packaging.requirements import Requirement
    from packaging.version import Version
    deps = re.search(r"^dependencies = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    spec = next(r for r in map(Requirement, re.findall(r'"([^"]+)"', deps)) if r.name == "torch").specifier
    oldest = Version(re.search(r"^torch==(\S+)", (ROOT / "constraints-cpu.txt").read_text(), re.M).group(1))
    newest = Version(re.search(r"^TORCH_NEXT \?= (\S+)", (ROOT / "Makefile").read_text(), re.M).group(1))
    assert oldest in spec and newest in spec, f"torch {spec} leaves out {oldest} or {newest}"
    below, above = f"{oldest.major}.{oldest.minor - 1}.99", f"{newest.major}.{newest.minor + 1}.0"
    assert below not in spec and above not in spec, f"torch {spec} reaches {below} or {above}: never run there"
