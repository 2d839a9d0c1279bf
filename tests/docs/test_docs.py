"""The documentation's house rules (pure Python, no torch):

- README.md is the front door: at most 150 lines, no commit hash, no CI timing row;
- reference pages (docs/*.md, docs/formats/, docs/kernels/) have no dated heading and no heading
  that names an issue; dated logs live in docs/records/, which is exempt;
- every relative link of README.md and docs/**/*.md resolves to a file and, with a #anchor, to a
  heading of that file (GitHub's slugs);
- docs/README.md lists every page under docs/, and every record is linked from a reference page.

Each checker is a plain function of text; the `test_checker_*` tests plant a fault and assert it
is caught, so the rules can fail.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 150

MONTHS = ("jan(uary)?|feb(ruary)?|mar(ch)?|apr(il)?|may|jun(e)?|jul(y)?|aug(ust)?|sep(t(ember)?)?|"
          "oct(ober)?|nov(ember)?|dec(ember)?")
DATE_RE = re.compile(r"\b(19|20)\d\d-[01]\d-[0-3]\d\b|\b(" + MONTHS + r")\.? +[0-3]?\d\b", re.IGNORECASE)
ISSUE_RE = re.compile(r"(?<![\w&])#\d+\b|\bissues? +\d+\b", re.IGNORECASE)
HASH_RE = re.compile(r"\b[0-9a-f]{7,40}\b")
LINK_RE = re.compile(r"!?\[([^\]]*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE_RE = re.compile(r"^\s*(```|~~~)")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    out, fenced = [], False
    for i, line in enumerate(text.splitlines(), 1):
        if FENCE_RE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((i, line))
    return out


def headings(text: str) -> list[tuple[int, str]]:
    """(line number, heading text) of the ATX headings outside fenced code."""
    return [(i, m.group(2).strip()) for i, line in prose_lines(text)
            if (m := re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lowercased, every character but letters,
    digits, '_', '-' and spaces dropped, spaces turned into '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # links -> their text
    text = re.sub(r"<[^>]+>", "", text)                          # inline html
    text = text.replace("`", "").replace("*", "")
    text = text.lower()
    text = "".join(c for c in text if c.isalnum() or c in "_- ")
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, h in headings(text):
        s = slug(h)
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def commit_hashes(text: str) -> list[tuple[int, str]]:
    """Hex words of 7-40 characters with a digit and a letter, outside fenced code."""
    return [(i, w) for i, line in prose_lines(text) for w in HASH_RE.findall(line)
            if re.search(r"\d", w) and re.search(r"[a-f]", w)]


def ci_timing_rows(text: str) -> list[tuple[int, str]]:
    """Lines that report a test run: a pytest time like 18m24s, or a table row with passed/skipped."""
    return [(i, line) for i, line in prose_lines(text)
            if re.search(r"\b\d+m\d\d?s\b", line)
            or (line.lstrip().startswith("|") and re.search(r"\b(passed|skipped)\b", line))]


def bad_headings(text: str) -> list[tuple[int, str]]:
    return [(i, h) for i, h in headings(text) if DATE_RE.search(h) or ISSUE_RE.search(h)]


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of the markdown links outside fenced code (inline code blanked)."""
    out = []
    for i, line in prose_lines(text):
        line = re.sub(r"`[^`]*`", "code", line)
        out += [(i, m.group(2)) for m in LINK_RE.finditer(line)]
    return out


def broken_links(path: Path, text: str | None = None) -> list[str]:
    """Relative links of `path` whose file does not exist or whose #anchor names no heading there."""
    text = path.read_text(encoding="utf-8") if text is None else text
    problems = []
    for line, target in links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):   # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = path if not file_part else (path.parent / file_part).resolve()
        where = f"{path.relative_to(ROOT)}:{line}: {target}"
        if not dest.exists():
            problems.append(f"{where}: no such file")
            continue
        if anchor:
            if dest.is_dir() or dest.suffix != ".md":
                problems.append(f"{where}: an anchor into something that is not a markdown file")
            elif anchor not in anchors(dest.read_text(encoding="utf-8") if dest != path else text):
                problems.append(f"{where}: no heading with this anchor in {dest.relative_to(ROOT)}")
    return problems


