"""Metric sinks: jsonl always; TensorBoard and W&B optional, with a clear error when not installed."""

import json
import sys

import pytest

from mugrpo.config import Config, ConfigError, load_config
from mugrpo.observability.loggers import JsonlLogger, MultiLogger, make_logger, scalars

RECORD = {"kind": "update", "stage": 0, "update": 3, "update_in_stage": 1, "time_s": 1.5,
          "loss/policy": -0.25, "loss/ratio_mean_neg": float("nan"), "optim/skipped": 0.0,
          "stage/num_sequences": 64, "flag/bool": True, "note/text": "x"}


def test_scalars_keep_namespaced_finite_numbers_only():
    # kind/stage/update/time_s are not namespaced; NaN, bools and strings are not plottable
    assert scalars(RECORD) == {"loss/policy": -0.25, "optim/skipped": 0.0, "stage/num_sequences": 64.0}


def test_default_logger_is_the_jsonl_file(tmp_path):
    logger = make_logger(Config(), tmp_path)
    assert isinstance(logger, JsonlLogger)
    logger.log(RECORD)
    logger.close()
    line = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert line["loss/ratio_mean_neg"] is None and line["update"] == 3  # NaN -> null, strict JSON


@pytest.mark.parametrize("name, module, pin", [("tensorboard", "torch.utils.tensorboard", "tensorboard==2.21.0"),
                                               ("wandb", "wandb", "wandb==0.31.0")])
def test_missing_optional_logger_names_the_pip_command(tmp_path, monkeypatch, name, module, pin):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    cfg = load_config(overrides=[f"log.loggers=[{name}]"])
    with pytest.raises(ConfigError, match=f"pip install {pin}"):
        make_logger(cfg, tmp_path)


def test_unknown_logger_is_a_config_error():
    with pytest.raises(ConfigError, match="log.loggers"):
        load_config(overrides=["log.loggers=[mlflow]"])


class _Broken:
    closed = False

    def log(self, record):
        raise RuntimeError("disk full")

    def close(self):
        self.closed = True


def test_a_failing_optional_sink_is_dropped_and_the_jsonl_continues(tmp_path, capsys):
    broken = _Broken()
    logger = MultiLogger(JsonlLogger(tmp_path / "metrics.jsonl"), [broken])
    logger.log(RECORD)
    logger.log({**RECORD, "update": 4})
    logger.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    assert "_Broken failed" in capsys.readouterr().err and logger.optional == [] and not broken.closed


def test_tensorboard_writes_events(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load_config(overrides=["log.loggers=[tensorboard]"])
    logger = make_logger(cfg, tmp_path)
    logger.log(RECORD)
    logger.log({**RECORD, "update": 4, "loss/policy": 0.5})
    logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss/policy")] == [(3, -0.25), (4, 0.5)]


def test_wandb_offline_needs_no_network(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(overrides=["log.loggers=[wandb]", "log.run_name=tiny"])
    logger = make_logger(cfg, tmp_path)
    logger.log(RECORD)
    logger.close()
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
