"""Numbers the trainer cannot use fail at once with the flag's name (issue 13): ``--batch-size 0``
was a ZeroDivisionError, ``--num-negatives 0`` trained on a loss of exactly 0, ``--eval-every 0`` a
modulo by zero, ``--temperature 0`` a NaN loss with HR@10 = 1. The same bounds (``config.BOUNDS``)
hold for a ``TrainConfig`` passed to ``train`` from Python."""
import argparse
import dataclasses

import pytest

from grcompile.train.__main__ import build_parser, parse_args
from grcompile.train.config import BOUNDS, TrainConfig
from grcompile.train.loop import train

BAD = [("--batch-size", "0"), ("--batch-size", "-8"), ("--eval-batch-size", "0"), ("--num-negatives", "0"),
       ("--num-negatives", "-1"), ("--epochs", "-1"), ("--steps", "-3"), ("--max-len", "1"), ("--eval-every", "0"),
       ("--patience", "0"), ("--temperature", "0"), ("--lr", "-0.1"), ("--lr", "nan"), ("--sparse-lr", "0"),
       ("--weight-decay", "-1"), ("--seed", "-1"), ("--k-core", "-2"), ("--threads", "0"), ("--max-minutes", "0"),
       ("--dropout", "1.0"), ("--embedding-dim", "0"), ("--num-blocks", "0"), ("--num-categories", "-1"),
       ("--synthetic-users", "0"), ("--synthetic-items", "0"), ("--hsp-group-size", "0"),
       ("--checkpoint-every", "0"), ("--batch-size", "eight"), ("--batch-size", "2.5")]


@pytest.mark.parametrize("flag, value", BAD)
def test_bad_numbers_are_argparse_errors_naming_the_flag(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args([flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: must be " in capsys.readouterr().err


def test_edge_values_that_mean_something_are_accepted():
    args = parse_args(["--epochs", "0", "--steps", "0", "--k-core", "0", "--num-categories", "0", "--dropout", "0",
                       "--max-len", "2", "--batch-size", "1", "--num-negatives", "1"])
    assert (args.epochs, args.steps, args.max_len, args.num_negatives) == (0, 0, 2, 1)


@pytest.mark.parametrize("changes, field", [({"batch_size": 0}, "batch_size"), ({"num_negatives": 0}, "num_negatives"),
                                            ({"eval_every": 0}, "eval_every"), ({"temperature": 0.0}, "temperature"),
                                            ({"model_overrides": {"num_blocks": 0}}, "num_blocks"),
                                            ({"synthetic": {"num_items": 0}}, "num_items"),
                                            ({"negatives": "all"}, "negatives"),
                                            ({"sparse_optimizer": "adamw"}, "sparse_optimizer")])
def test_train_validates_a_config_from_python(changes, field):
    config = dataclasses.replace(TrainConfig(), **changes)
    with pytest.raises(ValueError, match=f"TrainConfig.{field} must be"):
        train(config, progress=False, log=lambda *a: None)


def test_every_number_flag_has_a_bound():
    """A new int or float flag without a bound would bring the ZeroDivisionError class back."""
    unbounded = [a.option_strings[0] for a in build_parser()._actions
                 if a.type in (int, float) and a.help != argparse.SUPPRESS]
    assert unbounded == []
    assert {"batch_size", "num_negatives", "eval_every", "patience", "max_len"} <= BOUNDS.keys()
