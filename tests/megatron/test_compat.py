"""megatron_tepo.megatron.compat: what differs between megatron-core 0.16.1 and 0.19.x.

A resumed run that changes its learning rate (train.allow_config_change) must load its optimizer
on 0.19, which pairs saved parameter groups by their settings (max_lr among them): the saved groups
take the current learning rates first. The end-to-end check is
tests/trainer/test_user_journey.py::test_same_command_resumes_and_refuses_changed_settings on the
newest stack (it failed there before: "Could not find parameter group with key ...")."""
from types import SimpleNamespace

from megatron_tepo.megatron.compat import adopt_current_lr_in_saved_groups


def _optimizer(*groups):
    return SimpleNamespace(optimizer=SimpleNamespace(param_groups=list(groups)))


def test_saved_groups_take_the_current_learning_rates_everywhere_they_are():
    current = SimpleNamespace(chained_optimizers=[_optimizer({"max_lr": 3e-4, "min_lr": 0.0, "wd_mult": 1.0}),
                                                  _optimizer({"max_lr": 3e-4, "min_lr": 0.0, "wd_mult": 0.0})])
    saved = [{"optimizer": {"param_groups": [{"max_lr": 1e-4, "min_lr": 0.0, "wd_mult": 1.0},
                                             {"max_lr": 1e-4, "min_lr": 0.0, "wd_mult": 0.0}]},
              "fp32_from_fp16_params": []},
             {"optimizer": {"param_groups": [{"max_lr": 1e-4, "min_lr": 1e-5, "wd_mult": 1.0}]}}]
    assert adopt_current_lr_in_saved_groups(saved, current) == 3
    groups = saved[0]["optimizer"]["param_groups"] + saved[1]["optimizer"]["param_groups"]
    assert {(g["max_lr"], g["min_lr"]) for g in groups} == {(3e-4, 0.0)}
    assert [g["wd_mult"] for g in groups] == [1.0, 0.0, 1.0]  # the pairing keys megatron needs stay


def test_disagreeing_current_groups_are_left_alone():
    current = _optimizer({"max_lr": 3e-4, "min_lr": 0.0}, {"max_lr": 1e-3, "min_lr": 0.0})
    saved = {"param_groups": [{"max_lr": 1e-4, "min_lr": 0.0}]}
    assert adopt_current_lr_in_saved_groups(saved, current) == 0 and saved["param_groups"][0]["max_lr"] == 1e-4
