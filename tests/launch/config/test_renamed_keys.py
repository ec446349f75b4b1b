"""Renamed keys (launch.config.run.RENAMED): an old name still reads as the new key with a one-line warning naming
it, the new name reads without one, and both names of one key are refused."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from launch.config.run import RENAMED, build_config, load_config

ROOT = Path(__file__).resolve().parents[3]
# a value other than the default for each renamed [parallel] key
VALUES = {"overlap": False, "split_bw": False, "merge_w": 2}


def toml(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def test_every_renamed_key_has_a_value_here():
    assert set(VALUES) == set(RENAMED["parallel"])


@pytest.mark.parametrize("old", VALUES)
def test_an_old_name_in_a_file_warns_and_sets_the_new_key(old, tmp_path):
    new, value = RENAMED["parallel"][old], VALUES[old]
    path = tmp_path / "run.toml"
    path.write_text(f"[parallel]\n{old} = {toml(value)}\n")
    with pytest.warns(FutureWarning, match=f"parallel.{old} is renamed parallel.{new}"):
        cfg = load_config(path)
    assert getattr(cfg.parallel, new) == value


@pytest.mark.parametrize("old", VALUES)
def test_the_new_name_reads_without_a_warning(old):
    new, value = RENAMED["parallel"][old], VALUES[old]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = build_config({"parallel": {new: value}})
    assert getattr(cfg.parallel, new) == value


@pytest.mark.parametrize("old", VALUES)
def test_both_names_of_one_key_are_refused(old):
    new, value = RENAMED["parallel"][old], VALUES[old]
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match=f"parallel.{old} and parallel.{new} are both "
                                                                      f"given.*give parallel.{new} only"):
        build_config({"parallel": {old: value, new: value}})


def test_an_old_name_in_an_override_wins_over_the_files_new_one(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[parallel]\noverlap_fb_pairs = true\n")
    with pytest.warns(FutureWarning, match="parallel.overlap is renamed parallel.overlap_fb_pairs"):
        cfg = load_config(path, ["parallel.overlap=false"])
    assert cfg.parallel.overlap_fb_pairs is False


def test_a_base_files_old_name_is_overridden_by_the_new_one(tmp_path):
    (tmp_path / "base.toml").write_text("[parallel]\nsplit_bw = false\n")
    (tmp_path / "run.toml").write_text('base = "base.toml"\n[parallel]\ndefer_weight_grads = true\n')
    with pytest.warns(FutureWarning, match="parallel.split_bw is renamed parallel.defer_weight_grads"):
        assert load_config(tmp_path / "run.toml").parallel.defer_weight_grads is True


@pytest.mark.slow  # starts a process (tests/conftest.py)
def test_the_warning_is_printed_once(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[parallel]\nmerge_w = 2\n")
    code = f"from launch.config.run import load_config\nfor _ in range(3): load_config({str(path)!r})"
    err = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120).stderr
    lines = [line for line in err.splitlines() if "is renamed" in line]
    assert len(lines) == 1 and "parallel.merge_w is renamed parallel.chunks_per_weight_grad" in lines[0], err
