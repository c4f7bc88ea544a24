"""docs/results/ and the README's headline table agree with the committed JSON they are rendered from."""

import json
import re
import shutil
from pathlib import Path

import pytest

from bench import report

RENDERED_FROM = ("docs/results", "bench/results", "experiments/results")


def copy_tree(tmp_path: Path) -> Path:
    """The pages, the README and the JSON, copied so that a test can edit them."""
    for folder in RENDERED_FROM:
        shutil.copytree(report.ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("*.png"))
    shutil.copy(report.ROOT / "README.md", tmp_path / "README.md")
    return tmp_path


def test_committed_pages_match_their_json():
    diffs = report.check(report.ROOT)
    assert diffs == [], "pages differ from their JSON; run `python -m bench.report`:\n" + "\n".join(diffs)


def test_a_number_edited_by_hand_is_reported(tmp_path):
    root = copy_tree(tmp_path)
    page = root / "docs/results/clone.md"
    text = page.read_text()
    first_row = text.index("|---|", text.index("<!-- table:budgets begin -->"))
    digit = re.compile(r"\d").search(text, first_row)
    edited = text[: digit.start()] + str((int(digit.group()) + 1) % 10) + text[digit.end() :]
    page.write_text(edited)

    diffs = report.check(root)

    assert len(diffs) == 1
    assert "docs/results/clone.md" in diffs[0]
    assert report.main(["--check", "--root", str(root)]) == 1
    report.write(root)
    assert report.check(root) == []
    assert page.read_text() == text


def test_a_missing_field_names_its_file_and_field(tmp_path):
    root = copy_tree(tmp_path)
    clone = root / "bench/results/clone.json"
    data = json.loads(clone.read_text())
    del data["full_model_report_ppl"]
    clone.write_text(json.dumps(data))

    with pytest.raises(report.MissingField) as error:
        report.render_all(root)

    assert str(error.value) == "bench/results/clone.json: no field 'full_model_report_ppl'"
