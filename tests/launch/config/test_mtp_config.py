"""Run configs with multi-token prediction that cannot run are refused by build_config, naming the fields."""

from __future__ import annotations

import pytest

from launch.config.run import build_config


def raw(model: dict, parallel: dict) -> dict:
    """A 4-layer model config with the given model and parallel fields."""
    return {"model": {"num_layers": 4, **model}, "train": {"grad_accum_steps": 8, "seq_len": 16},
            "parallel": parallel}


@pytest.mark.parametrize("model, parallel, match", [
    ({"mtp_depth": -1}, {}, r"\[model\] mtp_depth = -1 must be an integer >= 0"),
    ({"mtp_depth": 1, "mtp_loss_coeff": 0}, {}, r"\[model\] mtp_loss_coeff = 0 must be a finite number > 0"),
    ({"mtp_depth": 1}, {"cp": 2}, r"model.mtp_depth = 1 does not run with parallel.cp = 2"),
    ({"mtp_depth": 1, "num_layers": 3}, {"pp": 3, "schedule": "1f1b"}, r"needs an even parallel.pp \(got 3\)"),
])
def test_bad_mtp_configs_are_refused(model, parallel, match):
    with pytest.raises(ValueError, match=match):
        build_config(raw(model, parallel))


def test_mtp_layouts_are_accepted():
    """Depth 0 ignores the coefficient; the layouts of the equivalence suite build; embedding copies only where
    the first and the last stage sit on different pipeline ranks."""
    assert not build_config(raw({"mtp_loss_coeff": 0}, {})).layout.embed_copy
    assert build_config(raw({"mtp_depth": 2}, {"pp": 2, "schedule": "1f1b"})).layout.embed_copy
    assert not build_config(raw({"mtp_depth": 2}, {"pp": 2, "schedule": "dualpipev"})).layout.embed_copy
    assert not build_config(raw({"mtp_depth": 2}, {"pp": 2, "schedule": "dualpipe"})).layout.embed_copy
    assert build_config(raw({"mtp_depth": 1}, {"pp": 2, "schedule": "zb1p"})).layout.embed_replica_group(1) == [0, 1]
