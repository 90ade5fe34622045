"""The benchmark suite's harness (benchmarks/suite.py, benchmarks/__main__.py): the registry, the
common arguments and the one result schema."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess

import pytest
import torch

from benchmarks import __main__ as harness
from benchmarks import suite
from benchmarks.suite import REGISTRY, RESULTS, ROOT

pytestmark = pytest.mark.bench

KEYS = {"schema", "benchmark", "machine", "commit", "command", "config", "figures", "started", "finished"}


@pytest.mark.unit
def test_write_result_writes_the_schema(tmp_path):
    args = argparse.Namespace(calls=3, out=tmp_path / "r.json", seeds=[0, 1])
    path = suite.write_result(args.out, "call_isolation", {"per_call_s": 0.25}, args, threads=2)
    doc = json.loads(path.read_text())
    assert set(doc) == KEYS and doc["schema"] == 1 and doc["benchmark"] == "call_isolation"
    assert doc["figures"] == {"per_call_s": 0.25}
    assert doc["config"] == {"calls": 3, "out": str(tmp_path / "r.json"), "seeds": [0, 1]}
    m = doc["machine"]
    assert m["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and m["cores"] == os.cpu_count()
    assert len(m["load_avg"]) == 3 and m["torch"] == torch.__version__ and m["threads"] == 2
    assert re.fullmatch(r"[0-9a-f]{40}", doc["commit"]["sha"]) and isinstance(doc["commit"]["dirty"], bool)
    assert doc["commit"]["source"] == "git"
    assert doc["command"][:1] == ["python"] and doc["started"] <= doc["finished"]
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # the temporary file was renamed over it


@pytest.mark.unit
def test_a_partial_write_has_no_finish_and_names_its_command(tmp_path):
    path = suite.write_result(tmp_path / "r.json", "smollm_tool_warmstart", {}, {"epochs": 1}, finished=False,
                              argv=["bash", "benchmarks/smollm/tool_warmstart.sh"])
    doc = suite.read_result(path)
    assert doc["finished"] is None and doc["command"] == ["bash", "benchmarks/smollm/tool_warmstart.sh"]


@pytest.mark.unit
def test_an_unregistered_name_is_refused(tmp_path):
    with pytest.raises(KeyError, match="not registered"):
        suite.write_result(tmp_path / "r.json", "no_such_benchmark", {}, {})
    assert not list(tmp_path.iterdir())


@pytest.mark.unit
def test_without_git_the_commit_comes_from_the_environment_or_the_run_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(suite, "ROOT", tmp_path)  # a copy of the tree without .git
    monkeypatch.setattr(suite, "_COMMIT", None)
    monkeypatch.delenv(suite.COMMIT_ENV, raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # git must not find a repository above
    with pytest.raises(SystemExit, match="set MUGRPO_BENCH_COMMIT=SHA"):
        suite.require_commit()
    with pytest.raises(SystemExit, match="'abc' is not a 40-hex sha"):
        monkeypatch.setattr(suite, "_COMMIT", None)
        monkeypatch.setenv(suite.COMMIT_ENV, "abc")
        suite.require_commit()
    monkeypatch.setattr(suite, "_COMMIT", None)
    monkeypatch.setenv(suite.COMMIT_ENV, "ab" * 20 + "+dirty")
    assert suite.require_commit() == {"sha": "ab" * 20, "dirty": True, "source": "MUGRPO_BENCH_COMMIT"}
    monkeypatch.setenv(suite.COMMIT_ENV, "cd" * 20)  # read once, at the start: a later change is not seen
    assert suite.commit()["sha"] == "ab" * 20


@pytest.mark.unit
def test_a_result_from_before_the_schema_reads_with_unknowns(tmp_path):
    old = {"command": "python -m benchmarks.lora", "machine": {"cpu_capability": "AVX2", "cpus": 2},
           "runs": [{"command": "mugrpo train", "s": 1.5}]}
    (tmp_path / "lora.json").write_text(json.dumps(old))
    doc = suite.read_result(tmp_path / "lora.json")
    assert doc["figures"] == old and doc["benchmark"] == "lora"
    assert doc["machine"]["cpu_capability"] == "AVX2" and doc["machine"]["cores"] == 2
    assert doc["machine"]["load_avg"] == "unknown" and doc["commit"]["sha"] == "unknown"
    assert doc["command"] == "python -m benchmarks.lora" and doc["config"] == "unknown"
    assert suite.read_figures(tmp_path / "lora.json") == old


@pytest.mark.unit
def test_common_arguments_default_to_the_registered_result():
    p = argparse.ArgumentParser()
    suite.common_arguments(p, "toy_lab_dynamic", seeds=[0, 1])
    args = p.parse_args([])
    assert args.out == str(ROOT / "benchmarks/results/toy_lab_dynamic.json") and args.seeds == [0, 1]
    assert not hasattr(args, "quick")
    p = argparse.ArgumentParser()
    suite.common_arguments(p, "toy_lab", quick="a smoke run")
    assert p.parse_args(["--quick", "--out", "x.json"]).quick and not hasattr(p.parse_args([]), "seeds")


@pytest.mark.unit
def test_the_listing_names_every_benchmark_and_an_unknown_name_exits_2(capsys):
    assert harness.main([]) == 0
    listed = capsys.readouterr().out
    for name, bench in REGISTRY.items():
        assert re.search(rf"^  {name} +{re.escape(bench.description)}$", listed, re.M), name
    assert harness.main(["no_such_benchmark"]) == 2
    assert "no benchmark named 'no_such_benchmark'" in capsys.readouterr().err


def test_every_registered_benchmark_imports_and_describes_itself():
    for name, bench in REGISTRY.items():
        assert bench.description and "\n" not in bench.description and len(bench.description) <= 100, name
        if bench.is_shell:
            assert (ROOT / bench.target).is_file(), name
            continue
        module, function = bench.target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), name


@pytest.mark.unit
def test_every_committed_result_is_in_the_schema_and_names_its_commit():
    """Every JSON under benchmarks/results/ (a benchmark's own folder included: its ``mugrpo eval``
    reports are results too), except ``legacy/``: results that cannot be re-run or converted."""
    paths = [p for p in RESULTS.rglob("*.json") if RESULTS / "legacy" not in p.parents]
    assert len(paths) > 40
    for path in sorted(paths):
        doc = json.loads(path.read_text())
        name = str(path.relative_to(RESULTS))
        assert set(doc) >= KEYS and doc["schema"] == 1 and doc["benchmark"] in REGISTRY, name
        assert re.fullmatch(r"[0-9a-f]{40}", doc["commit"]["sha"]), name
        assert doc["commit"]["source"] in ("git", suite.COMMIT_ENV) or doc["commit"]["source"].startswith("git: "), name
        assert subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", doc["commit"]["sha"] + "^{commit}"]).returncode == 0, name
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "benchmarks/results"], capture_output=True,
                             text=True, check=True).stdout.split()
    assert tracked and not [f for f in tracked if f.endswith(".jsonl")]  # raw logs: gzipped beside their result


def _two_shard_stage(folder):
    """A stage written by two ranks: shard 0 holds prompt groups "a" and "b", shard 1 group "c"."""
    from mugrpo.run_dir import SHARDS_FILE, shard_path
    from mugrpo.stages.data import StageData, shard_checksum

    for shard, prompts in enumerate(([[5, 6], [7]], [[8, 9, 10]])):
        n = 2 * len(prompts)
        StageData(prompts, [[3, 1]] * n, [[-0.5, -1.0]] * n, torch.zeros(n), torch.zeros(n),
                  torch.ones(n, dtype=torch.bool), list(range(len(prompts))), 2).save(shard_path(folder, shard))
    sums = [shard_checksum(shard_path(folder, s)) for s in range(2)]
    (folder / SHARDS_FILE).write_text(json.dumps({"num_shards": 2, "num_groups": [2, 1], "sha256": sums}))


@pytest.mark.unit
def test_benchmarks_read_every_shard_of_a_stage_checked(tmp_path):
    from mugrpo.run_dir import shard_path
    from mugrpo.stages.data import StageDataError

    _two_shard_stage(tmp_path)
    data = suite.read_stage_data(tmp_path)
    assert data.prompts == [[5, 6], [7], [8, 9, 10]]  # shard 1's group too, not rank 0's file alone
    raw = bytearray(shard_path(tmp_path, 1).read_bytes())
    raw[-1] ^= 1
    shard_path(tmp_path, 1).write_bytes(bytes(raw))
    with pytest.raises(StageDataError):
        suite.read_stage_data(tmp_path)
    with pytest.raises(SystemExit, match="not complete"):
        suite.read_stage_data(tmp_path / "nothing_here")
