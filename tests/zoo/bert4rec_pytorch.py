"""BERT4Rec in the style of the popular standalone PyTorch port: learned positional embedding
repeated over the batch, the mask ``(x > 0).unsqueeze(1).repeat(1, N, 1)`` repeated again over the
heads, ``scores.masked_fill(mask == 0, -1e9)``, a hand-written LayerNorm with the unbiased ``std``
(``a_2 * (x - mean) / (std + eps) + b_2``), the tanh GELU spelled out, pre-norm sublayer
connections, ``[MASK]`` tokens and holes (padding inside rows), logits at every position."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from grcompile.user_model import UserModel
from tests.zoo.batches import padded_ids

EXPECT = {"fused_attention": 2, "jagged": True, "dense_reason": ""}


class LayerNorm(nn.Module):
    def __init__(self, features, eps=1e-6):
        super().__init__()
        self.a_2 = nn.Parameter(torch.ones(features))
        self.b_2 = nn.Parameter(torch.zeros(features))
        self.eps = eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        std = x.std(-1, keepdim=True)
        return self.a_2 * (x - mean) / (std + self.eps) + self.b_2


class GELU(nn.Module):
    def forward(self, x):
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


class Attention(nn.Module):
    def forward(self, query, key, value, mask=None, dropout=None):
        scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(query.size(-1))
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        p_attn = F.softmax(scores, dim=-1)
        if dropout is not None:
            p_attn = dropout(p_attn)
        return torch.matmul(p_attn, value), p_attn


class MultiHeadedAttention(nn.Module):
    def __init__(self, h, d_model, dropout=0.1):
        super().__init__()
        self.d_k, self.h = d_model // h, h
        self.linear_layers = nn.ModuleList([nn.Linear(d_model, d_model) for _ in range(3)])
        self.output_linear = nn.Linear(d_model, d_model)
        self.attention = Attention()
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, query, key, value, mask=None):
        batch_size = query.size(0)
        query, key, value = [l(x).view(batch_size, -1, self.h, self.d_k).transpose(1, 2)
                             for l, x in zip(self.linear_layers, (query, key, value))]
        x, attn = self.attention(query, key, value, mask=mask, dropout=self.dropout)
        x = x.transpose(1, 2).contiguous().view(batch_size, -1, self.h * self.d_k)
        return self.output_linear(x)


class SublayerConnection(nn.Module):
    def __init__(self, size, dropout):
        super().__init__()
        self.norm = LayerNorm(size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, sublayer):
        return x + self.dropout(sublayer(self.norm(x)))


class TransformerBlock(nn.Module):
    def __init__(self, hidden, attn_heads, feed_forward_hidden, dropout):
        super().__init__()
        self.attention = MultiHeadedAttention(h=attn_heads, d_model=hidden, dropout=dropout)
        self.w_1 = nn.Linear(hidden, feed_forward_hidden)
        self.w_2 = nn.Linear(feed_forward_hidden, hidden)
        self.activation = GELU()
        self.ff_dropout = nn.Dropout(dropout)
        self.input_sublayer = SublayerConnection(size=hidden, dropout=dropout)
        self.output_sublayer = SublayerConnection(size=hidden, dropout=dropout)
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, x, mask):
        x = self.input_sublayer(x, lambda _x: self.attention.forward(_x, _x, _x, mask=mask))
        x = self.output_sublayer(x, lambda _x: self.w_2(self.ff_dropout(self.activation(self.w_1(_x)))))
        return self.dropout(x)


class BERT(nn.Module):
    def __init__(self, num_items, max_len, hidden=16, n_layers=2, heads=2, dropout=0.1):
        super().__init__()
        self.heads = heads
        self.token = nn.Embedding(num_items + 2, hidden, padding_idx=0)  # + [MASK]
        self.position = nn.Embedding(max_len, hidden)
        self.dropout = nn.Dropout(p=dropout)
        self.transformer_blocks = nn.ModuleList(
            [TransformerBlock(hidden, heads, hidden * 4, dropout) for _ in range(n_layers)])
        self.out = nn.Linear(hidden, num_items + 1)

    def forward(self, x):
        batch_size, n = x.shape
        mask = (x > 0).unsqueeze(1).repeat(1, n, 1).unsqueeze(1).repeat(1, self.heads, 1, 1)
        pe = self.position.weight[:n].unsqueeze(0).repeat(batch_size, 1, 1)
        x = self.dropout(self.token(x) + pe)
        for transformer in self.transformer_blocks:
            x = transformer.forward(x, mask)
        return self.out(x)


def factory(max_len=12, num_items=40, dropout=0.1, **kw):
    model = BERT(num_items, max_len, dropout=dropout, **kw)

    def make_batch(batch_size, max_len, seed):
        seq, _ = padded_ids(batch_size, max_len, num_items, seed, holes=0.2)
        g = torch.Generator().manual_seed(seed + 5)
        masked = (torch.rand(seq.shape, generator=g) < 0.15) & (seq != 0)
        return torch.where(masked, torch.full_like(seq, num_items + 1), seq)

    return UserModel(model, make_batch, valid=lambda x: x != 0, name="bert4rec_pytorch")
