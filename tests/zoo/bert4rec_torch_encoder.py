"""BERT4Rec on ``nn.TransformerEncoder``: pre-norm layers (``norm_first=True``), bidirectional
attention restricted by a bool ``src_key_padding_mask`` only, a ``[MASK]`` token (id
``num_items + 1``) at random positions inside the rows (a valid token, not padding), holes
(padding inside rows), logits over the items at every position."""
import torch
import torch.nn as nn

from grcompile.user_model import UserModel
from tests.zoo.batches import padded_ids

EXPECT = {"fused_attention": 2, "jagged": True, "dense_reason": ""}


class BERT4Rec(nn.Module):
    def __init__(self, num_items, max_len, d=16, heads=2, layers=2, dropout=0.1):
        super().__init__()
        self.mask_token = num_items + 1
        self.item = nn.Embedding(num_items + 2, d, padding_idx=0)
        self.position = nn.Embedding(max_len, d)
        self.drop = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(d), enable_nested_tensor=False)
        self.out = nn.Linear(d, num_items + 1)

    def forward(self, seq):
        positions = torch.arange(seq.size(1), device=seq.device).unsqueeze(0).expand_as(seq)
        x = self.drop(self.item(seq) + self.position(positions))
        x = self.encoder(x, src_key_padding_mask=seq.eq(0))
        return self.out(x)


def factory(max_len=12, num_items=40, dropout=0.1, **kw):
    model = BERT4Rec(num_items, max_len, dropout=dropout, **kw)

    def make_batch(batch_size, max_len, seed):
        seq, _ = padded_ids(batch_size, max_len, num_items, seed, holes=0.15)
        g = torch.Generator().manual_seed(seed + 3)
        masked = (torch.rand(seq.shape, generator=g) < 0.2) & (seq != 0)
        return torch.where(masked, torch.full_like(seq, num_items + 1), seq)

    return UserModel(model, make_batch, valid=lambda seq: seq != 0, name="bert4rec_torch_encoder")