def doc_pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def reference_pages() -> list[Path]:
    return sorted([*DOCS.glob("*.md"), *(DOCS / "formats").glob("*.md"), *(DOCS / "kernels").glob("*.md")])


# --- the rules ---------------------------------------------------------------------------------

def test_readme_is_short():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move detail into docs/"


def test_readme_has_no_commit_hash():
    found = commit_hashes(README.read_text(encoding="utf-8"))
    assert not found, f"commit hashes in README.md (they belong in docs/records/): {found}"


def test_readme_has_no_ci_timing_row():
    found = ci_timing_rows(README.read_text(encoding="utf-8"))
    assert not found, f"test-run figures in README.md (they belong in docs/testing.md): {found}"


def test_reference_pages_have_no_dated_or_issue_headings():
    assert reference_pages(), "no reference pages found"
    found = [f"{p.relative_to(ROOT)}:{i}: {h}" for p in reference_pages()
             for i, h in bad_headings(p.read_text(encoding="utf-8"))]
    assert not found, "dated or issue-named headings in reference pages (dated logs go to docs/records/):\n" + \
        "\n".join(found)


def test_every_link_resolves():
    problems = [p for page in [README, *doc_pages()] for p in broken_links(page)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_docs_index_lists_every_page():
    index = DOCS / "README.md"
    listed = {(index.parent / t.partition("#")[0]).resolve() for _, t in links(index.read_text(encoding="utf-8"))
              if t.partition("#")[0]}
    missing = [str(p.relative_to(ROOT)) for p in doc_pages() if p != index and p.resolve() not in listed]
    assert not missing, f"pages under docs/ missing from docs/README.md: {missing}"


def test_every_record_supports_a_reference_page():
    linked = {(p.parent / t.partition("#")[0]).resolve() for p in reference_pages() if p.name != "README.md"
              for _, t in links(p.read_text(encoding="utf-8")) if t.partition("#")[0]}
    orphans = [p.name for p in sorted((DOCS / "records").glob("*.md")) if p.resolve() not in linked]
    assert not orphans, f"records linked from no reference page (only from the index): {orphans}"


def test_records_are_named_by_date():
    bad = [p.name for p in (DOCS / "records").glob("*.md") if not re.match(r"^\d{4}-\d\d-\d\d-[a-z0-9-]+\.md$", p.name)]
    assert not bad, f"records must be named YYYY-MM-DD-topic.md: {bad}"


# --- the checkers can fail ---------------------------------------------------------------------

def test_checker_slug_follows_github():
    assert slug("TCQ's computed code (`_1mad`)") == "tcqs-computed-code-_1mad"
    assert slug("`python -m torch_lowbit bench e2e`") == "python--m-torch_lowbit-bench-e2e"
    assert slug("Mixed gcb2/gcb3 allocation (perplexity)") == "mixed-gcb2gcb3-allocation-perplexity"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


def test_checker_finds_commit_hashes_but_not_hex_in_code():
    assert commit_hashes("measured at commit `bd05667`") == [(1, "bd05667")]
    assert commit_hashes("```\nMAD = 0xdeadbeef12\n```\n1234567 tokens, decade") == []


def test_checker_finds_ci_rows():
    assert ci_timing_rows("| Zen 4 | 8031 passed, 200 skipped | 18m24s |")
    assert not ci_timing_rows("`bash .ci/run` runs the whole suite")


def test_checker_finds_dated_and_issue_headings():
    text = "# Title\n## Prefill (2026-11-27, night)\n## Runs of Nov 27\n## Targets (issue #20)\n## Done\n"
    assert [i for i, _ in bad_headings(text)] == [2, 3, 4]
    assert not bad_headings("## Prefill\n```\n# 2026-11-27\n```\nText of 2026-11-27.\n")


def test_checker_finds_broken_links():
    page = DOCS / "README.md"
    assert broken_links(page, "[x](no-such-page.md)")
    assert broken_links(page, "[x](README.md#no-such-heading)")
    assert broken_links(page, "# Here\n[x](#there)")
    assert not broken_links(page, "# Here\n[x](#here) [y](https://example.org/a#b) `[z](nowhere.md)`")
