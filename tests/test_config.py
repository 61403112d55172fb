"""Config validation: NaN / infinite float flags and malformed configs are one clear line."""
import pytest

from imggen.cli import config_from_args
from imggen.config import Config
from imggen.errors import ConfigError


@pytest.mark.parametrize("argv,msg", [
    (["--lr", "nan"], "train.lr must be a finite number > 0, got nan"),
    (["--lr=inf"], "train.lr must be a finite number > 0, got inf"),
    (["--model.mlp_ratio", "nan"], "model.mlp_ratio must be a finite number > 0, got nan"),
    (["--train.grad_clip", "nan"], "train.grad_clip must be a finite number > 0, got nan"),
    (["--train.weight_decay", "inf"], "train.weight_decay must be a finite number >= 0, got inf"),
    (["--train.grid_time_frac", "nan"], "train.grid_time_frac must be a finite number >= 0, got nan"),
    (["--model.dropout", "nan"], "model.dropout must be in [0, 1), got nan"),
    (["--train.min_lr_ratio", "nan"], "train.min_lr_ratio must be in [0, 1], got nan"),
])
def test_nan_and_inf_flags_are_one_line_errors(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        config_from_args(["--preset", "demo", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and msg in err[0], err


@pytest.mark.parametrize("d,msg", [
    ([1, 2], "not an imggen config"),
    ({"train": {}}, "not an imggen config"),
    ({"model": [1]}, "section model must be a mapping, got list"),
    ({"model": {"dim": "abc"}}, "model.dim must be of type int, got 'abc'"),
    ({"model": {"dim": 32.5}}, "model.dim must be of type int"),
    ({"model": {"layers": True}}, "model.layers must be of type int"),
    ({"model": {"window": "7"}}, "model.window must be of type int"),
    ({"model": {}, "train": {"lr": "x"}}, "train.lr must be of type float"),
    ({"model": {}, "data": {"limit": 1.5}}, "data.limit must be of type int"),
    ({"model": {"dimz": 3}}, "has no field 'dimz'"),
    ({"model": {}, "preset": 3}, "preset must be a string"),
])
def test_malformed_config_dict_is_config_error(d, msg):
    with pytest.raises(ConfigError, match=msg):
        Config.from_dict(d)


def test_config_dict_roundtrip_accepts_ints_for_floats_and_none_for_optional():
    cfg = Config()
    assert Config.from_dict(cfg.to_dict()) == cfg
    d = cfg.to_dict()
    d["model"]["mlp_ratio"], d["model"]["window"], d["train"]["lr"] = 2, None, 1
    assert Config.from_dict(d).validate().model.mlp_ratio == 2


def test_empty_attention_entry_is_an_error_not_dropped():
    from imggen.config import ModelConfig
    with pytest.raises(ConfigError, match="empty entry"):
        ModelConfig(height=8, width=8, attention="band,,local2d").validate()
    assert len(ModelConfig(height=8, width=8, attention=" band , local2d ").validate().patterns()) > 0
