"""SASRec as the RecBole library writes it: embeddings + LayerNorm + dropout first, the extended
attention mask built afterwards from ``item_seq != 0`` (``unsqueeze(1).unsqueeze(2)``, expanded to
``[B, 1, N, N]``, ``torch.tril``, ``torch.where(mask, 0., -10000.)``) and *added* to the scores,
hand-written heads (``transpose_for_scores``), erf GELU spelled out, post-norm residuals, and the
output gathered at ``item_seq_len - 1`` (``gather`` with an expanded index)."""
import math

import torch
import torch.nn as nn

from grcompile.user_model import UserModel
from tests.zoo.batches import padded_ids

EXPECT = {"fused_attention": 2, "jagged": True, "dense_reason": ""}


class MultiHeadAttention(nn.Module):
    def __init__(self, n_heads, hidden_size, hidden_dropout_prob, attn_dropout_prob, layer_norm_eps):
        super().__init__()
        self.num_attention_heads = n_heads
        self.attention_head_size = hidden_size // n_heads
        self.all_head_size = hidden_size
        self.sqrt_attention_head_size = math.sqrt(self.attention_head_size)
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)
        self.softmax = nn.Softmax(dim=-1)
        self.attn_dropout = nn.Dropout(attn_dropout_prob)
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.LayerNorm = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.out_dropout = nn.Dropout(hidden_dropout_prob)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(*new_x_shape)

    def forward(self, input_tensor, attention_mask):
        query_layer = self.transpose_for_scores(self.query(input_tensor)).permute(0, 2, 1, 3)
        key_layer = self.transpose_for_scores(self.key(input_tensor)).permute(0, 2, 3, 1)
        value_layer = self.transpose_for_scores(self.value(input_tensor)).permute(0, 2, 1, 3)
        attention_scores = torch.matmul(query_layer, key_layer)
        attention_scores = attention_scores / self.sqrt_attention_head_size
        attention_scores = attention_scores + attention_mask
        attention_probs = self.attn_dropout(self.softmax(attention_scores))
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        context_layer = context_layer.view(*(context_layer.size()[:-2] + (self.all_head_size,)))
        hidden_states = self.out_dropout(self.dense(context_layer))
        return self.LayerNorm(hidden_states + input_tensor)


class FeedForward(nn.Module):
    def __init__(self, hidden_size, inner_size, hidden_dropout_prob, layer_norm_eps):
        super().__init__()
        self.dense_1 = nn.Linear(hidden_size, inner_size)
        self.dense_2 = nn.Linear(inner_size, hidden_size)
        self.LayerNorm = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.dropout = nn.Dropout(hidden_dropout_prob)

    @staticmethod
    def gelu(x):
        return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))

    def forward(self, input_tensor):
        hidden_states = self.dropout(self.dense_2(self.gelu(self.dense_1(input_tensor))))
        return self.LayerNorm(hidden_states + input_tensor)


class SASRec(nn.Module):
    def __init__(self, n_items, max_seq_length, hidden_size=16, n_layers=2, n_heads=2, dropout_prob=0.5,
                 layer_norm_eps=1e-12):
        super().__init__()
        self.item_embedding = nn.Embedding(n_items + 1, hidden_size, padding_idx=0)
        self.position_embedding = nn.Embedding(max_seq_length, hidden_size)
        self.layers = nn.ModuleList()
        for _ in range(n_layers):
            self.layers.append(nn.ModuleList([
                MultiHeadAttention(n_heads, hidden_size, dropout_prob, dropout_prob, layer_norm_eps),
                FeedForward(hidden_size, 2 * hidden_size, dropout_prob, layer_norm_eps)]))
        self.LayerNorm = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.dropout = nn.Dropout(dropout_prob)

    def get_attention_mask(self, item_seq):
        attention_mask = item_seq != 0
        extended_attention_mask = attention_mask.unsqueeze(1).unsqueeze(2)  # [B, 1, 1, N]
        extended_attention_mask = torch.tril(extended_attention_mask.expand((-1, -1, item_seq.size(-1), -1)))
        return torch.where(extended_attention_mask, 0.0, -10000.0)

    @staticmethod
    def gather_indexes(output, gather_index):
        gather_index = gather_index.view(-1, 1, 1).expand(-1, -1, output.shape[-1])
        return output.gather(dim=1, index=gather_index).squeeze(1)

    def forward(self, item_seq, item_seq_len):
        position_ids = torch.arange(item_seq.size(1), dtype=torch.long, device=item_seq.device)
        position_ids = position_ids.unsqueeze(0).expand_as(item_seq)
        input_emb = self.item_embedding(item_seq) + self.position_embedding(position_ids)
        input_emb = self.dropout(self.LayerNorm(input_emb))
        extended_attention_mask = self.get_attention_mask(item_seq)
        hidden = input_emb
        for attention, feed_forward in self.layers:
            hidden = feed_forward(attention(hidden, extended_attention_mask))
        # RecBole never sees an empty sequence; clamp so that one reads position 0 (padding)
        seq_output = self.gather_indexes(hidden, (item_seq_len - 1).clamp(min=0))
        return torch.matmul(seq_output, self.item_embedding.weight.transpose(0, 1))  # full-sort scores


def factory(max_len=12, num_items=40, dropout=0.5, **kw):
    model = SASRec(num_items, max_len, dropout_prob=dropout, **kw)
    return UserModel(model, lambda b, n, seed: padded_ids(b, n, num_items, seed),
                     valid=lambda item_seq, item_seq_len: item_seq_len > 0, name="recbole_sasrec")
