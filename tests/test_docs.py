from pathlib import Path

from mugrpo.cli import reference_markdown
import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).parent.parent


def test_config_reference_doc_matches_the_code():
    # Regenerate with: .venv/bin/mugrpo config --reference --markdown > docs/CONFIG.md
    assert (ROOT / "docs" / "CONFIG.md").read_text().strip() == reference_markdown().strip()


def test_readme_quickstart_commands_exist_and_ci_calls_the_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/train.sh" in readme and "bash scripts/test.sh" in readme
    assert (ROOT / "scripts" / "train.sh").is_file() and (ROOT / "scripts" / "test.sh").is_file()
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
