"""Small truths in the docs: the stage folder's real name, no references to files
outside the repository, Item.entry documented, the calculator example's claim, the set-up time."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATH = re.compile(r"(?<![\w/.])(?:\.\./)?((?:scripts|benchmarks|examples|tests|mugrpo|docs)/[\w./-]*[\w/])")


def test_readme_names_the_stage_folder_as_it_is_written():
    from mugrpo.run_dir import RunDir

    assert RunDir(Path("r")).stage(0).name == "stage_000"
    readme = (ROOT / "README.md").read_text()
    assert not re.search(r"stage_[kK]\b", readme) and "stages/stage_000/" in readme


BENCHMARK_PAGES = sorted((ROOT / "docs" / "benchmarks").glob("*.md"))


def test_environment_and_benchmark_docs_refer_only_to_files_in_the_repository():
    names = ["ENVIRONMENTS.md", "BENCHMARKS.md", "GUIDE.md", "TESTING.md"]
    for name in names + [f"benchmarks/{p.name}" for p in BENCHMARK_PAGES]:
        text = (ROOT / "docs" / name).read_text()
        assert "/work/" not in text and "../shared" not in text, name
        assert not re.search(r"\bENVIRONMENT\.md", text), name  # a notes file outside the repository
        for match in PATH.finditer(text):
            path = match.group(1)
            if path.startswith("benchmarks/cache/"):  # made by the drivers, git-ignored (the docs say so)
                continue
            if text[match.end():match.end() + 1] in "$<{*":  # a name pattern: smollm_<size>, ..._s$s.json
                continue
            assert (ROOT / path).exists() or (ROOT / "docs" / path).exists(), f"{name}: {path}"


def test_item_entry_is_documented_for_environments():
    text = (ROOT / "docs" / "ENVIRONMENTS.md").read_text()
    assert "item.entry" in text and 'item.entry["' in text  # what it holds, and reading a column of the row


def test_the_calculator_example_does_not_claim_it_teaches_the_tool():
    doc = (ROOT / "examples" / "env_calculator.py").read_text().split('"""')[1]
    assert not doc.startswith("Train SmolLM2 to call") and "never emits a tool call" in doc


def test_the_set_up_time_is_the_measured_one():
    assert "1-2 minutes" not in (ROOT / "scripts" / "setup.sh").read_text()
    assert "about 2-4 minutes" in (ROOT / "README.md").read_text()


def test_the_front_page_and_the_benchmark_index_stay_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150  # a front page; the rest is in docs/
    assert len((ROOT / "docs" / "BENCHMARKS.md").read_text().splitlines()) <= 250  # an index of pages


def test_the_benchmark_index_links_every_page_and_names_real_result_commits():
    import json

    index = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    linked = set(re.findall(r"\]\(benchmarks/([\w-]+\.md)\)", index))
    assert linked == {p.name for p in BENCHMARK_PAGES}  # each page is reached from the index, each link lands
    results = ROOT / "benchmarks" / "results"
    shas = {json.loads(p.read_text())["commit"]["sha"] for p in results.rglob("*.json") if results / "legacy" not in p.parents}
    rows = [line.split("|") for line in index.splitlines() if re.match(r"\| (\d+[a-z]?|`benchmarks/)", line)]
    named = {c for row in rows for c in re.findall(r"\b[0-9a-f]{7}\b", row[-3] if row[1].strip()[0].isdigit() else row[-2])}
    assert len(named) >= 15 and not [c for c in named if not any(s.startswith(c) for s in shas)]
