"""A user tower on HuggingFace's ``BertModel`` code: ``get_extended_attention_mask``
(``(1.0 - mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min``, bidirectional; with
``is_decoder=True`` the causal part ``seq_ids[None, None, :].repeat(B, N, 1) <= seq_ids[None, :,
None]`` multiplied in first), ``nn.Linear`` query/key/value, ``transpose_for_scores`` by ``view`` +
``permute``, scores ``/ math.sqrt(head_size)`` plus the mask, dropout on the attention probs,
post-LN residuals, erf GELU, a ``position_ids`` buffer sliced to N, token-type embeddings of
``zeros_like(ids)``, and two exits concatenated: the tanh pooler on the first token (``[CLS]``-like)
and sentence-transformers' masked mean (``clamp(mask.sum(1), min=1e-9)``)."""
import math

import torch
import torch.nn as nn

from grcompile.user_model import UserModel
from tests.zoo.batches import padded_ids

EXPECT = {"fused_attention": 2, "jagged": True, "dense_reason": ""}


def get_extended_attention_mask(attention_mask, dtype, is_decoder=False):
    if is_decoder:
        batch_size, seq_length = attention_mask.shape
        seq_ids = torch.arange(seq_length, device=attention_mask.device)
        causal_mask = seq_ids[None, None, :].repeat(batch_size, seq_length, 1) <= seq_ids[None, :, None]
        causal_mask = causal_mask.to(attention_mask.dtype)
        extended_attention_mask = causal_mask[:, None, :, :] * attention_mask[:, None, None, :]
    else:
        extended_attention_mask = attention_mask[:, None, None, :]
    extended_attention_mask = extended_attention_mask.to(dtype=dtype)
    return (1.0 - extended_attention_mask) * torch.finfo(dtype).min


class BertSelfAttention(nn.Module):
    def __init__(self, hidden_size, num_heads, dropout):
        super().__init__()
        self.num_attention_heads = num_heads
        self.attention_head_size = hidden_size // num_heads
        self.all_head_size = hidden_size
        self.query = nn.Linear(hidden_size, self.all_head_size)
        self.key = nn.Linear(hidden_size, self.all_head_size)
        self.value = nn.Linear(hidden_size, self.all_head_size)
        self.dropout = nn.Dropout(dropout)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        x = x.view(new_x_shape)
        return x.permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        attention_scores = attention_scores + attention_mask
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        attention_probs = self.dropout(attention_probs)
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.all_head_size,)
        return context_layer.view(new_context_layer_shape)


class BertLayer(nn.Module):
    def __init__(self, hidden_size, num_heads, dropout):
        super().__init__()
        self.self_attn = BertSelfAttention(hidden_size, num_heads, dropout)
        self.attn_dense = nn.Linear(hidden_size, hidden_size)
        self.attn_norm = nn.LayerNorm(hidden_size, eps=1e-12)
        self.intermediate = nn.Linear(hidden_size, 4 * hidden_size)
        self.output = nn.Linear(4 * hidden_size, hidden_size)
        self.out_norm = nn.LayerNorm(hidden_size, eps=1e-12)
        self.dropout = nn.Dropout(dropout)

    def forward(self, hidden_states, attention_mask):
        attn = self.self_attn(hidden_states, attention_mask)
        attention_output = self.attn_norm(self.dropout(self.attn_dense(attn)) + hidden_states)
        intermediate = nn.functional.gelu(self.intermediate(attention_output))
        return self.out_norm(self.dropout(self.output(intermediate)) + attention_output)


class BertUserTower(nn.Module):
    def __init__(self, num_items, max_len, d=16, heads=2, layers=2, dropout=0.1, is_decoder=False):
        super().__init__()
        self.is_decoder = is_decoder
        self.word_embeddings = nn.Embedding(num_items + 1, d, padding_idx=0)
        self.position_embeddings = nn.Embedding(max_len, d)
        self.token_type_embeddings = nn.Embedding(2, d)
        self.emb_norm = nn.LayerNorm(d, eps=1e-12)
        self.emb_drop = nn.Dropout(dropout)
        self.register_buffer("position_ids", torch.arange(max_len).expand((1, -1)), persistent=False)
        self.layer = nn.ModuleList(BertLayer(d, heads, dropout) for _ in range(layers))
        self.pooler = nn.Linear(d, d)

    def forward(self, input_ids):
        seq_length = input_ids.size(1)
        attention_mask = (input_ids != 0).long()
        position_ids = self.position_ids[:, :seq_length]
        token_type_ids = torch.zeros_like(input_ids)
        embeddings = (self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
                      + self.position_embeddings(position_ids))
        hidden_states = self.emb_drop(self.emb_norm(embeddings))
        extended_attention_mask = get_extended_attention_mask(attention_mask, hidden_states.dtype, self.is_decoder)
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, extended_attention_mask)
        pooled_output = torch.tanh(self.pooler(hidden_states[:, 0]))
        input_mask_expanded = attention_mask.unsqueeze(-1).expand(hidden_states.size()).float()
        mean = torch.sum(hidden_states * input_mask_expanded, 1) / torch.clamp(input_mask_expanded.sum(1), min=1e-9)
        return torch.cat([pooled_output, mean], dim=-1)


def factory(max_len=12, num_items=40, dropout=0.1, **kw):
    model = BertUserTower(num_items, max_len, dropout=dropout, **kw)
    return UserModel(model, lambda b, n, seed: padded_ids(b, n, num_items, seed)[0],
                     valid=lambda ids: ids[:, 0] != 0, name="hf_extended_mask")
