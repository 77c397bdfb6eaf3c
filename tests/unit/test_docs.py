"""The README's figures are the ones docs/accuracy.md records with their commands, the README stays within its
length and says how to open the notebooks, and no tracked file speaks of the team's working history. Pure
text: imports neither torch nor stageplan."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_says_how_to_open_the_notebooks_and_the_tour_uses_a_scratch_folder() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make jupyter" in readme and "jupyter:" in (ROOT / "Makefile").read_text()
    assert "notebooks =" in (ROOT / "setup.cfg").read_text()
    assert "scratch folder" in readme


THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()


README_MAX_LINES = 300


# A figure: a number with a unit or a ratio sign (2.2 ms, 17.5%, 1.24×, 5.6 GB). The lookbehind keeps a token
# from starting inside another number, so "25%" never yields "5%".
FIGURE = re.compile(r"(?<![\d.,])\d+(?:\.\d+)?\s?(?:%|×|x\b|ms\b|µs\b|s\b|GiB\b|GB\b|MiB\b|KiB\b)")


TEAM_WORDS = re.compile(r"\bstops? [0-9]|\bthis stop\b|\blent\b|FIELD\.md", re.IGNORECASE)


def figures(text: str) -> set[str]:
    """Every figure in ``text``, whitespace removed (a figure wrapped across lines, or "2.2 ms" against
    "2.2ms", is the same figure)."""
    return {m.replace(" ", "") for m in FIGURE.findall(re.sub(r"\s+", " ", text))}


def section(markdown: str, title: str) -> str:
    """The body of the ``## title`` section, up to the next ``## `` heading."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", markdown, flags=re.M | re.S)
    assert match, f"README.md has no '## {title}' section"
    return match.group(1)


def headline_table(markdown: str) -> str:
    return "\n".join(line for line in section(markdown, "What and why").splitlines() if line.startswith("|"))


def test_the_figure_rule() -> None:
    assert figures("median 6.4% (worst 17.5%), 1.24× (1.02–1.36×), 2.2 ms, 5.6 GB, 2.6\n s, 4 MiB") == {
        "6.4%", "17.5%", "1.24×", "1.36×", "2.2ms", "5.6GB", "2.6s", "4MiB"}
    assert figures("25% and 0.25%") == {"25%", "0.25%"}  # no "5%" from inside them
    assert figures("3 stages, 12 layers, GPT-2, p90 1.583") == set()


def test_headline_and_limitation_figures_are_recorded_in_docs_accuracy() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    recorded = figures((ROOT / "docs" / "accuracy.md").read_text(encoding="utf-8"))
    for name, text in (("the headline table", headline_table(readme)),
                       ("Limitations", section(readme, "Limitations"))):
        quoted = figures(text)
        assert len(quoted) >= 5, f"{name} quotes only {sorted(quoted)}: is the section still there?"
        missing = sorted(quoted - recorded)
        assert not missing, f"{name} quotes figures docs/accuracy.md does not record: {missing}"


GENERATED = re.compile(r"<!-- begin: ([\w-]+) -->\n(.*?)<!-- end: \1 -->", re.S)
BEFORE_RECORDS = "before the records"


def test_headline_figures_come_from_the_tables_make_bench_generates() -> None:
    """A headline row cites the tables make bench regenerates from every record (benchmarks/results.py):
    each of its figures is in one of those tables, and it says over how many recorded runs. A figure from
    before the records began may stay only on a row that says so (its figures are then in docs/accuracy.md's
    hand-copied tables, as the test above checks)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    doc = (ROOT / "docs" / "accuracy.md").read_text(encoding="utf-8")
    generated = figures("\n".join(body for _, body in GENERATED.findall(doc)))
    rows = [line for line in headline_table(readme).splitlines()[2:]]
    recorded = [line for line in rows if BEFORE_RECORDS not in line]
    assert len(recorded) >= 3, f"the headline cites only {len(recorded)} rows from the recorded runs"
    for line in recorded:
        missing = sorted(figures(line) - generated)
        assert not missing, (f"headline row {line[:60]!r} quotes figures no generated table of "
                             f"docs/accuracy.md holds: {missing}; cite the recorded runs or say the row is "
                             f"from {BEFORE_RECORDS} began")
        assert re.search(r"over \d+ (recorded )?runs|one recorded run", line), (
            f"headline row {line[:60]!r} does not say over how many recorded runs")


def test_readme_fits_its_length() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines; keep it within {README_MAX_LINES} "
                                       f"(move reference to docs/)")


def _tracked_text_files() -> dict[str, str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    texts = {}
    for name in filter(None, out.decode().split("\0")):
        path = ROOT / name
        if name == THIS or not path.is_file():
            continue
        try:
            texts[name] = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # images and other binary files
            continue
    return texts


def _with_team_words() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for name, text in _tracked_text_files().items():
        hits = [f"{i}: {line.strip()[:100]}" for i,
                line in enumerate(text.splitlines(), 1) if TEAM_WORDS.search(line)]
        if hits:
            found[name] = hits
    return found


def test_no_tracked_file_speaks_of_the_teams_working_history() -> None:
    found = _with_team_words()
    assert not found, (
        "words of the team's working history (numbered stops, the internal field notes) in: "
        + "; ".join(f"{name} line {hits[0]}" for name, hits in sorted(found.items()))
    )


def test_the_tours_scratch_folder_links_the_profiles_from_any_folder(tmp_path: Path) -> None:
    """The tour's setup (its ```bash block), run from a folder outside the clone and run twice: it finds the
    clone from the stageplan on PATH (.venv/bin/stageplan, as activating .venv puts it there) and links its
    profiles/ into the scratch folder (the block's /tmp/tour, here under tmp_path)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert ". .venv/bin/activate" in readme and ".venv/bin/stageplan" in readme
    block = next(b for b in re.findall(r"```bash\n(.*?)```", section(readme, "CLI tour"), flags=re.S)
                 if "/tmp/tour" in b)
    clone = tmp_path / "clone"
    (clone / ".venv" / "bin").mkdir(parents=True)
    (clone / "profiles").mkdir()
    script = clone / ".venv" / "bin" / "stageplan"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    tour = tmp_path / "tour"
    env = {"PATH": f"{script.parent}:/usr/bin:/bin", "HOME": str(tmp_path)}
    for _ in range(2):  # a second run finds the link there already
        done = subprocess.run(["bash", "-euc", block.replace("/tmp/tour", str(tour)) + "\npwd"],
                              cwd=elsewhere, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert (tour / "profiles").resolve() == (clone / "profiles").resolve()
        assert done.stdout.strip() == str(tour)
