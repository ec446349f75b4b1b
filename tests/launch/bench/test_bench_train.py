"""moe-bench train: its rows are the issue's layouts of the config, bad arguments fail before any run."""

from __future__ import annotations

import pytest

from launch.bench.train import layouts, main


def test_rows_are_single_process_pp2_dualpipev_the_config_and_its_overlap_off():
    config = {"pp": 2, "dp": 2, "ep": 2, "schedule": "dualpipev", "gpus_per_node": 1}
    rows = layouts(config)
    assert list(rows.values()) == [{}, {"pp": 2, "schedule": "dualpipev"}, config, {**config, "overlap_fb_pairs": False}]
    assert list(rows)[2] == "config: pp=2 dp=2 ep=2 schedule=dualpipev"


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--warmup", "-1"]])
def test_bad_step_counts_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert "--steps" in capsys.readouterr().err


def test_a_config_that_fails_validation_names_the_field(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[parallel]\npp = 2\nschedule = "dualpipe"\ndp = 3\n')
    with pytest.raises(ValueError, match="parallel"):
        main(["--config", str(bad), "--steps", "1", "--warmup", "0"])


def test_only_an_unknown_layout_is_refused_naming_the_layouts_there_are(capsys):
    with pytest.raises(SystemExit):
        main(["--only", "pp=4 dualpipe", "--steps", "1"])
    err = capsys.readouterr().err
    assert "--only 'pp=4 dualpipe': not a layout of this config" in err and "'pp=2 dualpipev'" in err
