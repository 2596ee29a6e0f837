"""TiSASRec as its reference PyTorch port writes it: left padding, time-interval matrices
``[B, N, N]`` precomputed by the data loader, heads by ``cat(split(..., head_size, dim=2), dim=0)``,
absolute-position and time-interval embeddings on both the keys and the values
(``attn.unsqueeze(2).matmul(time_matrix_V)``), ``torch.where(mask, paddings, scores)`` with
``paddings = -2**32 + 1`` for the *query* rows of padding (``time_mask``) and for causality.
Padded keys are not masked: a real query attends to the left padding before it."""
import torch
import torch.nn as nn

from grcompile.user_model import UserModel
from tests.zoo.batches import padded_ids, timestamps

EXPECT = {"fused_attention": 0, "jagged": False,
          "dense_reason": "padded keys are not masked (only padded query rows are): valid outputs depend on them"}


class PointWiseFeedForward(nn.Module):
    def __init__(self, hidden_units, dropout_rate):
        super().__init__()
        self.conv1 = nn.Conv1d(hidden_units, hidden_units, kernel_size=1)
        self.dropout1 = nn.Dropout(p=dropout_rate)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv1d(hidden_units, hidden_units, kernel_size=1)
        self.dropout2 = nn.Dropout(p=dropout_rate)

    def forward(self, inputs):
        outputs = self.dropout2(self.conv2(self.relu(self.dropout1(self.conv1(inputs.transpose(-1, -2))))))
        return outputs.transpose(-1, -2) + inputs


class TimeAwareMultiHeadAttention(nn.Module):
    def __init__(self, hidden_size, head_num, dropout_rate):
        super().__init__()
        self.Q_w = nn.Linear(hidden_size, hidden_size)
        self.K_w = nn.Linear(hidden_size, hidden_size)
        self.V_w = nn.Linear(hidden_size, hidden_size)
        self.dropout = nn.Dropout(p=dropout_rate)
        self.softmax = nn.Softmax(dim=-1)
        self.head_num = head_num
        self.head_size = hidden_size // head_num

    def forward(self, queries, keys, time_mask, attn_mask, time_matrix_K, time_matrix_V, abs_pos_K, abs_pos_V):
        Q, K, V = self.Q_w(queries), self.K_w(keys), self.V_w(keys)
        Q_ = torch.cat(torch.split(Q, self.head_size, dim=2), dim=0)
        K_ = torch.cat(torch.split(K, self.head_size, dim=2), dim=0)
        V_ = torch.cat(torch.split(V, self.head_size, dim=2), dim=0)
        time_matrix_K_ = torch.cat(torch.split(time_matrix_K, self.head_size, dim=3), dim=0)
        time_matrix_V_ = torch.cat(torch.split(time_matrix_V, self.head_size, dim=3), dim=0)
        abs_pos_K_ = torch.cat(torch.split(abs_pos_K, self.head_size, dim=2), dim=0)
        abs_pos_V_ = torch.cat(torch.split(abs_pos_V, self.head_size, dim=2), dim=0)

        attn_weights = Q_.matmul(torch.transpose(K_, 1, 2))
        attn_weights = attn_weights + Q_.matmul(torch.transpose(abs_pos_K_, 1, 2))
        attn_weights = attn_weights + time_matrix_K_.matmul(Q_.unsqueeze(-1)).squeeze(-1)
        attn_weights = attn_weights / (K_.shape[-1] ** 0.5)

        time_mask = time_mask.unsqueeze(-1).repeat(self.head_num, 1, 1)
        time_mask = time_mask.expand(-1, -1, attn_weights.shape[-1])
        attn_mask = attn_mask.unsqueeze(0).expand(attn_weights.shape[0], -1, -1)
        paddings = torch.ones(attn_weights.shape, device=attn_weights.device) * (-2 ** 32 + 1)
        attn_weights = torch.where(time_mask, paddings, attn_weights)
        attn_weights = torch.where(attn_mask, paddings, attn_weights)
        attn_weights = self.dropout(self.softmax(attn_weights))

        outputs = attn_weights.matmul(V_)
        outputs = outputs + attn_weights.matmul(abs_pos_V_)
        outputs = outputs + attn_weights.unsqueeze(2).matmul(time_matrix_V_).reshape(outputs.shape).squeeze(2)
        return torch.cat(torch.split(outputs, Q.shape[0], dim=0), dim=2)


