"""The documentation: every relative link of README.md, docs/ and benchmarks/README.md names an existing file (and
heading), no path of one particular machine appears in it, the README's set-up commands agree with CI, and the
MkDocs site (mkdocs.yml) builds in strict mode, i.e. without a single warning."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HTML_LINK = re.compile(r"<(?:a|img)\s[^>]*?(?:href|src)=\"([^\"]+)\"", re.IGNORECASE)
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s[^>]*?(?:id|name)=\"([^\"]+)\"", re.IGNORECASE)
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|tmp|home|root)/")


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks, with inline code spans blanked out."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)))
    return lines


def links(path: Path) -> list[tuple[int, str]]:
    """Every link and image target of a Markdown page (inline, reference-style and raw HTML), with its line."""
    found = []
    for number, line in prose_lines(path):
        for pattern in (INLINE_LINK, HTML_LINK):
            found += [(number, m.group(1)) for m in pattern.finditer(line)]
        m = REFERENCE_LINK.match(line)
        if m:
            found.append((number, m.group(1)))
    return found


def github_slug(text: str) -> str:
    """The anchor GitHub gives a heading (docs/hooks.py gives the site's headings the same)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text only
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown page: its headings' (a repeated one gets -1, -2, ... as on GitHub) and HTML ids."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        found.update(HTML_ANCHOR.findall(line))
        m = HEADING.match(line)
        if m:
            slug = github_slug(m.group(2))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def is_external(target: str) -> bool:
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target)) or target.startswith("//")


def test_the_pages_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "docs/DESIGN.md", "docs/RESULTS.md", "benchmarks/README.md", "docs/guide/README.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path) -> None:
    problems = []
    for number, target in links(page):
        if not target or is_external(target):
            continue
        where = f"{page.relative_to(ROOT)}:{number}: {target}"
        if target.startswith("/"):
            problems.append(f"{where}: an absolute path (write it relative to the page)")
            continue
        path_part, _, fragment = target.partition("#")
        resolved = (page.parent / unquote(path_part)).resolve() if path_part else page
        if ROOT not in resolved.parents and resolved != ROOT:
            problems.append(f"{where}: points outside the repository")
        elif not resolved.exists():
            problems.append(f"{where}: no such file")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            problems.append(f"{where}: no heading #{fragment} in {resolved.relative_to(ROOT)}")
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_no_machine_paths() -> None:
    found = [f"{page.relative_to(ROOT)}:{number}: {line.strip()}"
             for page in [*PAGES, ROOT / "mkdocs.yml"]
             for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
             if MACHINE_PATH.search(line)]
    assert not found, "paths of one machine in the documentation (use relative ones, e.g. runs/...):\n" + "\n".join(found)


def test_readme_setup_commands_agree_with_ci() -> None:
    """The README's second set-up command runs the tests exactly as .ci/run does, with the torch that CI and
    pyproject.toml pin."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    setup = [line for line in readme.splitlines() if line.startswith("python3 -m venv .venv && ")]
    assert len(setup) == 2, setup
    assert setup[0].endswith(" && nmtflow quickstart")
    ci_commands = [line.strip() for line in ci.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert setup[1].endswith(" && " + ci_commands[-1]), (setup[1], ci_commands[-1])
    pins = {m for text in (readme, ci, (ROOT / "pyproject.toml").read_text(encoding="utf-8"))
            for m in re.findall(r"torch==[\w.+]+", text)}
    assert len(pins) == 1, pins


def test_site_builds_in_strict_mode(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="mkdocs is not installed, so the documentation site is not built here: "
                                         "pip install -e \".[docs]\" (as .ci/run does) to run this test")
    site = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                             str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "WARNING" not in output, output
    home = (site / "index.html").read_text(encoding="utf-8")
    assert "A five-minute tour" in home  # README.md is the home page
    for page in [*sorted((ROOT / "docs" / "guide").glob("*.md")), ROOT / "docs" / "DESIGN.md",
                 ROOT / "docs" / "RESULTS.md", ROOT / "benchmarks" / "README.md"]:
        rel = page.relative_to(ROOT).with_suffix("")
        built = site / (rel.parent if rel.name == "README" else rel) / "index.html"
        assert built.is_file(), f"{page.relative_to(ROOT)} was not built (expected {built.relative_to(site)})"
