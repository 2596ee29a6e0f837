"""SASRec in the style of the widely forked SASRec.pytorch: sequence-first
``nn.MultiheadAttention`` (``batch_first=False``, tensors transposed in and out), queries from a
LayerNorm and keys/values from the raw sequence, point-wise feed-forward as two ``Conv1d(k=1)`` on
transposed tensors, the timeline mask multiplied in after every block, left padding, a
``(log_seqs, pos_seqs, neg_seqs)`` BCE training signal. Unlike the original (which masks no keys),
this fork passes float masks: an additive causal ``attn_mask`` and a float ``key_padding_mask``
(-1e9 at padding), and leaves ``need_weights`` at its default (True; the weights are dropped)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from grcompile.user_model import UserModel
from tests.zoo.batches import padded_ids

EXPECT = {"fused_attention": 2, "jagged": True, "dense_reason": ""}


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
        return outputs.transpose(-1, -2) + inputs  # Conv1d wants (B, C, L)


class SASRec(nn.Module):
    def __init__(self, item_num, maxlen, hidden_units=16, num_heads=2, num_blocks=2, dropout_rate=0.2):
        super().__init__()
        self.item_emb = nn.Embedding(item_num + 1, hidden_units, padding_idx=0)
        self.pos_emb = nn.Embedding(maxlen + 1, hidden_units, padding_idx=0)
        self.emb_dropout = nn.Dropout(p=dropout_rate)
        self.attention_layernorms = nn.ModuleList()
        self.attention_layers = nn.ModuleList()
        self.forward_layernorms = nn.ModuleList()
        self.forward_layers = nn.ModuleList()
        self.last_layernorm = nn.LayerNorm(hidden_units, eps=1e-8)
        for _ in range(num_blocks):
            self.attention_layernorms.append(nn.LayerNorm(hidden_units, eps=1e-8))
            self.attention_layers.append(nn.MultiheadAttention(hidden_units, num_heads, dropout_rate))
            self.forward_layernorms.append(nn.LayerNorm(hidden_units, eps=1e-8))
            self.forward_layers.append(PointWiseFeedForward(hidden_units, dropout_rate))

    def log2feats(self, log_seqs):
        seqs = self.item_emb(log_seqs)
        seqs = seqs * self.item_emb.embedding_dim ** 0.5
        # positions 1..L on real items, 0 (padding_idx) on padding
        poss = torch.arange(1, log_seqs.shape[1] + 1, device=log_seqs.device).unsqueeze(0).repeat(log_seqs.shape[0], 1)
        poss = poss * (log_seqs != 0)
        seqs = seqs + self.pos_emb(poss)
        seqs = self.emb_dropout(seqs)

        timeline_mask = log_seqs == 0
        seqs = seqs * ~timeline_mask.unsqueeze(-1)
        tl = seqs.shape[1]
        attention_mask = torch.zeros(tl, tl, device=seqs.device).masked_fill(
            ~torch.tril(torch.ones((tl, tl), dtype=torch.bool, device=seqs.device)), -1e9)
        key_padding_mask = timeline_mask.float() * -1e9
        for i in range(len(self.attention_layers)):
            seqs = torch.transpose(seqs, 0, 1)
            Q = self.attention_layernorms[i](seqs)
            mha_outputs, _ = self.attention_layers[i](Q, seqs, seqs, attn_mask=attention_mask,
                                                      key_padding_mask=key_padding_mask)
            seqs = Q + mha_outputs
            seqs = torch.transpose(seqs, 0, 1)
            seqs = self.forward_layernorms[i](seqs)
            seqs = self.forward_layers[i](seqs)
            seqs = seqs * ~timeline_mask.unsqueeze(-1)
        return self.last_layernorm(seqs)

    def forward(self, log_seqs, pos_seqs, neg_seqs):
        log_feats = self.log2feats(log_seqs)
        pos_logits = (log_feats * self.item_emb(pos_seqs)).sum(dim=-1)
        neg_logits = (log_feats * self.item_emb(neg_seqs)).sum(dim=-1)
        return pos_logits, neg_logits


def bce_loss(out, log_seqs, pos_seqs, neg_seqs):
    pos_logits, neg_logits = out
    indices = torch.where(pos_seqs != 0)
    loss = F.binary_cross_entropy_with_logits(pos_logits[indices], torch.ones_like(pos_logits[indices]))
    return loss + F.binary_cross_entropy_with_logits(neg_logits[indices], torch.zeros_like(neg_logits[indices]))


def factory(max_len=12, num_items=40, dropout=0.2, **kw):
    model = SASRec(num_items, max_len, dropout_rate=dropout, **kw)

    def make_batch(batch_size, max_len, seed):
        seq, _ = padded_ids(batch_size, max_len, num_items, seed, left=True)
        g = torch.Generator().manual_seed(seed + 1)
        pos = torch.where(seq != 0, torch.randint(1, num_items + 1, seq.shape, generator=g), 0)
        neg = torch.where(seq != 0, torch.randint(1, num_items + 1, seq.shape, generator=g), 0)
        return seq, pos, neg

    return UserModel(model, make_batch, valid=lambda seq, pos, neg: seq != 0, loss=bce_loss, name="sasrec_pmixer")