class TiSASRec(nn.Module):
    def __init__(self, item_num, maxlen, time_span=16, hidden_units=16, num_heads=2, num_blocks=2, dropout_rate=0.2):
        super().__init__()
        self.item_emb = nn.Embedding(item_num + 1, hidden_units, padding_idx=0)
        self.item_emb_dropout = nn.Dropout(p=dropout_rate)
        self.abs_pos_K_emb = nn.Embedding(maxlen, hidden_units)
        self.abs_pos_V_emb = nn.Embedding(maxlen, hidden_units)
        self.time_matrix_K_emb = nn.Embedding(time_span + 1, hidden_units)
        self.time_matrix_V_emb = nn.Embedding(time_span + 1, hidden_units)
        self.attention_layernorms = nn.ModuleList()
        self.attention_layers = nn.ModuleList()
        self.forward_layernorms = nn.ModuleList()
        self.forward_layers = nn.ModuleList()
        self.last_layernorm = nn.LayerNorm(hidden_units, eps=1e-8)
        for _ in range(num_blocks):
            self.attention_layernorms.append(nn.LayerNorm(hidden_units, eps=1e-8))
            self.attention_layers.append(TimeAwareMultiHeadAttention(hidden_units, num_heads, dropout_rate))
            self.forward_layernorms.append(nn.LayerNorm(hidden_units, eps=1e-8))
            self.forward_layers.append(PointWiseFeedForward(hidden_units, dropout_rate))

    def forward(self, log_seqs, time_matrices):
        seqs = self.item_emb(log_seqs) * self.item_emb.embedding_dim ** 0.5
        seqs = self.item_emb_dropout(seqs)
        positions = torch.arange(log_seqs.shape[1], device=log_seqs.device).unsqueeze(0).expand_as(log_seqs)
        abs_pos_K = self.abs_pos_K_emb(positions)
        abs_pos_V = self.abs_pos_V_emb(positions)
        time_matrix_K = self.time_matrix_K_emb(time_matrices)
        time_matrix_V = self.time_matrix_V_emb(time_matrices)

        timeline_mask = log_seqs == 0
        seqs = seqs * ~timeline_mask.unsqueeze(-1)
        tl = seqs.shape[1]
        attention_mask = ~torch.tril(torch.ones((tl, tl), dtype=torch.bool, device=seqs.device))
        for i in range(len(self.attention_layers)):
            Q = self.attention_layernorms[i](seqs)
            mha_outputs = self.attention_layers[i](Q, seqs, timeline_mask, attention_mask,
                                                   time_matrix_K, time_matrix_V, abs_pos_K, abs_pos_V)
            seqs = Q + mha_outputs
            seqs = self.forward_layernorms[i](seqs)
            seqs = self.forward_layers[i](seqs)
            seqs = seqs * ~timeline_mask.unsqueeze(-1)
        return self.last_layernorm(seqs)


def factory(max_len=12, num_items=40, dropout=0.2, time_span=16, **kw):
    model = TiSASRec(num_items, max_len, time_span=time_span, dropout_rate=dropout, **kw)

    def make_batch(batch_size, max_len, seed):
        seq, _ = padded_ids(batch_size, max_len, num_items, seed, left=True)
        days = timestamps(seq, seed) // 86400
        interval = (days[:, :, None] - days[:, None, :]).abs().clamp(max=time_span)
        return seq, interval

    return UserModel(model, make_batch, valid=lambda seq, interval: seq != 0, name="tisasrec")
