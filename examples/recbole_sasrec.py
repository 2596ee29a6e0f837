"""The RecBole-style SASRec of the zoo (``tests/zoo/recbole_sasrec.py``: the mask built after the
embedding lookup, ``torch.where(mask, 0., -10000.)`` *added* to the scores, hand-written heads,
output gathered at ``len - 1``) at benchmark width: D = 64, 2 blocks, 2 heads.

    python -m grcompile.bench --model examples/recbole_sasrec.py:factory --max-len 200 --batch-size 128
"""
from __future__ import annotations

from grcompile.user_model import UserModel
from tests.zoo.batches import padded_ids
from tests.zoo.recbole_sasrec import SASRec


def factory(max_len: int = 200, num_items: int = 1000, dropout: float = 0.0, hidden_size: int = 64,
            n_layers: int = 2, n_heads: int = 2) -> UserModel:
    model = SASRec(num_items, max_len, hidden_size=hidden_size, n_layers=n_layers, n_heads=n_heads,
                   dropout_prob=dropout)
    return UserModel(model, lambda b, n, seed: padded_ids(b, n, num_items, seed),
                     valid=lambda item_seq, item_seq_len: item_seq_len > 0, name="recbole_sasrec")
