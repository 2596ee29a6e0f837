"""A GPT-style next-item model on ``nn.TransformerEncoder``: post-norm layers (``norm_first=False``,
``batch_first=True``, GELU), the float causal mask from
``nn.Transformer.generate_square_subsequent_mask`` plus ``is_causal=True``, a bool
``src_key_padding_mask``, a final LayerNorm, right padding, per-position logits."""
import torch
import torch.nn as nn

from grcompile.user_model import UserModel
from tests.zoo.batches import padded_ids

EXPECT = {"fused_attention": 2, "jagged": True, "dense_reason": ""}


class GPTRec(nn.Module):
    def __init__(self, num_items, max_len, d=16, heads=2, layers=2, dropout=0.1):
        super().__init__()
        self.tok = nn.Embedding(num_items + 1, d, padding_idx=0)
        self.pos = nn.Embedding(max_len, d)
        layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=2 * d, dropout=dropout,
                                           activation="gelu", batch_first=True, norm_first=False)
        self.encoder = nn.TransformerEncoder(layer, num_layers=layers, norm=nn.LayerNorm(d),
                                             enable_nested_tensor=False)
        self.head = nn.Linear(d, num_items + 1)

    def forward(self, ids):
        n = ids.size(1)
        x = self.tok(ids) + self.pos(torch.arange(n, device=ids.device))[None]
        causal = nn.Transformer.generate_square_subsequent_mask(n, device=ids.device)
        h = self.encoder(x, mask=causal, src_key_padding_mask=ids == 0, is_causal=True)
        return self.head(h)


def factory(max_len=12, num_items=40, dropout=0.1, **kw):
    model = GPTRec(num_items, max_len, dropout=dropout, **kw)
    return UserModel(model, lambda b, n, seed: padded_ids(b, n, num_items, seed)[0],
                     valid=lambda ids: ids != 0, name="torch_encoder_causal")
