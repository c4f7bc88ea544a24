"""The one `Level` value: canonical names, ordering, rejection, and levels that would share a name."""

from __future__ import annotations

import math
import pickle

import pytest
from pydantic import ValidationError

from device_sdk.format import DEFAULT_LEVELS, Level, LevelShape, Manifest, PackageError, parse_levels
from pipeline.settings import ElastifySettings


def test_a_level_has_one_canonical_name_whether_built_from_a_ratio_or_a_name():
    assert Level(0.5).name == "0.5" and Level(1).name == "1.0" and Level("1").name == "1.0"
    assert Level(0.1 + 0.2).name == "0.3"  # 0.30000000000000004 is level 0.3
    assert Level("0.50") == Level(0.5) == Level(Level(0.5)) == Level(0.5000001)
    assert Level(0.5).ratio == 0.5 and Level(1 / 3).name == "0.333333"
    assert str(Level(0.7)) == "0.7" and repr(Level(0.7)) == "Level(0.7)"
    assert all(Level(level.name) == level for level in DEFAULT_LEVELS)


def test_levels_order_and_hash_by_ratio_and_never_equal_a_string_or_a_float():
    assert sorted([Level(1.0), Level("0.2"), Level(0.55)]) == [Level(0.2), Level(0.55), Level(1.0)]
    assert Level(0.3) < Level("0.4") <= Level(0.4) < Level(1) and max(map(Level, ["0.9", "0.25"])) == Level(0.9)
    assert len({Level(0.5), Level("0.5"), Level(0.5000001), Level(0.6)}) == 2
    assert Level(0.5) != "0.5" and Level(0.5) != 0.5
    with pytest.raises(TypeError):
        _ = Level(0.5) < 0.6
    assert pickle.loads(pickle.dumps(Level(0.35))) == Level(0.35)
    with pytest.raises(AttributeError):
        Level(0.5).ratio = 0.6


@pytest.mark.parametrize("bad", [True, False, math.nan, "nan", math.inf, 0, 0.0, -0.1, 1.0000001, 2, "1.5", "half",
                                 "", None, [0.5], 4e-7])
def test_a_level_must_be_a_number_or_name_in_the_unit_interval_with_a_nonzero_name(bad):
    with pytest.raises(ValueError):
        Level(bad)


def test_the_smallest_level_is_the_smallest_with_a_name_other_than_zero():
    assert Level(6e-7).name == "1e-06"
    with pytest.raises(ValueError, match="rounds to 0.0 at 6 decimals"):
        Level(4e-7)


def test_a_level_list_whose_values_share_a_name_is_refused_with_both_values_named():
    assert parse_levels([0.2, "0.5", Level(1.0)]) == (Level(0.2), Level(0.5), Level(1.0))
    with pytest.raises(ValueError, match=r"levels 0.5 and 0.5000001 are both level 0.5"):
        parse_levels([0.2, 0.5, 0.5000001, 1.0])
    with pytest.raises(ValueError, match="both level 0.3"):
        parse_levels([0.3, 0.7, "0.30"])  # a duplicate is named even when it is also out of order
    with pytest.raises(ValueError, match="strictly increasing; 0.4 comes after 0.6"):
        parse_levels([0.6, 0.4])
    with pytest.raises(ValueError, match="must not be empty"):
        parse_levels([])


def test_stage_settings_take_the_default_levels_and_refuse_levels_that_share_a_name():
    assert ElastifySettings().levels == [level.ratio for level in DEFAULT_LEVELS]
    assert [level.name for level in DEFAULT_LEVELS] == ["0.2", "0.3", "0.4", "0.5", "0.6", "0.7", "0.8", "0.9", "1.0"]
    with pytest.raises(ValidationError, match="both level 0.5"):
        ElastifySettings(levels=[0.5, 0.5000004])


def _manifest(*levels: tuple[str, float]) -> dict:
    """The smallest valid manifest (one layer, no files) with these (name, ratio) level entries."""
    shapes = [{"name": name, "ratio": ratio, "attn_units": [1 + i], "mlp_units": [8 + i], "active_params": 10 + i,
               "active_fraction": ratio} for i, (name, ratio) in enumerate(levels)]
    return {
        "format_version": 1, "name": "tiny", "version": "1", "created_at": "2026-01-01T00:00:00Z", "build_id": None,
        "source": {}, "files": [], "byte_ranges": {},
        "architecture": {"family": "llama", "layers": 1, "hidden": 8, "heads": 2, "kv_heads": 2, "head_dim": 4,
                         "intermediate": 16, "vocab": 32, "norm_eps": 1e-5, "rope": {"theta": 10000.0}},
        "elastic": {"anchor_layers": [], "attn_units": [2], "mlp_units": [16], "levels": shapes, "tensors": {}},
    }


def test_the_manifest_keeps_name_and_ratio_and_finds_a_level_by_value():
    manifest = Manifest.from_dict(_manifest(("0.5", 0.5), ("1.0", 1.0)))
    half = manifest.elastic.levels[0]
    assert isinstance(half, LevelShape) and half.level == Level(0.5)
    assert manifest.elastic.level(Level(0.5)) is half
    assert manifest.elastic.level(0.5) is half and manifest.elastic.level("0.50") is half
    assert {"name", "ratio"} <= set(manifest.to_dict()["elastic"]["levels"][0]) and "level" not in half.__dict__
    with pytest.raises(PackageError, match=r"no level 0.7; the package has \['0.5', '1.0'\]"):
        manifest.elastic.level(0.7)
    with pytest.raises(PackageError):
        manifest.elastic.level("half")


@pytest.mark.parametrize(("levels", "message"), [
    ((("0.5", 0.5), ("0.5", 0.5000001)), "two levels are both level 0.5"),
    ((("0.50", 0.5),), "not the canonical name '0.5'"),
    ((("0.8", 0.8), ("0.4", 0.4)), "levels must increase; 0.4 comes after 0.8"),
    ((("1.5", 1.5),), r"must be in \(0, 1\]"),
])
def test_a_manifest_with_duplicate_misnamed_unordered_or_outside_levels_is_refused(levels, message):
    with pytest.raises(PackageError, match=message):
        Manifest.from_dict(_manifest(*levels))
