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
    def histories(batch_size: int, n: int, seed: int):
        """RecBole's next-item batches: a history holds at least one item (a user's first interaction
        has nothing before it and is no training example), so unlike the zoo's test batches no row is
        empty. (With an empty row, reading its position ``len - 1`` reads padding, and the loss over
        the batch would carry that row's padded value: grcompile runs such a call as written.)"""
        ids, lengths = padded_ids(batch_size, n, num_items, seed)
        ids[lengths == 0, 0] = 1 + seed % num_items
        return ids, lengths.clamp(min=1)

    return UserModel(model, histories, valid=lambda item_seq, item_seq_len: item_seq_len > 0, name="recbole_sasrec")
