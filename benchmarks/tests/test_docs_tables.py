"""The tables of the benchmark pages (docs/benchmarks/*.md, indexed by docs/BENCHMARKS.md) against the
results they cite (benchmarks/results/).

Each check names a table by its header row and rebuilds what its numbers must be from the committed
results: either the benchmark's own table generator (the doc's rows must appear as it prints them),
or the figures directly (every number of a row, the label cell aside, must round to the doc's
value at the precision the doc shows). Tables not listed here are not checked; the report of
issue 32 lists them."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

from benchmarks.suite import RESULTS, ROOT, read_figures

pytestmark = pytest.mark.bench

PAGES = ROOT / "docs" / "benchmarks"


def doc_text() -> str:
    """Every benchmark page, one after the other (a table's header row is unique among them)."""
    return "\n".join(p.read_text() for p in sorted(PAGES.glob("*.md")))
NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:e-?\d+)?")


def doc_table(header_start: str) -> list[list[str]]:
    """The rows (cells, stripped) of the one table whose header row starts with ``header_start``."""
    lines = doc_text().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(header_start)]
    assert len(starts) == 1, f"{len(starts)} tables start with {header_start!r} in docs/benchmarks/"
    rows = []
    for line in lines[starts[0] + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def numbers(cell: str) -> list[str]:
    return NUMBER.findall(cell.replace("**", ""))


def matches(shown: str, value: float) -> bool:
    """``value`` printed at ``shown``'s precision is ``shown`` (half a unit of its last digit)."""
    x = float(shown.replace(",", ""))
    if "e" in shown:
        mantissa = shown.split("e")[0]
        digits = len(mantissa.split(".")[1]) if "." in mantissa else 0
        return abs(x - value) <= 0.5 * 10 ** -digits * 10 ** int(shown.split("e")[1]) * 1.0001
    digits = len(shown.split(".")[1]) if "." in shown else 0
    return abs(x - value) <= 0.5 * 10 ** -digits + 1e-9


def check_rows(rows: list[list[str]], expected: list[list[float]], skip_cells: int = 1) -> None:
    assert len(rows) == len(expected), f"{len(rows)} rows in the doc, {len(expected)} in the results"
    for row, want in zip(rows, expected):
        shown = [n for cell in row[skip_cells:] for n in numbers(cell)]
        assert len(shown) == len(want), f"row {row[0]!r}: the doc shows {shown}, the results give {want}"
        bad = [(s, w) for s, w in zip(shown, want) if not matches(s, w)]
        assert not bad, f"row {row[0]!r}: doc vs results {bad}"


@pytest.mark.unit
def test_matches_reads_the_precision_the_doc_shows():
    assert matches("0.374", 0.37449) and not matches("0.374", 0.3746)
    assert matches("65", 64.9) and matches("134,515,008", 134515008) and not matches("302", 303)
    assert matches("4.47e-05", 4.4721e-05) and not matches("4.47e-05", 4.48e-05)
    assert numbers("**0.374 ± 0.018** (n=3)") == ["0.374", "0.018", "3"]


def _experiment(label: str) -> str:
    """The doc's row label as the results name it: "grpo (mu = 4)" -> grpo, "delta = 1e-2" -> delta=0.01."""
    key = label.split(" (")[0].replace(" = ", "=")
    return f"delta={float(key[6:]):g}" if key.startswith("delta=") else key


@pytest.mark.unit
def test_toy_lab_results_table():
    summary = read_figures(RESULTS / "toy_lab.json")["summary"]
    rows = doc_table("| experiment | final pass@1 | peak pass@1 | drop from peak |")
    assert sorted(_experiment(r[0]) for r in rows) == sorted(summary)
    expected = [[summary[_experiment(r[0])][k][m] for k in ("final_pass1", "peak_pass1", "drop_from_peak",
                                                             "late_ratio_mean_neg") for m in ("mean", "std")]
                + [100 * summary[_experiment(r[0])]["veto_token_frac_mean"]["mean"]] for r in rows]
    check_rows(rows, expected)


def test_long_toy_lab_and_corrections_tables_are_their_generators_output():
    from benchmarks.smollm import corrections
    from benchmarks.toy_lab import plot_corrections, plot_long

    doc = set(doc_text().splitlines())
    for name, text in (("toy_lab_long.json", plot_long.markdown_summary(RESULTS / "toy_lab_long.json")),
                       ("toy_lab_corrections.json", plot_corrections.table(read_figures(RESULTS / "toy_lab_corrections.json"))),
                       ("smollm_corrections.json", corrections.table(read_figures(RESULTS / "smollm_corrections.json")))):
        rows = [line for line in text.splitlines() if line.startswith("|")]
        missing = [line for line in rows if line not in doc]
        assert rows and not missing, f"{name}: rows not in docs/benchmarks/: {missing}"


@pytest.mark.unit
def test_trigger_tokens_table():
    runs = read_figures(RESULTS / "toy_lab_long_triggers.json")["runs"]
    expected = []
    for r in sorted(runs, key=lambda r: Path(r["run_dir"]).name):  # the doc lists grpo-stale-relaxed, then mu-grpo
        for d, v in r["by_delta"].items():
            expected.append([float(d), 100 * v["negative_with_trigger_frac"],
                             100 * v["trigger_token_frac_of_negative_tokens"], v["first_trigger_pos_mean"],
                             v["first_trigger_pos_median"], v["first_trigger_kind"]["decisive"],
                             v["first_trigger_kind"]["ordinary"], v["rho_before_first_mean"], v["rho_at_first_mean"],
                             v["rho_after_first_mean"]])
    check_rows(doc_table("| run | delta | A<0 responses with a trigger |"), expected)


@pytest.mark.unit
def test_rollout_phase_table():
    shapes = read_figures(RESULTS / "toy_lab_long_rollout.json")["shapes"]
    expected = [[s["calls"], s["tokens"], s["seconds"], s["ms_per_token"]] for s in shapes.values()]
    check_rows(doc_table("| shape | calls | generated tokens | seconds | ms per generated token |"), expected)


@pytest.mark.unit
def test_lora_table():
    runs = read_figures(RESULTS / "lora.json")["runs"]
    full = runs["full_none"]["trainable_params"]
    expected = []
    for key in ("full_none", "lora_r16_none", "full_bf16", "lora_r16_bf16"):
        r = runs[key]
        share = [100 * r["trainable_params"] / full] if key.startswith("lora") else []
        expected.append([r["trainable_params"], *share, r["optimizer_state_mb"], r["checkpoint_tensors_mb"],
                         r["peak_rss_gb"], statistics.fmean(r["seconds"][1:])])
    rows = doc_table("| | trainable parameters | AdamW state | checkpoint tensors | peak RSS |")
    check_rows(rows, expected)


@pytest.mark.unit
def test_tool_warmstart_table():
    figures = read_figures(RESULTS / "smollm_tool_warmstart" / "result.json")
    base, sft = figures["eval_base_tool"]["tasks"]["calc"], figures["eval_sft_tool"]["tasks"]["calc"]
    plain = {k: figures[f"eval_{k}_notool"]["tasks"]["calc"] for k in ("base", "sft")}
    rows = {r[0]: r[1:] for r in doc_table("| greedy, 64 held-out items | base model | after the warm start |")}
    n = sft["num_items"]
    check_rows([["", *rows["accuracy with the calculator"]]], [[100 * base["greedy_acc"], 100 * sft["greedy_acc"]]])
    check_rows([["", *rows["trajectories with a tool call (`env/tool_call_frac`)"]]],
               [[base["env/num_with_tool_call"], n, sft["env/num_with_tool_call"], n]])
    check_rows([["", *rows["tool calls (per trajectory)"]]],
               [[base["env/tool_calls"], sft["env/tool_calls"], sft["env/tool_calls"] / n, 2]])
    check_rows([["", *rows["policy turns per trajectory"]]], [[base["env/turns_mean"], sft["env/turns_mean"]]])
    check_rows([["", *rows["accuracy without the tool"]]],
               [[100 * plain["base"]["greedy_acc"], 100 * plain["sft"]["greedy_acc"], n, 256]])


@pytest.mark.parametrize("result, header", [
    ("async_stages.json", "| arm | cores | training clock (s), mean ± sd (seeds) | vs sync | trainer idle |"),
    ("async_stages_calculator.json",
     "| arm | cores | training clock (s), mean ± sd (seeds) | vs sync | vs sync_split |"),
])
def test_async_stages_tables(result, header):
    runs = read_figures(RESULTS / result)["runs"]
    cols = doc_table(header[:-1])
    by_arm = {a: sorted((r for r in runs if r["arm"] == a), key=lambda r: r["seed"]) for a in ("sync", "async",
                                                                                                "sync_split", "grpo")}
    mean = lambda arm, k: statistics.mean(r[k] for r in by_arm[arm])  # noqa: E731
    assert [row[0].split()[0] for row in cols] == list(by_arm)
    idle = 5 if "vs sync_split" in header else 4  # the column of "trainer idle"
    for row in cols:
        arm = row[0].split()[0]
        clocks = [r["clock_s"] for r in by_arm[arm]]
        check_rows([["", row[2]]], [[statistics.mean(clocks), statistics.stdev(clocks), *clocks]])
        check_rows([["", row[3]]], [[mean(arm, "clock_s") / mean("sync", "clock_s")]])
        check_rows([["", row[idle], row[idle + 1]]], [[100 * mean(arm, "trainer_idle_frac"),
                                                        100 * mean(arm, "engine_idle_frac")]])
        check_rows([["", row[idle + 2]]], [[max(r["policy_lag_max"] for r in by_arm[arm]),
                                            mean(arm, "policy_lag_mean")]])


@pytest.mark.unit
def test_every_result_a_table_cites_is_in_the_schema():
    for path in ("toy_lab.json", "toy_lab_long.json", "toy_lab_corrections.json", "smollm_corrections.json",
                 "toy_lab_long_triggers.json", "toy_lab_long_rollout.json", "lora.json",
                 "smollm_tool_warmstart/result.json", "async_stages.json", "async_stages_calculator.json"):
        assert json.loads((RESULTS / path).read_text())["schema"] == 1, path
        assert path.split("/")[0] in doc_text(), f"docs/benchmarks/ does not name {path}, the results of one of its tables"
