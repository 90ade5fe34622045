"""The checks every config section uses (mugrpo.config.checks): the error names the key, the value and
what is accepted; the resume-safe metadata."""
import pytest

from mugrpo.config.checks import SAFE, check, check_registered
from mugrpo.errors import ConfigError, UserError
from mugrpo.registry import Registry

pytestmark = pytest.mark.unit


def test_check_passes_silently_and_refuses_naming_key_value_and_accepted():
    check(True, "optim.lr", "a finite number > 0", 1e-5)  # nothing raised
    with pytest.raises(ConfigError) as info:
        check(False, "optim.lr", "a finite number > 0", -1.0)
    assert str(info.value) == "optim.lr=-1.0 is out of range; accepted: a finite number > 0"
    assert isinstance(info.value, UserError)  # the CLI exits 2 on it


def test_check_registered_accepts_a_registered_name_and_lists_the_names_otherwise():
    reg = Registry("test.kind", {"alpha": "math:sqrt", "beta": "math:floor"})
    check_registered("beta", reg, "loss.kind")
    with pytest.raises(ConfigError) as info:
        check_registered("gamma", reg, "loss.kind")
    assert str(info.value) == "loss.kind='gamma' is not a known option; accepted: alpha, beta"
    # a value that is not a string is refused the same way (never looked up)
    with pytest.raises(ConfigError, match=r"loss.kind=3 is not a known option; accepted: alpha, beta"):
        check_registered(3, reg, "loss.kind")
    reg.register("gamma", "math:ceil")  # a user's own entry is accepted from then on
    check_registered("gamma", reg, "loss.kind")


def test_safe_is_the_resume_safe_marker():
    assert SAFE == {"resume_safe": True}
